"""Helpers for the tests that read the canonical run's records (its Trainer and workdir are the
session fixtures `trainer` and `trained`, tests/conftest.py)."""
import json
import os

TIMING = ("step_time_s", "tokens_per_s")


def records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def numbers(recs: list[dict]) -> list[dict]:
  """Metrics records without their timing fields: what a resumed run repeats bit for bit."""
  return [{k: v for k, v in r.items() if k not in TIMING} for r in recs]


def checkpoint_listing(workdir) -> list[str]:
  """The entries of workdir/checkpoints, sorted ([] without the folder)."""
  directory = workdir / "checkpoints"
  return sorted(os.listdir(directory)) if directory.is_dir() else []
