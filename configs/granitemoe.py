"""Granite MoE configs (Hugging Face granitemoe, IBM's Granite MoE): grouped-query attention
without QK-norm, softmax top-k routing renormalized over the chosen experts, and Granite's four
multipliers: the embedding's output (model.embed_scale), each sublayer's output before it joins
the residual stream (model.residual_scale), the softmax scale itself (model.attention_scale)
and the logits' divisor (model.logit_divisor).

  python train.py --config configs/granitemoe.py:tiny --workdir runs/granitemoe_tiny

Presets:
  tiny  (default)  Granite's options at CPU size: 2 layers, d_model 64, 4 heads of 16 with 2 kv
                   heads, 8 experts top-2, no shared expert, embedding x 4, residual
                   x 0.5, softmax scale 1/16, logits / 2, tied embeddings.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (for
example ibm-granite's granite-3.1-3b-a800m-base).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="granitemoe", qk_norm="none", tie_embeddings=True, norm_eps=1e-6)
  c.moe.update(renormalize=True, aux_loss_weight=0.001, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_kv_heads=2, embed_scale=4.0, residual_scale=0.5, attention_scale=0.0625,
                   logit_divisor=2.0)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/granitemoe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
