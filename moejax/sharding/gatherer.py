"""The gather hook bound to one model's parameters: layouts, codec choice and codec state.

`Gatherer.gather(group, shards, states) -> (full, new_states, stats)` is what the model's
forward pass calls for each parameter group ("embed", "layers" (one layer's slice), "final_norm",
"lm_head"). It looks up each parameter's layout and, when the codec is on, its `CodecSpec` and
state, and calls the hook (`moejax.sharding.hook.gather_param`).

Codec state lives in the train state as a dict {group: {param_path: state}} holding only the
compressed parameters. Each device has its own state, so every state array is stored with a
leading device axis [N, ...] sharded over all devices; layer parameters' states also carry the
layer axis, [N, L, ...], which the layer scan slices. Caches are rebuilt, not checkpointed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.codec import gather as codec
from moejax.sharding import hook
from moejax.sharding.layout import Layout
from moejax.sharding.mesh import DEVICES

GROUPS = ("embed", "layers", "final_norm", "lm_head")


def param_group(group: str, path: str) -> str:
  """Reporting group of a parameter: attention, router, norms, experts, embeddings."""
  if group in ("embed", "lm_head"):
    return "embeddings"
  if "norm" in path or group == "final_norm":
    return "norms"
  if "router" in path:
    return "router"
  if any(name in path for name in ("w_gate", "w_up", "w_down")):
    return "experts"
  return "attention"


def _leaf_paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


@dataclasses.dataclass(frozen=True)
class Gatherer:
  layouts: Any                 # {group: Layout tree} like params
  param_shapes: Any            # {group: ShapeDtypeStruct tree}
  num_devices: int
  specs: dict                  # {group: {path: CodecSpec}} for compressed parameters only

  @classmethod
  def create(cls, param_shapes, layouts, num_devices: int, spec: codec.CodecSpec | None,
             select=None):
    """Compresses every sharded parameter (or those `select(group, path)` accepts)."""
    specs = {}
    for group in GROUPS:
      shapes, lays = param_shapes[group], layouts[group]
      chosen = {}
      for path, lay in zip(_leaf_paths(shapes), jax.tree.leaves(lays)):
        if (spec is not None and spec.mode != "off" and lay.kind == "shard"
            and num_devices > 1 and (select is None or select(group, path))):
          chosen[path] = spec
      specs[group] = chosen
    return cls(layouts, param_shapes, num_devices, specs)

  @property
  def enabled(self) -> bool:
    return any(self.specs.values())

  def _shard_shape(self, group: str, path: str):
    shapes = dict(zip(_leaf_paths(self.param_shapes[group]),
                      jax.tree.leaves(self.param_shapes[group])))
    lays = dict(zip(_leaf_paths(self.layouts[group]), jax.tree.leaves(self.layouts[group])))
    shape, lay = list(shapes[path].shape), lays[path]
    shape[lay.dim] //= self.num_devices
    return tuple(shape[1:]) if group == "layers" else tuple(shape)

  # -- state ---------------------------------------------------------------------------------
  def init_states(self, mesh, *, warmed_up: bool = False):
    """Fresh codec state (global arrays, one slice per device). `warmed_up` skips the warm-up
    count (after a restore): the first gather still sends everything to refill the caches."""
    def one(group, path, spec):
      state = codec.init_state(self._shard_shape(group, path), hook.COMPUTE_DTYPE,
                               self.num_devices, spec)
      if warmed_up:
        state = dict(state, step=jnp.full_like(state["step"], spec.warmup_steps))
      layers = self.param_shapes["layers"]
      num_layers = jax.tree.leaves(layers)[0].shape[0]
      lead = (self.num_devices, num_layers) if group == "layers" else (self.num_devices,)
      return jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), state)

    def build():
      return {g: {p: one(g, p, s) for p, s in self.specs[g].items()} for g in GROUPS}

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.state_specs(),
                             is_leaf=lambda v: isinstance(v, P))
    return jax.jit(build, out_shardings=shardings)()

  def state_specs(self):
    abstract = jax.eval_shape(lambda: {
        g: {p: codec.init_state(self._shard_shape(g, p), hook.COMPUTE_DTYPE, self.num_devices, s)
            for p, s in self.specs[g].items()} for g in GROUPS})
    return jax.tree.map(lambda _: P(DEVICES), abstract)

  def state_bytes_per_device(self) -> int:
    total = 0
    for g in GROUPS:
      n_layers = jax.tree.leaves(self.param_shapes["layers"])[0].shape[0] if g == "layers" else 1
      for p, s in self.specs[g].items():
        total += n_layers * codec.state_bytes(self._shard_shape(g, p), hook.COMPUTE_DTYPE,
                                              self.num_devices, s)
    return total

  # -- the hook --------------------------------------------------------------------------------
  def gather(self, group: str, shards, states: dict | None):
    """-> (full bf16 tree, new states {path: state}, {report group: stats})."""
    lays = self.layouts[group]
    if group == "layers":
      lays = jax.tree.map(Layout.unstacked, lays)
    paths = _leaf_paths(shards)
    leaves, treedef = jax.tree.flatten(shards)
    fulls, new_states, stats = [], {}, {}
    for path, x, lay in zip(paths, leaves, treedef.flatten_up_to(lays)):
      spec = self.specs[group].get(path)
      state = states[path] if spec is not None else None
      full, new_state, s = hook.gather_param(x, lay, state, spec)
      fulls.append(full)
      if spec is not None:
        new_states[path] = new_state
      key = param_group(group, path)
      stats[key] = s if key not in stats else {k: stats[key][k] + s[k] for k in s}
    return treedef.unflatten(fulls), new_states, stats


def squeeze_device_axis(states):
  """Inside shard_map each device sees its [1, ...] slice of the state: drop that axis."""
  return jax.tree.map(lambda x: x[0], states)


def expand_device_axis(states):
  return jax.tree.map(lambda x: x[None], states)


