"""train.py as one job of 2 processes x 2 CPU devices (jax.distributed over loopback, gloo),
started as SLURM starts tasks: SLURM's variables and no flags, so jax.distributed's cluster
auto-detection itself finds the coordinator, process count and index (tests/train/test_faults.py
starts its jobs with the flags).

The two processes run in lockstep (every step's collectives span both), process 0 alone writes
metrics and logs, and the losses equal those of 1 process x 4 devices on the same config: the
mesh, the layouts and the data are the same, only where the devices live differs. One job (with
codec.mode=auto, whose decision both processes must agree on) and its reference: 3 processes.
"""
import json
import os
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import REPO, xla_flags

STEPS = 5
WARMUP = 3               # codec.mode=auto decides after step 3
TIMEOUT_S = 420          # generous: 3 processes compile at once on a busy machine
ARGS = ["--config", "configs/olmoe.py:tiny", f"--config.steps={STEPS}", "--config.log_every=1",
        f"--config.eval_every={STEPS}", "--config.eval_batches=1"]
CODEC = ["--config.codec.mode=auto", f"--config.codec.warmup_steps={WARMUP}",
         "--config.codec.block_size=64", "--config.codec.comm_model=bytes",
         # Steady change rates, so the capacities sized at step 3 hold at step 5.
         "--config.optim.warmup_steps=0", "--config.optim.lr=3e-4"]
COMPARED = ("loss", "aux_loss", "z_loss", "grad_norm", "val_loss")
SAME = ("step", "lr", "gather_bytes", "scatter_bytes", "a2a_bytes")


def _slurm_job_id() -> int:
  """A SLURM job id whose coordinator port (jax's SlurmCluster: 61440 + id % 4096) is free."""
  start = random.randrange(4096)
  for offset in range(4096):
    job_id = (start + offset) % 4096
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", 61440 + job_id))
      except OSError:
        continue
    return job_id
  pytest.fail("no free port in SLURM's coordinator range 61440-65535")


def _slurm_env(job_id: int, num_tasks: int, task: int) -> dict:
  """What srun sets for task `task` of a one-node step of `num_tasks` tasks."""
  return {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": "localhost",
          "SLURM_NTASKS": str(num_tasks), "SLURM_PROCID": str(task),
          "SLURM_LOCALID": str(task), "SLURM_STEP_NUM_NODES": "1"}


def _start(tmp_path, name: str, workdir: str, devices: int, extra=(), slurm: dict | None = None):
  """train.py in the background on `devices` CPU devices; `slurm`: this task's SLURM variables
  (no flags: jax.distributed detects the job); `extra`: more flags (after ARGS, so they win)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices),
             JAX_PLATFORMS="cpu")
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "JAX_COORDINATOR_PORT", *(k for k in env if k.startswith("SLURM_"))):
    env.pop(var, None)
  args = [*ARGS, *extra, "--workdir", str(tmp_path / workdir)]
  if slurm:
    env.update(slurm)
    # No persistent compilation cache even if one is configured: its keys differ per process
    # (process 0 would load what process 1 has to compile), and gloo gives a process 30 s to
    # join each new collective. Without it the processes compile side by side.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
    return subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), *args], cwd=REPO,
                            env=env, stdout=out, stderr=err)


def _wait_all(procs: dict, tmp_path) -> None:
  """Waits for every process within TIMEOUT_S; on a failure or the deadline, kills the rest."""
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for name, proc in procs.items():
      rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
      assert rc == 0, f"{name} exited {rc}:\n{(tmp_path / f'{name}.err').read_text()[-3000:]}"
  except subprocess.TimeoutExpired:
    pytest.fail(f"train.py did not finish within {TIMEOUT_S}s")
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def _records(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_processes_match_one_and_agree_on_the_codec_choice(tmp_path):
  """One 2-process job and its 1-process reference, both with codec.mode=auto (plain gathers for
  the first 3 steps, then the controller's choice): the change rates the decision reads are
  replicated, so both processes install the same codec choice and train step (they would
  deadlock otherwise), and the job compresses. (Gains in bytes: a profile of fake devices over
  gloo would price every tiny shard plain.) The codec is lossless, so the losses still equal the
  1 process x 4 devices run's."""
  job_id = _slurm_job_id()
  procs = {f"proc{i}": _start(tmp_path, f"proc{i}", "job", 2, extra=CODEC,
                              slurm=_slurm_env(job_id, 2, i)) for i in range(2)}
  procs["single"] = _start(tmp_path, "single", "single", 4, extra=CODEC)   # alongside
  _wait_all(procs, tmp_path)

  # Process 0 logs and writes the metrics of the 4-device job; process 1 writes neither (one
  # record per step in the shared metrics.jsonl, not two).
  out0 = (tmp_path / "proc0.out").read_text()
  assert "4 device(s)" in out0 and out0.count(f"/{STEPS} | loss") == STEPS, out0
  out1 = (tmp_path / "proc1.out").read_text()
  assert "moejax:" not in out1 and "| loss" not in out1, out1
  two, one = _records(tmp_path / "job"), _records(tmp_path / "single")
  assert [r["step"] for r in two] == list(range(1, STEPS + 1))

  # Same losses as 1 process x 4 devices: only the order of cross-device sums may differ. Before
  # the codec's first decision (plain gathers) the byte figures are equal too.
  for a, b in zip(two, one, strict=True):
    same = SAME if a["step"] <= WARMUP else ("step", "lr", "scatter_bytes", "a2a_bytes")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    got = [a.get(k, np.nan) for k in COMPARED]
    want = [b.get(k, np.nan) for k in COMPARED]
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"step {a['step']}")
  assert np.isfinite(two[-1]["val_loss"])

  # One decision, after the warm-up, taken alike by both processes; the job compresses.
  assert out0.count(f"codec: step {WARMUP}:") == 1, out0
  with open(tmp_path / "job" / "codec_selection.json") as f:
    decision = json.load(f)["decisions"][0]
  chosen = sum(e["mode"] != "off" for e in decision["params"])
  assert chosen and two[-1]["codec_params"] == chosen
  # The first gather after the decision refills the caches; the next one patches.
  assert two[-1]["gather_bytes"] < two[-1]["gather_bytes_plain"]
