"""Faults a long run meets: a non-finite loss or gradient, a workdir with too many checkpoints, a
full disk during a save (a job of several processes: tests/train/test_job_faults.py).

The in-process tests train through the suite's canonical Trainer (tests/train/conftest.py,
compiled once per session) and compare with its uninterrupted run (`trained`). Faults are
injected without compiling anything new: `_variant` is that Trainer with its train step wrapped
by a hook the test controls, for a config that differs only in fields the step does not read
(`log_every`, `checkpoint.*`).
"""
import copy
import dataclasses
import math
import os
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from moejax.errors import CheckpointError, TrainingError
from moejax.train import checkpoint as ckpt
from moejax.train.loop import run
from moejax.train.stop import Interrupted
from tests.helpers import CANONICAL
from tests.train.conftest import checkpoint_listing as _listing, numbers as _numbers, records

STEPS = CANONICAL["steps"]                 # 12, checkpoints every 4
assert CANONICAL["checkpoint.every"] == 4 and STEPS == 12
# Checkpoints every 2 steps (short runs), nothing logged before the last step: only the
# one-step-late read and the save's own check see a NaN.
QUIET = {"log_every": 100, "checkpoint.every": 2}


def _config(cfg, **overrides):
  """`cfg` with dotted-path overrides ({"log_every": 100, "checkpoint.keep": 2})."""
  for path, value in overrides.items():
    group, _, field = path.rpartition(".")
    if group:
      value = dataclasses.replace(getattr(cfg, group), **{field: value})
    cfg = dataclasses.replace(cfg, **{group or field: value})
  return cfg


def _variant(trainer, wrap=None, **overrides):
  """`trainer`'s compiled steps for its config with `overrides`, each train step wrapped by
  `wrap(train_step)`: no new compile (the overrides are fields the step does not read)."""
  assert all(k in ("log_every", "eval_every") or k.startswith("checkpoint.") for k in overrides)
  cfg = _config(trainer.cfg, **overrides)
  variant = copy.copy(trainer)
  variant.cfg = cfg
  if wrap is not None:
    variant.compiled = lambda specs: dataclasses.replace(
        trainer.compiled(specs), train_step=wrap(trainer.compiled(specs).train_step))
  return variant


def _nan_like(tree):
  """The same arrays, shardings and dtypes, every value NaN (placed from the host: no compile)."""
  return jax.tree.map(lambda x: jax.device_put(np.full(x.shape, np.nan, x.dtype), x.sharding),
                      tree)


def _poisoned(at_step: int, what: str):
  """A train-step wrapper. what="params": the parameters become NaN before `at_step` (its loss
  is NaN). what="gradient": `at_step` computes a NaN gradient from good parameters (finite loss,
  NaN grad_norm, NaN parameters after the update). what="update": `at_step`'s figures are finite
  but its update makes the parameters NaN (Adam with eps=0 did, where a parameter had no
  gradient)."""
  def wrap(train_step):
    def step(state, batch):
      n = int(state.step) + 1
      if what == "params" and n == at_step:
        state = state.replace(params=_nan_like(state.params))
      state, metrics = train_step(state, batch)
      if what in ("gradient", "update") and n == at_step:
        state = state.replace(params=_nan_like(state.params))
      if what == "gradient" and n == at_step:
        metrics = dict(metrics, grad_norm=_nan_like(metrics["grad_norm"]))
      return state, metrics
    return step
  return wrap


# ------------------------------------------------------------------------------------------------
# SIGINT / SIGTERM: a stop at a step boundary, with a checkpoint there.

def _signalled(at_step: int, signum: int, times: int = 1):
  """A train-step wrapper that sends this process `signum` (`times` times) during `at_step`, as
  Ctrl-C or a scheduler would."""
  def wrap(train_step):
    def step(state, batch):
      n = int(state.step) + 1
      out = train_step(state, batch)
      if n == at_step:
        for _ in range(times):
          os.kill(os.getpid(), signum)
      return out
    return step
  return wrap


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_the_step_with_a_checkpoint_and_a_rerun_resumes_bit_exact(
    trainer, trained, tmp_path, capsys, signum):
  """SIGTERM (a scheduler's preemption) or Ctrl-C during step 6, between the saves at 4 and 8:
  it was a silent death or a KeyboardInterrupt traceback, steps 5-6 lost. Now step 6 finishes,
  is saved, and the run stops naming it; the rerun equals the uninterrupted run."""
  workdir = tmp_path / "w"
  handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with pytest.raises(Interrupted) as e:
    run(trainer.cfg, str(workdir), trainer=_variant(trainer, _signalled(6, signum)))
  name = signal.Signals(signum).name
  assert str(e.value) == (f"stopped on {name} after step 6, saved {workdir}/checkpoints/6; "
                          "rerun the same command to resume")
  assert e.value.exit_code == 128 + signum
  assert _listing(workdir) == ["4", "6"]
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
  capsys.readouterr()
  run(trainer.cfg, str(workdir), trainer=trainer)
  assert "moejax: resuming from step 6" in capsys.readouterr().out
  assert _numbers(records(workdir)) == _numbers(records(trained))


def test_a_workdir_in_use_by_another_run_is_refused(trainer, tmp_path):
  """Two runs into one workdir interleaved their metrics lines and deleted each other's
  checkpoints; the second now stops before it writes anything, naming the first."""
  from moejax.errors import ConfigError
  from moejax.train.workdir import WorkdirLock
  workdir = tmp_path / "w"
  workdir.mkdir()
  other = WorkdirLock(str(workdir))          # as another process's run would hold it
  with pytest.raises(ConfigError, match=rf"^workdir '{workdir}' is in use by another run \(pid "
                                        rf"{os.getpid()} on .* since .*\): wait for it to end, "
                                        "or choose another --workdir$"):
    run(trainer.cfg, str(workdir), trainer=trainer)
  assert not (workdir / "metrics.jsonl").exists() and _listing(workdir) == []
  other.release()
  WorkdirLock(str(workdir)).release()        # free again once the holder is gone


def test_a_second_ctrl_c_stops_at_once(trainer, tmp_path):
  """The second Ctrl-C acts as it would without moejax: Python's KeyboardInterrupt, where the
  process had Python's handler. (A process started in the background by a non-interactive
  shell inherits SIGINT ignored, and Python then installs no handler: there the second Ctrl-C
  is ignored as it would be without moejax; the test gives itself Python's.)"""
  inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    _second_ctrl_c(trainer, tmp_path)
  finally:
    signal.signal(signal.SIGINT, inherited)


def _second_ctrl_c(trainer, tmp_path):
  with pytest.raises(KeyboardInterrupt):
    run(trainer.cfg, str(tmp_path / "w"),
        trainer=_variant(trainer, _signalled(6, signal.SIGINT, times=2)))
  assert _listing(tmp_path / "w") == ["4"]
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ------------------------------------------------------------------------------------------------
# A non-finite loss or gradient norm.

def _stopped_before_saving_step_4(trainer, workdir, what: str) -> str:
  """Runs with step 4 (a save step) poisoned (`_poisoned(4, what)`); asserts that only
  checkpoint 2 exists; returns the TrainingError's message."""
  with pytest.raises(TrainingError) as e:
    run(_config(trainer.cfg, **QUIET), str(workdir),
        trainer=_variant(trainer, _poisoned(4, what), **QUIET))
  assert _listing(workdir) == ["2"]
  return str(e.value)


def test_nan_gradient_at_a_save_step_is_never_saved_and_a_rerun_resumes_bit_exact(
    trainer, trained, tmp_path, capsys):
  """Step 4's gradient is NaN (its loss is finite). Step 4 saves: the save reads that step's
  grad_norm first, so no checkpoint 4 is written; the run stops naming checkpoint 2, and a rerun
  from it equals the uninterrupted run, bit for bit."""
  workdir = tmp_path / "w"
  assert _stopped_before_saving_step_4(trainer, workdir, "gradient") == (
      "grad_norm became nan at step 4; stopping (try a lower optim.lr or a smaller "
      "optim.clip_norm: a rerun may change them); a rerun resumes from checkpoint "
      f"{workdir}/checkpoints/2 (step 2)")
  capsys.readouterr()
  run(trainer.cfg, str(workdir), trainer=trainer, stop_at=4)   # the rerun, without the fault
  assert (f"moejax: resuming from step 2 (checkpoint {workdir}/checkpoints/2)"
          in capsys.readouterr().out)
  assert _numbers(records(workdir)) == _numbers(records(trained))[2:4]     # steps 3, 4
  assert _listing(workdir) == ["2", "4"]


def test_nan_parameters_from_a_finite_step_are_never_saved(trainer, tmp_path):
  """Step 4's loss and gradient norm are finite but its update leaves NaN parameters (a step-1
  run with optim.eps=0 saved such a checkpoint and exited 0): the save checks the parameters,
  writes nothing, and the run stops naming checkpoint 2."""
  workdir = tmp_path / "w"
  assert _stopped_before_saving_step_4(trainer, workdir, "update") == (
      "a parameter became non-finite at step 4 with a finite loss and gradient norm (an update "
      "too large: try a lower optim.lr); not saved; a rerun resumes from checkpoint "
      f"{workdir}/checkpoints/2 (step 2)")


def test_nan_loss_stops_one_step_late_before_any_checkpoint(trainer, tmp_path):
  """Step 2 starts from NaN parameters. Nothing logs step 2: the loop reads its loss one step
  late, after dispatching step 3, and stops there, before the save at step 4."""
  workdir, quiet = tmp_path / "w", {"log_every": 100}       # checkpoints every 4
  with pytest.raises(TrainingError) as e:
    run(_config(trainer.cfg, **quiet), str(workdir),
        trainer=_variant(trainer, _poisoned(2, "params"), **quiet))
  assert str(e.value) == (
      "loss became nan at step 2; stopping (try a lower optim.lr or a smaller optim.clip_norm: "
      "a rerun may change them); no checkpoint yet: a rerun starts from the beginning")
  assert _listing(workdir) == []


def test_a_saves_time_is_not_counted_as_the_steps(trainer, tmp_path, monkeypatch):
  """Each save made slow by 1.5 s: the logged step times and tokens/s stay the steps' own (the
  save used to be charged to the steps of the next logging window: 0.15 against 0.03 s/step)."""
  slow = 1.5
  save = ckpt.Checkpointer.save

  def slow_save(self, *args, **kwargs):
    save(self, *args, **kwargs)
    time.sleep(slow)

  monkeypatch.setattr(ckpt.Checkpointer, "save", slow_save)
  workdir = tmp_path / "w"
  # Saves at 2 and 4, logging at 3 and 6 (the save at 4 inside the second window).
  overrides = {"log_every": 3, "checkpoint.every": 2}
  run(_config(trainer.cfg, **overrides), str(workdir), trainer=_variant(trainer, **overrides),
      stop_at=6)
  times = [r["step_time_s"] for r in records(workdir)]
  assert len(times) == 2 and max(times) < slow / 3, times


def _compiling_for(seconds: float, *, at_step: int):
  """A train-step wrapper: step `at_step` takes `seconds` longer, reported to jax.monitoring as
  XLA reports a compile of its own."""
  def wrap(train_step):
    def step(state, batch):
      if int(state.step) + 1 == at_step:
        time.sleep(seconds)
        jax.monitoring.record_event_duration_secs(
            "/jax/core/compile/backend_compile_duration", seconds)
      return train_step(state, batch)
    return step
  return wrap


def test_a_step_compiled_mid_run_is_not_counted_as_the_steps(trainer, tmp_path):
  """A codec decision (or grown dispatch buffers) compiles a new step mid-run: that compile,
  here a 1.5 s one reported to jax.monitoring as XLA reports its own, is left out of the logged
  step time (it counted: 2.0 s a step at tiny dims on 8 fake devices after the codec's
  decision)."""
  slow = 1.5
  overrides = {"log_every": 3, "checkpoint.every": 100}
  workdir = tmp_path / "w"
  run(_config(trainer.cfg, **overrides), str(workdir),
      trainer=_variant(trainer, _compiling_for(slow, at_step=5), **overrides), stop_at=6)
  times = [r["step_time_s"] for r in records(workdir)]
  assert len(times) == 2 and max(times) < slow / 3, times


def test_the_first_steps_compile_is_not_counted_when_it_is_logged_alone(trainer, tmp_path):
  """With log_every=1 the first step is logged on its own: its compile (here a 1.5 s one, as
  jax.monitoring reports XLA's) counted as the step's time (8.5 s/step, 0.1k tok/s for a tiny
  step of 0.04 s)."""
  slow = 1.5
  overrides = {"log_every": 1, "checkpoint.every": 100}
  workdir = tmp_path / "w"
  run(_config(trainer.cfg, **overrides), str(workdir),
      trainer=_variant(trainer, _compiling_for(slow, at_step=1), **overrides), stop_at=2)
  times = [r["step_time_s"] for r in records(workdir)]
  assert len(times) == 2 and max(times) < slow / 3, times


def test_the_first_step_is_logged_when_it_evaluates(trainer, tmp_path):
  """The first (compiling) step was logged only when log_every divided it: a step due to
  evaluate there (eval_every=1 here; a one-step run's last step) wrote no record, no val_loss."""
  overrides = {"log_every": 5, "eval_every": 1, "checkpoint.every": 100}
  workdir = tmp_path / "w"
  run(_config(trainer.cfg, **overrides), str(workdir), trainer=_variant(trainer, **overrides),
      stop_at=2)
  logged = records(workdir)
  assert [r["step"] for r in logged] == [1, 2]
  assert all(math.isfinite(r["val_loss"]) for r in logged)


# ------------------------------------------------------------------------------------------------
# Retention on start.

# A failed restore leaves Orbax's other reads of that step unawaited (see test_checkpoint.py).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_rerun_prunes_to_keep_never_the_newest_nor_an_unreadable_one(trainer, trained,
                                                                        tmp_path, capsys):
  """A run killed after its last save committed, before it pruned: more than `keep` complete
  checkpoints and nothing left to train. The rerun prunes on start."""
  workdir = tmp_path / "w"
  shutil.copytree(trained, workdir)                           # checkpoints 4, 8, 12
  shutil.copytree(workdir / "checkpoints" / "4", workdir / "checkpoints" / "2.unreadable")
  capsys.readouterr()
  run(_config(trainer.cfg, **{"checkpoint.keep": 2}), str(workdir),
      trainer=_variant(trainer, **{"checkpoint.keep": 2}))     # steps=12: nothing to train
  out = capsys.readouterr().out
  assert (f"moejax: checkpoint.keep=2: removed 1 older checkpoint(s) from {workdir}/checkpoints: "
          "step(s) 4\n") in out
  assert _listing(workdir) == ["12", "2.unreadable", "8"]

  # keep=1 and the newest unreadable: it is set aside first, so the one resumed from stays.
  shutil.copytree(trained / "checkpoints" / "4", workdir / "checkpoints" / "4")
  os.truncate(workdir / "checkpoints" / "12" / "meta" / "metadata", 10)
  run(_config(trainer.cfg, **{"checkpoint.keep": 1}), str(workdir), stop_at=8,
      trainer=_variant(trainer, **{"checkpoint.keep": 1}))
  assert "removed 1 older checkpoint(s)" in capsys.readouterr().out
  assert _listing(workdir) == ["12.unreadable", "2.unreadable", "8"]
  params = ckpt.load_params(str(workdir))                     # the kept one reads, bit for bit
  np.testing.assert_array_equal(params["embed"], ckpt.load_params(str(trained), step=8)["embed"])


# ------------------------------------------------------------------------------------------------
# A full disk during a save.

def _size_of(directory) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)


@pytest.fixture
def small_disk(tmp_path):
  """mount(size_bytes) -> a fresh tmpfs of that size at tmp_path/w/checkpoints, unmounted after."""
  mounted = []

  def mount(size_bytes: int):
    target = tmp_path / "w" / "checkpoints"
    target.mkdir(parents=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "moejax-test",
                             str(target)], capture_output=True, text=True)
    if result.returncode != 0:
      pytest.skip(f"cannot mount a size-limited tmpfs here (needs root / CAP_SYS_ADMIN): "
                  f"{result.stderr.strip()}")
    mounted.append(target)
    return tmp_path / "w"

  yield mount
  for target in mounted:
    subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("stop_at", [
    6,          # surfaces at the next save (step 6 waits for step 4's)
    4,          # the run's last save: surfaces when the run waits for it at the end
])
def test_full_disk_stops_naming_the_path_and_keeps_the_earlier_checkpoints(
    trainer, trained, small_disk, stop_at):
  """Room for one and a half checkpoints, saves every 2 steps: the save of step 4 runs out of
  space in the background. The run stops with one line naming that step's path and the intact
  checkpoint 2; the partial save never counts as a checkpoint; checkpoint 2 restores, every
  array equal to what was saved (the checksums taken at save time are verified)."""
  workdir = small_disk(int(1.5 * _size_of(trained / "checkpoints" / "4")))
  every2 = {"checkpoint.every": 2}
  with pytest.raises(CheckpointError) as e:
    run(_config(trainer.cfg, **every2), str(workdir), trainer=_variant(trainer, **every2),
        stop_at=stop_at)
  message, directory = str(e.value), workdir / "checkpoints"
  assert "\n" not in message
  assert message == (
      f"saving checkpoint {directory}/4 (step 4) failed: no space left on device; stopping. "
      f"The checkpoints before it are intact: a rerun resumes from checkpoint {directory}/2 "
      f"(step 2); its partial files are in {directory}/4.orbax-checkpoint-tmp (never resumed "
      "from; delete them to free the space)")
  assert sorted(os.listdir(directory)) == ["2", "4.orbax-checkpoint-tmp"]
  assert records(workdir)[-1]["step"] == stop_at
  checkpoints = ckpt.Checkpointer(str(workdir), trainer.cfg)
  try:
    assert checkpoints.all_steps() == [2]
    state, step = checkpoints.restore(trainer.layout, trainer.tx)   # checksums verified
  finally:
    checkpoints.close()
  assert step == 2 and int(state.step) == 2
