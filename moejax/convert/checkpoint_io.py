"""The moejax side of a conversion: a parameters-only checkpoint (`moejax.weights`) that
`load_params`, `load_config` and `--config.init_from` read, and reading one back for export.

`from-hf` writes OUT_DIR as an Orbax `CheckpointManager` directory holding step 0 with the items
of a training checkpoint minus the optimizer state and data position:

  OUT_DIR/0/params/   the parameters, global shapes (what `load_params(OUT_DIR)` returns)
  OUT_DIR/0/meta/     JSON: format, step 0, per-array checksums, where the weights came from
  OUT_DIR/0/config/   JSON: the moejax Config (`load_config(OUT_DIR)`)
  OUT_DIR/hf_config.json   the imported config.json, so that `to-hf` can restore the fields
                           moejax does not model (token ids, maximum length)
  OUT_DIR/tokenizer.json   the Hugging Face directory's tokenizer, when it has one

A run starts from it with `state.state_from_params(load_params(OUT_DIR, shardings=...), ...)`.
OUT_DIR is not a run's workdir: a run keeps its own checkpoints in WORKDIR/checkpoints.
"""
from __future__ import annotations

import json
import os

from moejax import weights
from moejax.config import Config
from moejax.errors import CheckpointError

HF_CONFIG_FILE = "hf_config.json"


def save_params(out_dir: str, cfg: Config, params, *, hf_config: dict | None = None,
                source: str = "") -> str:
  """`moejax.weights.save_params`, plus the imported config.json beside it."""
  out_dir = weights.save_params(out_dir, cfg, params, source=source)
  if hf_config is not None:
    with open(os.path.join(out_dir, HF_CONFIG_FILE), "w") as f:
      json.dump(hf_config, f, indent=2)
  return out_dir


def _read_hf_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path}: not readable JSON ({e})") from None


def _find_hf_config(path: str) -> dict | None:
  """The hf_config.json kept beside a from-hf checkpoint (path: its directory or step dir)."""
  path = os.path.abspath(path)
  for directory in (path, os.path.dirname(path)):
    candidate = os.path.join(directory, HF_CONFIG_FILE)
    if os.path.isfile(candidate):
      return _read_hf_json(candidate)
  return None


def _init_from_hf_config(cfg: Config) -> dict | None:
  """The Hugging Face config.json a run started from (`cfg.init_from`: a Hugging Face directory
  or a from-hf output), if it is of the run's family: what a fine-tuned workdir exports with."""
  if not cfg.init_from or not os.path.isdir(cfg.init_from):
    return None
  from moejax.convert.hf import read_hf_config
  from moejax.convert.hf_config import FAMILY_SPECS, canonical_model_type
  found = _find_hf_config(cfg.init_from)
  if found is None and is_hf_dir(cfg.init_from):
    try:
      found = read_hf_config(cfg.init_from)
    except CheckpointError:
      return None
  if not isinstance(found, dict) or (
      canonical_model_type(found.get("model_type"))
      != FAMILY_SPECS[cfg.model.family].model_type):
    return None
  return found


def load_params(path: str, step: int | None = None) -> tuple[Config, dict, dict | None]:
  """(Config, host params, imported config.json or None) from a from-hf output directory, a
  training workdir, its checkpoints/ directory, or one step's directory. A workdir's run that
  started from Hugging Face weights (`init_from`) gives that checkpoint's config.json."""
  cfg = weights.load_config(path, step)
  params = weights.load_params(path, step)
  hf_config = _find_hf_config(path)
  return cfg, params, hf_config if hf_config is not None else _init_from_hf_config(cfg)


TOKENIZER_FILE = weights.TOKENIZER_FILE


def is_hf_dir(path: str) -> bool:
  """A Hugging Face model directory: config.json beside safetensors weights."""
  return (os.path.isfile(os.path.join(path, "config.json"))
          and any(f.endswith(".safetensors") for f in os.listdir(path)))


def load_model(path: str, step: int | None = None, *,
               tokenizer: str | None = None) -> tuple[Config, dict, str]:
  """(Config, host params, tokenizer spec) for inference from a training workdir (or its
  checkpoints/ or a step's directory), a from-hf output directory, or a Hugging Face model
  directory. The tokenizer: `tokenizer` if given; else the tokenizer.json in that directory (for
  a step's or checkpoints/ directory, in the workdir above); else, for a training workdir, the
  one the config was trained with (`data.tokenizer`). A Hugging Face model (or a from-hf output)
  without tokenizer.json is refused: its config names no tokenizer."""
  path = os.path.abspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"{path}: no such checkpoint, workdir or Hugging Face directory")
  from_hf = os.path.isdir(path) and is_hf_dir(path)
  if from_hf and step is not None:
    raise CheckpointError(f"--step={step}: {path} is a Hugging Face directory, which holds one "
                          "set of weights; drop --step")
  if from_hf:
    from moejax.convert import hf
    cfg, params = hf.load_hf(path)
  else:
    cfg, params = weights.load_config(path, step), weights.load_params(path, step)
  if tokenizer is not None:
    return cfg, params, tokenizer
  found = weights.tokenizer_beside(path)
  if found is not None:
    return cfg, params, found
  hf_json = (_read_hf_json(os.path.join(path, "config.json")) if from_hf
             else _find_hf_config(path))
  if hf_json is not None:
    from moejax.convert.hf_config import TOKENIZER_KEY
    if hf_json.get(TOKENIZER_KEY) == "bytes":       # moejax's export of a run on bytes
      return cfg, params, "bytes"
    what = "these Hugging Face weights" if from_hf else "this from-hf checkpoint"
    raise CheckpointError(f"{path}: no {TOKENIZER_FILE} beside {what}; copy the model's "
                          "tokenizer.json there or pass --tokenizer (--tokenizer bytes for a "
                          "model trained on UTF-8 bytes)")
  return cfg, params, weights.tokenizer_of(cfg)
