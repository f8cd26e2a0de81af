"""scripts/gpu_schedule.py's arguments and its refusal without jax's CUDA plugin (the compile
itself needs the plugin, which the test set-up does not install: its figures are in
docs/measurements.md; the schedule reading it shares with the GPU check is tested in
test_device_check.py)."""
import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_schedule.py")
_spec = importlib.util.spec_from_file_location("gpu_schedule", _PATH)
gpu_schedule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_schedule)


def test_overrides_are_python_literals_or_bare_strings():
  args = gpu_schedule.parse_args(["--set", "seq_len=1024", "--set", "moe.placement=ep",
                                  "--set", "mesh.shape=(2, 4)", "--gpus", "16"], ["fsdp"])
  assert dict(args.set) == {"seq_len": 1024, "moe.placement": "ep", "mesh.shape": (2, 4)}
  assert args.gpus == 16 and args.target == "h200" and args.variant == []
  assert args.experts == "hopper" and args.lines == 0


def test_the_target_names_the_gpu_the_kernels_are_chosen_for(tmp_path, monkeypatch):
  from moejax.placement import hopper
  assert gpu_schedule._target_gpu("h200") == hopper.Target("9.0", 132)
  (tmp_path / "bad.txtpb").write_text("gpu_device_info { core_count: 132 }\n")
  monkeypatch.setattr(gpu_schedule, "TARGETS", str(tmp_path))
  with pytest.raises(ValueError, match="bad.txtpb: no cuda_compute_capability major"):
    gpu_schedule._target_gpu("bad")


@pytest.mark.parametrize("argv, says", [(["--gpus", "12"], "--gpus: 12: 1 to 8, or a multiple"),
                                        (["--set", "seq_len"], "expected KEY=VALUE"),
                                        (["--target", "h900"], "invalid choice: 'h900'"),
                                        (["--preset", "nosuch:20b"], "no family 'nosuch'"),
                                        (["--max-period", "0"], "must be >= 1, got 0"),
                                        (["--lines", "-1"], "--lines: must be >= 0, got -1"),
                                        (["--experts", "dense"], "invalid choice: 'dense'")])
def test_bad_arguments_are_one_line(argv, says, capsys):
  with pytest.raises(SystemExit) as e:
    gpu_schedule.parse_args(argv, ["fsdp"])
  assert e.value.code == 2 and says in capsys.readouterr().err


def test_without_the_plugin_it_names_the_set_up_command(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(gpu_schedule, "PLUGIN_DIR", str(tmp_path / "none"))
  monkeypatch.setattr(sys, "path", list(sys.path))     # main() prepends the repository's paths
  assert gpu_schedule.main(["--variant", "fsdp"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"gpu_schedule: jax's CUDA plugin is not in {tmp_path / 'none'}: run "
                 "bash scripts/setup_gpu_compile.sh"]
