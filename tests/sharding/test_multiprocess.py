"""train.py as one job of 2 processes x 4 CPU devices (jax.distributed over loopback, gloo),
started as SLURM starts tasks: SLURM's variables and no flags, so jax.distributed's cluster
auto-detection itself finds the coordinator, process count and index (tests/train/test_job_faults.py
starts its jobs with the flags).

The two processes run in lockstep (every step's collectives span both), process 0 alone writes
metrics and logs, and the losses equal those of 1 process x 8 devices on the same config (the
suite's codec.mode=auto run, whose decision both processes must agree on): the mesh, the layouts
and the data are the same, only where the devices live differs.
"""
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import CODEC_AUTO_RUN, CODEC_AUTO_STEPS, REPO, config_flags, xla_flags

STEPS = CODEC_AUTO_STEPS
WARMUP = CODEC_AUTO_RUN["codec.warmup_steps"]     # codec.mode=auto decides after step 3
TIMEOUT_S = 420          # generous: 2 processes compile at once on a busy machine
ARGS = config_flags(CODEC_AUTO_RUN)
COMPARED = ("loss", "aux_loss", "z_loss", "grad_norm", "val_loss")
TIGHT_STEPS = 4         # steps compared at rtol 1e-6 (the rest at 1e-3)
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


def _start(tmp_path, name: str, workdir: str, devices: int, slurm: dict):
  """train.py (ARGS) in the background on `devices` CPU devices with this task's SLURM
  variables (no flags: jax.distributed detects the job)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices),
             JAX_PLATFORMS="cpu")
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "JAX_COORDINATOR_PORT", *(k for k in env if k.startswith("SLURM_"))):
    env.pop(var, None)
  args = [*ARGS, "--workdir", str(tmp_path / workdir)]
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
def test_two_processes_match_one_and_agree_on_the_codec_choice(tmp_path, codec_auto_run):
  """A 2-process job (2 x 4 CPU devices) of the suite's codec.mode=auto run, whose reference is
  that run on 8 devices in one process (tests/conftest.py `codec_auto_run`): plain gathers for
  the first 3 steps, then the controller's choice. The change rates the decision reads are
  replicated, so both processes install the same codec choice and train step (they would
  deadlock otherwise), the same choice as the 1-process run's, and the job compresses. (Gains in
  bytes: a profile of fake devices over gloo would price every tiny shard plain.) The codec is
  lossless, so the losses equal the 1-process run's."""
  job_id = _slurm_job_id()
  procs = {f"proc{i}": _start(tmp_path, f"proc{i}", "job", 4, slurm=_slurm_env(job_id, 2, i))
           for i in range(2)}
  _wait_all(procs, tmp_path)
  single = codec_auto_run[1]

  # Process 0 logs and writes the metrics of the 4-device job; process 1 writes neither (one
  # record per step in the shared metrics.jsonl, not two).
  out0 = (tmp_path / "proc0.out").read_text()
  assert "8 device(s)" in out0 and out0.count(f"/{STEPS} | loss") == STEPS, out0
  out1 = (tmp_path / "proc1.out").read_text()
  assert "moejax:" not in out1 and "| loss" not in out1, out1
  two, one = _records(tmp_path / "job"), _records(pathlib.Path(single))
  assert [r["step"] for r in two] == list(range(1, STEPS + 1))

  # Same losses as 1 process x 8 devices: only the order of cross-device sums may differ (gloo's
  # against the in-process reduction). That difference is about 1e-7 at first and grows step by
  # step through Adam and the bf16 casts (measured: grad_norm -3.7e-6 at step 5, -1.1e-4 at step
  # 6, aux_loss 1.3e-4 at step 8), so the first steps are held tightly and the rest loosely.
  # Before the codec's first decision (plain gathers) the byte figures are equal too.
  for a, b in zip(two, one, strict=True):
    same = SAME if a["step"] <= WARMUP else ("step", "lr", "scatter_bytes", "a2a_bytes")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    keys = [k for k in COMPARED if k in a]   # val_loss on evaluation steps only
    assert "loss" in keys and keys == [k for k in COMPARED if k in b], a["step"]
    got, want = [a[k] for k in keys], [b[k] for k in keys]
    rtol = 1e-6 if a["step"] <= TIGHT_STEPS else 1e-3
    np.testing.assert_allclose(got, want, rtol=rtol, err_msg=f"step {a['step']}")
  assert np.isfinite(two[-1]["val_loss"])

  # One decision, after the warm-up, taken alike by both processes; the job compresses.
  assert out0.count(f"codec: step {WARMUP}:") == 1, out0
  with open(tmp_path / "job" / "codec_selection.json") as f:
    decision = json.load(f)["decisions"][0]
  with open(os.path.join(single, "codec_selection.json")) as f:
    reference = json.load(f)["decisions"][0]
  chosen_as = lambda d: [(e["group"], e["path"], e["mode"], e.get("capacity_fraction"))  # noqa: E731
                         for e in d["params"]]
  assert chosen_as(decision) == chosen_as(reference)
  chosen = sum(e["mode"] != "off" for e in decision["params"])
  assert chosen and two[-1]["codec_params"] == chosen
  # The first gather after the decision refills the caches; the next one patches.
  assert two[-1]["gather_bytes"] < two[-1]["gather_bytes_plain"]
