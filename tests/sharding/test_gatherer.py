"""The Gatherer maps parameter trees to the one gather (`hook.gather_leaf`) and sums its figures:
a small declared model on 8 fake devices, plain and compressed leaves side by side."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.codec import gather as codec
from moejax.sharding import axes as ax
from moejax.sharding import hook
from moejax.sharding import layout as layout_lib
from moejax.sharding.axes import ParamMeta
from moejax.sharding.gatherer import PARAM_STATS, Gatherer, expand_device_axis, \
    squeeze_device_axis
from moejax.sharding.mesh import DEVICES, make_mesh

N = 8
META = {
    "embed": ParamMeta((16, 8), (ax.VOCAB, ax.EMBED), ax.EMBEDDINGS),
    "layers": {"w": ParamMeta((2, 8, 16), (ax.LAYERS, ax.EMBED, ax.MLP), ax.EXPERTS),
               "scale": ParamMeta((2, 3), (ax.LAYERS, ax.NORM), ax.NORMS)},   # 3: replicated
}
SPEC = codec.CodecSpec("element", warmup_steps=0, capacity_fraction=0.5)


def _gatherer(spec=SPEC):
  layouts = layout_lib.param_layouts(META, "fsdp", N)
  return Gatherer.create(META, layouts, N, spec)


def test_candidates_groups_and_shapes():
  g = _gatherer()
  assert g.groups == ("embed", "layers")
  assert sorted(g.candidates()) == [("embed", ""), ("layers", "['w']")]
  assert g.specs == {"embed": {"": SPEC}, "layers": {"['w']": SPEC}}
  assert g.shard_shape("layers", "['w']") == (1, 16)        # one layer's slice of [2, 8/8, 16]
  assert g.shard_shape("embed", "") == (2, 8)
  assert g.copies("layers") == 2 and g.is_stacked("layers") and not g.is_stacked("embed")
  assert g.report_group("layers", "['scale']") == ax.NORMS
  single = Gatherer.create(META, layout_lib.param_layouts(META, "fsdp", 1), 1, SPEC)
  assert single.candidates() == [] and not single.enabled


def test_with_specs_checks_parameters_and_drops_off():
  g = _gatherer(None)
  assert not g.enabled
  chosen = g.with_specs({"layers": {"['w']": SPEC, }, "embed": {"": codec.CodecSpec("off")}})
  assert chosen.specs == {"embed": {}, "layers": {"['w']": SPEC}}
  with pytest.raises(ValueError, match="not a sharded parameter"):
    g.with_specs({"layers": {"['scale']": SPEC}})


def test_scatter_bytes_sum_the_hook_figure_over_leaves():
  g = _gatherer(None)
  expected = (hook.scatter_bytes((2, 8), layout_lib.Layout("shard", 0), N)
              + hook.scatter_bytes((2, 1, 16), layout_lib.Layout("shard", 1), N)
              + hook.scatter_bytes((2, 3), layout_lib.Layout("replicate"), N))
  assert g.scatter_bytes() == expected


def test_scatter_bytes_halve_for_the_bf16_leaves_under_a_bf16_reduce():
  meta = {**META, "decay": ParamMeta((16,), (ax.HEADS,), ax.DECAY)}   # gathered in float32
  layouts = layout_lib.param_layouts(meta, "fsdp", N)
  f32 = Gatherer.create(meta, layouts, N, None)
  bf16 = Gatherer.create(meta, layouts, N, None, reduce_dtype=jnp.bfloat16)
  decay = Gatherer.create({"decay": meta["decay"]}, {"decay": layouts["decay"]}, N, None)
  assert decay.scatter_bytes() > 0 and bf16.group_dtype(ax.DECAY) == jnp.float32
  assert bf16.scatter_bytes() == ((f32.scatter_bytes() - decay.scatter_bytes()) / 2
                                  + decay.scatter_bytes())


def test_init_states_reuse_keeps_same_state_caches():
  mesh = make_mesh((1, -1))
  g = _gatherer()
  states = g.init_states(mesh)
  bigger = codec.CodecSpec("element", warmup_steps=0, capacity_fraction=1.0)   # same state
  other = codec.CodecSpec("word", warmup_steps=0)                             # another state
  g2 = g.with_specs({"embed": {"": bigger}, "layers": {"['w']": other}})
  reused = g2.init_states(mesh, warmed_up=True, reuse=(g, states))
  assert reused["embed"][""] is states["embed"][""]
  assert reused["layers"]["['w']"]["cache"].dtype == jnp.uint16           # word: whole values
  assert reused["layers"]["['w']"]["cache"].shape[:2] == (N, 2)           # [N, L, ...]
  assert g.param_state_bytes("layers", "['w']") == 2 * codec.state_bytes(
      (1, 16), hook.COMPUTE_DTYPE, N, SPEC)


def test_gather_maps_leaves_to_the_hook_and_sums_by_report_group():
  mesh = make_mesh((1, -1))
  g = _gatherer()
  layouts = layout_lib.param_layouts(META, "fsdp", N)
  shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, jnp.float32), META)
  specs = layout_lib.param_specs(shapes, layouts)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda m: jnp.asarray(rng.normal(size=m.shape).astype(np.float32)), META)
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs,
                        is_leaf=lambda v: isinstance(v, jax.Array))
  states = g.init_states(mesh)

  def body(params, states):
    states = squeeze_device_axis(states)
    embed, new_embed, stats_embed = g.gather("embed", params["embed"], states["embed"])
    layer0 = jax.tree.map(lambda x: x[0], params["layers"])
    state0 = jax.tree.map(lambda x: x[0], states["layers"])
    layer, new_layer, stats_layer = g.gather("layers", layer0, state0)
    return embed, layer, expand_device_axis(new_embed), stats_embed, stats_layer

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DEVICES)),
                            out_specs=(P(), P(), P(DEVICES), P(), P()), check_vma=False))
  embed, layer, new_embed, stats_embed, stats_layer = f(params, states)
  bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16))   # noqa: E731
  np.testing.assert_array_equal(np.asarray(embed), bf16(params["embed"]))
  np.testing.assert_array_equal(np.asarray(layer["w"]), bf16(params["layers"]["w"][0]))
  np.testing.assert_array_equal(np.asarray(layer["scale"]), bf16(params["layers"]["scale"][0]))
  assert set(new_embed) == {""}                                  # only compressed leaves
  # Report groups as declared; per-parameter rows for compressed leaves only.
  assert set(stats_layer) == {ax.EXPERTS, ax.NORMS, PARAM_STATS}
  assert set(stats_layer[PARAM_STATS]) == {"['w']"}
  assert stats_layer[PARAM_STATS]["['w']"].shape == (len(hook.STAT_KEYS),)
  assert float(stats_layer[ax.NORMS]["bytes_sent"]) == 0           # replicated: no gather
  assert float(stats_embed[ax.EMBEDDINGS]["dense"]) == 1            # first gather fills caches
  assert float(stats_embed[ax.EMBEDDINGS]["bytes_plain"]) == 2 * 8 * 2


NEW_PARAMETERS = {
    "qwen2_moe": ("layers", {"['attn']['bq']", "['attn']['bk']", "['attn']['bv']",
                             "['moe']['shared_w_gate']", "['moe']['shared_w_up']",
                             "['moe']['shared_w_down']", "['moe']['shared_gate']"}),
    # latent attention and the dense MLP, in the dense layers' own group
    "deepseek_v3": ("dense_layers", {"['attn']['wq_a']", "['attn']['wq_b']", "['attn']['wkv_a']",
                                     "['attn']['wkv_b']", "['mlp']['w_gate']", "['mlp']['w_up']",
                                     "['mlp']['w_down']"}),
}


@pytest.mark.parametrize("family", sorted(NEW_PARAMETERS))
def test_a_familys_new_parameters_gather_compressed_bit_exactly(family):
  """Qwen2-MoE's tiny preset: the parameters OLMoE has not (q/k/v biases, a gated shared expert);
  DeepSeek's: latent attention and the dense layers' MLP. They go through the codec beside the
  plain others and arrive bit-exact, the first gather filling the caches, the second patching
  the values that changed. DeepSeek's score bias is never a codec candidate (float32)."""
  from moejax.models import olmoe
  from tests.helpers import tiny_config
  meta = olmoe.param_meta(tiny_config(family))
  group, new = NEW_PARAMETERS[family]
  mesh = make_mesh((1, -1))
  layouts = layout_lib.param_layouts(meta, "fsdp", N)
  spec = codec.CodecSpec("element", warmup_steps=0, capacity_fraction=0.15)
  g = Gatherer.create(meta, layouts, N, spec, select=lambda g_, path: g_ == group and path in new)
  compressed = set(g.specs[group])
  assert compressed == new
  # A shard whose patch would be no smaller than its values (a bias of 8 values) goes dense.
  sizes = {p: codec.wire_bytes(g.shard_shape(group, p), jnp.bfloat16, spec) for p in compressed}
  patch_no_smaller = {p: float(s["forward"] != s["compressed"]) for p, s in sizes.items()}
  assert all(not patch_no_smaller[p] for p in compressed
             if np.prod(g.shard_shape(group, p)) >= 512), patch_no_smaller   # weights: patches
  assert ("layers", "['moe']['score_bias']") not in g.candidates()
  shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, jnp.float32), meta[group])
  specs = layout_lib.param_specs(shapes, layouts[group])
  rng = np.random.default_rng(0)
  host = jax.tree.map(lambda m: rng.normal(size=m.shape).astype(np.float32), meta[group])
  put = lambda tree: jax.tree.map(  # noqa: E731
      lambda x, s: jax.device_put(jnp.asarray(x), NamedSharding(mesh, s)), tree, specs)

  def body(params, states):
    states = squeeze_device_axis(states)
    layer0 = jax.tree.map(lambda x: x[0], params)
    state0 = jax.tree.map(lambda x: x[0], states)
    full, new_states, stats = g.gather(group, layer0, state0)
    return full, expand_device_axis(new_states), stats[PARAM_STATS]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DEVICES)),
                            out_specs=(P(), P(DEVICES), P()), check_vma=False))
  states = g.init_states(mesh)[group]
  set_layer0 = jax.jit(lambda states, new: jax.tree.map(lambda s, n: s.at[:, 0].set(n), states,
                                                        new))
  dense = hook.STAT_KEYS.index("dense")
  new_states = None
  for step in range(2):
    if step:      # a few values change: the patches carry them
      host = jax.tree.map(lambda x: np.where(rng.random(x.shape) < 0.05, x * 1.5, x), host)
      states = set_layer0(states, new_states)
    full, new_states, rows = f(put(host), states)
    for path, x in jax.tree_util.tree_leaves_with_path(full):
      want = _leaf(host, path)[0].astype(ml_dtypes.bfloat16)     # round to nearest even
      np.testing.assert_array_equal(np.asarray(x).view(np.uint16), want.view(np.uint16),
                                    err_msg=jax.tree_util.keystr(path))
    assert {p: float(r[dense]) for p, r in rows.items()} == {
        p: 1.0 if step == 0 else patch_no_smaller[p] for p in compressed}


def _leaf(tree, path):
  for entry in path:
    tree = tree[entry.key]
  return tree
