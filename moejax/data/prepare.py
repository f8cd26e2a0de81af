"""Tokenize a corpus once, for `data.source=tokens` (see moejax.data.prepared).

  python -m moejax.data.prepare --data PATH [PATH ...]|builtin [--source text|jsonl]
      --tokenizer T --out DIR
  python -m moejax.data.prepare --verify DIR

`--data`, `--source` and `--tokenizer` read as `moejax.evaluate`'s and the config's `data.*`
do; training on DIR (`--config.data.source=tokens --config.data.path=DIR`, the same
`data.tokenizer`) reads the same token stream, batches and validation split as training on
PATH. Several files (a corpus in shards, `--data shards/*.jsonl`) are one stream, in the order
given. `--verify` reads DIR's tokens whole and checks them against the CRC-32 it was written
with (after copying it between machines).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from moejax.errors import DataError, run_command


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m moejax.data.prepare",
                                   description="Tokenize a corpus once, for data.source=tokens.")
  parser.add_argument("--data", nargs="+", help=".jsonl or text files (one stream, in this "
                      "order), or 'builtin'")
  parser.add_argument("--source", choices=("text", "jsonl"), default=None,
                      help="how to read --data (default: jsonl for a .jsonl file, else text)")
  parser.add_argument("--tokenizer", default="bytes",
                      help="'bytes' or a tokenizer.json (or its folder): the run's data.tokenizer")
  parser.add_argument("--out", help="the directory to write (must not exist)")
  parser.add_argument("--verify", metavar="DIR", default=None,
                      help="check a prepared directory's tokens against its CRC-32 instead")
  return parser


class Stopped(BaseException):
  """SIGTERM while preparing: unwinds as Ctrl-C does, so the partial directory is removed."""


def _stop(signum, frame):
  del frame
  raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  # A stopped preparation removes what it wrote (`prepared.write`) and says so in one line:
  # SIGTERM left its partial directory behind, Ctrl-C printed a traceback.
  previous = signal.signal(signal.SIGTERM, _stop)
  try:
    return _main(args)
  except (KeyboardInterrupt, Stopped) as e:
    signum = e.args[0] if isinstance(e, Stopped) else signal.SIGINT
    print(f"moejax: preparation stopped ({signal.Signals(signum).name}): nothing written"
          + (f" to {args.out}" if args.out else ""), file=sys.stderr)
    return 128 + int(signum)
  finally:
    signal.signal(signal.SIGTERM, previous)


def _main(args) -> int:

  def body():
    from moejax.data import prepared
    from moejax.data.tokenizer import load_tokenizer
    from moejax.data.sources import source_of
    if args.verify is not None:
      if args.data or args.out:
        raise DataError("--verify DIR takes no --data or --out")
      prepared.verify(args.verify)
      print(f"{args.verify}: tokens match their CRC-32")
      return
    if not args.data or not args.out:
      raise DataError("--data and --out are required (or --verify DIR)")
    if "builtin" in args.data and len(args.data) > 1:
      raise DataError("--data builtin is a corpus of its own: name it alone")
    inputs = []
    for path in args.data:
      source = source_of(path, args.source)
      if source == "tokens":
        raise DataError(f"--data {path}: a directory is already prepared (--data names text or "
                        ".jsonl files, or builtin)")
      if os.path.realpath(path) in map(os.path.realpath, args.data[:len(inputs)]):
        raise DataError(f"--data names {path} twice")
      inputs.append((source, None if source == "builtin" else path))
    prepared.write(inputs, load_tokenizer(args.tokenizer), args.out, log=print)

  return run_command(body)


if __name__ == "__main__":
  sys.exit(main())
