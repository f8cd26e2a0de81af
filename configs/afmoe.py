"""AfMoE configs (Hugging Face afmoe, Arcee's Trinity models): grouped-query attention with
per-head QK-norm and a sigmoid output gate of its own projection, where three layers of four
attend within a sliding window and the fourth to the whole sequence without rotary embeddings
(NoPE); each sublayer between two norms (on its input and on its output: "sandwich"); a leading
dense layer, then a shared expert beside sigmoid-scored experts with a selection-only score bias,
top-k renormalized and scaled.

  python train.py --config configs/afmoe.py:tiny --workdir runs/afmoe_tiny

Presets:
  tiny  (default)  AfMoE's options at CPU size: 4 layers (the first dense), d_model 64, 4 heads
                   of 16 with 2 kv heads, per-head QK-norm, the attention's output gate, sandwich
                   norms, layers 0-2 sliding within 32 tokens, layer 3 global and unrotated, 8
                   experts top-2, two shared experts' width, sigmoid scores renormalized, score
                   bias rate 1e-3.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (no preset
of published shapes here: transformers' AfmoeConfig defaults are not a Trinity model's).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="afmoe", qk_norm="head", attention_gate=True, attention_gate_own=True,
                 norm_position="sandwich")
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=4, dense_layers=(0,), dense_hidden=128, num_kv_heads=2,
                   sliding_window=32, sliding_layers=(0, 1, 2), nope_layers=(3,))
    c.moe.update(shared_expert_hidden=128)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/afmoe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
