"""Any Hugging Face checkpoint of a family moejax imports, as a preset: the model and routing from
its config.json, the fine-tuning settings the published presets share, and --config.init_from
set to it (its weights and its tokenizer.json).

  python train.py --config configs/hf.py:/models/Qwen3-235B-A22B --workdir runs/ft \
      --config.data.source=tokens --config.data.path=my_tokens

For a checkpoint with no preset of its own (Qwen3-235B-A22B, GLM-4.6, Kimi-K2, a fine-tuned
variant), or to take every field a published preset fixes from the checkpoint itself. Quantized
weights (FP8, INT4: moejax.convert.safetensors_io) start dequantized. --config.FIELD=VALUE
still overrides any field (placement, mesh, batch, steps, ...); moejax's defaults fill the rest.
"""
import os

import ml_collections

from moejax.config import default_config_dict, from_config_dict, published_fine_tuning

PRESETS = ()      # the argument is a directory


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  from moejax.convert import config_from_hf, read_hf_config
  from moejax.convert.hf_config import FAMILY_SPECS
  from moejax.weights import config_to_dict
  if not arg:
    raise ValueError("configs/hf.py needs a Hugging Face checkpoint directory: "
                     "--config configs/hf.py:DIR")
  c = published_fine_tuning(default_config_dict())
  cfg = config_from_hf(read_hf_config(arg), base=from_config_dict(c),
                       where=os.path.join(arg, "config.json"))
  for group in ("model", "moe"):
    fields = config_to_dict(cfg)[group]
    c[group].update({k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
  # Training choices the family presets make, not in config.json: no router z-loss where the
  # architecture has none; a moving score bias (DeepSeek-V3's 1e-3 per step) where it has one.
  if not FAMILY_SPECS[cfg.model.family].z_loss_key:
    c.moe.z_loss_weight = 0.0
  c.moe.score_bias_rate = 1e-3 if cfg.moe.score_bias else 0.0
  c.init_from = arg
  return c
