"""MiniMax-M2 configs (Hugging Face minimax_m2): grouped-query attention with QK-norm over all
heads' width, rotary embeddings on part of each head, fine-grained routed experts only (no
shared expert, no dense layer), sigmoid scores with a selection-only score bias, renormalized.

  python train.py --config configs/minimax_m2.py:tiny --workdir runs/minimax_tiny

Presets:
  tiny  (default)  MiniMax-M2's options at CPU size: 2 layers, d_model 64, 4 heads of 16 over 2
                   kv heads, QK-norm over all heads, half of each head rotated, 8 experts top-2,
                   sigmoid scores renormalized, score bias rate 1e-3.
  m2               MiniMax-M2 (MiniMaxAI/MiniMax-M2 config.json): 62 layers, d_model 3072, 48
                   heads of 128 over 8 kv heads, 64 of each head's 128 dims rotated (theta 5e6),
                   256 experts top-8 of width 1536, vocab 200064; 228.7B total, 10.4B active
                   without the embedding (published 230B / 10B). The published weights are FP8,
                   dequantized on import (--config.init_from=DIR).

m2 keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "m2")
# MiniMax counts the active parameters without the input embedding (the test reads them so).
PUBLISHED = {
    "m2": (230e9, 10e9, "MiniMax-M2 model card (MiniMaxAI): 230B total, 10B active"),
}


def _m2_options(c) -> None:
  c.model.update(family="minimax_m2", qk_norm="full", norm_eps=1e-6)
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _m2_options(c)
  if preset == "tiny":
    c.model.update(num_kv_heads=2, rotary_dim=8)
  elif preset == "m2":
    c.model.update(vocab_size=200064, d_model=3072, num_layers=62, num_heads=48, num_kv_heads=8,
                   head_dim=128, rotary_dim=64, rope_theta=5e6)
    c.moe.update(num_experts=256, top_k=8, expert_hidden=1536, aux_loss_weight=0.001)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/minimax_m2.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
