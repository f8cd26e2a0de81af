"""Faults a long run meets: a non-finite loss or gradient, a workdir with too many checkpoints, a
full disk during a save, and a process of a multi-process job that dies.

The in-process tests train through the suite's canonical Trainer (tests/train/conftest.py,
compiled once per session) and compare with its uninterrupted run (`trained`). Faults are
injected without compiling anything new: `_variant` is that Trainer with its train step wrapped
by a hook the test controls, for a config that differs only in fields the step does not read
(`log_every`, `checkpoint.*`). The multi-process test is the one subprocess job here.
"""
import copy
import dataclasses
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from moejax.errors import CheckpointError, TrainingError
from moejax.train import checkpoint as ckpt
from moejax.train.loop import run
from moejax.train.stop import Interrupted
from tests.helpers import CANONICAL, REPO, xla_flags
from tests.train.conftest import TIMING, records

STEPS = CANONICAL["steps"]                 # 12, checkpoints every 4
assert CANONICAL["checkpoint.every"] == 4 and STEPS == 12
# Checkpoints every 2 steps (short runs), nothing logged before the last step: only the
# one-step-late read and the save's own check see a NaN.
QUIET = {"log_every": 100, "checkpoint.every": 2}


def _numbers(recs: list[dict]) -> list[dict]:
  return [{k: v for k, v in r.items() if k not in TIMING} for r in recs]


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


def _listing(workdir) -> list[str]:
  directory = workdir / "checkpoints"
  return sorted(os.listdir(directory)) if directory.is_dir() else []


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


# ------------------------------------------------------------------------------------------------
# A process of a two-process job dies.

MP_STEPS, MP_EVERY = 4, 2
MP_ARGS = ["--config", "configs/olmoe.py:tiny", f"--config.steps={MP_STEPS}",
           "--config.log_every=1", "--config.eval_batches=1",
           f"--config.checkpoint.every={MP_EVERY}", "--config.distributed.heartbeat_timeout_s=20",
           # the smallest program that still trains across both processes: compiles fast
           "--config.model.num_layers=1", "--config.remat=none", "--config.prefetch=False"]
MP_TIMEOUT_S = 300
LOST_WITHIN_S = 60

# train.py that stops for good, alive, once it has the metrics of step `stall` (it sits there,
# heartbeating, while its peer waits in the next step's collectives) until it is killed.
STALL = """
import runpy, sys, time
from moejax.train import metrics
marker, stall, train_py = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.argv = [train_py, *sys.argv[4:]]
original = metrics.MetricsWriter.write

def write(self, record):
  original(self, record)
  if record["step"] == stall:
    open(marker, "w").close()
    time.sleep(3600)

metrics.MetricsWriter.write = write
runpy.run_path(train_py, run_name="__main__")
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _job(tmp_path, name: str, wrapper=(), extra0=(), extra1=(), workdir1=None):
  """Both processes of one job on 1 CPU device each; `wrapper` runs process 1 under a script,
  `extra0` / `extra1` add arguments to process 0's / 1's, `workdir1` gives it another workdir."""
  address = f"127.0.0.1:{_free_port()}"
  env = dict(os.environ, XLA_FLAGS=xla_flags(1),
             JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false", PYTHONUNBUFFERED="1")
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "JAX_COMPILATION_CACHE_DIR"):
    env.pop(var, None)
  procs = []
  for i in range(2):
    workdir = workdir1 if i == 1 and workdir1 is not None else tmp_path / "job"
    command = [sys.executable, *(wrapper if i == 1 else ()), os.path.join(REPO, "train.py"),
               *MP_ARGS, *(extra1 if i == 1 else extra0), "--workdir", str(workdir),
               "--coordinator_address", address, "--num_processes=2", f"--process_id={i}"]
    with open(tmp_path / f"{name}{i}.out", "w") as out, \
         open(tmp_path / f"{name}{i}.err", "w") as err:
      procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err))
  return procs


def _kill_all(procs):
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.mark.slow
def test_a_killed_process_stops_the_other_with_one_line_and_a_rerun_resumes_bit_exact(tmp_path):
  """Process 1 stalls after step 3 (process 0 goes on into step 4's collectives and waits
  there), then is SIGKILLed. Process 0 exits at once, exit code 2, one line naming process 1.
  Rerunning both resumes from checkpoint 2: step 3 runs twice, with the same values."""
  marker = tmp_path / "stalled"
  (tmp_path / "stall.py").write_text(STALL)
  procs = _job(tmp_path, "first", wrapper=(str(tmp_path / "stall.py"), str(marker), "3"))
  try:
    deadline = time.monotonic() + MP_TIMEOUT_S
    while not marker.exists():
      for i, proc in enumerate(procs):
        assert proc.poll() is None, (tmp_path / f"first{i}.err").read_text()[-3000:]
      assert time.monotonic() < deadline, "the job never reached step 3"
      time.sleep(0.1)
    while not (tmp_path / "job" / "checkpoints" / str(MP_EVERY)).is_dir():   # committed
      assert time.monotonic() < deadline, "the save of step 2 never committed"
      time.sleep(0.1)
    time.sleep(0.2)                          # process 0 is in step 4 by now
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    try:
      rc = procs[0].wait(timeout=LOST_WITHIN_S)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process 0 still runs {LOST_WITHIN_S} s after process 1 was killed")
    waited = time.monotonic() - killed
  finally:
    _kill_all(procs)
  err = (tmp_path / "first0.err").read_text()
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert rc == 2 and errors == [
      "error: process 1 of 2 was lost (its connection closed: the process exited or was "
      "killed); process 0 stops too: rerun every process to resume from the latest "
      "checkpoint"], err[-3000:]
  assert waited < LOST_WITHIN_S
  first = records(tmp_path / "job")
  assert [r["step"] for r in first] == [1, 2, 3]
  assert _listing(tmp_path / "job") == ["2"]     # step 4 never finished

  procs = _job(tmp_path, "rerun")
  try:
    for i, proc in enumerate(procs):
      assert proc.wait(timeout=MP_TIMEOUT_S) == 0, (tmp_path / f"rerun{i}.err").read_text()[-3000:]
  finally:
    _kill_all(procs)
  assert "moejax: resuming from step 2" in (tmp_path / "rerun0.out").read_text()
  again = records(tmp_path / "job")[len(first):]
  assert [r["step"] for r in again] == [3, 4]
  assert _numbers(again[:1]) == _numbers(first[2:3])     # bit for bit, every figure
  assert np.isfinite(again[-1]["val_loss"])
  assert _listing(tmp_path / "job") == ["2", "4"]


@pytest.mark.slow
@pytest.mark.parametrize("differs", ["config", "workdir"])
def test_a_process_with_another_config_or_workdir_stops_every_process_with_one_line(
    tmp_path, differs):
  """Process 1 starts with another config.seed, or with its own workdir: before anything
  compiles, both processes stop with exit code 2, each with the line naming process 1 and what
  differs (process 0 used to say only that process 1 stopped with an error); nothing is trained
  or written."""
  other = tmp_path / "other"
  procs = _job(tmp_path, differs, extra1=["--config.seed=7"] if differs == "config" else (),
               workdir1=other if differs == "workdir" else None)
  try:
    codes = [proc.wait(timeout=MP_TIMEOUT_S) for proc in procs]
  finally:
    _kill_all(procs)
  firsts = []
  for i in range(2):
    err = (tmp_path / f"{differs}{i}.err").read_text()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert codes[i] == 2 and errors, err[-3000:]
    firsts.append(errors[0])
  if differs == "config":
    assert firsts == ["error: process 1 runs another config.seed than process 0: start every "
                      "process of the job with the same config and workdir"] * 2
  else:
    for i, line in enumerate(firsts):
      assert line.startswith("error: process 1 does not see the file process 0 wrote in its "
                             "workdir (this process's: "), line
      assert repr(str(other if i == 1 else tmp_path / "job")) in line, line
  for workdir in (tmp_path / "job", other):
    assert not (workdir / "metrics.jsonl").exists()
    assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


# train.py that stops itself (SIGSTOP: alive, connections open, silent) right after the job's
# checks, writing `marker` first.
SILENT = """
import os, runpy, signal, sys
from moejax.train import loop, workdir
marker, train_py = sys.argv[1], sys.argv[2]
sys.argv = [train_py, *sys.argv[3:]]
original = workdir.check_same_job

def check_same_job(*args, **kwargs):
  original(*args, **kwargs)
  open(marker, "w").close()
  os.kill(os.getpid(), signal.SIGSTOP)

loop.workdir_lib.check_same_job = check_same_job
runpy.run_path(train_py, run_name="__main__")
"""


@pytest.mark.slow
def test_a_silent_process_is_declared_lost_after_the_heartbeat_timeout(tmp_path):
  """Process 1 stops itself (SIGSTOP) once the job's checks have passed: process 0 stops after
  `config.distributed.heartbeat_timeout_s` (2 s here) with one line naming it, exit code 2,
  rather than waiting in its next collective for jax.distributed's own timeout."""
  marker = tmp_path / "stopped"
  (tmp_path / "silent.py").write_text(SILENT)
  timeout = ["--config.distributed.heartbeat_timeout_s=2"]
  procs = _job(tmp_path, "silent", wrapper=(str(tmp_path / "silent.py"), str(marker)),
               extra0=timeout, extra1=timeout)
  try:
    deadline = time.monotonic() + MP_TIMEOUT_S
    while not marker.exists():
      for i, proc in enumerate(procs):
        assert proc.poll() is None, (tmp_path / f"silent{i}.err").read_text()[-3000:]
      assert time.monotonic() < deadline, "the job never passed its checks"
      time.sleep(0.02)
    stopped = time.monotonic()
    rc = procs[0].wait(timeout=LOST_WITHIN_S)
    waited = time.monotonic() - stopped
  finally:
    _kill_all(procs)
  err = (tmp_path / "silent0.err").read_text()
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert rc == 2 and errors == [
      "error: process 1 of 2 was lost (no heartbeat for 2 s "
      "(config.distributed.heartbeat_timeout_s)); process 0 stops too: rerun every process to "
      "resume from the latest checkpoint"], err[-3000:]
  assert 1.5 < waited < 2 + 10, waited
