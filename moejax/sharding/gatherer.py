"""The gather hook bound to one model's parameters: layouts, codec choice and codec state.

`Gatherer.gather(group, shards, states) -> (full, new_states, stats)` is what the model's
forward pass calls for each gather group: the top-level keys of the model's parameter
declarations (`param_meta`: "embed", "layers" (one MoE layer's slice), "dense_layers" (one
dense layer's, when the model has them), "final_norm", "lm_head" unless tied). A group whose
parameters carry the stacked `axes.LAYERS` axis is a layer group: it is gathered one layer at a
time inside the layer scan. It looks up each parameter's layout and, when the codec is on for
it, its `CodecSpec` (mode and capacity, chosen per parameter) and state, and hands the group's
leaves to the one gather (`moejax.sharding.hook.gather_leaves`, which packs the plain ones into
one collective): it only maps trees to leaves and sums figures.

Codec state lives in the train state as a dict {group: {param_path: state}} holding only the
compressed parameters. Each device has its own state, so every state array is stored with a
leading device axis [N, ...] sharded over all devices; layer parameters' states also carry the
layer axis, [N, L, ...], which the layer scan slices. Parameters of `axes.FLOAT32_GROUPS` (the
router's selection bias) are gathered plainly in float32, never compressed. Caches are rebuilt,
not checkpointed. Without states (evaluation) every parameter is gathered plainly and no cache
moves.

Stats: {report group (the `axes.GROUPS` entry each parameter declares): summed hook stats},
plus, under `PARAM_STATS`, each compressed parameter's own figures ({path: [K]}, [L, K] for
layer parameters), `hook.STAT_KEYS` in order. `split_param_stats` takes them out again and
`codec_metrics` turns them into one [R, K] array (rows: `param_rows()`) for whoever sizes or
chooses the codec (`moejax.train.codec_control`), plus the cache memory per device by mode.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.codec import gather as codec
from moejax.sharding import axes, hook
from moejax.sharding.layout import Layout
from moejax.sharding.mesh import DEVICES

PARAM_STATS = "params"        # key of the per-parameter figures in a group's stats
PARAM_METRIC = "codec_param_stats"   # metrics key of the [R, K] array


def _leaf_paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


@dataclasses.dataclass(frozen=True)
class Gatherer:
  layouts: Any                 # {group: Layout tree} like params
  param_meta: Any              # {group: tree of axes.ParamMeta}: shapes, axes, report groups
  num_devices: int
  specs: dict                  # {group: {path: CodecSpec}} for compressed parameters only
  compute_dtype: Any = hook.COMPUTE_DTYPE   # what the plain gathers deliver (config.compute_dtype)
  # {group: share of a compressed parameter's gathers per step that the backward rebuilds from
  # its cache} (`hook.run_gathers`; what the codec's selection prices)
  rebuilt_share: dict = dataclasses.field(default_factory=dict)
  transport: str = "auto"      # how the codec payload travels (`codec.gather.TRANSPORTS`)
  reduce_dtype: Any = hook.GRAD_DTYPE   # what bf16 leaves' gradients sum in (config.reduce_dtype)

  @classmethod
  def create(cls, param_meta, layouts, num_devices: int, spec: codec.CodecSpec | None,
             select=None, compute_dtype=hook.COMPUTE_DTYPE, rebuilt_share=None,
             transport: str = "auto", reduce_dtype=hook.GRAD_DTYPE):
    """Compresses every sharded parameter (or those `select(group, path)` accepts). The gather
    groups are the top-level keys of `param_meta`, as the model declares its parameters."""
    specs = {g: {} for g in param_meta}
    if spec is not None and spec.mode != "off":
      probe = cls(layouts, param_meta, num_devices, specs)
      for group, path in probe.candidates():
        if select is None or select(group, path):
          specs[group][path] = spec
    return cls(layouts, param_meta, num_devices, specs, compute_dtype, dict(rebuilt_share or {}),
               transport, reduce_dtype)

  @property
  def groups(self) -> tuple[str, ...]:
    """The model's gather groups (its parameters' top-level keys), in order."""
    return tuple(self.param_meta)

  def report_group(self, group: str, path: str) -> str:
    """A parameter's report group (`axes.GROUPS`), as the model declares it."""
    return self._meta(group, path).group

  def _meta(self, group: str, path: str):
    return dict(zip(_leaf_paths(self.param_meta[group]),
                    jax.tree.leaves(self.param_meta[group])))[path]

  def with_specs(self, specs: dict) -> "Gatherer":
    """The same parameters with another codec choice: {group: {path: CodecSpec}} (mode 'off'
    entries and missing groups mean plain)."""
    allowed = set(self.candidates())
    chosen = {g: {} for g in self.groups}
    for g, per_path in specs.items():
      for p, spec in per_path.items():
        if spec.mode == "off":
          continue
        if (g, p) not in allowed:
          raise ValueError(f"{g}{p} is not a sharded parameter: it cannot use the codec")
        chosen[g][p] = spec
    return dataclasses.replace(self, specs=chosen)

  @property
  def enabled(self) -> bool:
    return any(self.specs.values())

  def is_stacked(self, group: str) -> bool:
    """Whether `group` is a layer group (its parameters stacked over layers, gathered per
    layer)."""
    return jax.tree.leaves(self.param_meta[group])[0].axes[0] == axes.LAYERS

  def candidates(self) -> list[tuple[str, str]]:
    """(group, path) of every parameter the codec can gather: sharded over more than one device
    (and not kept in float32)."""
    out = []
    if self.num_devices < 2:
      return out
    for group in self.groups:
      for path, lay, meta in zip(_leaf_paths(self.param_meta[group]),
                                 jax.tree.leaves(self.layouts[group]),
                                 jax.tree.leaves(self.param_meta[group])):
        if lay.kind == "shard" and meta.group not in axes.FLOAT32_GROUPS:
          out.append((group, path))
    return out

  def copies(self, group: str) -> int:
    """Shards of one parameter that one spec covers: the layers of a stacked parameter."""
    return jax.tree.leaves(self.param_meta[group])[0].shape[0] if self.is_stacked(group) else 1

  def layout(self, group: str, path: str) -> Layout:
    return dict(zip(_leaf_paths(self.layouts[group]), jax.tree.leaves(self.layouts[group])))[path]

  def shard_shape(self, group: str, path: str) -> tuple[int, ...]:
    """One device's shard of one gather (one layer's slice for layer parameters)."""
    shape, lay = list(self._meta(group, path).shape), self.layout(group, path)
    shape[lay.dim] //= self.num_devices
    return tuple(shape[1:]) if self.is_stacked(group) else tuple(shape)

  # -- state ---------------------------------------------------------------------------------
  def init_states(self, mesh, *, warmed_up: bool = False, reuse=None):
    """Fresh codec state (global arrays, one slice per device). `warmed_up` skips the warm-up
    count (after a restore or a change of codec choice): the first gather still sends
    everything to refill the caches. `reuse=(gatherer, states)` keeps the states of parameters
    whose new spec needs the same state (`codec.same_state`: same mode, e.g. only the capacity
    changed), so their caches stay valid."""
    kept = {g: {} for g in self.groups}
    if reuse is not None:
      old, old_states = reuse
      for g in self.groups:
        for p, spec in self.specs[g].items():
          before = old.specs[g].get(p)
          if before is not None and codec.same_state(before, spec):
            kept[g][p] = old_states[g][p]
    fresh = {g: {p: s for p, s in self.specs[g].items() if p not in kept[g]} for g in self.groups}
    built = self._build_states(mesh, fresh, warmed_up) if any(fresh.values()) else {
        g: {} for g in self.groups}
    return {g: {p: kept[g][p] if p in kept[g] else built[g][p] for p in self.specs[g]}
            for g in self.groups}

  def _build_states(self, mesh, specs, warmed_up: bool):
    def one(group, path, spec):
      state = codec.init_state(self.shard_shape(group, path), hook.COMPUTE_DTYPE,
                               self.num_devices, spec)
      if warmed_up:
        state = dict(state, step=jnp.full_like(state["step"], spec.warmup_steps))
      lead = (self.num_devices, self.copies(group)) if self.is_stacked(group) else (
          self.num_devices,)
      return jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), state)

    def build():
      return {g: {p: one(g, p, s) for p, s in specs[g].items()} for g in self.groups}

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self._specs_of(specs),
                             is_leaf=lambda v: isinstance(v, P))
    return jax.jit(build, out_shardings=shardings)()

  def state_specs(self):
    return self._specs_of(self.specs)

  def _specs_of(self, specs):
    abstract = jax.eval_shape(lambda: {
        g: {p: codec.init_state(self.shard_shape(g, p), hook.COMPUTE_DTYPE, self.num_devices, s)
            for p, s in specs[g].items()} for g in self.groups})
    return jax.tree.map(lambda _: P(DEVICES), abstract)

  def param_state_bytes(self, group: str, path: str, spec: codec.CodecSpec | None = None) -> int:
    """Codec state bytes per device of one parameter (all its layers)."""
    spec = spec if spec is not None else self.specs[group][path]
    return self.copies(group) * codec.state_bytes(self.shard_shape(group, path),
                                                  hook.COMPUTE_DTYPE, self.num_devices, spec)

  def state_bytes_by_mode(self) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in self.groups:
      for p, s in self.specs[g].items():
        out[s.mode] = out.get(s.mode, 0) + self.param_state_bytes(g, p)
    return out

  def scatter_bytes(self) -> float:
    """Bytes each device receives per step in the hook's gradient collectives."""
    total = 0.0
    for g in self.groups:
      for x, lay in zip(jax.tree.leaves(self.param_meta[g]), jax.tree.leaves(self.layouts[g])):
        shape = list(x.shape)
        if lay.kind == "shard":
          shape[lay.dim] //= self.num_devices
        total += hook.scatter_bytes(shape, lay, self.num_devices, hook.reduce_dtype_of(
            self.group_dtype(x.group), self.reduce_dtype))
    return total

  def group_dtype(self, report_group: str):
    """The dtype the parameters of a report group are gathered and computed in."""
    return jnp.float32 if report_group in axes.FLOAT32_GROUPS else self.compute_dtype

  # -- the hook --------------------------------------------------------------------------------
  def gather(self, group: str, shards, states: dict | None, rebuild_from: dict | None = None):
    """-> (full tree in the compute dtype, new states {path: state}, {report group: stats,
    PARAM_STATS: ...}). `rebuild_from`: the new states of the same gather run before on the
    same shards (a re-gather under remat); compressed parameters are rebuilt from their caches
    (`hook.gather_leaves`)."""
    lays = self.layouts[group]
    if self.is_stacked(group):
      lays = jax.tree.map(Layout.unstacked, lays)
    paths = _leaf_paths(shards)
    leaves, treedef = jax.tree.flatten(shards)
    specs = [self.specs[group].get(path) if states is not None else None for path in paths]
    keys = [self.report_group(group, path) for path in paths]
    fulls, leaf_states, leaf_stats = hook.gather_leaves(
        leaves, treedef.flatten_up_to(lays), specs,
        [states[path] if spec else None for path, spec in zip(paths, specs)],
        dtypes=[self.group_dtype(key) for key in keys],
        rebuild_states=None if rebuild_from is None else [
            rebuild_from[path] if spec else None for path, spec in zip(paths, specs)],
        transport=self.transport, reduce_dtype=self.reduce_dtype)
    new_states, stats, per_param = {}, {}, {}
    for path, spec, key, new_state, s in zip(paths, specs, keys, leaf_states, leaf_stats):
      if spec is not None:
        new_states[path] = new_state
        per_param[path] = jnp.stack([s[k] for k in hook.STAT_KEYS])
      stats[key] = s if key not in stats else {k: stats[key][k] + s[k] for k in s}
    if per_param:
      stats[PARAM_STATS] = per_param
    return treedef.unflatten(fulls), new_states, stats

  # -- figures ---------------------------------------------------------------------------------
  def param_rows(self) -> list[tuple[str, str, int]]:
    """(group, path, layer) of each row of the `codec_metrics` array (layer 0 outside the layer
    groups)."""
    return [(g, p, layer) for g in self.groups for p in self.specs[g]
            for layer in range(self.copies(g))]

  @staticmethod
  def split_param_stats(stats: dict) -> tuple[dict, dict]:
    """{group: gather stats} -> (the same without the per-parameter figures, {group: {path:
    figures}})."""
    rest = {g: {k: v for k, v in s.items() if k != PARAM_STATS} for g, s in stats.items()}
    return rest, {g: s.get(PARAM_STATS, {}) for g, s in stats.items()}

  def codec_metrics(self, param_stats: dict) -> dict:
    """Per-parameter figures as one [R, K] array (`PARAM_METRIC`; rows `param_rows()`, columns
    `hook.STAT_KEYS`), and the codec state bytes per device, by mode and in total."""
    rows = []
    for g in self.groups:
      for p in self.specs[g]:
        x = param_stats[g][p]
        rows.append(x.reshape(-1, len(hook.STAT_KEYS)))
    by_mode = self.state_bytes_by_mode()
    out = {f"codec/cache_bytes/{m}": float(by_mode.get(m, 0)) for m in codec.COMPRESSED_MODES}
    out["codec_cache_bytes"] = float(sum(by_mode.values()))
    if rows:
      out[PARAM_METRIC] = jnp.concatenate(rows, axis=0)
    return out


def squeeze_device_axis(states):
  """Inside shard_map each device sees its [1, ...] slice of the state: drop that axis."""
  return jax.tree.map(lambda x: x[0], states)


def expand_device_axis(states):
  return jax.tree.map(lambda x: x[None], states)


