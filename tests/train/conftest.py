"""Helpers for the tests that read the canonical run's records (its Trainer and workdir are the
session fixtures `trainer` and `trained`, tests/conftest.py)."""
import json
import os

TIMING = ("step_time_s", "tokens_per_s")


def records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]
