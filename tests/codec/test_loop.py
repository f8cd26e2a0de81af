"""`codec.mode=auto` through the training loop: the policy decides after the warm-up, logs its
choice in WORKDIR/codec_selection.json, every checkpoint holds the decision in force (item
"codec"), and a resumed run reinstalls it from there and continues bit for bit like the
uninterrupted run."""
import json
import os

import orbax.checkpoint as ocp
import pytest

from moejax.train import codec_control
from moejax.train.loop import run
from tests.helpers import CODEC_AUTO_STEPS as STEPS

TIMING = ("step_time_s", "tokens_per_s")


def _without_gather_figures(record):
  refill = ("exp_change_rate", "block_change_rate", "codec_fallbacks")
  return {k: v for k, v in record.items()
          if not (k.startswith(("gather_bytes", "codec/")) or k in refill)}


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


@pytest.fixture(scope="module")
def trainer(codec_auto_run):
  return codec_auto_run[0]


@pytest.fixture(scope="module")
def uninterrupted(codec_auto_run):
  return codec_auto_run[1]


def test_auto_decides_after_warmup_and_compresses(uninterrupted, capsys):
  records = _records(uninterrupted)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  with open(os.path.join(uninterrupted, codec_control.SELECTION_FILE)) as f:
    decisions = json.load(f)["decisions"]
  assert [d["step"] for d in decisions] == [3]
  chosen = [e for e in decisions[0]["params"] if e["mode"] != "off"]
  assert chosen and all(e["reason"] for e in decisions[0]["params"])
  # Plain until the decision; then the chosen parameters compress (the first gather of each
  # refills the caches, so look one step later).
  assert all("codec_params" not in r for r in records[:3])
  late = records[-1]
  assert late["codec_params"] == len(chosen)
  assert late["gather_bytes"] < late["gather_bytes_plain"]


def test_resumed_auto_run_reinstalls_the_choice_bit_for_bit(trainer, uninterrupted, tmp_path,
                                                             capsys):
  workdir = str(tmp_path / "w")
  run(trainer.cfg, workdir, trainer=trainer, stop_at=5)
  capsys.readouterr()
  os.remove(os.path.join(workdir, codec_control.SELECTION_FILE))   # the checkpoint is the source
  run(trainer.cfg, workdir, trainer=trainer)
  out = capsys.readouterr().out
  assert "codec: step 5: reinstalled the codec choice of step 3" in out
  resumed, reference = _records(workdir), _records(uninterrupted)
  assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
  # Everything but the gather bytes of step 6 (its caches refill after the restore).
  for a, b in zip(resumed, reference):
    if a["step"] == 6:
      assert a["gather_bytes"] > b["gather_bytes"]
      a, b = _without_gather_figures(a), _without_gather_figures(b)
    assert a == b


def test_run_resumed_while_probing_decides_as_the_uninterrupted_one(trainer, uninterrupted,
                                                                    tmp_path, capsys):
  """Stopped at step 2, inside the probe window of the first decision (steps 1-3): the
  checkpoint holds the decision's schedule and the counts probed so far, so the resumed run
  decides at step 3 from the same counts, and its every figure is the uninterrupted run's."""
  workdir = str(tmp_path / "w")
  run(trainer.cfg, workdir, trainer=trainer, stop_at=2)
  run(trainer.cfg, workdir, trainer=trainer)
  capsys.readouterr()
  with open(os.path.join(workdir, codec_control.SELECTION_FILE)) as f:
    resumed = json.load(f)["decisions"]
  with open(os.path.join(uninterrupted, codec_control.SELECTION_FILE)) as f:
    reference = json.load(f)["decisions"]
  assert [d["step"] for d in resumed] == [d["step"] for d in reference] == [3]
  assert resumed[0]["params"] == reference[0]["params"]
  assert _records(workdir) == _records(uninterrupted)


def test_checkpoints_hold_the_decision_in_force(uninterrupted):
  with open(os.path.join(uninterrupted, codec_control.SELECTION_FILE)) as f:
    logged = json.load(f)["decisions"][0]
  chosen = {(e["group"], e["path"]): e for e in logged["params"] if e["mode"] != "off"}
  manager = ocp.CheckpointManager(os.path.join(uninterrupted, "checkpoints"),
                                  item_handlers={"codec": ocp.JsonCheckpointHandler()})
  for step, decided in ((3, 3), (6, 3)):
    item = manager.restore(step, args=ocp.args.Composite(codec=ocp.args.JsonRestore()))["codec"]
    assert item["step"] == decided
    saved = {(e["group"], e["path"]): e for e in item["specs"]}
    assert saved.keys() == chosen.keys()
    for key, e in saved.items():
      assert (e["mode"], e["capacity_fraction"]) == (chosen[key]["mode"],
                                                     chosen[key]["capacity_fraction"])
  manager.close()
