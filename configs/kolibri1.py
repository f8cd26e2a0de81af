"""Kolibri configs (Hugging Face kolibri1, Aleph Alpha's Kolibri-1): grouped-query attention with
per-head QK-norm where four layers of five attend within a sliding window and the fifth to the
whole sequence unrotated (NoPE); each sublayer between two norms ("sandwich"); experts in every
layer beside an ungated shared expert, scored by sigmoids and chosen by the logits plus a
selection-only bias (model.score_bias_on_logits).

  python train.py --config configs/kolibri1.py:tiny --workdir runs/kolibri1_tiny

Presets:
  tiny  (default)  Kolibri's options at CPU size: 5 layers, d_model 64, 4 heads of 16 with 2 kv
                   heads, per-head QK-norm, sandwich norms, layers 0-3 sliding within 32 tokens,
                   layer 4 global and unrotated, 8 experts top-2 with sigmoid scores chosen by
                   the biased logits, score bias rate 1e-3, an ungated shared expert of 64.

A published checkpoint trains from its own config.json: `--config configs/hf.py:DIR` (no preset
of published shapes here: transformers' Kolibri1Config defaults are not checked against the
published model).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict

PRESETS = ("tiny",)
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="kolibri1", qk_norm="head", norm_eps=1e-6, norm_position="sandwich")
  c.moe.update(score="sigmoid", score_bias=True, score_bias_on_logits=True,
               score_bias_rate=1e-3, aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=5, num_kv_heads=2, sliding_window=32, sliding_layers=(0, 1, 2, 3),
                   nope_layers=(4,))
    c.moe.update(shared_expert_hidden=64)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/kolibri1.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
