"""Mesh and multi-process misconfiguration: one clear message (on the command line: one line and
exit 2, tests/test_cli.py)."""
import pytest

from moejax import distributed
from moejax.errors import ConfigError
from moejax.train.loop import run
from tests.helpers import tiny_config


def test_mesh_that_does_not_match_the_devices_is_one_message(tmp_path):
  """What `train.py --config.mesh.shape=(2,1)` meets on 8 devices (in process; train.py's one
  line and exit code 2 for such errors: tests/test_cli.py)."""
  with pytest.raises(ConfigError) as e:
    run(tiny_config(**{"mesh.shape": (2, 1)}), str(tmp_path / "w"))
  assert "\n" not in str(e.value)
  assert "config.mesh.shape=(2, 1) needs 2 devices, but 8 are available" in str(e.value)


@pytest.mark.parametrize("num_processes,process_id,env,message", [
    (2, None, {}, "a coordinator address was given but not both --num_processes and "
                  "--process_id"),
    (2, None, {"JAX_PROCESS_ID": "one"}, "JAX_PROCESS_ID='one': expected an integer"),
    (None, None, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     r"--process_id=2 must be in [0, num_processes=2)"),
])
def test_bad_process_settings(monkeypatch, num_processes, process_id, env, message):
  for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ConfigError) as e:      # raised before jax.distributed is touched
    distributed.maybe_initialize("127.0.0.1:1", num_processes, process_id)
  assert message in str(e.value)


def test_no_coordinator_means_one_process(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", *distributed.SLURM_VARS, "KUBERNETES_SERVICE_HOST"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.maybe_initialize() is False


def test_flags_without_a_coordinator_are_refused(monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  with pytest.raises(ConfigError, match="given without --coordinator_address"):
    distributed.maybe_initialize(None, 2, 0)


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "4",
      "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node001", "SLURM_NTASKS": "1",
      "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, None),           # one task: one process
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, None),             # an allocation, not a step
    ({}, None),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),            # a pod, not an Indexed Job
])
def test_cluster_detection(monkeypatch, env, expected):
  for name in (*distributed.SLURM_VARS, "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  assert distributed.detected_cluster() == expected
