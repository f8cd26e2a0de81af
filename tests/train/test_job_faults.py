"""Faults of a job of two processes (jax.distributed over loopback, 1 CPU device each, train.py
as subprocesses): a process that dies or falls silent, and processes started with different
configs or workdirs. Apart from tests/train/test_faults.py, whose in-process tests share the
canonical Trainer, so that the two files can run on different workers."""
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import REPO, xla_flags
from tests.train.conftest import checkpoint_listing as _listing, numbers as _numbers, records


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


def _wait_for(path, procs, tmp_path, name: str, what: str, deadline: float) -> None:
  """Until `path` exists, with every process of job `name` still running (else its stderr)."""
  while not path.exists():
    for i, proc in enumerate(procs):
      assert proc.poll() is None, (tmp_path / f"{name}{i}.err").read_text()[-3000:]
    assert time.monotonic() < deadline, what
    time.sleep(0.02)


def _errors(path):
  """(the text of a process's stderr file, its `error:` lines)."""
  err = path.read_text()
  return err, [line for line in err.splitlines() if line.startswith("error:")]


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
    _wait_for(marker, procs, tmp_path, "first", "the job never reached step 3", deadline)
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
  err, errors = _errors(tmp_path / "first0.err")
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
  if differs == "workdir":      # process 0's folder is the user's: a tokenizer.json they keep
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "tokenizer.json").write_text("{}")
  procs = _job(tmp_path, differs, extra1=["--config.seed=7"] if differs == "config" else (),
               workdir1=other if differs == "workdir" else None)
  try:
    codes = [proc.wait(timeout=MP_TIMEOUT_S) for proc in procs]
  finally:
    _kill_all(procs)
  firsts = []
  for i in range(2):
    err, errors = _errors(tmp_path / f"{differs}{i}.err")
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
  # The workdir the failed start made is removed (by process 0); where the processes' workdirs
  # differ, none is (process 0's existed, and went with a tokenizer.json, when process 1's
  # new folder counted as the job's).
  if differs == "config":
    assert not (tmp_path / "job").exists()
  else:
    assert (tmp_path / "job" / "tokenizer.json").exists() and other.is_dir()


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
    _wait_for(marker, procs, tmp_path, "silent", "the job never passed its checks",
              time.monotonic() + MP_TIMEOUT_S)
    stopped = time.monotonic()
    rc = procs[0].wait(timeout=LOST_WITHIN_S)
    waited = time.monotonic() - stopped
  finally:
    _kill_all(procs)
  err, errors = _errors(tmp_path / "silent0.err")
  assert rc == 2 and errors == [
      "error: process 1 of 2 was lost (no heartbeat for 2 s "
      "(config.distributed.heartbeat_timeout_s)); process 0 stops too: rerun every process to "
      "resume from the latest checkpoint"], err[-3000:]
  assert 1.5 < waited < 2 + 10, waited
