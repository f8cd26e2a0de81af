"""Solar Open configs (Hugging Face solar_open: Upstage's Solar Open): grouped-query attention
(q/k/v biases when attention_bias), whole heads rotated, experts in every layer, a shared expert
beside fine-grained routed ones, GLM-4.5's router (sigmoid scores, a selection-only score bias,
renormalized top-k).

  python train.py --config configs/solar_open.py:tiny --workdir runs/solar_tiny

Presets:
  tiny  (default)  Solar Open's options at CPU size: 2 layers, d_model 64, 4 heads of 16 over 2
                   kv heads, 8 experts top-2, one shared expert, sigmoid scores renormalized,
                   score bias rate 1e-3.
  open100b         Solar Open 100B (transformers' SolarOpenConfig defaults, its docstring's
                   upstage/Solar-Open-100B): 48 layers, d_model 4096, 64 heads of 128 over 8 kv
                   heads (theta 1e6), 1 shared + 128 routed experts top-8 of width 1280, vocab
                   196608; 102.7B total, 12.1B active.

open100b keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "open100b")
# Published (total, active) parameters and where the figures come from.
PUBLISHED = {
    "open100b": (102e9, 12e9, "Solar Open model card (upstage/Solar-Open-100B): 102B total, "
                              "12B active"),
}


def _solar_options(c) -> None:
  c.model.update(family="solar_open", qk_norm="none", rope_theta=1e6)
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               aux_loss_weight=0.0, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _solar_options(c)
  if preset == "tiny":
    c.model.update(num_kv_heads=2)
    c.moe.update(shared_expert_hidden=64)
  elif preset == "open100b":
    c.model.update(vocab_size=196608, d_model=4096, num_layers=48, num_heads=64, num_kv_heads=8,
                   head_dim=128)
    c.moe.update(num_experts=128, top_k=8, expert_hidden=1280, shared_expert_hidden=1280)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/solar_open.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
