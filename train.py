"""Train an MoE language model.

  python train.py --config configs/olmoe.py:tiny --workdir runs/tiny [--config.FIELD=VALUE ...]

Multi-process: pass --coordinator_address, --num_processes and --process_id (or set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and every process joins one job.
"""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/olmoe.py", "Config file[:preset].")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Where metrics and checkpoints go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from moejax import distributed
  from moejax.config import from_config_dict
  from moejax.errors import MoejaxError
  from moejax.train.loop import run
  try:
    distributed.maybe_initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    run(from_config_dict(_CONFIG.value), _WORKDIR.value)
  except MoejaxError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv):
  """absl flag parsing, with every failure (bad field, preset, value) as one line + exit 2."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # config files raise anything; the user needs the message only
    message = str(e).strip().splitlines()
    message = [line for line in message if line.strip() and not line.startswith("Pass --help")]
    detail = message[-1].strip() if message else type(e).__name__
    if isinstance(e, (AttributeError, KeyError)):   # ConfigDict's way of saying "no such field"
      detail = f"unknown config field {detail.strip(chr(34))} in a --config.FIELD override"
    print(f"error: bad command line: {detail}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  app.run(main, flags_parser=parse_flags)
