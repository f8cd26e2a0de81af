"""Mesh and multi-process misconfiguration: one clear line (on the command line: exit 2)."""
import pytest

from moejax import distributed
from moejax.errors import ConfigError
from tests.helpers import run_train


def test_mesh_that_does_not_match_the_devices_is_one_line(tmp_path):
  proc = run_train(["--config", "configs/olmoe.py:tiny", "--config.mesh.shape=(2,1)",
                    "--workdir", str(tmp_path / "w")], timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
  assert len(lines) == 1, proc.stderr
  assert "config.mesh.shape=(2, 1) needs 2 devices, but 1 are available" in lines[0]
  assert "Traceback" not in proc.stderr


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
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  assert distributed.maybe_initialize() is False
