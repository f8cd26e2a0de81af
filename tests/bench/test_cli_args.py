"""The bench scripts refuse bad arguments with argparse's one line naming the flag and exit code 2,
before any work (0 is no stand-in for a default; a value that would end in a traceback later is
refused up front). One subprocess runs every script's `__main__` in turn."""
import json
import subprocess
import sys

from tests.helpers import REPO, xla_flags

CASES = [
    ("step.py", ["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    ("step.py", ["--only", "nosuch"], "argument --only: no variant's name contains 'nosuch'"),
    ("step.py", ["--quick", "--experts"], "argument --experts: not allowed with argument --quick"),
    ("fssdp.py", ["--reshard_every", "0"], "argument --reshard_every: must be >= 1, got 0"),
    ("fssdp.py", ["--steps", "5"], "argument --steps: must be >= --reshard_every=10, got 5"),
    ("codec.py", ["--quick", "--steps_high", "20"], "argument --steps_high: must be more than"),
    ("codec.py", ["--composed", "--composed_steps", "3"],
     "argument --composed_steps: must be >= 10, got 3"),
    ("placement.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("planner.py", ["--calls", "0"], "argument --calls: must be >= 1, got 0"),
    ("routing.py", ["--steps", "2"], "argument --steps: must be >= 3, got 2"),
    ("soak.py", ["--steps", "250"], "argument --steps: must be a multiple of 100, got 250"),
    ("families.py", ["--steps", "1"], "argument --steps: must be >= 2, got 1"),
    ("indexer.py", ["--steps", "1"], "argument --steps: must be >= 2, got 1"),
    ("indexer.py", ["--seq", "512"], "argument --seq: must be >= 513, got 512"),
    ("projection.py", ["--plot", "/nonexistent/dir/p.png"], "argument --plot: no folder"),
    ("trace.py", ["--only", "gpt_oss:huge:fsdp"], "argument --only: gpt_oss has no preset 'huge'"),
    ("linear_attention.py", ["--seq", "512,0"],
     "argument --seq: expected comma-separated positive lengths, got '512,0'"),
]

DRIVER = """
import contextlib, io, json, os, runpy, sys
out = []
for script, argv, _ in json.loads(sys.argv[1]):
  sys.argv = [script, *argv]
  err = io.StringIO()
  code = None
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      runpy.run_path(os.path.join("bench", script), run_name="__main__")
    except SystemExit as e:
      code = e.code
  out.append((code, err.getvalue()))
print(json.dumps(out))
"""


def test_bad_arguments_stop_with_one_line_naming_the_flag():
  env = {"XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
  result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(CASES)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  for (script, argv, message), (code, err) in zip(CASES, json.loads(result.stdout.splitlines()[-1]),
                                                 strict=True):
    last = err.strip().splitlines()[-1]
    assert code == 2 and message in last and "Traceback" not in err, (script, argv, err)
    assert last.startswith(f"{script}: error: "), (script, last)
