"""train.py turns bad input into one line on stderr and exit code 2, never a traceback."""
import pytest

from tests.helpers import run_train


@pytest.mark.parametrize("args,message", [
    (["--config", "configs/olmoe.py:huge"], "unknown preset 'huge'"),
    (["--config.moe.foo=1"], "unknown config field 'foo'"),
    (["--config.moe.top_k=abc"], "--config.moe.top_k=abc"),
    (["--config.moe.top_k=9"], "config.moe.top_k=9: must be at most moe.num_experts=8"),
    (["--config.data.source=jsonl", "--config.data.path=/no/such.jsonl"],
     "/no/such.jsonl: file not found"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
  if not args[0].startswith("--config="):
    args = ["--config", "configs/olmoe.py:tiny", *args]
  proc = run_train([*args, "--workdir", str(tmp_path / "w")], timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr
