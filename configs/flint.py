"""Flint configs (Hugging Face flint): grouped-query attention with per-head QK-norm and a
learned sink per head (model.attention_sinks), the sliding layers rotated and the global ones
not (NoPE), the first two layers dense (mlp_only_layers), then sigmoid-scored experts without a
score bias, top-k renormalized (the router kept in float32, as Flint's checkpoints keep it),
beside an ungated shared expert.

  python train.py --config configs/flint.py:tiny --workdir runs/flint_tiny

Presets:
  tiny  (default)  Flint's options at CPU size: 5 layers (0 and 1 dense), d_model 64, 4 heads of
                   16 with 2 kv heads and sinks, per-head QK-norm, layers 2 and 3 sliding within
                   32 tokens, the others global and unrotated, 8 experts top-2 with sigmoid
                   scores renormalized, an ungated shared expert of 64.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (no preset
of published shapes here).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="flint", qk_norm="head", norm_eps=1e-6, attention_sinks=True)
  c.moe.update(score="sigmoid", renormalize=True, router_float32=True, aux_loss_weight=0.0005,
               z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=5, dense_layers=(0, 1), dense_hidden=128, num_kv_heads=2,
                   sliding_window=32, sliding_layers=(2, 3), nope_layers=(0, 1, 4))
    c.moe.update(shared_expert_hidden=64)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/flint.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
