"""Checkpoints (Orbax): save during and at the end of a run, resume the latest readable one, and
load a checkpoint's parameters into your own code.

Layout of WORKDIR/checkpoints/, one Orbax `CheckpointManager` keeping the last `checkpoint.keep`:

  <step>/params/      parameters with their global shapes (OCDBT); each process writes its shards
  <step>/opt_state/   optimizer state, sharded like the parameters
  <step>/<feature>/   the feature states registered with the Checkpointer, one item each
                      (`StateLayout.checkpoint_items`; fssdp: the load history and the expert
                      owners, `moejax.placement.placement.FssdpCheckpoint`)
  <step>/meta/        JSON: step, seed, data-iterator position, a checksum per array
  <step>/config/      JSON: the config of the run that wrote it, checked on resume
  <step>.orbax-checkpoint-tmp/   a save in progress. Orbax renames it to <step> once every item
                      is written, so a run killed mid-save leaves only this name, which is ignored
  <step>.unreadable/  a checkpoint whose files failed to restore, moved out of the way, never
                      deleted (a restore that ran out of memory or permission stops instead)

Retention: each save prunes to the latest `checkpoint.keep`, and so does a rerun right after it
restores (`Checkpointer.prune`): a run killed between a save's commit and its pruning leaves one
checkpoint too many, and a rerun with nothing left to train would never save again. Pruning
counts complete checkpoints only (never a tmp or `.unreadable` directory) and never removes the
newest.

A failed save (a full disk, say) surfaces when the run waits for it: at the next save or at the
end of the run (`close`). It raises CheckpointError naming the step's path and the latest intact
checkpoint; the failed step never counts as a checkpoint (its files stay under the tmp name,
which Orbax replaces when that step is saved again), and the checkpoints before it stay as they
were (a save prunes older ones only after it commits).

Arrays keep their global shapes, so a checkpoint restores onto any mesh and any expert
placement: the targets are `StateLayout.shardings` of the restoring run. fssdp stores experts
where their owners are; its item saves them in canonical order (expert (l, e) at [l, e]) and
its restore puts them back where the saved owners say.

An array's checksum is the sum of its elements' bit patterns, as unsigned integers, modulo 2**32:
an exact integer sum that does not depend on the sharding. It catches a file that reads without
error but holds other bytes. The seed is the run's only randomness (initialization and data
order derive from it).
"""
from __future__ import annotations

import errno
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from moejax import weights
from moejax.config import Config, upgrade_saved
from moejax.errors import CheckpointError, DataError, MoejaxError
from moejax.train.metrics import log
from moejax.train import state as state_lib
from moejax.train.state import StateLayout, TrainState

SUBDIR = weights.SUBDIR
UNREADABLE = ".unreadable"
# Reading a checkpoint's parameters into your own code lives in moejax.weights; these names are
# where the documentation has always pointed.
load_config = weights.load_config
load_params = weights.load_params

# Config fields a resumed run may change: they do not change what the saved state means.
# (data.path and data.source may change: the data iterator checks the token stream itself, by
# length and CRC; a run on its source files moves to the same corpus prepared.)
# (init_from only matters when there is no checkpoint to resume.)
# (the dispatch buffers' size, and the rows run through the experts, change which step may
# overflow, never an assignment.)
# (optim.: the optimizer's hyperparameters act on each step's update, not on its state's
# structure, so a run that diverged resumes with a lower lr; clipping switched on or off is
# refused apart, since it adds or drops a transformation's state.)
MAY_DIFFER = ("steps", "log_every", "eval_every", "eval_batches", "remat", "prefetch",
              "scatter_ahead", "schedule_latencies", "schedule_cluster", "mesh.",
              "moe.placement", "moe.dispatch_capacity_factor", "moe.dispatch_overflow", "moe.dispatch_chunks",
              "moe.receive_capacity_factor", "moe.exchange_buffers",
              "checkpoint.", "codec.", "data.path", "data.source", "init_from", "distributed.",
              "optim.")


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), SUBDIR)


# ------------------------------------------------------------------------------------------------
# Config as JSON, and the compatibility check.

def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  """A nested config dict -> {"dotted.field": value}."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[prefix + key] = value
  return flat


def same_tokenizer(cfg: Config, workdir: str) -> bool:
  """Whether `cfg`'s data.tokenizer is the one its run kept in `workdir`
  (`weights.keep_tokenizer`): byte for byte the same tokenizer.json, ending documents with the
  same EOS id, whatever its path (the kept copy itself, a relative path, a copy on another
  machine)."""
  import filecmp
  from moejax.data.tokenizer import load_tokenizer
  kept = os.path.join(workdir, weights.TOKENIZER_FILE)
  try:
    given = weights.tokenizer_file(weights.tokenizer_of(cfg))
    return (given is not None and os.path.isfile(kept) and filecmp.cmp(given, kept, shallow=False)
            and load_tokenizer(given).eos_id == load_tokenizer(kept).eos_id)
  except (OSError, ValueError, MoejaxError):
    return False          # not readable as one: the paths' difference is reported


def _may_differ(field: str) -> bool:
  return any(field == f or (f.endswith(".") and field.startswith(f)) for f in MAY_DIFFER)


_ABSENT = object()


def _show(value) -> str:
  return "no such field" if value is _ABSENT else json.dumps(value)


def check_compatible(saved: dict, cfg: Config, workdir: str | None = None) -> None:
  """Raises CheckpointError naming every field (in config order) that differs and may not, in
  one line.

  A field missing from an older checkpoint counts as its default value. `workdir`: the run's,
  where its tokenizer is kept: data.tokenizer may then name it by another path
  (`same_tokenizer`). fssdp.* may differ unless both runs are fssdp (a run of another placement
  holds no fssdp state)."""
  run = flatten(weights.config_to_dict(cfg))
  saved = flatten(upgrade_saved(saved))
  defaults = flatten(weights.config_to_dict(Config()))
  kept = None if workdir is None else os.path.join(workdir, weights.TOKENIZER_FILE)
  both_fssdp = (saved.get("moe.placement", defaults["moe.placement"]) == "fssdp"
                and cfg.moe.placement == "fssdp")
  differences = []
  shaped = False          # a model.* or moe.* field: init_from would refuse these weights too
  for field in [*run, *(k for k in saved if k not in run)]:
    if _may_differ(field) or (field.startswith("fssdp.") and not both_fssdp):
      continue
    have = saved.get(field, defaults.get(field, _ABSENT))
    want = run.get(field, _ABSENT)
    if field == "data.tokenizer" and have != want and kept is not None:
      if same_tokenizer(cfg, workdir):
        continue
      if os.path.isfile(kept):
        differences.append(f"config.{field}: checkpoint has {_show(have)}, run has "
                           f"{_show(want)}, not byte for byte the run's {kept} with its EOS")
        continue
    if have != want:
      differences.append(f"config.{field}: checkpoint has {_show(have)}, run has {_show(want)}")
      shaped = shaped or field.startswith(("model.", "moe."))
  have = saved.get("optim.clip_norm", defaults["optim.clip_norm"])
  if (have > 0) != (cfg.optim.clip_norm > 0):
    differences.append(
        f"config.optim.clip_norm: checkpoint has {_show(have)}, run has "
        f"{_show(cfg.optim.clip_norm)}: clipping switched {'off' if have > 0 else 'on'} changes "
        "the optimizer state's structure; keep it "
        f"{'on (any value > 0)' if have > 0 else 'off (0)'}, or start a new workdir from these "
        "weights (--config.init_from=CHECKPOINT)")
  if differences:
    raise CheckpointError("; ".join(differences), weights_differ=shaped)


# ------------------------------------------------------------------------------------------------
# The manager.

def _is_json(feature) -> bool:
  """A feature whose item is host data (JSON) rather than arrays."""
  return bool(getattr(feature, "json", False))


# Every feature item a checkpoint may hold, JSON or not: a run whose features lack one (fsdp
# resuming an fssdp run's checkpoint) still registers its handler, or Orbax warns on restore
# that the item it did not ask for "could not be restored".
FEATURE_ITEMS_JSON = {"dispatch": True, "codec": True, "fssdp": False}


def _open_manager(directory: str, keep: int, features=()):
  json_items = {**FEATURE_ITEMS_JSON, **{f.name: _is_json(f) for f in features}}
  handlers = {name: ocp.JsonCheckpointHandler() if is_json else ocp.StandardCheckpointHandler()
              for name, is_json in json_items.items()}
  try:
    return weights.open_manager(directory, keep=keep, opt_state=ocp.StandardCheckpointHandler(),
                                **handlers)
  except OSError as e:    # e.g. a dangling checkpoints symlink
    raise CheckpointError(f"{directory}: cannot open the checkpoint directory "
                          f"({e.strerror or e})") from None


# What a restore may raise that says nothing about the checkpoint's files: out of host or device
# memory, no permission, too many open files. Such a checkpoint is not set aside.
_RESOURCE_ERRNOS = (errno.ENOMEM, errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE)
# (tensorstore, which reads the arrays, reports errno as a status: PERMISSION_DENIED for EACCES,
# RESOURCE_EXHAUSTED for ENOMEM / EMFILE.)
_RESOURCE_MESSAGES = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "Out of memory", "out of memory")


def _not_the_files(error: BaseException | None, handled: BaseException | None = None) -> bool:
  """Whether `error`, or what caused it, is a resource failure rather than damage. The walk
  follows causes and unsuppressed contexts, and stops at `handled`: an error the caller was
  already handling when the restore began, which says nothing about this checkpoint."""
  seen = 0
  while error is not None and error is not handled and seen < 16:
    if isinstance(error, MemoryError):
      return True
    if isinstance(error, OSError) and error.errno in _RESOURCE_ERRNOS:
      return True
    if any(m in str(error) for m in _RESOURCE_MESSAGES):
      return True
    error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    seen += 1
  return False


def _all_agree(ok: bool) -> bool:
  """True if `ok` on every process (a restore must fail or succeed everywhere together)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _key_name(key) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def _shapes(tree) -> dict[str, tuple]:
  """{"a/b/c": (shape, dtype name)} for the leaves of arrays, shape structs or Orbax metadata."""
  return {"/".join(_key_name(k) for k in path): (tuple(x.shape), np.dtype(x.dtype).name)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _check_shapes(item: str, saved_metadata, target) -> None:
  saved, want = _shapes(saved_metadata), _shapes(target)
  for key, (shape, dtype) in want.items():
    if key not in saved:
      raise CheckpointError(f"{item}/{key}: not in the checkpoint")
    if saved[key] != (shape, dtype):
      raise CheckpointError(f"{item}/{key}: checkpoint has {saved[key][1]}{list(saved[key][0])}, "
                            f"run has {dtype}{list(shape)}")
  for key in saved:
    if key not in want:
      raise CheckpointError(f"{item}/{key}: in the checkpoint but not in the run")


def abstract_state(layout: StateLayout, tx: optax.GradientTransformation) -> TrainState:
  """What a checkpoint holds (step, params, opt_state) as ShapeDtypeStructs carrying the target
  shardings of `layout`: what a restore fills in."""
  def abstract(shapes, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)

  return TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=layout.shardings.step),
      params=abstract(layout.param_shapes, layout.shardings.params),
      opt_state=abstract(jax.eval_shape(tx.init, layout.param_shapes),
                         layout.shardings.opt_state))


TMP_SUFFIX = ".orbax-checkpoint-tmp"     # Orbax's name for a step's save in progress


def _save_error(error: BaseException) -> str:
  """One line for a failed save; a full disk said in plain words (tensorstore's message is
  long and names an inner file)."""
  inner, depth = error, 0
  while inner is not None and depth < 20:
    text = str(inner)
    if (getattr(inner, "errno", None) == errno.ENOSPC or "No space left on device" in text
        or "os_error_code='28'" in text):
      return "no space left on device"
    inner, depth = inner.__cause__ or inner.__context__, depth + 1
  return weights.one_line(error)


def _has_item(metadata, item: str) -> bool:
  try:
    tree = metadata[item]
  except (KeyError, TypeError):
    return False
  return tree is not None and bool(jax.tree.leaves(tree))


class Checkpointer:
  """The checkpoints of one run, in WORKDIR/checkpoints: save, wait, restore the latest good one."""

  def __init__(self, workdir: str, cfg: Config, features: tuple = ()):
    """`features`: the run's feature states that are checkpoint items of their own
    (`StateLayout.checkpoint_items`), each with `name`, `item(state) -> (item, state to save)`,
    `target(saved leaf names) -> abstract item` and `restore(state, item or None, where, log)`;
    one with `json = True` saves host data as JSON (no target). The Checkpointer saves and
    restores them and knows nothing else about them."""
    self.cfg = cfg
    self.features = tuple(features)
    self.directory = checkpoint_dir(workdir)
    self._config = weights.config_to_dict(cfg)
    self._manager = _open_manager(self.directory, keep=cfg.checkpoint.keep,
                                  features=self.features)
    self._pending: int | None = None     # the step whose save may still be in flight
    self._failed = False                 # a save failed (reported once, as CheckpointError)

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints (a save in progress or set aside is not one)."""
    return sorted(self._manager.all_steps())

  def resume_point(self) -> str:
    """Where a rerun would start, as words: the latest checkpoint, or the beginning."""
    steps = self.all_steps()
    if not steps:
      return "no checkpoint yet: a rerun starts from the beginning"
    return f"a rerun resumes from checkpoint {self.step_path(steps[-1])} (step {steps[-1]})"

  def prune(self) -> list[int]:
    """Removes the oldest complete checkpoints beyond `checkpoint.keep` (never the newest; tmp
    and `.unreadable` directories are not checkpoints and stay) and logs one line. Returns the
    steps removed. Called on every process alike (Orbax deletes on process 0)."""
    steps = self.all_steps()
    keep = self.cfg.checkpoint.keep
    removed = steps[:-keep] if len(steps) > keep >= 1 else []
    for step in removed:
      self._manager.delete(step)
    if removed:
      log(f"moejax: checkpoint.keep={keep}: removed {len(removed)} older checkpoint(s) from "
          f"{self.directory}: step(s) {', '.join(map(str, removed))}")
    return removed

  def should_save(self, step: int) -> bool:
    every = self.cfg.checkpoint.every
    return step == self.cfg.steps or (every > 0 and step % every == 0)

  def save(self, step: int, state: TrainState, data_state: dict) -> None:
    """Starts writing `state` at `step` in the background (after waiting for the previous save);
    returns once the arrays are copied off the devices, so `state` may be donated next. Each
    feature gives its item and may rewrite what is saved (fssdp saves experts in canonical
    order)."""
    self.wait()                 # the previous save: a failure surfaces here, named
    if step in self._manager.all_steps():
      return
    extra, json_items = {}, {}
    for feature in self.features:
      item, state = feature.item(state)
      (json_items if _is_json(feature) else extra)[feature.name] = item
    items = {"params": state.params, "opt_state": state.opt_state, **extra}
    meta = {"format": weights.FORMAT, "step": int(step), "seed": self.cfg.seed, "data": data_state,
            "checksums": {item: weights.checksums(tree) for item, tree in items.items()}}
    self._pending = step
    try:
      self._manager.save(step, force=True, args=ocp.args.Composite(
          **{item: ocp.args.StandardSave(tree) for item, tree in items.items()},
          **{item: ocp.args.JsonSave(value) for item, value in json_items.items()},
          meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(self._config)))
    except Exception as e:  # noqa: BLE001 -- whatever the storage raises
      self._save_failed(step, e)

  def wait(self) -> None:
    """Blocks until every started save has committed; a save that failed raises CheckpointError
    (once) naming its step's path and the latest intact checkpoint."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- whatever the storage raised in the background
      self._save_failed(self._pending, e)
    self._pending = None

  def close(self) -> None:
    """Waits for the last save (raising CheckpointError if it failed) and closes the manager."""
    try:
      self.wait()
    finally:
      try:
        self._manager.close()
      except Exception:  # noqa: BLE001
        if not self._failed:
          raise          # after a reported failure, the manager's echo of it is not news

  def _save_failed(self, step: int | None, error: BaseException) -> None:
    self._failed = True
    self._pending = None
    self._manager.reload()       # what is on disk: the failed step is not a checkpoint
    where = (f"checkpoint {self.step_path(step)} (step {step})" if step is not None
             else f"a checkpoint in {self.directory}")
    partial = self.step_path(step) + TMP_SUFFIX if step is not None else ""
    leftover = (f"; its partial files are in {partial} (never resumed from; delete them to "
                "free the space)" if partial and os.path.exists(partial) else "")
    raise CheckpointError(f"saving {where} failed: {_save_error(error)}; stopping. The "
                          f"checkpoints before it are intact: {self.resume_point()}"
                          f"{leftover}") from None

  def restore(self, layout: StateLayout, tx: optax.GradientTransformation,
              data_iterator=None) -> tuple[TrainState, int] | None:
    """The latest readable checkpoint as a TrainState on `layout`'s shardings, and its step.

    Sets `data_iterator` to the saved position. An unreadable checkpoint is reported, moved to
    <step>.unreadable and skipped for the one before it; one from an incompatible config (or
    with other array shapes) stops with CheckpointError, and so does a restore that failed for
    want of memory or permission (`_not_the_files`), leaving the checkpoint where it is.
    Returns None when there is none.
    """
    target = abstract_state(layout, tx)
    handled = sys.exc_info()[1]     # a caller's own error in flight: not this restore's
    for step in sorted(self._manager.all_steps(), reverse=True):
      where = f"checkpoint {self.step_path(step)} (step {step})"
      error = None
      try:
        saved_config = self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        metadata = self._manager.metadata(step).item_metadata
        saved_shapes = {item: metadata[item] for item in ("params", "opt_state")}
        for item, tree in saved_shapes.items():
          if tree is None or not jax.tree.leaves(tree):
            raise FileNotFoundError(f"{item}/_METADATA lists no arrays")
        saved_items = {f.name: metadata[f.name] for f in self.features
                       if not _is_json(f) and _has_item(metadata, f.name)}
        saved_json = [f.name for f in self.features if _is_json(f)
                      and os.path.isdir(os.path.join(self.step_path(step), f.name))]
      except Exception as e:  # noqa: BLE001 -- whatever a damaged file raises
        error = e
      if _all_agree(error is None):
        try:
          check_compatible(saved_config, self.cfg, os.path.dirname(self.directory))
          _check_shapes("params", saved_shapes["params"], target.params)
          _check_shapes("opt_state", saved_shapes["opt_state"], target.opt_state)
          feature_targets = {}
          for feature in self.features:
            if feature.name in saved_items:
              saved = saved_items[feature.name]
              feature_targets[feature.name] = feature.target(_shapes(saved))
              _check_shapes(feature.name, saved, feature_targets[feature.name])
        except CheckpointError as e:
          # init_from takes the weights alone: offered unless the model's shape or options
          # differ, which it refuses as well
          start = ("" if getattr(e, "weights_differ", True) else
                   f" (--config.init_from={self.step_path(step)} starts it from these weights)")
          raise CheckpointError(f"{where} does not fit this run: {e}; resume with the "
                                f"checkpoint's config, or use a new --workdir{start}") from None
        try:
          with weights.quiet_failed_reads():
            state, meta = self._restore_state(step, layout, target, feature_targets, saved_json)
        except Exception as e:  # noqa: BLE001
          error = e
      if not _all_agree(error is None):
        resource = _not_the_files(error, handled)
        if not _all_agree(not resource):
          raise CheckpointError(
              f"restoring {where} failed for a reason that is not the checkpoint's: "
              f"{weights.one_line(error) if resource else 'on another process'}; "
              "it was left in place. Free the resource and rerun") from None
        self._set_aside(step, error)
        continue
      if data_iterator is not None:
        try:
          data_iterator.set_state(meta["data"])
        except DataError as e:
          raise CheckpointError(f"{where}: {e}") from None
      return state, step
    aside = self.unreadable_dirs()
    if aside:
      raise CheckpointError(
          f"no readable checkpoint in {self.directory}, only ones set aside as unreadable "
          f"({', '.join(aside)}); repair one and rename it back to its step, or remove them "
          "to start from step 0")
    return None

  def _restore_state(self, step: int, layout: StateLayout, target: TrainState,
                     feature_targets: dict, saved_json=()) -> tuple[TrainState, dict]:
    targets = {"params": target.params, "opt_state": target.opt_state, **feature_targets}
    restored = self._manager.restore(step, args=ocp.args.Composite(
        **{item: ocp.args.StandardRestore(tree) for item, tree in targets.items()},
        **{item: ocp.args.JsonRestore() for item in saved_json},
        meta=ocp.args.JsonRestore()))
    meta = restored["meta"]
    if meta.get("format") != weights.FORMAT or meta.get("step") != step:
      raise CheckpointError(f"meta/ says format {meta.get('format')}, step {meta.get('step')}")
    for item in targets:
      weights.verify(item, restored[item], meta["checksums"][item])
    step_array = jax.make_array_from_callback((), layout.shardings.step,
                                              lambda _: np.asarray(step, np.int32))
    state = TrainState(step=step_array, params=restored["params"], opt_state=restored["opt_state"])
    # Codec caches are not saved: rebuilt (the first gather sends everything, once).
    state = state_lib.with_rebuilt_state(layout, state, restored=True)
    where = f"checkpoint {self.step_path(step)} (step {step})"
    for feature in self.features:
      state = feature.restore(state, restored.get(feature.name), where, log)
    return state, meta

  def _set_aside(self, step: int, error: BaseException | None) -> None:
    path = self.step_path(step)
    target, n = path + UNREADABLE, 1
    while os.path.exists(target):
      n += 1
      target = f"{path}{UNREADABLE}-{n}"
    if jax.process_index() == 0:
      os.rename(path, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"moejax_checkpoint_set_aside_{step}")
    self._manager.reload()
    reason = weights.one_line(error) if error is not None else "unreadable on another process"
    log(f"moejax: checkpoint {path} (step {step}) is unreadable: {reason}; moved it to "
        f"{target} and trying the previous one")

  def unreadable_dirs(self) -> list[str]:
    if not os.path.isdir(self.directory):
      return []
    return sorted(n for n in os.listdir(self.directory) if UNREADABLE in n)


