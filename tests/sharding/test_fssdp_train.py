"""FSSDP in the train step on 8 fake devices (2 nodes x 4): same losses as ep, across a
re-shard; SparseAllGather / SparseReduceScatter move exactly the planned replicas; a run
interrupted and resumed across a re-shard equals an uninterrupted one, bit for bit.

One fssdp Trainer (compiled once) serves the in-process steps and the `run` calls."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.layers.dispatch import Dispatch
from moejax.sharding import fssdp, fssdp_plan, fssdp_reshard
from moejax.sharding.mesh import DEVICES, make_mesh
from moejax.train import checkpoint as ckpt
from moejax.train.loop import Trainer, put_batch, run
from tests.helpers import tiny_config

STEPS = 6
# run(): 8 steps, re-shards after steps 3 and 6, checkpoints at 4 and 8.
RUN = {"batch_size": 16, "seq_len": 32, "mesh.shape": (2, 4), "steps": 8, "log_every": 1,
       "eval_batches": 1, "checkpoint.every": 4, "fssdp.reshard_every": 3}
TIMING = ("step_time_s", "tokens_per_s")


def _batches(n):
  rng = np.random.default_rng(3)
  out = []
  for _ in range(n):
    toks = rng.integers(0, 256, (16, 33)).astype(np.int32)
    out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
  return out


def _trainer(placement):
  return Trainer(tiny_config(**RUN, **{"moe.placement": placement}))


def _train(trainer, reshard_at=None):
  cfg = trainer.cfg
  state = trainer.init_state()
  losses, records, relabel = [], [], None
  for i, b in enumerate(_batches(STEPS)):
    if i == reshard_at:
      # A skewed load history: experts 0 and 1 (both owned by device 0) are hot.
      hot = np.ones((cfg.fssdp.window, cfg.model.num_layers, cfg.moe.num_experts), np.float32)
      hot[:, :, :2] = 50.0
      state = state.replace(load_history=state.load_history._replace(
          loads_WxLxE=jax.device_put(hot, state.load_history.loads_WxLxE.sharding)))
      opt_before = jax.device_get(state.opt_state)
      state, relabel = trainer.reshard(state)
      relabel = (relabel, opt_before, jax.device_get(state.opt_state))
    state, metrics = trainer.train_step(state, put_batch(b, trainer.mesh))
    losses.append(float(metrics["loss"]))
    records.append(metrics)
  return np.array(losses), jax.device_get(records), relabel


@pytest.fixture(scope="module")
def fssdp_trainer():
  return _trainer("fssdp")


@pytest.fixture(scope="module")
def ep():
  return _train(_trainer("ep"))


@pytest.fixture(scope="module")
def fssdp_run(fssdp_trainer):
  return _train(fssdp_trainer, reshard_at=3)


def test_fssdp_matches_ep_across_a_reshard(ep, fssdp_run):
  losses_ep, _, _ = ep
  losses, records, (relabel, opt_before, opt_after) = fssdp_run
  np.testing.assert_allclose(losses, losses_ep, rtol=2e-3)
  assert relabel.moved > 0 and relabel.moved_bytes > 0
  # Replicas were materialized, and the straggler factor is reported per layer.
  assert max(float(np.max(r["replicas"])) for r in records) > 0
  assert all(np.all(r["straggler"] >= 1.0) for r in records)
  # Re-sharding moved the optimizer moments with their experts: a permutation of rows.
  mu_before = jax.tree.leaves(opt_before)
  mu_after = jax.tree.leaves(opt_after)
  for a, b in zip(mu_before, mu_after):
    if a.ndim >= 3 and a.shape[1] == 8:        # [L, E, ...] expert moments
      np.testing.assert_array_equal(np.sort(a.reshape(a.shape[0], 8, -1), axis=1),
                                    np.sort(b.reshape(b.shape[0], 8, -1), axis=1))


def test_sparse_all_gather_then_reduce_scatter_counts_replicas():
  mesh = make_mesh((2, 4), jax.devices()[:8])
  n, el, m = 8, 2, 2
  dispatch = Dispatch("fssdp", DEVICES, n, 4, replica_slots=m, overlap_degree=4)
  load_E = jnp.asarray([40.0, 1, 1, 1, 1, 1, 1, 1, 30, 1, 1, 1, 1, 1, 1, 1])
  plan = fssdp_plan.materialize_plan(load_E, fssdp.owner_of(16, n), num_devices=n,
                                     devices_per_node=4, replica_slots=m, overlap_degree=4)

  def body(w_ElxR):
    def total(w):
      return jnp.sum(fssdp.sparse_all_gather(w, plan.replica_expert_NxM, dispatch=dispatch))
    return jax.grad(total)(w_ElxR)

  ones = jnp.ones((n * el, 3), jnp.float32)
  grads = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DEVICES), out_specs=P(DEVICES),
                                check_vma=False))(ones)
  # Each expert's gradient counts its replicas (3 values per row), exactly.
  replicas_E = np.bincount(np.asarray(plan.replica_expert_NxM).ravel(), minlength=17)[:16]
  np.testing.assert_array_equal(np.asarray(grads)[:, 0], replicas_E)
  assert int(plan.num_replicas) == replicas_E.sum() > 0


def test_relabel_plan_is_a_permutation_per_layer():
  load = np.random.default_rng(0).gamma(0.5, size=(3, 16))
  r = fssdp_reshard.plan_relabel(load, 8, 4, bytes_per_expert=10)
  for row in r.perm_LxE:
    assert sorted(row.tolist()) == list(range(16))
  assert r.moved_bytes == 10 * r.moved


# ------------------------------------------------------------------------------------------------
# Resume: the load history (the predictor's window, hence every plan and re-shard) is saved.

def _records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


@pytest.fixture(scope="module")
def uninterrupted(fssdp_trainer, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("fssdp") / "w"
  run(fssdp_trainer.cfg, str(workdir), trainer=fssdp_trainer)
  return workdir


def test_resume_across_a_reshard_is_bit_exact(fssdp_trainer, uninterrupted, tmp_path, capsys):
  workdir = tmp_path / "w"
  run(fssdp_trainer.cfg, str(workdir), trainer=fssdp_trainer, stop_at=4)   # re-sharded at 3
  capsys.readouterr()
  run(fssdp_trainer.cfg, str(workdir), trainer=fssdp_trainer)              # re-shards at 6
  out = capsys.readouterr().out
  assert "moejax: resuming from step 4" in out and "load history" not in out
  records, reference = _records(workdir), _records(uninterrupted)
  assert [r["step"] for r in records] == list(range(1, 9))
  moved = {r["step"]: r["reshard_moved_experts"] for r in reference if "reshard_moved_experts" in r}
  assert sorted(moved) == [4, 7] and all(m > 0 for m in moved.values())   # after steps 3, 6
  assert records == reference                       # losses, plans, moves: every figure
  for a, b in zip(jax.tree.leaves(ckpt.load_params(str(workdir))),
                  jax.tree.leaves(ckpt.load_params(str(uninterrupted)))):
    np.testing.assert_array_equal(a, b)


def test_checkpoint_without_load_history_restores_with_a_log_line(fssdp_trainer, uninterrupted,
                                                                   tmp_path, capsys):
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  shutil.rmtree(workdir / "checkpoints" / "8" / "fssdp")     # as an older version wrote it
  checkpoints = ckpt.Checkpointer(str(workdir), fssdp_trainer.cfg)
  try:
    state, step = checkpoints.restore(fssdp_trainer.layout, fssdp_trainer.tx)
  finally:
    checkpoints.close()
  assert step == 8 and int(state.load_history.count) == 0
  assert (f"moejax: checkpoint {workdir}/checkpoints/8 (step 8) holds no fssdp load history"
          in capsys.readouterr().out)
