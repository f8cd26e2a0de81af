"""ep/fssdp dispatch buffers sized from measured loads (moe.dispatch_overflow="grow"): a step
that overflows its buffers applies nothing, the Trainer grows them and reruns it, so training is
lossless with buffers far below the dropless worst case, and a resumed run continues on the
grown size the checkpoint holds.

A one-layer ep model on 8 devices (compiles fast) on the default capacity (factor 2: 64 rows per
destination for the 256 assignments of a device), which its first step overflows; the one
growth covers the run (deterministic: fixed seed and data). 16 experts, two a device: a token's
top-2 may both reach one device, so a destination may be sent every one of a device's 256 rows
(with one expert a device it is sent at most 128, `dispatch.max_rows`, and any growth past 128
is dropless at once).
"""
import json
import os

import jax
import pytest

from moejax.train.loop import Trainer, run
from tests.helpers import tiny_config

SMALL = {"moe.placement": "ep", "model.num_layers": 1, "remat": "none", "prefetch": False,
         "steps": 4, "log_every": 1, "eval_batches": 1, "checkpoint.every": 2,
         "moe.dispatch_capacity_factor": 2.0, "moe.num_experts": 16}
TIMING = ("step_time_s", "tokens_per_s")


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


@pytest.fixture(scope="module")
def trainer():
  return Trainer(tiny_config(**SMALL))


def test_overflow_grows_the_buffers_reruns_the_step_and_resumes_on_the_grown_size(
    trainer, tmp_path, capsys):
  cfg = trainer.cfg
  workdir = tmp_path / "w"
  run(cfg, str(workdir), trainer=trainer, stop_at=2)
  grown = [line for line in capsys.readouterr().out.splitlines()
           if "dispatch buffers overflowed" in line]
  assert len(grown) == 1, grown
  assert grown[0].startswith("moejax: the ep dispatch buffers overflowed (a device sent ")
  assert "moe.dispatch_capacity_factor 2 -> " in grown[0]
  assert grown[0].endswith("; rerunning the step")
  factor = trainer.dispatch_capacity_factor
  assert factor > 2.0
  with open(workdir / "checkpoints" / "2" / "dispatch" / "metadata") as f:
    assert json.load(f) == {"dispatch_capacity_factor": factor, "configured": 2.0,
                            "receive_capacity_factor": trainer.receive_capacity_factor,
                            "receive_configured": 1.25, "eval_capacity_factors": None}

  trainer.dispatch_capacity_factor = 2.0       # as a new process starts: the config's
  run(cfg, str(workdir), trainer=trainer)      # resumes at step 2 on the checkpoint's size
  out = capsys.readouterr().out
  assert "moejax: resuming from step 2" in out and "overflowed" not in out
  assert trainer.dispatch_capacity_factor == factor
  resumed = _records(workdir)
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  # Lossless: nothing was dropped, and every step needed no more rows than the buffer held.
  assert all(r["ep_dropped_frac"] == 0.0 and 0 < r["dispatch_needed"] <= r["dispatch_capacity"]
             for r in resumed)
  # The experts ran the rows each device received, and fewer than the receive buffer holds
  # (8 destinations' blocks).
  assert all(0 < r["receive_needed"] <= r["receive_capacity"] < 8 * r["dispatch_capacity"]
             for r in resumed), [(r["receive_needed"], r["receive_capacity"]) for r in resumed]
  # Evaluation ran every received row (no replicas planned for it: its busiest owners would
  # grow the receive capacity training runs at).
  assert "val_loss" in resumed[-1] and trainer._eval_steps
  assert all(receive == 0.0 for _, receive in trainer._eval_steps)
  rows = resumed[0]["dispatch_capacity"]
  assert rows < cfg.batch_size * cfg.seq_len // 8 * cfg.moe.top_k      # below dropless (T x K)

  # The overflowed attempt left no trace: a run on the grown buffers from its first step (the
  # same compiled steps) matches, bit for bit, figure by figure.
  run(cfg, str(tmp_path / "fresh"), trainer=trainer)
  assert "overflowed" not in capsys.readouterr().out
  assert _records(tmp_path / "fresh") == resumed


def test_a_device_receiving_more_rows_than_its_experts_run_grows_them_and_reruns(
    trainer, tmp_path, capsys):
  """moe.receive_capacity_factor: each device runs R = ceil(factor x T x K) of its receive
  buffer's rows through its experts. At 0.5 (128 of the ~256 rows a device receives, in a
  buffer of 8 x 128) the first step overflows; R grows to what the busiest device received,
  with a margin, and the step reruns: the run equals one whose experts run every row of the
  buffer (factor 0), figure by figure but the capacity's own."""
  cfg = trainer.cfg
  runs = {}
  for receive in (0.5, 0.0):
    trainer.dispatch_capacity_factor, trainer.receive_capacity_factor = 4.0, receive
    run(cfg, str(tmp_path / str(receive)), trainer=trainer, stop_at=1)
    runs[receive] = (_records(tmp_path / str(receive)), capsys.readouterr().out,
                     trainer.receive_capacity_factor)
  records, out, grown_factor = runs[0.5]
  grown = [line for line in out.splitlines() if "rows for its ep experts" in line]
  assert len(grown) == 1 and "dispatch buffers overflowed" not in out, out
  assert grown[0].startswith("moejax: a device received ")
  assert "moe.receive_capacity_factor 0.5 -> " in grown[0]
  assert grown_factor >= 1.0         # at least doubled
  assert all(r["ep_dropped_frac"] == 0.0 and r["receive_needed"] <= r["receive_capacity"]
             for r in records)
  assert records[0]["receive_capacity"] < 8 * 128
  capacity = ("receive_capacity",)
  strip = lambda rs: [{k: v for k, v in r.items() if k not in capacity} for r in rs]  # noqa: E731
  assert strip(records) == strip(runs[0.0][0])
  assert runs[0.0][0][0]["receive_capacity"] == 8 * 128


def test_a_restore_takes_the_grown_factors_its_config_still_configures():
  """The checkpoint item "dispatch": each grown factor comes back where the run configures what
  the saved run did, else the config's stands with one line; evaluation's own grown factors
  come back with them (only where both do); a checkpoint from before the receive capacity
  brings back the dispatch factor alone, one from before evaluation's own factors none."""
  import types
  from moejax.train.loop import DispatchCapacityItem
  cfg = tiny_config(**SMALL)
  saved = {"dispatch_capacity_factor": 3.5, "configured": 2.0,
           "receive_capacity_factor": 2.5, "receive_configured": 1.25,
           "eval_capacity_factors": [4.0, 5.0]}
  for item, want, lines_want in (
      (saved, (3.5, 2.5, (4.0, 5.0)), []),
      ({**saved, "receive_configured": 1.5}, (3.5, 1.25, None),
       ["moejax: step 4 sized the rows run through the experts by factor 2.5; this run "
        "configures "
        "moe.receive_capacity_factor=1.25 and starts from that"]),
      ({"dispatch_capacity_factor": 3.5, "configured": 2.0}, (3.5, 1.25, None), [])):
    trainer = types.SimpleNamespace(cfg=cfg, dispatch_capacity_factor=2.0,
                                    receive_capacity_factor=1.25, _eval_factors=None)
    lines = []
    DispatchCapacityItem(trainer).restore("state", item, "step 4", lines.append)
    assert (trainer.dispatch_capacity_factor, trainer.receive_capacity_factor,
            trainer._eval_factors) == want
    assert lines == lines_want


def test_packed_buffers_train_as_the_blocks_do(trainer, tmp_path, capsys, monkeypatch):
  """The GPU's packed exchange buffers (`moe.exchange_buffers`: here the CPU mesh is told it
  packs, and `ragged_all_to_all` is emulated from all_gathers) in the Trainer: they apply no
  dispatch cap (every row is sent; a cap would only drop rows and rerun the step), so only what
  a device receives can overflow, and the receive capacity grows; the run equals the blocks'
  figure by figure, the capacities and the buffer-sized byte counts aside, its validation loss
  too (evaluation at capacities of its own, grown apart from training's)."""
  from jax import lax
  from moejax.train import state
  from tests.helpers import emulated_ragged_all_to_all
  monkeypatch.setattr(state, "packs_exchange", lambda cfg, mesh: True)
  monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  packed = Trainer(trainer.cfg)
  assert packed.layout.placement.dispatch.packed
  assert packed.layout.placement.dispatch.capacity_factor == 0.0      # no cap sent
  run(trainer.cfg, str(tmp_path / "packed"), trainer=packed)
  out = capsys.readouterr().out
  assert "dispatch buffers overflowed" not in out
  assert "rows for its ep experts" in out and packed.receive_capacity_factor > 1.25, out
  train_lines = [line for line in out.splitlines() if "rerunning the step" in line]
  # training's factor: its own growths alone (evaluation's name themselves)
  assert packed.receive_capacity_factor == float(
      train_lines[-1].split("moe.receive_capacity_factor ")[1].split(" -> ")[1].split()[0])
  run(trainer.cfg, str(tmp_path / "blocks"), trainer=trainer)
  sized = ("dispatch_capacity", "receive_capacity", "a2a_bytes")
  # bytes moved: packed, the T x K rows sent; blocks, 8 destinations' blocks of C rows
  a = trainer.cfg.batch_size * trainer.cfg.seq_len // 8 * trainer.cfg.moe.top_k
  (p, *_), (b, *_) = (_records(tmp_path / w) for w in ("packed", "blocks"))
  assert p["a2a_bytes"] == pytest.approx(b["a2a_bytes"] * a / (8 * b["dispatch_capacity"]))
  strip = lambda rs: [{k: v for k, v in r.items() if k not in sized} for r in rs]  # noqa: E731
  packed_records = _records(tmp_path / "packed")
  assert strip(packed_records) == strip(_records(tmp_path / "blocks"))
  assert "val_loss" in packed_records[-1]
  # An evaluation that overflows its receive capacity grows its own and reruns: the blocks'
  # loss, and training's capacities untouched.
  from moejax import evaluate
  val = evaluate.batches(trainer.cfg, "builtin", "val", "bytes", 1)
  params = jax.device_get(trainer.init_state().params)
  factors = packed.capacity_factors
  packed._eval_factors = (2.0, 0.125)             # 32 rows of a device's ~256
  loss = evaluate.mean_loss(packed, params, val)
  assert "rows for its ep experts, which run 32: evaluation moe.receive_capacity_factor 0.125 " \
      in capsys.readouterr().out
  assert packed.eval_capacity_factors[1] > 0.125 and packed.capacity_factors == factors
  assert loss == evaluate.mean_loss(trainer, params, val)
  assert all(r["ep_dropped_frac"] == 0.0 and r["receive_needed"] <= r["receive_capacity"]
             for r in packed_records)
