"""python -m moejax.report WORKDIR: writes WORKDIR/report.html and WORKDIR/report/*.png."""
import argparse
import sys

from moejax.errors import run_command


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m moejax.report", description=__doc__)
  parser.add_argument("workdir", help="a train.py workdir (holds metrics.jsonl)")
  args = parser.parse_args(argv)
  from moejax.report.render import write_report
  return run_command(lambda: print(f"moejax: wrote {write_report(args.workdir)}"))


if __name__ == "__main__":
  sys.exit(main())
