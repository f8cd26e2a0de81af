"""Checkpoints on disk with real Orbax: bit-exact resume, a process killed while saving, damaged
files, other meshes and expert placements, incompatible configs, and `load_params`.

Training runs in process on 8 devices through the suite's canonical Trainer (tests/conftest.py
`trainer_for`, compiled once per session), except the run that must be killed: a train.py
subprocess, on 8 devices too, so that its numbers can be compared bit for bit. The uninterrupted
reference run (`trained`, tests/train/conftest.py) is shared with test_init_from.py. Mesh and
placement changes are tested on random states, without training.
"""
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import Config
from moejax.errors import CheckpointError
from moejax.models import olmoe
from moejax.sharding.mesh import make_mesh
from moejax import weights
from moejax.train import checkpoint as ckpt
from moejax.train import optim, state as state_lib
from moejax.train.loop import run
from tests.helpers import CANONICAL, REPO, canonical_config, canonical_flags, tiny_config
from tests.train.conftest import TIMING, records as _records

SMALL = {"batch_size": 8, "seq_len": 32, "log_every": 1, "eval_batches": 1}
STEPS = CANONICAL["steps"]                 # 12, checkpoints every 4
assert CANONICAL["checkpoint.every"] == 4
CLI = canonical_flags("fsdp")

# train.py with Orbax's JSON writer stopped, forever, when it writes the meta/ item of one step:
# the process sits in the middle of that save, its tmp directory on disk, until it is killed.
PAUSE_SAVE = """
import runpy, sys, time
import orbax.checkpoint as ocp
marker, pause_step, train_py = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.argv = [train_py, *sys.argv[4:]]
original = ocp.handlers.JsonCheckpointHandler.async_save

async def async_save(self, directory, item=None, args=None):
  if args is not None and args.item.get("step") == pause_step:
    open(marker, "w").close()
    time.sleep(3600)
  return await original(self, directory, item, args)

ocp.handlers.JsonCheckpointHandler.async_save = async_save
runpy.run_path(train_py, run_name="__main__")
"""


def _numbers(records: list[dict]) -> list[dict]:
  """What a resumed run must reproduce exactly: everything but wall-clock figures."""
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


# ------------------------------------------------------------------------------------------------
# One uninterrupted run (checkpoints 4, 8, 12): `trained`, the reference, and what later tests
# copy (tests/train/conftest.py).

def _copy(trained, tmp_path):
  shutil.copytree(trained, tmp_path / "w")
  return tmp_path / "w"


def test_train_stop_resume_equals_an_uninterrupted_run(trainer, trained, tmp_path, capsys):
  workdir = tmp_path / "w"
  run(trainer.cfg, str(workdir), trainer=trainer, stop_at=STEPS // 2)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]
  capsys.readouterr()
  run(trainer.cfg, str(workdir), trainer=trainer)
  assert (f"moejax: resuming from step 6 (checkpoint {workdir}/checkpoints/6)"
          in capsys.readouterr().out)
  records = _records(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))     # appended, in order
  assert _numbers(records) == _numbers(_records(trained))              # lr and data included
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "6", "8"]   # the last 3 kept


def test_killed_while_saving_resumes_from_the_previous_checkpoint(trainer, trained, tmp_path,
                                                                  capsys):
  workdir, marker = tmp_path / "w", tmp_path / "saving"
  wrapper = tmp_path / "pause_save.py"
  wrapper.write_text(PAUSE_SAVE)
  output = tmp_path / "output.txt"
  with open(output, "w") as out:
    proc = subprocess.Popen(
        [sys.executable, str(wrapper), str(marker), "8", os.path.join(REPO, "train.py"), *CLI,
         "--workdir", str(workdir)], cwd=REPO, env=dict(os.environ),   # 8 devices, as here
        stdout=out, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 300
    while not marker.exists():
      assert proc.poll() is None, output.read_text()[-3000:]
      assert time.monotonic() < deadline, "the run never reached its save at step 8"
      time.sleep(0.2)
    listing = sorted(os.listdir(workdir / "checkpoints"))
    assert "4" in listing and "8.orbax-checkpoint-tmp" in listing and "8" not in listing
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert [r["step"] for r in _records(workdir)] == list(range(1, 9))

  capsys.readouterr()
  run(trainer.cfg, str(workdir), trainer=trainer)     # what rerunning the command does
  assert (f"moejax: resuming from step 4 (checkpoint {workdir}/checkpoints/4)"
          in capsys.readouterr().out)
  records = _records(workdir)
  assert [r["step"] for r in records] == [*range(1, 9), *range(5, STEPS + 1)]
  # Steps 5-8 ran twice, before the kill and after the resume; all of it equals the
  # uninterrupted run, bit for bit.
  assert _numbers(records[4:8]) == _numbers(records[8:12])
  assert _numbers(records[:8] + records[12:]) == _numbers(_records(trained))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "4", "8"]   # tmp dir replaced


# ------------------------------------------------------------------------------------------------
# Damaged checkpoints.

def _largest_file(directory) -> str:
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


def _flip_a_bit(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)[0]
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte ^ 1]))


# A failed restore leaves Orbax's other reads of that step unawaited; their errors surface when
# they are garbage collected (collected below, inside the test).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete", "flip_a_bit", "truncate_meta"])
def test_damaged_checkpoint_is_reported_skipped_and_kept(trainer, trained, tmp_path, capfd,
                                                        damage):
  workdir = _copy(trained, tmp_path)
  step_dir = workdir / "checkpoints" / "12"
  params_file = _largest_file(step_dir / "params")
  truncated_size = os.path.getsize(params_file) // 2
  if damage == "truncate":
    os.truncate(params_file, truncated_size)
  elif damage == "delete":
    os.remove(_largest_file(step_dir / "opt_state"))
  elif damage == "flip_a_bit":      # reads without error: only the checksum can tell
    _flip_a_bit(params_file)
  else:
    os.truncate(step_dir / "meta" / "metadata", 10)
  files = sorted(os.path.relpath(os.path.join(d, f), step_dir)
                 for d, _, fs in os.walk(step_dir) for f in fs)
  checkpoints = ckpt.Checkpointer(str(workdir), trainer.cfg)
  try:
    state, step = checkpoints.restore(trainer.layout, trainer.tx)
  finally:
    checkpoints.close()
    gc.collect()
  assert step == 8 and int(state.step) == 8
  out, err = capfd.readouterr()
  report = [line for line in out.splitlines() if "unreadable" in line]
  assert len(report) == 1
  # Nothing of the abandoned reads (`weights.quiet_failed_reads`; printed in some runs only)
  assert not any(noise in err for noise in ("Traceback", "Event loop is closed",
                                            "never retrieved", "Exception ignored")), err
  assert report[0].startswith(f"moejax: checkpoint {step_dir} (step 12) is unreadable: ")
  assert report[0].endswith(f"moved it to {step_dir}.unreadable and trying the previous one")
  # Never deleted: every file is still there, the damaged one as it was.
  kept = workdir / "checkpoints" / "12.unreadable"
  assert sorted(os.path.relpath(os.path.join(d, f), kept)
                for d, _, fs in os.walk(kept) for f in fs) == files
  if damage == "truncate":
    assert os.path.getsize(params_file.replace("/12/", "/12.unreadable/")) == truncated_size
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12.unreadable", "4", "8"]


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")
def test_a_failed_read_s_stragglers_print_nothing_and_the_rest_is_kept(capfd, caplog):
  """What a failed Orbax restore's abandoned reads print, as TensorStore's threads print it (to
  the file descriptor, after the failure, interleaved), with asyncio's record of an unretrieved
  future and an unawaited coroutine: dropped; another line written meanwhile is kept, and the
  failure raises."""
  import asyncio
  import logging
  import threading
  closed = ("Traceback (most recent call last):\n"
            '  File "/usr/lib/python3.12/asyncio/base_events.py", line 837, in '
            "call_soon_threadsafe\n    self._check_closed()\n"
            '  File "/usr/lib/python3.12/asyncio/base_events.py", line 539, in _check_closed\n'
            "    raise RuntimeError('Event loop is closed')\nRuntimeError: Event loop is closed\n")

  def straggler(delay_s):
    time.sleep(delay_s)
    for part in (closed[:60], closed[60:]):        # two writes another thread's lines may split
      os.write(2, part.encode())

  async def read():
    raise ValueError("OUT_OF_RANGE")

  threads = [threading.Thread(target=straggler, args=(d,)) for d in (0.0, 0.05, 0.1)]
  with pytest.raises(ValueError, match="damaged"):
    with weights.quiet_failed_reads():
      # Written before the stragglers start: raw writes from threads can land mid-line, and a
      # line glued inside a traceback's line goes with it (a race, seen once in six runs).
      os.write(2, b"a line of its own\n")
      for t in threads:
        t.start()
      logging.getLogger("asyncio").error("Future exception was never retrieved")
      read()                                          # never awaited: collected at the end
      raise ValueError("damaged")
  for t in threads:
    t.join()
  out, err = capfd.readouterr()
  assert err == "a line of its own\n"
  assert "never retrieved" not in caplog.text
  logging.getLogger("asyncio").error("another record")        # the filter is gone again
  assert "another record" in caplog.text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("error", [MemoryError("host"), PermissionError(13, "Permission denied"),
                                   RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating")])
def test_restore_that_ran_out_of_memory_keeps_the_checkpoint(trainer, trained, tmp_path,
                                                             monkeypatch, error):
  """Out of memory (or permission) while reading is not damage: the checkpoint stays where it is
  and the restore stops with one line, rather than resuming from an older one."""
  workdir = _copy(trained, tmp_path)
  before = sorted(os.listdir(workdir / "checkpoints"))

  def failing(self, *args, **kwargs):
    raise RuntimeError("reading params/ failed") from error

  monkeypatch.setattr(ckpt.Checkpointer, "_restore_state", failing)
  checkpoints = ckpt.Checkpointer(str(workdir), trainer.cfg)
  try:
    with pytest.raises(CheckpointError, match="not the checkpoint's: .*left in place"):
      checkpoints.restore(trainer.layout, trainer.tx)
  finally:
    checkpoints.close()
  assert sorted(os.listdir(workdir / "checkpoints")) == before
  assert ckpt._not_the_files(error) and not ckpt._not_the_files(ValueError("bad header"))
  assert ckpt._not_the_files(ValueError("PERMISSION_DENIED: Failed to open [os_error_code='13']"))


def test_damage_found_while_the_caller_handles_a_memory_error_is_still_damage(trainer, trained,
                                                                              tmp_path):
  """A caller's own MemoryError in flight becomes the damage's __context__; it must not make a
  truncated checkpoint look like a resource failure."""
  workdir = _copy(trained, tmp_path)
  os.truncate(workdir / "checkpoints" / "12" / "meta" / "metadata", 10)
  checkpoints = ckpt.Checkpointer(str(workdir), trainer.cfg)
  try:
    try:
      raise MemoryError("the caller's")
    except MemoryError:
      _, step = checkpoints.restore(trainer.layout, trainer.tx)
  finally:
    checkpoints.close()
  assert step == 8
  assert "12.unreadable" in os.listdir(workdir / "checkpoints")


def test_only_unreadable_checkpoints_is_an_error_not_a_fresh_start(trainer, trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  for step in ("4", "8", "12"):
    os.truncate(workdir / "checkpoints" / step / "meta" / "metadata", 10)
  for _ in range(2):      # the second time they are already set aside
    checkpoints = ckpt.Checkpointer(str(workdir), trainer.cfg)
    with pytest.raises(CheckpointError, match="no readable checkpoint in .*12.unreadable"):
      checkpoints.restore(trainer.layout, trainer.tx)
    checkpoints.close()


# ------------------------------------------------------------------------------------------------
# Incompatible configs.

def test_incompatible_config_is_refused_naming_the_field(trained, tmp_path):
  """What `train.py ... --config.model.d_model=128` runs (in process; how train.py turns a
  MoejaxError into one line and exit code 2 is tests/test_cli.py's)."""
  workdir = _copy(trained, tmp_path)
  with pytest.raises(CheckpointError) as e:
    run(canonical_config(**{"model.d_model": 128}), str(workdir))
  message = str(e.value)
  assert "\n" not in message
  assert f"checkpoint {workdir}/checkpoints/12 (step 12)" in message
  assert "config.model.d_model: checkpoint has 64, run has 128" in message
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "4", "8"]   # untouched


def test_which_fields_may_differ_on_resume():
  saved = weights.config_to_dict(tiny_config())
  ckpt.check_compatible(saved, tiny_config(**{
      "steps": 999, "log_every": 3, "eval_every": 7, "eval_batches": 2, "remat": "none",
      "mesh.shape": (2, -1), "moe.placement": "ep", "checkpoint.every": 5,
      "checkpoint.keep": 9, "init_from": "elsewhere", "moe.dispatch_capacity_factor": 3.0,
      "moe.dispatch_overflow": "drop", "optim.lr": 1e-3, "optim.clip_norm": 0.5,
      "optim.warmup_steps": 0, "optim.b2": 0.99,     # a diverged run resumes with a lower lr
      "data.source": "tokens", "data.path": "prepared"}))   # the iterator checks the stream
  for field, value, message in [
      ("optim.clip_norm", 0.0, "config.optim.clip_norm: checkpoint has 1.0, run has 0.0: "
       "clipping switched off changes the optimizer state's structure; keep it on (any value "
       "> 0), or start a new workdir from these weights (--config.init_from=CHECKPOINT)"),
      ("moe.num_experts", 16, "config.moe.num_experts: checkpoint has 8, run has 16"),
      ("seed", 1, "config.seed: checkpoint has 0, run has 1"),
      ("data.tokenizer", "tok.json",
       'config.data.tokenizer: checkpoint has "bytes", run has "tok.json"')]:
    with pytest.raises(CheckpointError) as e:
      ckpt.check_compatible(saved, tiny_config(**{field: value}))
    assert str(e.value) == message
  # Every field that differs, in one line (one try names them all).
  with pytest.raises(CheckpointError) as e:
    ckpt.check_compatible(saved, tiny_config(**{"moe.num_experts": 16, "seed": 1}))
  assert str(e.value) == ("config.moe.num_experts: checkpoint has 8, run has 16; config.seed: "
                          "checkpoint has 0, run has 1")
  assert e.value.weights_differ                    # init_from is not offered for these weights
  with pytest.raises(CheckpointError) as e:
    ckpt.check_compatible(saved, tiny_config(**{"seed": 1}))
  assert not e.value.weights_differ                # the weights fit: init_from is offered
  # fssdp.* held no state in a run of another placement: a move to fssdp may set them; between
  # two fssdp runs they stay.
  ckpt.check_compatible(saved, tiny_config(**{"moe.placement": "fssdp",
                                              "fssdp.reshard_every": 5}))
  fssdp_saved = weights.config_to_dict(tiny_config(**{"moe.placement": "fssdp"}))
  with pytest.raises(CheckpointError, match=r"^config.fssdp.reshard_every: checkpoint has"):
    ckpt.check_compatible(fssdp_saved, tiny_config(**{"moe.placement": "fssdp",
                                                      "fssdp.reshard_every": 5}))
  # A field an older checkpoint does not have counts as its default value.
  del saved["routing"]["locality_weight"]
  ckpt.check_compatible(saved, tiny_config())
  with pytest.raises(CheckpointError, match="config.routing.locality_weight: checkpoint has "
                                            f"{Config().routing.locality_weight}, run has 0.5"):
    ckpt.check_compatible(saved, tiny_config(**{"routing.locality_weight": 0.5}))


def test_the_tokenizer_may_be_named_by_another_path_to_the_same_file(tmp_path):
  """data.tokenizer is compared with what the run kept in its workdir (`keep_tokenizer`), not
  by its path text: the kept copy itself, a copy elsewhere and a relative path resume; another
  file, or the same one ending documents with another EOS, is refused naming the kept copy."""
  import json
  from tests.data.conftest import SENTENCES, word_level
  source, copy, other = (tmp_path / d / "tokenizer.json" for d in ("a", "b", "c"))
  for path in (source, copy, other):
    path.parent.mkdir()
  word_level(SENTENCES).save(str(source))
  shutil.copyfile(source, copy)
  word_level(SENTENCES + ["one more word"]).save(str(other))
  workdir = tmp_path / "w"
  workdir.mkdir()
  kept = weights.keep_tokenizer(str(source), str(workdir))
  saved = weights.config_to_dict(tiny_config(**{"data.tokenizer": str(source)}))
  check = lambda spec, where=str(workdir): ckpt.check_compatible(   # noqa: E731
      saved, tiny_config(**{"data.tokenizer": str(spec)}), where)
  for spec in (kept, copy, os.path.relpath(copy), copy.parent):
    check(spec)
  with pytest.raises(CheckpointError, match=r'^config.data.tokenizer: checkpoint has ".*/a/'
                                            r'tokenizer.json", run has ".*/b/tokenizer.json"$'):
    check(copy, None)                        # no workdir to compare with: the paths differ
  refused = (r'^config.data.tokenizer: checkpoint has ".*/a/tokenizer.json", run has ".*/{}", '
             r"not byte for byte the run's .*/w/tokenizer.json with its EOS$")
  with pytest.raises(CheckpointError, match=refused.format("c/tokenizer.json")):
    check(other)
  (copy.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
  with pytest.raises(CheckpointError, match=refused.format("b")):
    check(copy.parent)


# ------------------------------------------------------------------------------------------------
# Other meshes and expert placements (in process, no training: random state, exact equality).

def _layout(placement: str, devices: int, **overrides):
  cfg = tiny_config(**SMALL, **{"moe.placement": placement}, **overrides)
  mesh = make_mesh((1, -1), jax.devices()[:devices])
  tx = optim.make_optimizer(cfg)
  return cfg, mesh, state_lib.state_layout(cfg, mesh, tx), tx


def _save(directory, cfg, layout, tx, host_state, data_state=None, **kwargs):
  """Checkpoint step 3 of `host_state` laid out on `layout` in `directory`."""
  state = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), host_state,
                       ckpt.abstract_state(layout, tx))
  checkpoints = ckpt.Checkpointer(str(directory), cfg, **kwargs)
  checkpoints.save(3, state, data_state or {"next_batch": 3})
  checkpoints.close()


@pytest.fixture(scope="module")
def host_state():
  """A TrainState of host arrays, every value random (optimizer moments too)."""
  _, _, layout, tx = _layout("fsdp", 1)
  rng = np.random.default_rng(0)

  def fill(s):
    if np.issubdtype(s.dtype, np.integer):
      return rng.integers(0, 1000, s.shape).astype(s.dtype)
    return rng.standard_normal(s.shape).astype(s.dtype)

  state = jax.tree.map(fill, ckpt.abstract_state(layout, tx))
  return state.replace(step=np.asarray(3, np.int32))


@pytest.mark.parametrize("source,target", [
    (("fsdp", 8), ("fsdp", 4)),
    (("fsdp", 1), ("fsdp", 8)),
    (("fsdp", 8), ("ep", 8)),
    (("ep", 8), ("fsdp", 1)),
])
def test_restore_onto_another_mesh_and_placement(tmp_path, host_state, source, target):
  cfg, _, layout, tx = _layout(*source)
  _save(tmp_path, cfg, layout, tx, host_state)

  cfg, mesh, layout, tx = _layout(*target)
  checkpoints = ckpt.Checkpointer(str(tmp_path), cfg)
  state, step = checkpoints.restore(layout, tx)
  checkpoints.close()
  assert step == 3
  for field in ("step", "params", "opt_state"):
    want_tree, got_tree = getattr(host_state, field), getattr(state, field)
    for (path, want), got, sharding in zip(jax.tree_util.tree_leaves_with_path(want_tree),
                                           jax.tree.leaves(got_tree),
                                           jax.tree.leaves(getattr(layout.shardings, field))):
      where = field + jax.tree_util.keystr(path)
      assert got.sharding == sharding, where
      np.testing.assert_array_equal(np.asarray(got), want, err_msg=where)

  # load_params lays them out as training would on `mesh`, with the checkpoint's placement.
  sharded = ckpt.load_params(str(tmp_path), mesh=mesh)
  _, _, layout, _ = _layout(source[0], target[1])
  for want, got, sharding in zip(jax.tree.leaves(host_state.params), jax.tree.leaves(sharded),
                                 jax.tree.leaves(layout.shardings.params)):
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), want)


def test_an_item_this_run_does_not_use_restores_without_orbaxs_warning(tmp_path, host_state,
                                                                         caplog):
  """A checkpoint of a run with a feature item ("dispatch": ep's grown buffers), restored by a
  run without it (fsdp): Orbax warned that the item "could not be restored" (no handler was
  registered for it); the state restores either way."""
  import dataclasses as dc

  @dc.dataclass
  class Dispatch:
    name: str = "dispatch"
    json: bool = True

    def item(self, state):
      return {"dispatch_capacity_factor": 3.0}, state

  cfg, _, layout, tx = _layout("fsdp", 1)
  _save(tmp_path, cfg, layout, tx, host_state, features=(Dispatch(),))
  checkpoints = ckpt.Checkpointer(str(tmp_path), cfg)
  with caplog.at_level("WARNING"):
    _, step = checkpoints.restore(layout, tx)
  checkpoints.close()
  assert step == 3
  assert not [r for r in caplog.records if "could not be restored" in r.getMessage()]
  # The registry names every feature item there is, JSON or not, as the features do.
  from moejax.placement.placement import FssdpCheckpoint
  from moejax.train.codec_control import CodecDecisionItem
  from moejax.train.loop import DispatchCapacityItem
  items = {c.name: getattr(c, "json", False) for c in (
      DispatchCapacityItem(None), CodecDecisionItem(None), FssdpCheckpoint(None, None, None))}
  assert items == ckpt.FEATURE_ITEMS_JSON


@pytest.mark.parametrize("saved_overrides,run_overrides,message", [
    ({}, {"model.d_model": 32},
     r"params/embed: checkpoint has float32\[320, 64\], run has float32\[320, 32\]"),
    ({}, {"model.qk_norm": "none"},
     r"params/layers/attn/k_norm: in the checkpoint but not in the run"),
    ({"model.qk_norm": "none"}, {},
     r"params/layers/attn/k_norm: not in the checkpoint"),
])
def test_a_checkpoint_whose_arrays_do_not_fit_the_run_is_refused_by_path(
    tmp_path, saved_overrides, run_overrides, message):
  """A checkpoint whose config matches the run's but whose arrays do not (written by another
  version, or its config edited by hand): refused before any array is read, naming the array,
  and left in place."""
  saved_cfg, _, layout, tx = _layout("fsdp", 1, **saved_overrides)
  zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), ckpt.abstract_state(layout, tx))
  _save(tmp_path, saved_cfg, layout, tx, zeros)
  _, _, run_layout, run_tx = _layout("fsdp", 1, **run_overrides)
  checkpoints = ckpt.Checkpointer(str(tmp_path), saved_cfg)  # the saved config: arrays differ
  with pytest.raises(CheckpointError) as e:
    checkpoints.restore(run_layout, run_tx)
  checkpoints.close()
  # (no --config.init_from offered: these weights would not fit a new run of this config either)
  step3 = re.escape(f"{tmp_path}/checkpoints/3")
  assert re.fullmatch(f"checkpoint {step3} \\(step 3\\) does not fit this run: {message}; resume "
                      "with the checkpoint's config, or use a new --workdir", str(e.value)), (
      str(e.value))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]


def test_a_checkpoint_of_other_training_data_is_refused_and_kept(tmp_path, host_state):
  """The data position saved with a checkpoint belongs to its corpus: a rerun whose text file
  changed under the same data.path (a field that may differ) stops with one line naming the
  checkpoint, rather than resuming at a position in other data."""
  from moejax.data import DataSpec, make_data
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the first corpus, long enough for a few batches of windows. " * 40)
  data = make_data(DataSpec("text", str(corpus)), batch_size=2, seq_len=16)
  next(data.train)
  cfg, _, layout, tx = _layout("fsdp", 1)
  _save(tmp_path / "w", cfg, layout, tx, host_state, data.train.get_state())
  # The same file read again: resumes where it was.
  again = make_data(DataSpec("text", str(corpus)), batch_size=2, seq_len=16)
  checkpoints = ckpt.Checkpointer(str(tmp_path / "w"), cfg)
  assert checkpoints.restore(layout, tx, data_iterator=again.train)[1] == 3
  checkpoints.close()
  assert again.train.get_state() == data.train.get_state()
  corpus.write_text("another corpus altogether, of other words and another length. " * 50)
  other = make_data(DataSpec("text", str(corpus)), batch_size=2, seq_len=16)
  checkpoints = ckpt.Checkpointer(str(tmp_path / "w"), cfg)
  with pytest.raises(CheckpointError, match=r"^checkpoint .*/w/checkpoints/3 \(step 3\): the "
                                            r"checkpoint's data position is for other training "
                                            r"data .* or train in a new --workdir$"):
    checkpoints.restore(layout, tx, data_iterator=other.train)
  checkpoints.close()
  assert sorted(os.listdir(tmp_path / "w" / "checkpoints")) == ["3"]


# ------------------------------------------------------------------------------------------------
# load_params: a checkpoint's parameters in your own code.

def test_load_params_into_numpy_and_nnx_modules(trainer, trained):
  params = ckpt.load_params(str(trained))                  # workdir: latest step, numpy
  cfg = ckpt.load_config(str(trained))
  assert cfg == trainer.cfg
  assert isinstance(params["embed"], np.ndarray) and params["embed"].shape == (320, 64)
  older = ckpt.load_params(str(trained / "checkpoints" / "8"))   # one step's directory
  assert not np.array_equal(older["embed"], params["embed"])
  np.testing.assert_array_equal(ckpt.load_params(str(trained), step=8)["lm_head"],
                                older["lm_head"])

  layer0 = olmoe.layer_from_params(cfg, jax.tree.map(lambda x: x[0], params["layers"]))
  np.testing.assert_array_equal(layer0.moe.w_up[...], params["layers"]["moe"]["w_up"][0])
  module_state = nnx.state(layer0, nnx.Param)
  nnx.replace_by_pure_dict(module_state, jax.tree.map(lambda x: x[1], params["layers"]))
  nnx.update(layer0, module_state)
  np.testing.assert_array_equal(layer0.attn.wq[...], params["layers"]["attn"]["wq"][1])

  with pytest.raises(CheckpointError, match="no checkpoint of step 5 .steps: 4, 8, 12."):
    ckpt.load_params(str(trained), step=5)
  # A layer's parameters checked by name and rank when the module is made (stacked ones, or a
  # missing router, built a module that failed at its call).
  with pytest.raises(ValueError, match=r"layer_params\['attn'\]\['k_norm'\] has shape \(2, 64\), "
                                       r"one layer's is \(64,\)"):
    olmoe.layer_from_params(cfg, params["layers"])
  missing = jax.tree.map(lambda x: x[0], params["layers"])
  del missing["moe"]["router"]
  with pytest.raises(ValueError, match=r"layer_params\['moe'\]\['router'\] is missing"):
    olmoe.layer_from_params(cfg, missing)


def test_load_params_refuses_bad_arguments_by_name(trained):
  """Before Orbax starts a restore it cannot finish (a sharding that does not divide a leaf was
  reported as a damaged checkpoint, then Orbax's abandoned coroutines printed ~1,200 lines)."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  for kwargs, message in (
      (dict(step="4"), r"^load_params: step='4' must be an int"),
      (dict(mesh=mesh), r"^load_params: mesh has axes \('x',\), not moejax's"),
      (dict(shardings=NamedSharding(mesh, P("x"))),
       r"^load_params: shardings\['layers'\]\['attn'\]\['k_norm'\] does not fit its shape "
       r"\(2, 64\)"),
      (dict(shardings={"embed": NamedSharding(mesh, P())}),
       r"^load_params: shardings is not one Sharding or a pytree like the parameters")):
    with pytest.raises(CheckpointError, match=message):
      ckpt.load_params(str(trained), **kwargs)
