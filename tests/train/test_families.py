"""Every family trains sharded as on one device: each family's tiny preset on 8 fake devices,
one placement per family, against the same config on one device, in float32 compute
(`compute_dtype`), so the comparison is tight (in bf16 the two programs round in different
places). OLMoE's fsdp is tests/train/test_step.py's (bf16); Mixtral's tiny preset holds nothing
the others here do not (grouped-query attention, renormalized top-k), and is no longer trained
again (bench/families.py trains it under every placement, as it does Llama 4's, whose options
sharded are chunks and temperatures without parameters and weights on the experts' inputs, run
under ep against one device in tests/layers/test_moe.py);
DeepSeek (latent attention, a dense first layer, grouped sigmoid routing with a score bias) trains
under fssdp against ep across a re-shard, resumed bit for bit, in
tests/placement/test_fssdp_train.py; its score bias is checked there. Qwen3-MoE's one option of
its own (QK-norm per head: two norm scales per layer) is checked against transformers in
tests/convert/test_hf_parity.py and not trained sharded again; nor is GLM-4.5's (its q/k/v biases
are Qwen2-MoE's below, its dense first layer, shared expert and grouped sigmoid routing with a
score bias DeepSeek's; its 8-device first-step losses under fsdp, ep and fssdp are
`bench/families.py`'s, within 2e-5 of one device's in bf16). Granite-4.0-H (three Mamba-2
layers, their projections, biased convolution taps, fp32-gathered decay and skip parameters and
per-group norm scale sharded as their own stacked group beside the softmax layer's; Granite's
multipliers and shared MLP) under fssdp, its two MoE groups two pools of expert slots, across a
re-shard (its own test below, its layers as a repeating pattern of two groups, one scan over
the period; its preset's order, the linear group in two scans around the softmax layer, was
trained so here through `5cd1a1f` and is in `bench/families.py` under every placement). Qwen3-Next (Gated DeltaNet layers in the same
groups, with the same
kinds of parameters as Mamba-2's; the attention's output gate, its weight gathered inside the q
projection's, as MiniCPM5-MoE's; zero-centered norms; a gated shared expert) trained under fsdp
equal to one device here, and under fssdp across a heterogeneous re-shard in 31 s, until
Granite-4.0-H's check covered its groups and pools; `bench/families.py` trains both, and
EXAONE-MoE, under every placement.
DeepSeek-V3.2 (each of the 64
tokens attending to its 32 best earlier keys by the indexer, which its own KL loss trains)
trained under fsdp equal to one device here through `1c4cdba` (its one-device step, below, stays;
`bench/families.py` trains it under every placement). (gpt-oss's experts, biased and with the
clamped SwiGLU, go through the ep exchange as on one device in tests/placement/test_dispatch.py,
their replicas through the coded and plain SparseAllGather in tests/placement/test_fssdp.py;
its train step under fsdp and fssdp and Cohere2-MoE's parallel blocks under fsdp were measured
equal to one device's within 5e-7 once, not in CI: `bench/families.py` trains both under every
placement.) (AfMoE's own gate weight is a plain
matrix on wq's axes, its sandwich norms plain norm scales: nothing a placement treats apart.
FlexOlmo's norms on the sublayers' outputs (plain norm scales) under ep and Granite SWA's
attention sinks (per head, replicated, gathered in fp32, as the linear layers' decay parameters
are) under fsdp trained equal to one device here until Qwen3-Next's check covered theirs.)

The other techniques run on the families where their own tests run them: the codec gathers
Qwen2-MoE's biases and shared expert bit-exactly (tests/sharding/test_gatherer.py); admission acts
on Qwen2-MoE's routed experts in the sharded step (tests/routing/test_sharded_admission.py; its
capacity is per device, so a binding capacity admits other tokens on 8 devices than on one by
design).
"""
import jax
import numpy as np
import optax
import pytest

from tests.helpers import run_steps, tiny_config

FAMILY_PLACEMENTS = {"qwen2_moe": "ep"}
# (clip_norm above any first gradient norm here: run_steps reads the gradients unclipped; sandwich
# norms, as AfMoE's, put unit-RMS sublayer outputs on the residual stream: first norms above 1)
SETTINGS = {"steps": 2, "compute_dtype": "float32", "optim.clip_norm": 100.0}
TOLERANCE = 1e-5   # max |difference| per leaf, relative to its max |gradient| (measured ~5e-7)


def family_config(family: str):
  return tiny_config(family, **{"moe.placement": FAMILY_PLACEMENTS.get(family, "fsdp")},
                     **SETTINGS)


@pytest.mark.parametrize("family", sorted(FAMILY_PLACEMENTS))
def test_sharded_equals_single_device(family, trainer_for):
  cfg = family_config(family)
  single = run_steps(trainer_for(cfg, 1))
  sharded = run_steps(trainer_for(cfg, 8))
  _compare_grads(single["grads"], sharded["grads"])
  np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-6)
  if cfg.moe.placement == "ep":     # dropless by default: every assignment reaches its expert
    assert all(float(m["ep_dropped_frac"]) == 0.0 for m in sharded["all_metrics"])
    assert all(np.all(m["dropped_frac"] == 0.0) for m in sharded["all_metrics"])


def _compare_grads(single, sharded):
  for path, g1, g8 in zip(jax.tree_util.tree_leaves_with_path(single),
                          jax.tree.leaves(single), jax.tree.leaves(sharded)):
    scale = np.max(np.abs(g1)) + 1e-12
    assert np.max(np.abs(g1 - g8)) / scale < TOLERANCE, jax.tree_util.keystr(path[0])


def test_hybrid_fssdp_reshards_each_layer_group_within_its_own_slots(trainer_for):
  """Granite-4.0-H's MoE layers stack as two groups (Mamba-2 layers, softmax layers), so fssdp
  stores them as two pools (`moejax.placement.reshard`, Pools). Here in a repeating pattern,
  [Mamba-2, softmax] twice: one scan over its period of two (`olmoe.layer_scans`; each layer
  reads its group's stacked shards by row and its own per-MoE-layer owners at period x 2 + its
  place, across both groups), prefetched across the layers. On 2 nodes x 4 its first
  step's gradients equal one device's (Mamba-2's parameters: projections, biased taps,
  fp32-gathered decay and skip, the per-group norm scale); then a re-shard from skewed loads
  (MoE layer l's expert l hot) gives each layer its own owners and makes the linear pool
  heterogeneous while each pool keeps its own slot count per device, and the second step
  (owned windows and ranks per pool) still equals one device's, as do the experts the
  checkpoint item puts back in canonical order. (As one scan per run of equal layers, the
  preset's order took 50 s of this test, Mamba-2 layers 0-2 then the softmax layer 36 s.)"""
  from moejax.models import olmoe
  from moejax.placement import ownership
  from moejax.train.loop import put_batch
  from tests.helpers import random_batches
  order = {"model.linear_layers": (0, 2), "model.nope_layers": (1, 3)}
  cfg = tiny_config("granitemoehybrid", **{"moe.placement": "fssdp", "mesh.shape": (2, 4),
                                         "fssdp.calibrate": False}, **order, **SETTINGS)
  assert [(len(s.period), s.repeats) for s in olmoe.layer_scans(cfg)] == [(2, 2)]
  # one device's reference under fsdp: the same math, and the cheaper program to compile
  single = run_steps(trainer_for(tiny_config("granitemoehybrid", **order, **SETTINGS), 1))
  trainer = trainer_for(cfg)
  state = trainer.init_state()
  first, second = [put_batch(b, trainer.mesh) for b in random_batches(cfg, 2)]
  state, metrics = trainer.train_step(state, first)
  losses = [float(metrics["loss"])]
  # the even start stores experts in canonical order: the first gradients compare as they lie
  mu = jax.device_get(optax.tree_utils.tree_get(state.opt_state, "mu"))
  _compare_grads(single["grads"], jax.tree.map(lambda m: m / (1 - cfg.optim.b1), mu))
  history = state.placement.history
  hot = np.full(history.loads_WxLxE.shape, 10.0, np.float32)
  for layer in range(hot.shape[1]):
    hot[:, layer, layer] = 50.0
  state, resharding = trainer.reshard(state.replace(placement=state.placement.replace(
      history=history._replace(loads_WxLxE=jax.device_put(hot, history.loads_WxLxE.sharding)))))
  state, metrics = trainer.train_step(state, second)
  losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, single["losses"], rtol=1e-6)
  np.testing.assert_array_equal(metrics["expert_load_LxE"],      # model order, both groups
                                single["metrics"]["expert_load_LxE"])
  owner = resharding.owner_LxE
  assert resharding.moved > 0
  np.testing.assert_array_equal(np.asarray(state.placement.owner_LxE), owner)
  pools = olmoe.moe_rows(cfg)
  assert sorted(pools) == ["layers", "linear_layers"]
  for group, rows in pools.items():
    count_LxN = ownership.experts_per_device(owner[list(rows)], 8)
    np.testing.assert_array_equal(count_LxN.sum(axis=0), np.full(8, len(rows)), err_msg=group)
  assert len({tuple(row) for row in owner}) == len(owner)     # each layer its own owners
  count_LxN = ownership.experts_per_device(owner[list(pools["linear_layers"])], 8)
  assert count_LxN.max() > 1 and count_LxN.min() == 0      # heterogeneous within the pool
  _, stored = trainer.layout.checkpoint_items[0].item(state)
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(single["params"]),
                        jax.tree.leaves(single["params"]),
                        jax.tree.leaves(jax.device_get(stored.params))):
    scale = np.max(np.abs(a)) + 1e-12
    assert np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))) / scale < 1e-5, (
        jax.tree_util.keystr(path))


def test_deepseek_v32_trains_its_indexer_by_its_own_loss(trainer_for):
  """DeepSeek-V3.2's train step: the indexer's loss (every layer's, logged as index_loss) moves
  the indexer, the language-model loss the rest (that neither reaches the other's parameters:
  tests/layers/test_attention.py, where the selection is checked against numpy's; that
  model.train_indexer=False leaves the indexer as it is: tests/train/test_optim.py)."""
  cfg = family_config("deepseek_v32")
  before = jax.device_get(trainer_for(cfg, 1).init_state().params)
  trained = run_steps(trainer_for(cfg, 1))
  assert all(float(m["index_loss"]) > 0 for m in trained["all_metrics"])
  for group in ("dense_layers", "layers"):
    for name in ("index_wq", "index_wk", "index_k_norm", "index_k_bias", "index_weights",
                 "wkv_b"):
      assert not np.array_equal(trained["params"][group]["attn"][name],
                                before[group]["attn"][name]), name

