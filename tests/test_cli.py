"""train.py turns bad input into one line on stderr and exit code 2, never a traceback.

Bad command lines (absl flag parsing, before anything imports jax) run train.py itself: they
cost a Python start, not a jax import. Errors found later, in the library that train.py calls
(`from_config_dict`, `moejax.train.run`), are tested in process by calling it; one subprocess
(the smoke test) shows train.py turning such an error into one line and exit code 2.
"""
import pytest

from moejax.config import from_config_dict
from moejax.errors import ConfigError, MoejaxError
from moejax.train.loop import run
from tests.helpers import run_train, tiny_config
import configs.olmoe as olmoe_configs


def _one_error_line(proc, message):
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--config", "configs/olmoe.py:huge"], "error: bad command line: unknown preset 'huge'"),
    (["--config.moe.foo=1"], "unknown config field 'moe.foo'"),
    (["--config.moe.top_k=abc"], "error: config.moe.top_k=abc: takes an integer"),
    # No override to make absl read the file: it used to fail later, in main, with a traceback.
    (["--config", "configs/nothere.py:tiny"], "No such file or directory: 'configs/nothere.py'"),
    (["--config", "configs"], "Is a directory: 'configs'"),
])
def test_bad_command_line_is_one_line(tmp_path, args, message):
  if not args[0].startswith("--config="):
    args = ["--config", "configs/olmoe.py:tiny", *args]
  _one_error_line(run_train([*args, "--workdir", str(tmp_path / "w")], timeout=120), message)


def test_a_config_file_without_get_config_is_named(tmp_path):
  path = tmp_path / "mine.py"
  path.write_text("x = 1\n")
  _one_error_line(run_train(["--config", f"{path}:tiny", "--workdir", str(tmp_path / "w")],
                            timeout=120),
                  f"error: --config {path}:tiny: the file defines no get_config(); a config file "
                  "defines get_config(preset=None)")


def test_a_value_of_the_wrong_type_says_what_the_field_takes():
  """absl's parser words ("invalid literal for int() with base 10: '1e3'", an ast.Name for a
  group) become what the typed config's field takes."""
  import train
  cases = {
      "flag --config.steps=1e3: invalid literal for int() with base 10: '1e3'":
          "config.steps=1e3: takes an integer (e.g. 1000, not 1e3)",
      "flag --config.model.qkv_bias=yes: ('Non-boolean argument to boolean flag', 'yes')":
          "config.model.qkv_bias=yes: takes True or False",
      "flag --config.optim.lr=abc: could not convert string to float: 'abc'":
          "config.optim.lr=abc: takes a number (e.g. 3e-4)",
      "flag --config.moe=ep: Failed to parse 'ep' as a ConfigDict: ValueError(...)":
          "config.moe=ep: a group of fields, set one at a time (e.g. --config.moe.num_experts=...)",
      "flag --workdir=x: something": None,                 # not a config field: absl's words
      "flag --config.moe.placement=3: odd": None}          # a string field: the validator's
  for detail, want in cases.items():
    assert train._typed_value_error(detail) == want, detail


def test_library_error_is_one_line_smoke(tmp_path):
  """The one train.py run that imports moejax: a config error raised by the library (here the
  memory plan's, for devices the batch does not divide; its table's header used to be printed
  before it)."""
  proc = run_train(["--config", "configs/olmoe.py:tiny", "--memory_on_devices=3",
                    "--workdir", str(tmp_path / "w")], timeout=120)
  _one_error_line(proc, "config.batch_size=16 is not divisible by the 3 devices")
  assert "train-step memory" not in proc.stdout


def test_invalid_config_is_one_message():
  cd = olmoe_configs.get_config("tiny")
  cd.moe.top_k = 9
  with pytest.raises(ConfigError) as e:
    from_config_dict(cd)
  assert "\n" not in str(e.value)
  assert "config.moe.top_k=9: must be at most moe.num_experts=8" in str(e.value)


def test_missing_data_file_is_one_message(tmp_path):
  """A data file or tokenizer that cannot be read: one line naming its config field (the path
  alone before) and the path."""
  for overrides, start in (
      ({"data.source": "jsonl", "data.path": "/no/such.jsonl"},
       "config.data.path='/no/such.jsonl': /no/such.jsonl: file not found"),
      ({"data.tokenizer": "/no/tokenizer.json"},
       "config.data.tokenizer='/no/tokenizer.json': /no/tokenizer.json: tokenizer file not found")):
    with pytest.raises(MoejaxError) as e:     # what train.py prints as one line, exit 2
      run(tiny_config(**overrides), str(tmp_path / "w"))   # fails before anything compiles
    assert "\n" not in str(e.value) and str(e.value).startswith(start), str(e.value)


def test_memory_on_devices_prints_the_report_and_trains_nothing(tmp_path, capsys):
  import train
  from absl import flags
  workdir = tmp_path / "w"
  try:
    train.parse_flags(["train.py", "--config=configs/olmoe.py:1b7b", "--memory_on_devices=64",
                       "--workdir", str(workdir)])
    train.main([])
  finally:
    flags.FLAGS.memory_on_devices = None
  out = capsys.readouterr().out
  assert out.startswith("train-step memory per device on 64 devices (placement=fsdp, "
                        "remat=full, batch 64x4096):")
  rows = dict(line.rsplit(None, 2)[:2] for line in out.splitlines()[1:])
  assert list(rows) == ["parameters", "optimizer", "gradients", "placement", "codec_state",
                        "batch", "gathered", "activations", "exchange", "total"]
  assert float(rows["exchange"]) == 0 and 0 < float(rows["gathered"]) < float(rows["total"]) < 80
  assert not workdir.exists()
  # ep: the exchange buffers the config names (packed planned, as on GPUs; blocks when asked).
  exchange = {}
  for buffers in ("auto", "blocks"):
    config_file = tmp_path / f"ep_{buffers}.py"
    config_file.write_text("import configs.olmoe as olmoe\n\n\ndef get_config(arg):\n"
                           "  c = olmoe.get_config(arg)\n  c.moe.placement = 'ep'\n"
                           f"  c.moe.exchange_buffers = {buffers!r}\n  return c\n")
    try:
      train.parse_flags(["train.py", f"--config={config_file}:1b7b", "--memory_on_devices=64"])
      train.main([])
    finally:
      flags.FLAGS.memory_on_devices = None
    out = capsys.readouterr().out
    name = "per-destination blocks" if buffers == "blocks" else "packed"
    assert out.splitlines()[0].endswith(f"batch 64x4096, {name} exchange buffers):"), out
    exchange[buffers] = float(dict(line.rsplit(None, 2)[:2]
                                   for line in out.splitlines()[1:])["exchange"])
  assert 0 < exchange["auto"] < exchange["blocks"]


@pytest.mark.parametrize("signum", [2, 15])             # SIGINT, SIGTERM
def test_a_signal_before_the_run_is_one_line_and_leaves_no_workdir(tmp_path, signum):
  """Ctrl-C or SIGTERM after train.py has made its workdir, while the model initializes (before
  the run's own handlers): one line and exit 128 + the signal, not a KeyboardInterrupt traceback
  (SIGINT) or a silent death that left the workdir (SIGTERM), and the workdir it made is
  removed."""
  import os
  import signal
  import subprocess
  import sys
  import time
  from tests.helpers import REPO, xla_flags
  workdir = tmp_path / "w"
  proc = subprocess.Popen(   # SIGINT as a terminal gives it (a background job inherits it ignored)
      [sys.executable, os.path.join(REPO, "train.py"), "--config", "configs/olmoe.py:tiny",
       "--workdir", str(workdir)], cwd=REPO, env=dict(os.environ, XLA_FLAGS=xla_flags(1)),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  deadline = time.monotonic() + 120
  while not workdir.exists() and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  proc.send_signal(signum)             # the run has begun: its data and model come next
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signum, err
  name = signal.Signals(signum).name
  if not err and f"moejax: stopped on {name} after step 1, saved {workdir}/checkpoints/1" in out:
    # Python dropped the exception: raised inside jax's gc callback, which runs at every
    # collection while the model compiles; the run's handler took the signal up after all
    assert (workdir / "checkpoints" / "1").is_dir()
    return
  assert "Traceback" not in err and err.strip().splitlines() == [
      f"moejax: stopped on {name} at once: nothing saved since the last checkpoint, if there is "
      "one"], err
  assert not workdir.exists()


def test_a_signal_python_dropped_is_taken_up_by_the_run():
  """Python drops an exception raised in a gc callback (jax registers one); train.py's handler
  remembers the signal, and the run's handlers take it as a request to stop."""
  import signal
  import train
  from moejax.train.stop import StopRequests
  previous = signal.signal(signal.SIGINT, train.EarlySignal())
  try:
    for seen in (signal.SIGINT, signal.SIGTERM):
      train.EarlySignal.seen = seen
      stops = StopRequests()
      assert stops.requested(1) and stops.signum == seen
      stops.close()
    train.EarlySignal.seen = None
    stops = StopRequests()
    assert not stops.requested(1)
    stops.close()
  finally:
    train.EarlySignal.seen = None
    signal.signal(signal.SIGINT, previous)
