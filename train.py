"""Train an MoE language model.

  python train.py --config configs/olmoe.py:tiny --workdir runs/tiny [--config.FIELD=VALUE ...]
  python train.py --config configs/olmoe.py:1b7b --memory_on_devices=64   # bytes per device

Multi-process: pass --coordinator_address, --num_processes and --process_id (or set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and every process joins one job; under
SLURM (srun) or a Kubernetes Job no flags are needed (docs/cluster.md). If a
process is lost, the others stop with one line naming it and exit code 2 (moejax.distributed).
"""
import os
import re
import sys

import signal


class EarlyStop(BaseException):
  """SIGTERM before the run's own handler is in place (`EarlySignal`): unwinds as Ctrl-C does."""


class EarlySignal:
  """train.py's SIGINT and SIGTERM handler until the run installs its own (`moejax.train.stop`):
  raises KeyboardInterrupt (SIGINT) or EarlyStop (SIGTERM), and remembers the signal (`seen`),
  since Python drops an exception raised inside a gc callback (jax registers one, run at every
  collection while modules import and programs compile): checked after the imports, and taken
  over by the run's handler."""
  seen: int | None = None

  def __call__(self, signum, frame):
    del frame
    EarlySignal.seen = signum
    raise KeyboardInterrupt if signum == signal.SIGINT else EarlyStop(signum)

  @staticmethod
  def unraisable(args) -> None:
    """sys.unraisablehook: a dropped stop is not printed (it is acted on)."""
    if not isinstance(args.exc_value, (KeyboardInterrupt, EarlyStop)):
      sys.__unraisablehook__(args)


from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/olmoe.py", "Config file[:preset].")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Where metrics and checkpoints go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_MEMORY = flags.DEFINE_integer(
    "memory_on_devices", None, "Print this config's train-step memory per device on that many "
    "devices, by component (moejax.train.memory; no devices needed, nothing compiled), and exit.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from moejax import distributed
  from moejax.config import from_config_dict
  from moejax.errors import ConfigError, MoejaxError
  from moejax.train.loop import run
  from moejax.train.stop import Interrupted
  if EarlySignal.seen is not None:      # a signal dropped inside a gc callback while importing
    EarlySignal()(EarlySignal.seen, None)
  try:
    cfg = from_config_dict(_CONFIG.value)
    if _MEMORY.value is not None:
      from moejax.train.memory import memory_report
      if _MEMORY.value < 1:
        raise ConfigError(f"--memory_on_devices={_MEMORY.value}: must be a positive device count")
      # The devices planned are accelerators: "auto" exchange buffers are packed there.
      blocks = cfg.moe.exchange_buffers == "blocks"
      report = memory_report(cfg, _MEMORY.value,      # refuses a split first: no header then
                             packed_exchange=not blocks)
      buffers = (f", {'per-destination blocks' if blocks else 'packed'} exchange buffers"
                 if cfg.moe.placement != "fsdp" else "")
      print(f"train-step memory per device on {_MEMORY.value} devices "
            f"(placement={cfg.moe.placement}, remat={cfg.remat}, batch {cfg.batch_size}x"
            f"{cfg.seq_len}{buffers}):")
      print(report.table())
      return
    distributed.maybe_initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                 heartbeat_timeout_s=cfg.distributed.heartbeat_timeout_s)
    run(cfg, _WORKDIR.value)
  except Interrupted as e:     # SIGINT / SIGTERM: saved at a step boundary, every process alike
    print(f"moejax: {e}", flush=True)
    distributed.finish()
    sys.exit(e.exit_code)
  except MoejaxError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    distributed.stop(2)     # multi-process: the other processes stop too, none waits on them
    # Exit now: a save that failed can leave Orbax's background threads waiting forever on a
    # directory that was never created, and interpreter exit would wait on them.
    sys.stdout.flush()
    os._exit(2)
  distributed.finish()


def _override_fields(argv):
  """The dotted FIELDs of the --config.FIELD[=VALUE] arguments in argv."""
  for arg in argv[1:]:
    if arg == "--":
      break
    name = arg.lstrip("-").split("=", 1)[0]
    if arg.startswith("-") and name.startswith("config."):
      yield name[len("config."):]


def parse_flags(argv):
  """absl flag parsing, with every failure (bad field, preset, value) as one line + exit 2."""
  from moejax.config import check_not_renamed
  from moejax.errors import ConfigError
  try:   # before absl, which would only say the old field is unknown
    for field in _override_fields(argv):
      check_not_renamed(field)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    parsed = flags.FLAGS(argv)
    # The config file is read lazily, on first use, when no --config.FIELD override made it
    # load here: a missing file would end in a traceback in main.
    _CONFIG.value.keys()
    return parsed
  except Exception as e:  # noqa: BLE001  config files raise anything; the message is enough
    inner = e   # ConfigDict wraps a KeyError in an AttributeError; a KeyError's str() is a repr
    while inner.args and isinstance(inner.args[0], BaseException):
      inner = inner.args[0]
    text = str(inner.args[0]) if isinstance(inner, KeyError) and inner.args else str(inner)
    message = [line.strip() for line in text.strip().splitlines()
               if line.strip() and not line.startswith("Pass --help")]
    detail = message[-1] if message else type(e).__name__
    if isinstance(e, AttributeError) and "has no attribute 'get_config'" in text:
      print(f"error: --config {_config_arg(argv)}: the file defines no get_config(); a config "
            "file defines get_config(preset=None) returning the run's config (see "
            "configs/olmoe.py)", file=sys.stderr)
      sys.exit(2)
    if isinstance(e, (AttributeError, KeyError)):   # ConfigDict's way of saying "no such field"
      hint = f" ({message[1]})" if len(message) > 1 else ""   # e.g. 'Did you mean "top_k"...'
      name = _unknown_field(argv) or message[0].strip(chr(34)) if message else None
      detail = (f"unknown config field {name} in a --config.FIELD override{hint}"
                if name else detail)
      print(f"error: bad command line: {detail}", file=sys.stderr)
      sys.exit(2)
    typed = _typed_value_error(detail)
    detail = re.sub(r"^[A-Za-z]*Error: ", "", detail)   # a config file's ValueError: its words
    print(f"error: {typed}" if typed else f"error: bad command line: {detail}", file=sys.stderr)
    sys.exit(2)


def _unknown_field(argv) -> str | None:
  """The first --config.FIELD override whose dotted path the typed config lacks, quoted whole
  (ConfigDict names only its last part: 'foo' for moe.foo)."""
  import dataclasses

  import moejax.config as config_lib
  for field in _override_fields(argv):
    node = config_lib.Config
    for name in field.split("."):
      fields = ({f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node)
                else None)
      if fields is None:
        break                      # a dict-valued field (its keys are free): not ours to judge
      if name not in fields:
        return repr(field)
      node = fields[name].type
      if isinstance(node, str):    # postponed annotations: a group's class by name
        node = getattr(config_lib, node, node)
  return None


def _config_arg(argv) -> str:
  """The --config flag's value in argv (its file, with any :PRESET)."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return "?"


def _typed_value_error(detail: str) -> str | None:
  """absl's "flag --config.FIELD=VALUE: <parser's words>" as "config.FIELD=VALUE: <what the
  field takes>", from the typed config's field; None when the flag is not a config field."""
  import dataclasses
  import re

  from moejax.config import Config
  match = re.match(r"flag --config\.([\w.]+)=(.*?): ", detail)
  if not match:
    return None
  field, value = match.groups()
  node = Config
  for name in field.split("."):
    fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
    if name not in fields:
      return None
    node = fields[name].type
    node = {"int": int, "float": float, "bool": bool, "str": str}.get(node, node) if isinstance(
        node, str) else node
    if isinstance(node, str):          # a group, by its class name
      import moejax.config as config_lib
      node = getattr(config_lib, node, node)
  if dataclasses.is_dataclass(node):
    return (f"config.{field}={value}: a group of fields, set one at a time (e.g. "
            f"--config.{field}.{dataclasses.fields(node)[0].name}=...)")
  takes = {int: "an integer (e.g. 1000, not 1e3)", float: "a number (e.g. 3e-4)",
           bool: "True or False"}.get(node)
  return f"config.{field}={value}: takes {takes}" if takes else None


def stopped_at_once(signum: int) -> None:
  """Ctrl-C or SIGTERM before the run's own handler is in place (imports, reading the config,
  loading the data, initializing the model), or a second Ctrl-C (which stops at once): one line,
  not Python's traceback or a silent death; exit status 128 + the signal."""
  print(f"moejax: stopped on {signal.Signals(signum).name} at once: nothing saved since the "
        "last checkpoint, if there is one", file=sys.stderr, flush=True)
  distributed = sys.modules.get("moejax.distributed")
  if distributed is not None:
    distributed.stop(128 + signum)      # multi-process: the others stop too
  sys.stdout.flush()
  os._exit(128 + signum)       # not interpreter exit: it would wait on Orbax's save threads


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  for sig, default in ((signal.SIGINT, signal.default_int_handler),
                       (signal.SIGTERM, signal.SIG_DFL)):
    if signal.getsignal(sig) is default:         # not ignored (nohup, a background job)
      signal.signal(sig, EarlySignal())
      sys.unraisablehook = EarlySignal.unraisable
  try:
    app.run(main, flags_parser=parse_flags)
  except KeyboardInterrupt:
    stopped_at_once(signal.SIGINT)
  except EarlyStop as e:
    stopped_at_once(e.args[0])
