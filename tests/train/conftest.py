"""The canonical fsdp Trainer on 8 devices and its uninterrupted run, shared by the checkpoint
and init_from tests (one compile, one 12-step run per session)."""
import json
import os

import pytest

from moejax.train.loop import run
from tests.helpers import CANONICAL, canonical_config

TIMING = ("step_time_s", "tokens_per_s")


def records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def trainer(trainer_for):
  return trainer_for(canonical_config("fsdp"), 8)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, trainer):
  """workdir of one uninterrupted canonical run: checkpoints 4, 8, 12. Copy before changing."""
  workdir = tmp_path_factory.mktemp("trained") / "w"
  run(trainer.cfg, str(workdir), trainer=trainer)
  assert [r["step"] for r in records(workdir)] == list(range(1, CANONICAL["steps"] + 1))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "4", "8"]
  return workdir
