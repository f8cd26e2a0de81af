"""FSSDP in the train step on 8 fake devices (2 nodes x 4): same losses as ep, across a
re-shard; SparseAllGather / SparseReduceScatter move exactly the planned replicas; a run
interrupted and resumed across a re-shard equals an uninterrupted one, bit for bit; the replica
codec is lossless in the step and pays once devices keep their experts.

The model is DeepSeek's tiny preset (a dense first layer, so the placement's layers are the two
MoE ones of three; a shared expert; grouped sigmoid routing with a score bias that the train step
moves and the checkpoint keeps): FSSDP on a family other than OLMoE. Its attention here is the
standard one: latent attention adds 10 s to each of the two step compiles (34.6 vs 24.0 s) and
is an attention choice the placement never sees (it is checked against transformers, decoded
and gathered through the codec elsewhere, and trained under every placement in
bench/families.py). One fssdp Trainer (compiled once) serves the in-process steps and the `run`
calls."""
import contextlib
import json
import os
import shutil
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from moejax.codec import replicas
from moejax.config import num_moe_layers
from moejax.placement.dispatch import Dispatch
from moejax.placement import fssdp, ownership, planner, reshard
from moejax.sharding import axes
from moejax.models import olmoe
from moejax.sharding.mesh import DEVICES, make_mesh
from moejax.train import checkpoint as ckpt
from moejax.train import optim, state as state_lib
from moejax.train.loop import Trainer, put_batch, run
from tests.helpers import tiny_config

FAMILY = "deepseek_v3"
STEPS = 6
STANDARD_ATTENTION = {"model.kv_lora_rank": 0, "model.q_lora_rank": 0, "model.qk_nope_head_dim": 0,
                      "model.qk_rope_head_dim": 0, "model.v_head_dim": 0, "model.head_dim": 16}
# run(): 8 steps, re-shards after steps 3 and 6, checkpoints at 4 and 8. The replica codec is on
# (delta patches where a device kept its expert; ep ignores it), so re-sharding, resume and
# evaluation run with it.
RUN = {"batch_size": 16, "seq_len": 32, "mesh.shape": (2, 4), "steps": 8, "log_every": 1,
       "eval_batches": 1, "checkpoint.every": 4, "fssdp.reshard_every": 3,
       "fssdp.replica_codec": "delta", **STANDARD_ATTENTION}
TIMING = ("step_time_s", "tokens_per_s")


def _batches(n):
  rng = np.random.default_rng(3)
  out = []
  for _ in range(n):
    toks = rng.integers(0, 256, (16, 33)).astype(np.int32)
    out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
  return out


def _trainer(placement):
  return Trainer(tiny_config(FAMILY, **RUN, **{"moe.placement": placement}))


def _skewed(cfg):
  """A load history whose re-shard is heterogeneous: in each layer expert 0 is hot, so the node
  that owns it takes fewer of that layer's other experts (2 nodes x 4, E = 8)."""
  hot = np.full((cfg.fssdp.window, num_moe_layers(cfg), cfg.moe.num_experts), 10.0, np.float32)
  hot[:, :, 0] = 50.0
  return hot


def _train(trainer, reshard_at=None):
  cfg = trainer.cfg
  state = trainer.init_state()
  losses, records, reshard = [], [], None
  for i, b in enumerate(_batches(STEPS)):
    if i == reshard_at:
      history = state.placement.history
      state = state.replace(placement=state.placement.replace(history=history._replace(
          loads_WxLxE=jax.device_put(_skewed(cfg), history.loads_WxLxE.sharding))))
      before = jax.device_get((state.params, state.opt_state, state.placement.owner_LxE))
      state, resharding = trainer.reshard(state)
      after = jax.device_get((state.params, state.opt_state, state.placement.owner_LxE))
      reshard = (resharding, before, after)
    state, metrics = trainer.train_step(state, put_batch(b, trainer.mesh))
    losses.append(float(metrics["loss"]))
    records.append(metrics)
  return np.array(losses), jax.device_get(records), reshard


@pytest.fixture(scope="module")
def fssdp_trainer():
  return _trainer("fssdp")


@pytest.fixture(scope="module")
def ep():
  return _train(_trainer("ep"))


@pytest.fixture(scope="module")
def fssdp_run(fssdp_trainer):
  return _train(fssdp_trainer, reshard_at=3)


def is_expert_param(path, expert_paths=axes.expert_paths(
    olmoe.param_meta(tiny_config(FAMILY, **{"moe.placement": "fssdp"})))):
  return any(axes.ends_with(path, names) for names in expert_paths)


def _expert_leaves(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)
          if is_expert_param(p)}


def fssdp_run_rate() -> float:
  return tiny_config(FAMILY).moe.score_bias_rate


def test_fssdp_matches_ep_across_a_heterogeneous_reshard(ep, fssdp_run):
  losses_ep, _, _ = ep
  losses, records, (resharding, before, after) = fssdp_run
  np.testing.assert_allclose(losses, losses_ep, rtol=3e-4)
  assert resharding.moved > 0 and resharding.moved_bytes > 0
  # Heterogeneous: some layer gives a device more than E/N = 1 experts, another fewer; every
  # device still holds S = L * E/N = 2 slots.
  count_LxN = ownership.experts_per_device(after[2], 8)
  assert count_LxN.max() > 1 and count_LxN.min() == 0
  np.testing.assert_array_equal(count_LxN.sum(axis=0), np.full(8, 2))
  np.testing.assert_array_equal(after[2], resharding.owner_LxE)
  # Replicas were materialized, and the straggler factor is reported per layer.
  assert max(float(np.max(r["replicas"])) for r in records) > 0
  assert all(np.all(r["straggler"] >= 1.0) for r in records)
  # Parameters and Adam moments moved together: each expert's rows now sit at its new owner's
  # slot, bit for bit, and nothing else changed.
  old_at = reshard.positions(before[2], 8).ravel()
  new_at = reshard.positions(after[2], 8).ravel()
  (old_params, old_opt), (new_params, new_opt) = before[:2], after[:2]
  experts_before = _expert_leaves((old_params, old_opt))
  experts_after = _expert_leaves((new_params, new_opt))
  assert len(experts_before) == 9                             # w_gate/up/down, mu, nu
  for key, x in experts_before.items():
    y = experts_after[key]
    flat_x, flat_y = x.reshape((16,) + x.shape[2:]), y.reshape((16,) + y.shape[2:])
    np.testing.assert_array_equal(flat_y[new_at], flat_x[old_at], err_msg=key)
    assert not np.array_equal(flat_y, flat_x), key
  others = lambda t: [x for p, x in jax.tree_util.tree_leaves_with_path(t)   # noqa: E731
                      if not is_expert_param(p)]
  for x, y in zip(others((old_params, old_opt)), others((new_params, new_opt))):
    np.testing.assert_array_equal(x, y)
  # The score bias moved by the load only (no gradient, no decay): +-rate or 0 per step, 3 steps.
  rate = fssdp_run_rate()
  moves = old_params["layers"]["moe"]["score_bias"] / rate
  assert np.any(moves != 0) and np.max(np.abs(moves)) <= 3
  np.testing.assert_allclose(moves, np.round(moves), atol=1e-3)


def test_sparse_all_gather_then_reduce_scatter_counts_replicas():
  """Heterogeneous owners: SpAG reads each replica from its owner's stored slot, SpRS sums the
  gradient of every replica back into that slot, exactly."""
  mesh = make_mesh((2, 4), jax.devices()[:8])
  n, m, num_layers, num_experts = 8, 2, 2, 16
  dispatch = Dispatch("fssdp", DEVICES, n, 4, replica_slots=m, overlap_degree=4)
  load_LxE = np.full((num_layers, num_experts), 10.0)
  load_LxE[:, 0] = 50.0
  owner_LxE = ownership.heterogeneous_placement(load_LxE, n, 4, max_per_layer=4)
  assert ownership.experts_per_device(owner_LxE, n).max() > num_experts // n
  plan = planner.materialize_plan(jnp.asarray(load_LxE[0], jnp.float32), owner_LxE[0],
                                     num_devices=n, devices_per_node=4, replica_slots=m,
                                     overlap_degree=4)

  def body(w_LxElxR):
    def total(w):
      owners, windows = fssdp.owned_windows(jnp.asarray(owner_LxE), w, jax.lax.axis_index(DEVICES),
                                            num_devices=n, max_per_layer=4)
      layer0 = fssdp.Owners(owners.owner_E[0], owners.rank_E[0])
      return jnp.sum(fssdp.sparse_all_gather(windows[0], plan.replica_expert_NxM,
                                             dispatch=dispatch, owners=layer0))
    return jax.grad(total)(w_LxElxR)

  ones = jnp.ones((num_layers, num_experts, 3), jnp.float32)
  grads = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, DEVICES),
                                out_specs=P(None, DEVICES), check_vma=False))(ones)
  replicas_E = np.bincount(np.asarray(plan.replica_expert_NxM).ravel(), minlength=17)[:16]
  expected = np.zeros(num_layers * num_experts)
  expected[reshard.positions(owner_LxE, n)[0]] = replicas_E
  np.testing.assert_array_equal(np.asarray(grads).reshape(-1, 3)[:, 0], expected)
  assert int(plan.num_replicas) == replicas_E.sum() > 0


def test_reshard_plan_moves_whole_experts_between_equal_slot_counts():
  rng = np.random.default_rng(0)
  owner = ownership.initial_placement(3, 16, 8)
  for _ in range(3):
    r = reshard.plan_reshard(rng.gamma(0.5, size=(3, 16)), owner, 8, 4, max_per_layer=4,
                                   bytes_per_expert=10)
    assert sorted(r.perm_LxE.ravel().tolist()) == list(range(48))
    assert r.moved == np.sum(r.owner_LxE != owner) and r.moved_bytes == 10 * r.moved
    np.testing.assert_array_equal(ownership.experts_per_device(r.owner_LxE, 8).sum(0),
                                  np.full(8, 6))
    # The expert at each new position is the one the old storage held for it.
    np.testing.assert_array_equal(r.perm_LxE.ravel()[reshard.positions(r.owner_LxE, 8)],
                                  reshard.positions(owner, 8))
    # Storage position (l, j) belongs to device j // El: the owner table's device.
    assert np.all(reshard.positions(r.owner_LxE, 8) % 16 // 2 == r.owner_LxE)
    owner = r.owner_LxE


def test_pools_reshard_and_store_each_layer_group_within_its_own_slots():
  """Two pools (rows 0, 2, 4 and 1, 3 of five MoE layers: a hybrid model's linear and softmax
  MoE groups, each stacked [L_g, E, ...]): every device keeps 2 slots per layer of each pool,
  each pool's permutation stays within its own arrays, and an expert stored under the new owners
  sits at its position, on its owner's part of the expert axis, and goes back to canonical
  order."""
  pools = ((0, 2, 4), (1, 3))
  group_pools = (("linear_layers", pools[0]), ("layers", pools[1]))
  paths = (("linear_layers", "moe", "w"), ("layers", "moe", "w"))
  r = reshard.plan_reshard(np.random.default_rng(1).gamma(0.5, size=(5, 16)),
                           ownership.initial_placement(5, 16, 8), 8, 4, max_per_layer=4,
                           bytes_per_expert=10, pools=pools)
  assert r.moved > 0 and r.moved_bytes == 10 * r.moved
  ids = {group: np.arange(len(rows) * 16).reshape(len(rows), 16) for group, rows in group_pools}
  canonical = {group: {"moe": {"w": x}} for group, x in ids.items()}
  stored = reshard.permute_experts(canonical, reshard.from_canonical(r.owner_LxE, 8, pools),
                                   expert_paths=paths, group_pools=group_pools)
  pos_LxE = reshard.positions(r.owner_LxE, 8, pools)
  for group, rows in group_pools:
    owner = r.owner_LxE[list(rows)]
    np.testing.assert_array_equal(ownership.experts_per_device(owner, 8).sum(0),
                                  np.full(8, 2 * len(rows)))
    assert sorted(r.perm_LxE[list(rows)].ravel()) == list(range(16 * len(rows)))
    np.testing.assert_array_equal(stored[group]["moe"]["w"].ravel()[pos_LxE[list(rows)]],
                                  ids[group])
    assert np.all(pos_LxE[list(rows)] % 16 // 2 == owner)
  back = reshard.permute_experts(stored, reshard.to_canonical(r.owner_LxE, 8, pools),
                                 expert_paths=paths, group_pools=group_pools)
  for group in ids:
    np.testing.assert_array_equal(back[group]["moe"]["w"], ids[group])


# ------------------------------------------------------------------------------------------------
# Resume: the load history (the predictor's window, hence every plan and re-shard) is saved.

def _records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


@contextlib.contextmanager
def _heterogeneous_first_reshard(trainer):
  """The re-shard after step 3 plans from `_skewed` loads (the tiny model's own are too even to
  give a layer unequal counts); the run's own history is kept and later re-shards use it."""
  reshard = trainer.reshard

  def skewed_reshard(state):
    if int(state.step) != 3:
      return reshard(state)
    history = state.placement.history
    state, resharding = reshard(state.replace(placement=state.placement.replace(
        history=history._replace(loads_WxLxE=jax.device_put(
            _skewed(trainer.cfg), history.loads_WxLxE.sharding)))))
    return state.replace(placement=state.placement.replace(history=history)), resharding

  trainer.reshard = skewed_reshard
  try:
    yield
  finally:
    del trainer.reshard


@pytest.fixture(scope="module")
def uninterrupted(fssdp_trainer, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("fssdp") / "w"
  with _heterogeneous_first_reshard(fssdp_trainer):
    run(fssdp_trainer.cfg, str(workdir), trainer=fssdp_trainer)
  return workdir


def test_resume_across_a_heterogeneous_reshard_is_bit_exact(fssdp_trainer, uninterrupted,
                                                            tmp_path, capsys):
  workdir = tmp_path / "w"
  with _heterogeneous_first_reshard(fssdp_trainer):
    run(fssdp_trainer.cfg, str(workdir), trainer=fssdp_trainer, stop_at=4)   # re-sharded at 3
    capsys.readouterr()
    run(fssdp_trainer.cfg, str(workdir), trainer=fssdp_trainer)              # re-shards at 6
  out = capsys.readouterr().out
  assert "moejax: resuming from step 4" in out and "load history" not in out
  records, reference = _records(workdir), _records(uninterrupted)
  assert [r["step"] for r in records] == list(range(1, 9))
  moved = {r["step"]: r["reshard_moved_experts"] for r in reference if "reshard_moved_experts" in r}
  assert sorted(moved) == [3, 6] and all(m > 0 for m in moved.values())   # on the steps that moved
  # Losses, plans, moves: every figure, but the replicas' bytes of the first step after the
  # restore: the replica codec's caches are rebuilt, not saved, so that step sends them plain.
  first = 5
  strip = lambda rs: [{k: v for k, v in r.items() if k != "spag_bytes"} for r in rs]  # noqa: E731
  assert strip(records) == strip(reference)
  assert any(sum(r["spag_bytes"]) < sum(r["spag_bytes_plain"]) for r in reference)  # patches
  for r, ref in zip(records, reference):
    if r["step"] == first:
      assert sum(r["spag_bytes"]) >= sum(r["spag_bytes_plain"]) >= sum(ref["spag_bytes"])
    else:
      assert r["spag_bytes"] == ref["spag_bytes"]
  # The checkpoint resumed from held a heterogeneous layout: unequal counts per layer, equal
  # slot counts per device.
  owner = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / "4" / "fssdp")[
      "expert_owner"]
  count_LxN = ownership.experts_per_device(np.asarray(owner), 8)
  assert count_LxN.max() > 1 and count_LxN.min() == 0
  np.testing.assert_array_equal(count_LxN.sum(axis=0), np.full(8, 2))
  for a, b in zip(jax.tree.leaves(ckpt.load_params(str(workdir))),
                  jax.tree.leaves(ckpt.load_params(str(uninterrupted)))):
    np.testing.assert_array_equal(a, b)


def test_checkpoints_hold_experts_in_canonical_order(fssdp_trainer, uninterrupted):
  """What `load_params` (and so ep, fsdp, to-hf) reads at [l, e] is expert e of layer l. Checked
  against the run's start, not against moejax's own permutations: four small AdamW steps leave
  each expert far closer to its own initial weights than to any other expert's, so an expert
  saved in another's place (the step-4 checkpoint's owners are heterogeneous) shows."""
  init = _expert_leaves(jax.device_get(fssdp_trainer.init_state().params))
  saved = _expert_leaves(ckpt.load_params(str(uninterrupted), step=4))
  assert init.keys() == saved.keys() and init
  for name, w0 in init.items():
    w = np.asarray(saved[name], np.float32).reshape(*w0.shape[:2], -1)   # [L, E, ...]
    w0 = np.asarray(w0, np.float32).reshape(w.shape)
    dist_LxExE = np.linalg.norm(w[:, :, None] - w0[:, None, :], axis=-1)  # saved e to initial e'
    own = np.diagonal(dist_LxExE, axis1=1, axis2=2)
    others = np.where(np.eye(w.shape[1], dtype=bool), np.inf, dist_LxExE).min(axis=2)
    assert np.all(own < 0.5 * others), (name, own, others)


def _restore(trainer, workdir):
  """(state, step) of the latest checkpoint in `workdir`, restored for `trainer`."""
  checkpoints = ckpt.Checkpointer(str(workdir), trainer.cfg, trainer.layout.checkpoint_items)
  try:
    return checkpoints.restore(trainer.layout, trainer.tx)
  finally:
    checkpoints.close()


def test_checkpoint_without_load_history_restores_with_a_log_line(fssdp_trainer, uninterrupted,
                                                                   tmp_path, capsys):
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  shutil.rmtree(workdir / "checkpoints" / "8" / "fssdp")     # as an older version wrote it
  state, step = _restore(fssdp_trainer, workdir)
  assert step == 8 and int(state.placement.history.count) == 0
  assert (f"moejax: checkpoint {workdir}/checkpoints/8 (step 8) holds no fssdp load history"
          in capsys.readouterr().out)


def test_checkpoint_without_replica_plan_restores_with_a_log_line(fssdp_trainer, uninterrupted,
                                                                  tmp_path, capsys):
  """A checkpoint from before the replica plan was saved: restored, the next step plans without
  last step's replicas, and says so."""
  workdir = tmp_path / "w"
  shutil.copytree(uninterrupted, workdir)
  step_dir = workdir / "checkpoints" / "8"
  saved = ocp.StandardCheckpointer().restore(step_dir / "fssdp")
  slots = fssdp_trainer.cfg.fssdp.replica_slots
  assert np.asarray(saved.pop("replica_plan")).shape == (2, 8, slots)   # [L, N, M]
  shutil.rmtree(step_dir / "fssdp")
  with ocp.StandardCheckpointer() as writer:                  # as an older version wrote it
    writer.save(step_dir / "fssdp", saved)
  meta_file = next((step_dir / "meta").glob("*"))
  meta = json.loads(meta_file.read_text())
  meta["checksums"]["fssdp"] = {k: v for k, v in meta["checksums"]["fssdp"].items()
                                if "replica_plan" not in k}
  meta_file.write_text(json.dumps(meta))
  state, step = _restore(fssdp_trainer, workdir)
  assert step == 8 and int(state.placement.history.count) == 8
  assert np.all(np.asarray(state.placement.replicas["held"]) == -1)
  assert (f"moejax: checkpoint {workdir}/checkpoints/8 (step 8) holds no replica plan"
          in capsys.readouterr().out)


@pytest.fixture(scope="module")
def step4(uninterrupted, tmp_path_factory):
  """The run's workdir up to its step-4 checkpoint, whose owners are heterogeneous (unequal
  counts per layer: `test_resume_across_a_heterogeneous_reshard_is_bit_exact`)."""
  workdir = tmp_path_factory.mktemp("fssdp_step4") / "w"
  shutil.copytree(uninterrupted, workdir)
  shutil.rmtree(workdir / "checkpoints" / "8")
  return workdir


@pytest.fixture(scope="module")
def restored_elsewhere(step4):
  """The step-4 checkpoint restored, as a resume with another `mesh.shape` or `moe.placement`
  does, on 4 devices under fssdp and on 8 under ep: {placement: (layout, state, step, log
  lines)}. No step runs (that would compile two more train steps)."""
  out = {}
  for placement, devices in (("fssdp", 4), ("ep", 8)):
    cfg = tiny_config(FAMILY, **{**RUN, "moe.placement": placement, "mesh.shape": (1, devices)})
    mesh = make_mesh(cfg.mesh.shape, jax.devices()[:devices])
    tx = optim.make_optimizer(cfg)
    layout = state_lib.state_layout(cfg, mesh, tx)
    lines = []
    checkpoints = ckpt.Checkpointer(str(step4), cfg, layout.checkpoint_items)
    try:
      with unittest.mock.patch.object(ckpt, "log", lines.append):
        state, step = checkpoints.restore(layout, tx)
    finally:
      checkpoints.close()
    out[placement] = (layout, state, step, lines)
  return out


@pytest.mark.parametrize("placement", ["fssdp", "ep"])
def test_a_heterogeneous_checkpoint_restores_onto_another_device_count_and_placement(
    step4, restored_elsewhere, placement):
  """Every expert lands at its canonical place with its optimizer moments: the parameters equal
  what `load_params` reads, the moments equal across the two restores (ep permutes nothing), and
  fssdp on 4 devices starts from the even owners with one line saying why."""
  layout, state, step, lines = restored_elsewhere[placement]
  assert step == 4
  for want, got, sharding in zip(jax.tree.leaves(ckpt.load_params(str(step4))),
                                 jax.tree.leaves(state.params),
                                 jax.tree.leaves(layout.shardings.params)):
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), want)
  for a, b in zip(jax.tree.leaves(restored_elsewhere["fssdp"][1].opt_state),
                  jax.tree.leaves(restored_elsewhere["ep"][1].opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if placement == "ep":
    assert state.placement is None and not lines
    return
  where = f"moejax: checkpoint {step4}/checkpoints/4 (step 4)"
  assert lines == [
      f"{where} holds no replica plan for 4 devices x 2 slots (an older version or another mesh "
      "wrote it): the next step plans its replicas without last step's, so this resume is not "
      "bit-exact",
      f"{where}: its expert owners are for another number of devices; experts start from the "
      "even placement on 4 devices"]
  even = layout.placement.init_state()
  np.testing.assert_array_equal(np.asarray(state.placement.owner_LxE), np.asarray(even.owner_LxE))
  assert int(state.placement.history.count) == 4   # the load history is per expert: kept


def test_report_plots_the_straggler_per_layer(uninterrupted):
  """The run report's straggler plot (placement ep/fssdp only) is each layer's straggler factor
  as logged (tests/report/test_report.py checks the other plots on a codec run)."""
  from moejax.report import series
  records = _records(uninterrupted)
  panel = {p.name: p for p in series.panels(str(uninterrupted))}["straggler"]
  assert panel.missing is None
  straggler_TxL = np.array([r["straggler"] for r in records])
  assert list(panel.lines) == [f"layer {l}" for l in range(straggler_TxL.shape[1])]
  for l, (steps, values) in enumerate(panel.lines.values()):
    np.testing.assert_array_equal(steps, [r["step"] for r in records])
    np.testing.assert_allclose(values, straggler_TxL[:, l])


@pytest.fixture(scope="module")
def compiled_fssdp_step(fssdp_trainer, fssdp_run):
  """The step `fssdp_run` ran, compiled ahead of time (its HLO and buffers)."""
  return fssdp_trainer.train_step.lower(*fssdp_trainer.abstract_inputs()).compile()


def test_no_collective_of_the_step_sits_in_a_conditional(fssdp_trainer, compiled_fssdp_step):
  """Calibration's late SparseAllGather runs unconditionally (it fetches only the replicas a
  device lacks: none when the re-plan is not adopted), in the same computation as the exchange
  and the expert matmuls it overlaps: no conditional branch of the compiled step holds a
  collective (tests/sharding/test_overlap.py has the rule)."""
  from tests.sharding import hlo
  assert fssdp_trainer.cfg.fssdp.calibrate
  text = compiled_fssdp_step.as_text()
  assert hlo.compiled_collectives(text)
  assert [b for b in hlo.conditional_branches(text) if b.collectives] == []


# ------------------------------------------------------------------------------------------------
# The replica codec in the train step.

REPLICA_STEPS = 30


def _replica_run(trainer, *, patches: bool):
  """REPLICA_STEPS in-process steps (no re-shard: that is the loop's), every replica sent plain
  (its replica state invalidated before each step) unless `patches`."""
  state = trainer.init_state()
  losses, sent, plain, late = [], [], [], []
  for b in _batches(REPLICA_STEPS):
    if not patches:
      state = state.replace(placement=state.placement.replace(
          replicas=replicas.invalidate(state.placement.replicas)))
    state, m = trainer.train_step(state, put_batch(b, trainer.mesh))
    losses.append(float(m["loss"]))
    sent.append(float(np.sum(m["spag_bytes"])))
    plain.append(float(np.sum(m["spag_bytes_plain"])))
    # Calibration's late SparseAllGather moved replicas (an adopted re-plan added some) when
    # the replicas' bytes exceed the planned ones' over the two passes.
    late.append(bool(np.any(np.asarray(m["spag_bytes_plain"])
                            > 2 * np.asarray(m["spag_bytes_needed"]) + 1)))
  return losses, sent, plain, late, jax.device_get(state.params)


def test_replica_codec_is_lossless_and_pays_once_devices_keep_their_experts(fssdp_trainer):
  """30 steps with delta patches equal, bit for bit (losses and final parameters), the same 30
  with every replica sent plain; no step sends more than plain plus the agreement; over the last
  10 steps the replicas cost under 0.8 of their plain bytes (0.67 here). DeepSeek's routing has
  no aux loss, so hot experts (and replicas) appear in the tiny model within 30 steps. The plain
  SparseAllGather itself equals the coded one bit for bit in tests/placement/test_fssdp.py."""
  losses_off, sent_off, plain_off, _, params_off = _replica_run(fssdp_trainer, patches=False)
  losses, sent, plain, late, params = _replica_run(fssdp_trainer, patches=True)
  assert sum(late) >= 5          # the coded late gather moved new replicas too
  assert losses == losses_off
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a).view(np.uint8),
                                                  np.asarray(b).view(np.uint8)),
                      params_off, params)
  assert all(jax.tree.leaves(same))
  placement = fssdp_trainer.layout.placement
  n, codec = placement.num_devices, placement.replica_codec
  # The agreement: each device receives the 7 others' choices, per MoE layer and pass (remat
  # reruns it).
  agreement = 2 * num_moe_layers(fssdp_trainer.cfg) * (n - 1) * codec.agree_bytes(
      placement.max_per_layer)
  assert plain == plain_off
  assert all(s == p + agreement for s, p in zip(sent_off, plain))
  assert all(s <= p + agreement for s, p in zip(sent, plain))
  assert sum(plain[-10:]) > 0
  assert sum(sent[-10:]) < 0.8 * sum(plain[-10:])
