"""Granite MoE hybrid configs (Hugging Face granitemoehybrid, IBM's Granite-4.0-H): most layers'
attention is Mamba-2 (`moejax.layers.state_space`: a selective state-space layer, its
convolution biased, a gated norm over each group's channels), a few softmax attention layers
without position embedding (the checkpoints' position_embedding_type null: NoPE), every layer's
MLP routed experts beside an ungated shared MLP, and Granite's four multipliers (embedding,
residual, softmax scale, logits).

  python train.py --config configs/granitemoehybrid.py:tiny --workdir runs/granitemoehybrid_tiny

Presets:
  tiny  (default)  Granite-4.0-H's options at CPU size: 4 layers, layers 0, 1 and 3 Mamba-2 (2
                   groups of state 8 over 8 heads of 16), layer 2 softmax attention without
                   RoPE (4 heads of 16 over 2 kv heads), 8 experts top-2, a shared MLP of 64,
                   embedding x 4, residual x 0.5, softmax scale 1/16, logits / 2, tied
                   embeddings; trains on CPU.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (for
example ibm-granite's granite-4.0-h-tiny).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="granitemoehybrid", qk_norm="none", tie_embeddings=True, norm_eps=1e-6,
                 linear_kind="mamba2")
  c.moe.update(renormalize=True, aux_loss_weight=0.001, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=4, linear_layers=(0, 1, 3), nope_layers=(2,), num_kv_heads=2,
                   linear_key_heads=2, linear_key_dim=8, linear_value_heads=8,
                   linear_value_dim=16, embed_scale=4.0, residual_scale=0.5,
                   attention_scale=0.0625, logit_divisor=2.0)
    c.moe.update(shared_expert_hidden=64)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/granitemoehybrid.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
