"""Granite MoE SWA configs (Hugging Face granitemoe_swa, IBM's granite-swash models): Granite
MoE's layer (grouped-query attention without QK-norm, softmax top-k renormalized over the
chosen experts, an optional shared MLP, Granite's four multipliers) with a learned attention sink
per head (model.attention_sinks), three layers of four attending within a sliding window, and a
RoPE base per layer (layer_rope_theta: the global layers' is the model's, the sliding layers'
their own, model.sliding_rope_theta; 0 unrotated, model.nope_layers).

  python train.py --config configs/granitemoe_swa.py:tiny --workdir runs/granitemoe_swa_tiny

Presets:
  tiny  (default)  Granite SWA's options at CPU size: 4 layers, d_model 64, 4 heads of 16 with 2
                   kv heads and sinks, layer 0 global and unrotated, layers 1-3 sliding within
                   32 tokens by RoPE base 10000, 8 experts top-2, an ungated shared MLP of 64,
                   embedding x 4, residual x 0.5, softmax scale 1/16, logits / 2.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (no preset
of published shapes here: transformers' GraniteMoeSWAConfig defaults are not a published
model's).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="granitemoe_swa", qk_norm="none", norm_eps=1e-6, attention_sinks=True)
  c.moe.update(renormalize=True, aux_loss_weight=0.001, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=4, num_kv_heads=2, embed_scale=4.0, residual_scale=0.5,
                   attention_scale=0.0625, logit_divisor=2.0, sliding_window=32,
                   sliding_layers=(1, 2, 3), nope_layers=(0,))
    c.moe.update(shared_expert_hidden=64)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/granitemoe_swa.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
