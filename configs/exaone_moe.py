"""EXAONE-MoE configs (Hugging Face exaone_moe, LG AI Research's K-EXAONE): grouped-query
attention with per-head QK-norm where three layers of four attend within a sliding window and the
fourth to the whole sequence without rotary embeddings (NoPE); DeepSeek-V3's MoE: a leading
dense layer, a shared expert, sigmoid scores with a selection-only score bias, renormalized
top-k, routed scaling.

  python train.py --config configs/exaone_moe.py:tiny --workdir runs/exaone_tiny

Presets:
  tiny  (default)  EXAONE-MoE's options at CPU size: 4 layers (the first dense), d_model 64, 4
                   heads of 16 with 2 kv heads, per-head QK-norm, layers 0-2 sliding within 32
                   tokens, layer 3 global and unrotated, 8 experts top-2, one shared expert,
                   sigmoid scores renormalized and scaled by 2.5, score bias rate 1e-3.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (no preset
of published shapes here: transformers' ExaoneMoeConfig defaults are not K-EXAONE's).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="exaone_moe", qk_norm="head")
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               routed_scale=2.5, aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=4, dense_layers=(0,), dense_hidden=128, num_kv_heads=2,
                   sliding_window=32, sliding_layers=(0, 1, 2), nope_layers=(3,))
    c.moe.update(shared_expert_hidden=64)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/exaone_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
