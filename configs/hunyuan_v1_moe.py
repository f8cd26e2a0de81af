"""Hunyuan-A13B configs (Hugging Face hunyuan_v1_moe, Tencent's Hunyuan-A13B): grouped-query
attention with per-head QK-norm of the rotated q and k (model.qk_norm_after_rope), experts in
every layer beside an ungated shared MLP of the experts' width, softmax top-k renormalized.
Its NTK-alpha RoPE (rope_scaling "dynamic" with a fixed alpha) is plain RoPE of base
theta * alpha^(d / (d - 2)), read so.

  python train.py --config configs/hunyuan_v1_moe.py:tiny --workdir runs/hunyuan_tiny

Presets:
  tiny  (default)  Hunyuan-A13B's options at CPU size: 2 layers, d_model 64, 4 heads of 16 with 2
                   kv heads, per-head QK-norm after RoPE, 8 experts top-2 of width 64 and a
                   shared MLP of 64, softmax top-k renormalized.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (no preset
of published shapes here: transformers' HunYuanMoEV1Config defaults are not Hunyuan-A13B's).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="hunyuan_v1_moe", qk_norm="head", qk_norm_after_rope=True)
  c.moe.update(renormalize=True, aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_kv_heads=2)
    c.moe.update(shared_expert_hidden=64)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/hunyuan_v1_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
