"""Parameters on disk: the pieces of moejax's Orbax checkpoint format that training
(`moejax.train.checkpoint`) and conversion (`moejax.convert`) share, and reading a checkpoint's
parameters into your own code (`load_params`, `load_config`).

A checkpoint directory is an Orbax `CheckpointManager` directory: one subdirectory per step with
the items `params/` (global shapes, OCDBT), `meta/` (JSON: format, step, a checksum per array)
and `config/` (JSON: the moejax Config), plus what training adds (optimizer state, data position,
feature states). `save_params` writes a parameters-only checkpoint at step 0 (what
`python -m moejax.convert from-hf` produces).

An array's checksum is the sum of its elements' bit patterns, as unsigned integers, modulo 2**32:
an exact integer sum that does not depend on the sharding. It catches a file that reads without
error but holds other bytes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, Sharding

from moejax.config import Config, from_config_dict, upgrade_saved
from moejax.errors import CheckpointError, ConfigError, MoejaxError
from moejax.sharding import layout as layout_lib
from moejax.sharding import mesh as mesh_lib

SUBDIR = "checkpoints"    # a run's checkpoints, inside its workdir
TOKENIZER_FILE = "tokenizer.json"   # a Hugging Face tokenizer, kept beside the weights
TOKENIZER_FROM_WEIGHTS = "init_from"   # data.tokenizer: the one beside config.init_from
FORMAT = 1
PARAMS_STEP = 0           # the one step of a parameters-only checkpoint


def tokenizer_beside(path: str) -> str | None:
  """The tokenizer.json kept with the weights at `path` (a Hugging Face directory, a from-hf
  output, a training workdir, its checkpoints/ or a step's directory), or None."""
  path = os.path.abspath(path)
  directories = [path]
  if os.path.basename(path).isdigit():                       # WORKDIR/checkpoints/STEP
    directories += [os.path.dirname(path), os.path.dirname(os.path.dirname(path))]
  elif os.path.basename(path) == SUBDIR:                     # WORKDIR/checkpoints
    directories.append(os.path.dirname(path))
  for directory in directories:
    if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
      return os.path.join(directory, TOKENIZER_FILE)
  return None


def tokenizer_file(spec: str) -> str | None:
  """The tokenizer.json a tokenizer spec names (the file, or a folder holding one); None for
  'bytes' or when there is no such file."""
  if spec == "bytes":
    return None
  path = os.path.join(spec, TOKENIZER_FILE) if os.path.isdir(spec) else spec
  return path if os.path.isfile(path) else None


def keep_tokenizer(spec: str, directory: str) -> str | None:
  """Copies the tokenizer.json that `spec` names into `directory` (replacing another one there)
  with a tokenizer_config.json naming the EOS the tokenizer resolves to where it stands (its own
  tokenizer_config.json, or a config.json / hf_config.json beside it), so the copy ends
  documents with the same id wherever it is read. Returns the copy, or None for 'bytes'."""
  from moejax.data.tokenizer import TOKENIZER_CONFIG_FILE, load_tokenizer, read_json
  source = tokenizer_file(spec)
  if source is None:
    return None
  target = os.path.join(directory, TOKENIZER_FILE)
  if os.path.exists(target) and os.path.samefile(source, target):
    return target                    # already there, with whatever declares its EOS
  eos = load_tokenizer(source).eos_token
  config = read_json(os.path.join(os.path.dirname(source), TOKENIZER_CONFIG_FILE))
  if eos is not None:
    config["eos_token"] = eos
  shutil.copyfile(source, target)
  config_target = os.path.join(directory, TOKENIZER_CONFIG_FILE)
  if config:
    with open(config_target, "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
  elif os.path.exists(config_target):
    os.remove(config_target)         # a stale one would name another tokenizer's EOS
  return target


def tokenizer_of(cfg: Config) -> str:
  """`cfg.data.tokenizer`, with `init_from` resolved to the tokenizer.json beside
  `cfg.init_from`'s weights; CheckpointError if there is none."""
  if cfg.data.tokenizer != TOKENIZER_FROM_WEIGHTS:
    return cfg.data.tokenizer
  if not cfg.init_from:
    raise ConfigError(f"config.data.tokenizer={TOKENIZER_FROM_WEIGHTS!r} reads the tokenizer.json "
                      "beside config.init_from, which is empty: set config.init_from=HF_DIR, or "
                      "config.data.tokenizer to 'bytes' or a tokenizer.json")
  found = tokenizer_beside(cfg.init_from)
  if found is None:
    raise CheckpointError(f"config.data.tokenizer={TOKENIZER_FROM_WEIGHTS!r}: no {TOKENIZER_FILE} "
                          f"beside config.init_from={cfg.init_from!r}; copy the model's "
                          "tokenizer.json there or set config.data.tokenizer to its path (or "
                          "to 'bytes' for weights trained on bytes, as moejax's to-hf says of "
                          "them)")
  return found


def config_to_dict(cfg: Config) -> dict:
  """Nested plain dict (tuples as lists), as stored in a checkpoint's config/ item."""
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


# ------------------------------------------------------------------------------------------------
# Checksums.

_WORD = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _word_sum(x_N):
  words = jax.lax.bitcast_convert_type(x_N, _WORD[x_N.dtype.itemsize])
  return jnp.sum(words.astype(jnp.uint32), dtype=jnp.uint32)


_word_sums = jax.jit(lambda leaves: [_word_sum(x) for x in leaves])


def _np_word_sum(x: np.ndarray) -> int:
  words = np.ascontiguousarray(x).view(np.dtype(_WORD[x.dtype.itemsize]))
  return int(np.sum(words, dtype=np.uint64) % (1 << 32))


def checksums(tree) -> dict[str, int]:
  """{key path: sum of the array's bit patterns mod 2**32} for jax or numpy leaves."""
  with_path = jax.tree_util.tree_leaves_with_path(tree)
  leaves = [x for _, x in with_path]
  if all(isinstance(x, np.ndarray) for x in leaves):
    sums = [_np_word_sum(x) for x in leaves]
  else:
    sums = [int(s) for s in jax.device_get(_word_sums(leaves))]
  return {jax.tree_util.keystr(path): s for (path, _), s in zip(with_path, sums)}


def verify(item: str, tree, expected: dict[str, int]) -> None:
  got = checksums(tree)
  if set(got) != set(expected):
    missing = sorted(set(expected) ^ set(got))
    raise CheckpointError(f"{item}: arrays differ from the checksum list (first: {missing[0]})")
  for key, value in got.items():
    if value != int(expected[key]):
      raise CheckpointError(f"{item}{key}: checksum {value} != {expected[key]} recorded at save")


# ------------------------------------------------------------------------------------------------
# The manager.

def open_manager(directory: str, keep: int | None = None, create: bool = True, **handlers):
  """An Orbax CheckpointManager for `directory` with moejax's items (readers pass create=False).
  `lightweight_initialize` lists steps without reading their files, so a damaged one cannot
  stop the listing."""
  options = ocp.CheckpointManagerOptions(
      create=create, lightweight_initialize=True, enable_async_checkpointing=True,
      preservation_policy=None if keep is None else ocp.checkpoint_managers.LatestN(n=keep))
  handlers = {"params": ocp.StandardCheckpointHandler(),
              "meta": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler(),
              **handlers}
  return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


# What a failed restore's abandoned reads print: each read that completes after Orbax's event
# loop closed tries to schedule its callback there, and its thread prints the RuntimeError.
_CLOSED_LOOP = "RuntimeError: Event loop is closed"
_CLOSED_LOOP_LINES = re.compile(
    r"  File \"[^\"]*asyncio/base_events\.py\", line \d+, in (?:call_soon_threadsafe|_check_closed)"
    r"|    self\._check_closed\(\)"
    r"|    raise RuntimeError\('Event loop is closed'\)|" + _CLOSED_LOOP)
_TRACEBACK = "Traceback (most recent call last):"


@contextlib.contextmanager
def quiet_failed_reads():
  """Orbax reads a checkpoint's arrays as asyncio tasks. When one read fails (a damaged file),
  the others surface as asyncio's "exception was never retrieved" records, "Exception ignored
  in <coroutine>" warnings and "Event loop is closed" tracebacks that TensorStore's threads
  print: hundreds of lines with TensorStore specs around the one line that says what happened.
  Within this block, and as it ends (the garbage collector finalizes the abandoned tasks there),
  those are dropped; the failure itself still raises, and whatever else the block writes to
  stderr is written after it."""
  asyncio_log = logging.getLogger("asyncio")
  hook = sys.unraisablehook

  def unretrieved(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in record.getMessage()

  def unraisable(u):
    if not (inspect.iscoroutine(u.object) or isinstance(u.exc_value, RuntimeError)
            and str(u.exc_value) == "Event loop is closed"):
      hook(u)

  asyncio_log.addFilter(unretrieved)
  sys.unraisablehook = unraisable
  sys.stderr.flush()
  saved_fd = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)      # the threads print from C++: only the descriptor sees it
    try:
      yield
    except BaseException:
      _until_quiet(captured)    # the abandoned reads finish and print after the failure
      raise
    finally:
      gc.collect()
      sys.stderr.flush()
      os.dup2(saved_fd, 2)
      os.close(saved_fd)
      sys.unraisablehook = hook
      asyncio_log.removeFilter(unretrieved)
      captured.seek(0)
      text = captured.read().decode(errors="replace")
      closed = text.count(_CLOSED_LOOP)
      if closed:
        text = _CLOSED_LOOP_LINES.sub("", text).replace(_TRACEBACK, "", closed)
        text = "".join(line for line in text.splitlines(keepends=True) if line.strip())
      sys.stderr.write(text)
      sys.stderr.flush()


def _until_quiet(captured, quiet_s: float = 0.2, limit_s: float = 3.0) -> None:
  """Waits until nothing more was written to `captured` for `quiet_s` (at most `limit_s`)."""
  start = time.monotonic()
  size, since = -1, start
  while time.monotonic() - start < limit_s:
    now_size = os.fstat(captured.fileno()).st_size
    if now_size != size:
      size, since = now_size, time.monotonic()
    elif time.monotonic() - since >= quiet_s:
      return
    time.sleep(0.02)


def one_line(e: BaseException) -> str:
  """The innermost cause of `e` as one line (tensorstore's message names the file)."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = " ".join(str(e).split())
  text = text if len(text) <= 300 else text[:297] + "..."
  return text if isinstance(e, MoejaxError) else f"{type(e).__name__}: {text}"


def first_non_finite(params) -> str | None:
  """The path (`jax.tree_util.keystr`) of the first parameter holding a NaN or an infinity, or
  None: host arrays, any float dtype."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not np.all(np.isfinite(np.asarray(leaf, np.float32))):
      return jax.tree_util.keystr(path)
  return None


def check_new_dir(out_dir: str) -> str:
  """`out_dir` as an absolute path, or a CheckpointError when it already holds files (callers
  check before reading the weights they will write there)."""
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise CheckpointError(f"{out_dir}: is a file, not a directory; choose a new directory for "
                          "the checkpoint")
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise CheckpointError(f"{out_dir}: not empty; choose a new directory for the checkpoint")
  return out_dir


def save_params(out_dir: str, cfg: Config, params, *, source: str = "") -> str:
  """Writes `params` as step 0 of a parameters-only checkpoint in `out_dir` (must not hold
  one): what `load_params(out_dir)` and `--config.init_from=out_dir` read."""
  out_dir = check_new_dir(out_dir)
  meta = {"format": FORMAT, "step": PARAMS_STEP, "source": source,
          "checksums": {"params": checksums(params)}}
  manager = ocp.CheckpointManager(
      out_dir, options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
      item_handlers={"params": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()})
  try:
    manager.save(PARAMS_STEP, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta),
        config=ocp.args.JsonSave(config_to_dict(cfg))))
    manager.wait_until_finished()
  finally:
    manager.close()
  return out_dir


# ------------------------------------------------------------------------------------------------
# Reading parameters into your own code.

def _locate(path: str, step: int | None) -> tuple[str, int]:
  """(manager directory, step) from a workdir, its checkpoints/ dir, or one step's dir."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, SUBDIR)):
    path = os.path.join(path, SUBDIR)
  elif os.path.basename(path).isdigit() and os.path.isdir(os.path.join(path, "params")):
    if step is not None and step != int(os.path.basename(path)):
      raise CheckpointError(f"{path} is the checkpoint of step {os.path.basename(path)}, "
                            f"not of step {step}")
    path, step = os.path.dirname(path), int(os.path.basename(path))
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: no such checkpoint directory")
  with open_manager(path, create=False) as manager:
    steps = sorted(manager.all_steps())
  if not steps:
    raise CheckpointError(f"{path}: no complete checkpoint in this directory")
  if step is None:
    step = steps[-1]
  if step not in steps:
    raise CheckpointError(f"{path}: no checkpoint of step {step} (steps: "
                          f"{', '.join(map(str, steps))})")
  return path, step


def _read_config(directory: str, step: int) -> Config:
  try:
    with open_manager(directory, create=False) as manager:
      saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return from_config_dict(upgrade_saved(saved["config"]))
  except Exception as e:  # noqa: BLE001
    raise CheckpointError(f"checkpoint {os.path.join(directory, str(step))} (step {step}): "
                          f"config/: {one_line(e)}") from None


def load_config(path: str, step: int | None = None) -> Config:
  """The Config that wrote a checkpoint (a workdir, its checkpoints/ dir, or a step's dir)."""
  return _read_config(*_locate(path, step))


def _check_shardings(shapes, shardings) -> None:
  """CheckpointError naming the parameter whose sharding does not fit it (before Orbax starts a
  restore it cannot finish)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  try:
    per_leaf = treedef.flatten_up_to(shardings)
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"load_params: shardings is not one Sharding or a pytree like the "
                          f"parameters: {one_line(e)}") from None
  for (path, shape), sharding in zip(leaves, per_leaf):
    name = jax.tree_util.keystr(path)
    if not isinstance(sharding, Sharding):
      raise CheckpointError(f"load_params: shardings{name} is {type(sharding).__name__}, not a "
                            "jax Sharding")
    try:
      sharding.shard_shape(shape.shape)
    except Exception as e:  # noqa: BLE001  (jax raises several kinds for a misfit)
      raise CheckpointError(f"load_params: shardings{name} does not fit its shape "
                            f"{tuple(shape.shape)}: {one_line(e)}") from None


def load_params(path: str, step: int | None = None, *, mesh=None, shardings=None) -> dict:
  """A checkpoint's parameters: the nested dict `moejax.models.olmoe.forward` takes.

  Args:
    path: a workdir, its checkpoints/ directory, or one step's directory.
    step: which step (default: the latest complete one).
    mesh: a moejax mesh (`moejax.sharding.mesh.make_mesh`): sharded arrays laid out as in
      training, for the checkpoint's expert placement.
    shardings: instead of `mesh`, one Sharding for every array or a pytree of them like params.
  With neither, host numpy arrays. Checksums are verified; every failure is a CheckpointError.
  """
  if mesh is not None and shardings is not None:
    raise CheckpointError("load_params takes mesh or shardings, not both")
  if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
    raise CheckpointError(f"load_params: step={step!r} must be an int (or None: the latest)")
  if mesh is not None and tuple(mesh.axis_names) != tuple(mesh_lib.DEVICES):
    raise CheckpointError(f"load_params: mesh has axes {tuple(mesh.axis_names)}, not moejax's "
                          f"{tuple(mesh_lib.DEVICES)}: make it with "
                          "moejax.sharding.mesh.make_mesh, or pass shardings=")
  directory, step = _locate(path, step)
  cfg = _read_config(directory, step)
  from moejax.models import olmoe   # only to know the shapes
  shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  if mesh is not None:
    layouts = layout_lib.param_layouts(olmoe.param_meta(cfg), cfg.moe.placement, mesh.devices.size)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                             layout_lib.param_specs(shapes, layouts),
                             is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
  if shardings is None:
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
  else:
    if isinstance(shardings, Sharding):
      shardings = jax.tree.map(lambda _: shardings, shapes)
    _check_shardings(shapes, shardings)
    restore_args = jax.tree.map(lambda _, sh: ocp.ArrayRestoreArgs(sharding=sh), shapes,
                                shardings)
  try:
    with (quiet_failed_reads(),
          open_manager(directory, create=False, params=ocp.PyTreeCheckpointHandler()) as manager):
      restored = manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.PyTreeRestore(shapes, restore_args), meta=ocp.args.JsonRestore()))
    verify("params", restored["params"], restored["meta"]["checksums"]["params"])
  except Exception as e:  # noqa: BLE001
    raise CheckpointError(f"checkpoint {os.path.join(directory, str(step))} (step {step}) is "
                          f"unreadable: {one_line(e)}") from None
  return restored["params"]
