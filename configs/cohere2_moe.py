"""Cohere2-MoE configs (Hugging Face cohere2_moe, Cohere's Command A MoE): parallel blocks
(attention and the MLP read one norm's output side by side, both joining the residual stream:
model.norm_position "parallel"), LayerNorm without a bias (model.norm_kind "layer"), neighbour-
pair rotary on the sliding layers, the full MoE layers unrotated (NoPE), leading dense layers
(rotated), softmax over the top-k logits, shared experts averaged with the routed ones
(moe.routed_scale and moe.shared_expert_scale 0.5), logits scaled (logit_scale: its inverse is
model.logit_divisor), tied embeddings.

  python train.py --config configs/cohere2_moe.py:tiny --workdir runs/cohere2_moe_tiny

Presets:
  tiny  (default)  Cohere2-MoE's options at CPU size: 4 layers (layer 0 dense and rotated,
                   layers 1 and 2 sliding within 32 tokens, layer 3 global and unrotated),
                   d_model 64, 4 heads of 16 with 2 kv heads, 8 experts top-2 and a shared
                   expert of 64, averaged; logit_scale 1/4 (the config class's 1/16 slows a
                   64-wide model's first steps: loss ratio 0.661 after 200 steps).

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
  c.model.update(family="cohere2_moe", qk_norm="none", norm_position="parallel",
                 norm_kind="layer", rotary_interleaved=True, logit_divisor=4.0,
                 tie_embeddings=True)
  c.moe.update(renormalize=True, routed_scale=0.5, shared_expert_scale=0.5, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=4, dense_layers=(0,), dense_hidden=128, num_kv_heads=2,
                   sliding_window=32, sliding_layers=(1, 2), nope_layers=(3,))
    c.moe.update(shared_expert_hidden=64)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/cohere2_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
