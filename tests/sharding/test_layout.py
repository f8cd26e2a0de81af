"""Layouts from declared logical axes and the placements' rules tables; groups; the decay mask.

Abstract only (`eval_shape`): the 1b7b preset (6.9B parameters) is never materialized.
"""
import jax
import pytest
from flax import nnx

import configs.olmoe as olmoe_configs
from moejax.config import from_config_dict
from moejax.models import olmoe
from moejax.sharding import axes as ax
from moejax.sharding import layout as layout_lib
from moejax.sharding.axes import ParamMeta
from moejax.sharding.gatherer import Gatherer
from moejax.sharding.layout import Layout, layout_for
from moejax.train import optim

PLACEMENTS = ("fsdp", "ep", "fssdp")
S, X = "shard", "expert"

# (kind, dim) of the stored array under fsdp, ep, fssdp on 8 devices: the same for tiny and 1b7b.
EXPECTED = {
    "['embed']": [(S, 0), (S, 0), (S, 0)],
    "['final_norm']": [(S, 0), (S, 0), (S, 0)],
    "['layers']['attn']['k_norm']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['attn']['q_norm']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['attn']['wk']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['attn']['wo']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['attn']['wq']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['attn']['wv']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['attn_norm']['scale']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['ffn_norm']['scale']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['moe']['router']": [(S, 1), (S, 1), (S, 1)],
    "['layers']['moe']['w_down']": [(S, 3), (X, 1), (X, 1)],
    "['layers']['moe']['w_gate']": [(S, 2), (X, 1), (X, 1)],
    "['layers']['moe']['w_up']": [(S, 2), (X, 1), (X, 1)],
    "['lm_head']": [(S, 1), (S, 1), (S, 1)],
}

GROUP = {
    "['embed']": "embeddings", "['lm_head']": "embeddings", "['final_norm']": "norms",
    "['layers']['attn']['k_norm']": "norms", "['layers']['attn']['q_norm']": "norms",
    "['layers']['attn']['wk']": "attention", "['layers']['attn']['wo']": "attention",
    "['layers']['attn']['wq']": "attention", "['layers']['attn']['wv']": "attention",
    "['layers']['attn_norm']['scale']": "norms", "['layers']['ffn_norm']['scale']": "norms",
    "['layers']['moe']['router']": "router", "['layers']['moe']['w_down']": "experts",
    "['layers']['moe']['w_gate']": "experts", "['layers']['moe']['w_up']": "experts",
}


def _cfg(preset: str, placement: str = "fsdp"):
  cd = olmoe_configs.get_config(preset)
  cd.moe.placement = placement
  return from_config_dict(cd)


def _by_path(tree) -> dict:
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda v: isinstance(v, Layout))}


@pytest.mark.parametrize("preset", ["tiny", "1b7b"])
def test_every_parameter_layout_on_8_devices(preset):
  for i, placement in enumerate(PLACEMENTS):
    cfg = _cfg(preset, placement)
    layouts = _by_path(layout_lib.param_layouts(olmoe.param_meta(cfg), placement, 8))
    got = {path: (lay.kind, lay.dim) for path, lay in layouts.items()}
    assert got == {path: row[i] for path, row in EXPECTED.items()}, (preset, placement)


@pytest.mark.parametrize("preset", ["tiny", "1b7b"])
def test_declarations_match_the_initialized_parameters(preset):
  cfg = _cfg(preset)
  shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  meta = olmoe.param_meta(cfg)
  assert jax.tree.structure(shapes) == jax.tree.structure(meta)
  for x, m in zip(jax.tree.leaves(shapes), jax.tree.leaves(meta)):
    assert tuple(x.shape) == m.shape and len(m.axes) == len(m.shape)
  # Layer parameters are stacked on their own logical axis; nothing else carries it.
  for path, m in _by_path(meta).items():
    assert (m.axes[0] == ax.LAYERS) == path.startswith("['layers']"), path
    assert ax.LAYERS not in m.axes[1:], path
  # The specs the train state uses follow the layouts.
  specs = _by_path(layout_lib.param_specs(shapes, layout_lib.param_layouts(meta, "ep", 8)))
  assert specs["['layers']['moe']['w_up']"] == jax.sharding.PartitionSpec(
      None, ("node", "device"), None, None)
  assert specs["['lm_head']"] == jax.sharding.PartitionSpec(None, ("node", "device"))


# -- the rules -------------------------------------------------------------------------------------
FSDP, EP = layout_lib.RULES["fsdp"], layout_lib.RULES["ep"]


def test_an_indivisible_axis_falls_back_to_the_next_preference_then_replicates():
  assert layout_for(ParamMeta((16, 24), (ax.VOCAB, ax.EMBED), "embeddings"), FSDP, 8) == \
      Layout("shard", 0)
  assert layout_for(ParamMeta((12, 24), (ax.VOCAB, ax.EMBED), "embeddings"), FSDP, 8) == \
      Layout("shard", 1)
  assert layout_for(ParamMeta((12, 20), (ax.VOCAB, ax.EMBED), "embeddings"), FSDP, 8) == \
      Layout("replicate")
  # The preference is by name, not position or size: the same shape, other axes.
  assert layout_for(ParamMeta((16, 24), (ax.EMBED, ax.VOCAB), "embeddings"), FSDP, 8) == \
      Layout("shard", 1)
  w_down = ParamMeta((2, 8, 64, 32), (ax.LAYERS, ax.EXPERT, ax.MLP, ax.EMBED), "experts")
  assert layout_for(w_down, FSDP, 8) == Layout("shard", 3)
  assert layout_for(w_down, FSDP, 3) == Layout("replicate")
  assert layout_for(w_down, EP, 8) == Layout("expert", 1)


def test_one_device_replicates_but_owns_its_experts():
  router = ParamMeta((2, 64, 8), (ax.LAYERS, ax.EMBED, ax.EXPERT_SCORE), "router")
  w_up = ParamMeta((2, 8, 64, 32), (ax.LAYERS, ax.EXPERT, ax.EMBED, ax.MLP), "experts")
  for rules in (FSDP, EP):
    assert layout_for(router, rules, 1) == Layout("replicate")
  assert layout_for(w_up, FSDP, 1) == Layout("replicate")
  assert layout_for(w_up, EP, 1) == Layout("expert", 1)


def test_the_router_is_never_expert_parallel():
  router = ParamMeta((2, 64, 8), (ax.LAYERS, ax.EMBED, ax.EXPERT_SCORE), "router")
  assert layout_for(router, EP, 8) == Layout("shard", 1)
  assert layout_for(ParamMeta((2, 60, 8), router.axes, "router"), EP, 8) == Layout("shard", 2)


def test_the_layer_axis_is_never_sharded():
  norm = ParamMeta((8, 12), (ax.LAYERS, ax.NORM), "norms")
  for rules in layout_lib.RULES.values():
    assert layout_for(norm, rules, 8) == Layout("replicate")
    assert all(axis != ax.LAYERS for axis, _ in rules)
  with pytest.raises(ValueError, match="layer axis"):
    layout_for(norm, ((ax.LAYERS, "shard"),), 8)


def test_experts_indivisible_by_the_devices_are_an_error_under_expert_parallelism():
  w_up = ParamMeta((2, 6, 64, 32), (ax.LAYERS, ax.EXPERT, ax.EMBED, ax.MLP), "experts")
  with pytest.raises(ValueError, match="6 experts are not divisible by the 4 devices"):
    layout_for(w_up, EP, 4)
  assert layout_for(w_up, FSDP, 4) == Layout("shard", 2)


def test_declarations_are_checked():
  with pytest.raises(ValueError, match="name 1 dimensions of a 2-d"):
    ax.param(jax.numpy.zeros((2, 3)), (ax.EMBED,), ax.ATTENTION)
  with pytest.raises(ValueError, match="at most once"):
    ax.param(jax.numpy.zeros((2, 3)), (ax.EMBED, ax.EMBED), ax.ATTENTION)
  with pytest.raises(ValueError, match="group"):
    ax.param(jax.numpy.zeros((2,)), (ax.NORM,), "norm")
  meta = ax.meta_of(ax.param(jax.numpy.zeros((2, 3)), (ax.EMBED, ax.MLP), ax.EXPERTS),
                    stacked=4)
  assert meta == ParamMeta((4, 2, 3), (ax.LAYERS, ax.EMBED, ax.MLP), ax.EXPERTS)
  with pytest.raises(ValueError, match="without declared logical axes"):
    ax.meta_of(nnx.Param(jax.numpy.zeros(2)))


# -- groups ----------------------------------------------------------------------------------------
def test_groups_and_expert_parameters_are_read_from_the_declarations():
  cfg = _cfg("tiny")
  meta = olmoe.param_meta(cfg)
  assert {path: m.group for path, m in _by_path(meta).items()} == GROUP
  gatherer = Gatherer.create(meta, layout_lib.param_layouts(meta, "fsdp", 8), 8, None)
  assert gatherer.groups == tuple(meta)           # the model's gather groups, as declared
  for path, group in GROUP.items():
    top, _, rest = path[2:].partition("']")
    assert gatherer.report_group(top, rest) == group, path
  with pytest.raises(KeyError):
    gatherer.report_group("layers", "['moe']['w_new']")
  # Parameters and the optimizer's moments alike: exactly the three expert matrices.
  expert_paths = ax.expert_paths(meta)
  assert sorted(expert_paths) == [("layers", "moe", w) for w in ("w_down", "w_gate", "w_up")]
  opt_shapes = jax.eval_shape(optim.make_optimizer(cfg).init, meta_shapes(meta))
  experts = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_leaves_with_path((meta_shapes(meta), opt_shapes))
             if any(ax.ends_with(p, names) for names in expert_paths)]
  names = sorted(k.rpartition("[")[2] for k in experts)
  assert names == ["'w_down']"] * 3 + ["'w_gate']"] * 3 + ["'w_up']"] * 3
  key = jax.tree_util.DictKey
  assert ax.ends_with((key("layers"), key("moe"), key("w_gate")), ("layers", "moe", "w_gate"))
  assert not ax.ends_with((key("moe"), key("w_gate")), ("layers", "moe", "w_gate"))
  assert not ax.ends_with((key("layers"), key("moe"), key("router")), ("layers", "moe", "w_gate"))


def meta_shapes(meta):
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, jax.numpy.float32), meta)


def test_weight_decay_skips_exactly_the_norms():
  mask = _by_path(optim.decay_mask(_cfg("tiny")))
  assert {path for path, decay in mask.items() if not decay} == {
      path for path, group in GROUP.items() if group == "norms"}
  assert set(mask) == set(GROUP)
