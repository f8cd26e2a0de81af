"""Mellum configs (Hugging Face mellum, JetBrains' Mellum2): grouped-query attention with
per-head QK-norm, layers attending within a sliding window by their own plain RoPE (base 10000)
or to the whole sequence by the model's (base 500000; model.sliding_rope_theta), dense and MoE
layers in any order (mlp_layer_types), softmax top-k renormalized.

  python train.py --config configs/mellum.py:tiny --workdir runs/mellum_tiny

Presets:
  tiny       (default)  Mellum's options at CPU size: 4 layers (layer 1 dense), d_model 64, 4
                        heads of 16 with 2 kv heads, per-head QK-norm, layers 0, 2 and 3
                        sliding within 32 tokens by RoPE base 10000, layer 1 global by base
                        500000, 8 experts top-2, softmax top-k renormalized.
  12b_a2_5b             transformers' MellumConfig defaults (its docs name
                        JetBrains/Mellum2-12B-A2.5B-Base; moejax counts 12.15B / 2.44B): 28
                        layers, d 2304, 32 / 4 kv heads of 128,
                        64 experts top-8 of 896; every layer global (the defaults' layer_types:
                        set sliding_layers from the checkpoint's, or train from its own config,
                        `--config configs/hf.py:DIR`).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "12b_a2_5b")
PUBLISHED = {}     # 12b_a2_5b counts 12.15B / 2.44B; the name's 12B / 2.5B are not checked


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="mellum", qk_norm="head", norm_eps=1e-6, rope_theta=500000.0)
  c.moe.update(renormalize=True, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=4, dense_layers=(1,), dense_hidden=128, num_kv_heads=2,
                   sliding_window=32, sliding_layers=(0, 2, 3), sliding_rope_theta=10000.0)
  elif preset == "12b_a2_5b":
    c.model.update(vocab_size=98304, d_model=2304, num_layers=28, num_heads=32, num_kv_heads=4,
                   head_dim=128)
    c.moe.update(num_experts=64, top_k=8, expert_hidden=896)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/mellum.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
