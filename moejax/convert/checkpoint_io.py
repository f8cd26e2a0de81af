"""The moejax side of a conversion: a parameters-only checkpoint that `moejax.train.checkpoint`
reads (`load_params`, `load_config`), and reading one back for export.

`from-hf` writes OUT_DIR as an Orbax `CheckpointManager` directory holding step 0 with the items
of a training checkpoint minus the optimizer state and data position:

  OUT_DIR/0/params/   the parameters, global shapes (what `load_params(OUT_DIR)` returns)
  OUT_DIR/0/meta/     JSON: format, step 0, per-array checksums, where the weights came from
  OUT_DIR/0/config/   JSON: the moejax Config (`load_config(OUT_DIR)`)
  OUT_DIR/hf_config.json   the imported config.json, so that `to-hf` can restore the fields
                           moejax does not model (token ids, maximum length)

A run starts from it with `state.state_from_params(load_params(OUT_DIR, shardings=...), ...)`.
OUT_DIR is not a run's workdir: a run keeps its own checkpoints in WORKDIR/checkpoints.
"""
from __future__ import annotations

import json
import os

import orbax.checkpoint as ocp

from moejax.config import Config
from moejax.errors import CheckpointError
from moejax.train import checkpoint as train_checkpoint

HF_CONFIG_FILE = "hf_config.json"
STEP = 0


def save_params(out_dir: str, cfg: Config, params, *, hf_config: dict | None = None,
                source: str = "") -> str:
  """Writes `params` as step 0 of a parameters-only checkpoint in `out_dir` (must not hold one)."""
  out_dir = os.path.abspath(out_dir)
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise CheckpointError(f"{out_dir}: not empty; choose a new directory for the checkpoint")
  meta = {"format": train_checkpoint.FORMAT, "step": STEP, "source": source,
          "checksums": {"params": train_checkpoint.checksums(params)}}
  manager = ocp.CheckpointManager(
      out_dir, options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
      item_handlers={"params": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()})
  try:
    manager.save(STEP, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta),
        config=ocp.args.JsonSave(train_checkpoint.config_to_dict(cfg))))
    manager.wait_until_finished()
  finally:
    manager.close()
  if hf_config is not None:
    with open(os.path.join(out_dir, HF_CONFIG_FILE), "w") as f:
      json.dump(hf_config, f, indent=2)
  return out_dir


def _find_hf_config(path: str) -> dict | None:
  """The hf_config.json kept beside a from-hf checkpoint (path: its directory or step dir)."""
  path = os.path.abspath(path)
  for directory in (path, os.path.dirname(path)):
    candidate = os.path.join(directory, HF_CONFIG_FILE)
    if os.path.isfile(candidate):
      try:
        with open(candidate) as f:
          return json.load(f)
      except (OSError, ValueError) as e:
        raise CheckpointError(f"{candidate}: not readable JSON ({e})") from None
  return None


def load_params(path: str, step: int | None = None) -> tuple[Config, dict, dict | None]:
  """(Config, host params, imported config.json or None) from a from-hf output directory, a
  training workdir, its checkpoints/ directory, or one step's directory."""
  cfg = train_checkpoint.load_config(path, step)
  params = train_checkpoint.load_params(path, step)
  return cfg, params, _find_hf_config(path)
