"""Hy3 configs (Hugging Face hy_v3, Tencent's Hy3): grouped-query attention with per-head
QK-norm, whole heads rotated; a leading dense layer, one shared expert beside fine-grained routed
ones, sigmoid scores with a selection-only score bias, always renormalized, routed scaling.

  python train.py --config configs/hy_v3.py:tiny --workdir runs/hy3_tiny

Presets:
  tiny  (default)  Hy3's options at CPU size: 3 layers (the first dense), d_model 64, 4 heads of
                   16 with 2 kv heads, per-head QK-norm, 8 experts top-2, one shared expert,
                   sigmoid scores renormalized and scaled by 2.826, score bias rate 1e-3.
  preview          transformers' HYV3Config defaults (its docstring's tencent/Hy3-preview): 80
                   layers, the first dense (13312), d_model 4096, 64 heads of 128 with 8 kv heads
                   (theta 11158840), 1 shared + 192 routed experts top-8 of width 1536, routed
                   scaling 2.826, vocab 120832; 295.0B total, 20.7B active (the checkpoint's
                   multi-token-prediction layer not counted).

preview keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "preview")
# No published parameter counts to check against: the preset is transformers' config default.
PUBLISHED = {}


def _hy3_options(c) -> None:
  c.model.update(family="hy_v3", qk_norm="head", rope_theta=11158840.0)
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               routed_scale=2.826, aux_loss_weight=0.0, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _hy3_options(c)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, num_kv_heads=2)
    c.moe.update(shared_expert_hidden=64)
  elif preset == "preview":
    c.model.update(vocab_size=120832, d_model=4096, num_layers=80, dense_layers=(0,),
                   dense_hidden=13312, num_heads=64, num_kv_heads=8, head_dim=128,
                   init_std=0.006)
    c.moe.update(num_experts=192, top_k=8, expert_hidden=1536, shared_expert_hidden=1536)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/hy_v3.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
