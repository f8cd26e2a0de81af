"""dots.llm1 configs (Hugging Face dots1): multi-head attention with per-head QK-norm, a leading
dense layer, two shared experts beside fine-grained routed ones, DeepSeek-V3's router (sigmoid
scores, a selection-only score bias, renormalized top-k, routed scaling).

  python train.py --config configs/dots1.py:tiny --workdir runs/dots1_tiny

Presets:
  tiny  (default)  dots.llm1's options at CPU size: 3 layers (the first dense), d_model 64, 4
                   heads of 16, per-head QK-norm, 8 experts top-2, two shared experts, sigmoid
                   scores renormalized and scaled by 2.5, score bias rate 1e-3.
  142b             dots.llm1 (rednote-hilab/dots.llm1.base): 62 layers, the first dense (10944),
                   d_model 4096, 32 heads of 128, per-head QK-norm, 2 shared + 128 routed experts
                   top-6 of width 1408 (renormalized, scaled by 2.5; no groups: n_group null),
                   RoPE base 1e7, vocab 152064; 142.8B total, 14.0B active (published 142B /
                   14B). --config.init_from=HF_DIR checks these against the checkpoint's
                   config.json first and names any field that differs.

142b keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "142b")
PUBLISHED = {
    "142b": (142e9, 14e9, "dots.llm1 model card (rednote-hilab): 142B total, 14B activated"),
}


def _dots_options(c) -> None:
  c.model.update(family="dots1", qk_norm="head")
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               routed_scale=2.5, aux_loss_weight=0.0, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _dots_options(c)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128)
    c.moe.update(shared_expert_hidden=2 * 64)
  elif preset == "142b":
    c.model.update(vocab_size=152064, d_model=4096, num_layers=62, dense_layers=(0,),
                   dense_hidden=10944, num_heads=32, head_dim=128, rope_theta=1e7)
    c.moe.update(num_experts=128, top_k=6, expert_hidden=1408, shared_expert_hidden=2 * 1408)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/dots1.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
