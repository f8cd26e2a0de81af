"""Train state and its abstract initialization onto the mesh.

Pattern: `eval_shape` -> shardings from the parameter layouts -> `jit(init, out_shardings=...)`,
so no device ever holds more than its shards.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.codec.gather import CodecSpec
from moejax.codec.replicas import ReplicaCodec
from moejax.config import Config, expert_values, num_moe_layers
from moejax.errors import ConfigError
from moejax.models import olmoe
from moejax.placement import Placement
from moejax.sharding import axes, hook, layout as layout_lib
from moejax.sharding.gatherer import Gatherer
from moejax.sharding.mesh import DEVICES, num_devices, topology


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # Per-device state of the compressed gather ({group: {param: state}}; empty dicts when the
  # codec is off). Rebuilt, not checkpointed: after a restore the first gather sends everything.
  gather_state: Any = None
  # The placement's state across steps (fssdp: `FssdpState`, load history and expert owners;
  # None otherwise). Checkpointed through the placement's checkpoint item.
  placement: Any = None


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Static description of where every piece of the train state lives."""
  param_shapes: Any
  layouts: Any          # pytree of layout_lib.Layout, like params
  param_specs: Any      # pytree of PartitionSpec, like params
  shardings: Any        # TrainState of NamedSharding
  gatherer: Gatherer    # the gather hook bound to these parameters (codec choice + state)
  mesh: Any
  cfg: Any = None
  placement: Placement | None = None   # where experts live (moejax.placement)

  @property
  def checkpoint_items(self) -> tuple:
    """Feature states that are their own checkpoint items (see `moejax.train.checkpoint`)."""
    if self.placement is None:
      return ()
    return self.placement.checkpoint_items(self.shardings.placement,
                                           (self.shardings.params, self.shardings.opt_state))


def placement_of(cfg: Config, mesh, param_meta=None) -> Placement:
  """Where `cfg`'s experts live on `mesh`."""
  return placement_for(cfg, num_devices(mesh), topology(mesh).devices_per_node, param_meta,
                       packed_exchange=packs_exchange(cfg, mesh))


def packs_exchange(cfg: Config, mesh) -> bool:
  """Whether the ep/fssdp exchange on `mesh` takes packed buffers (`Dispatch.packed`):
  moe.exchange_buffers, "auto" where the devices have `ragged_all_to_all` (not XLA:CPU)."""
  choice, platform = cfg.moe.exchange_buffers, mesh.devices.flat[0].platform
  if choice == "packed" and platform == "cpu" and cfg.moe.placement != "fsdp":
    raise ConfigError("config.moe.exchange_buffers='packed' needs ragged_all_to_all, which "
                      "XLA:CPU has not: use 'auto' or 'blocks' on CPU devices")
  return choice == "packed" or (choice == "auto" and platform != "cpu")


def placement_for(cfg: Config, num_devices_: int, devices_per_node: int,
                  param_meta=None, *, packed_exchange: bool = False) -> Placement:
  """`placement_of` for a device count, without a mesh (`train.memory` plans devices it has
  not got)."""
  moe, f = cfg.moe, cfg.fssdp
  param_meta = olmoe.param_meta(cfg) if param_meta is None else param_meta
  return Placement(moe.placement, num_moe_layers(cfg), moe.num_experts, moe.top_k,
                   cfg.model.d_model, moe.expert_hidden, num_devices_, devices_per_node, DEVICES,
                   expert_values=expert_values(cfg),
                   dispatch_capacity_factor=moe.dispatch_capacity_factor,
                   receive_capacity_factor=moe.receive_capacity_factor,
                   dispatch_overflow=moe.dispatch_overflow,
                   dispatch_chunks=moe.dispatch_chunks, replica_slots=f.replica_slots,
                   overlap_degree=f.overlap_degree, owner_sends=f.resolved_owner_sends(),
                   calibrate=f.calibrate, window=f.window, max_per_layer_setting=f.max_per_layer,
                   expert_paths=axes.expert_paths(param_meta), pools=fssdp_pools(cfg),
                   itemsize=jnp.dtype(hook.COMPUTE_DTYPES[cfg.compute_dtype]).itemsize,
                   replica_codec=replica_codec_of(cfg), packed_exchange=packed_exchange,
                   rows_leave_tokens=moe.weights_on_input)


def fssdp_pools(cfg: Config) -> tuple:
  """fssdp's storage pools, ((MoE layer group, its rows of [L, E]), ...), where the MoE layers
  stack as more than one group (`moejax.placement.reshard`, Pools); () for one group."""
  rows = olmoe.moe_rows(cfg)
  return () if len(rows) == 1 else tuple(rows.items())


def replica_codec_of(cfg: Config) -> ReplicaCodec | None:
  """fssdp's replica codec (`moejax.codec.replicas`), or None: replicas travel plain."""
  if (cfg.moe.placement != "fssdp"
      or cfg.fssdp.resolved_replica_codec(cfg.codec.mode) == "off"):
    return None
  return ReplicaCodec(expert_values(cfg), cfg.compute_dtype)


def state_layout(cfg: Config, mesh, tx: optax.GradientTransformation) -> StateLayout:
  param_shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  param_meta = olmoe.param_meta(cfg)
  layouts = layout_lib.param_layouts(param_meta, cfg.moe.placement, num_devices(mesh))
  specs = layout_lib.param_specs(param_shapes, layouts)
  param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                 is_leaf=lambda s: isinstance(s, P))
  opt_shapes = jax.eval_shape(tx.init, param_shapes)
  replicated = NamedSharding(mesh, P())
  opt_shardings = optax.tree_map_params(
      tx, lambda _, s: s, opt_shapes, param_shardings,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda v: isinstance(v, NamedSharding))
  n = num_devices(mesh)
  gatherer = Gatherer.create(param_meta, layouts, n, codec_spec(cfg),
                             compute_dtype=hook.COMPUTE_DTYPES[cfg.compute_dtype],
                             rebuilt_share=rebuilt_shares(cfg), transport=cfg.codec.transport,
                             reduce_dtype=hook.REDUCE_DTYPES[cfg.reduce_dtype])
  gather_state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), gatherer.state_specs(),
                                        is_leaf=lambda s: isinstance(s, P))
  placement = placement_of(cfg, mesh, param_meta)
  placement_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), placement.state_specs(),
                                     is_leaf=lambda s: isinstance(s, P))
  shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                         gather_state=gather_state_shardings, placement=placement_shardings)
  return StateLayout(param_shapes, layouts, specs, shardings, gatherer, mesh, cfg, placement)


def rebuilt_shares(cfg: Config) -> dict[str, float]:
  """{layer group: share of a compressed parameter's gathers per step rebuilt from its cache}
  (`hook.run_gathers`); groups gathered once per step rebuild nothing."""
  out = {}
  for group in olmoe.layer_groups(cfg):
    scans = olmoe.scanned_layers(cfg, group)
    every, moving = (hook.gathers_per_layer(scans, remat=cfg.remat, prefetch=cfg.prefetch,
                                            rebuilt=r) for r in (False, True))
    out[group] = 1.0 - moving / every
  return out


def codec_spec(cfg: Config) -> CodecSpec | None:
  c = cfg.codec
  if c.mode == "off" or c.controlled:   # controlled: plain until codec_control chooses
    return None
  return CodecSpec(c.mode, block_size=c.block_size, detect=c.detect,
                   capacity_fraction=c.capacity_fraction or None, warmup_steps=c.warmup_steps,
                   delta_bits=c.delta_bits)


def _without_gather_state(shardings: TrainState) -> TrainState:
  return shardings.replace(gather_state=None, placement=None)


def with_rebuilt_state(lay: StateLayout, state: TrainState, *,
                       restored: bool = False) -> TrainState:
  """Adds the state that is not part of the parameters: codec caches (rebuilt, never saved), and
  the placement's state as it starts (a restore then sets the saved one).
  `restored`: the weights are past the codec warm-up, so only the first gather sends
  everything (to refill the caches)."""
  if lay.placement.replica_codec is None:
    placement = jax.device_put(lay.placement.init_state(), lay.shardings.placement)
  else:   # built on the devices, each its own part: the replica caches are per device
    placement = jax.jit(lay.placement.init_state, out_shardings=lay.shardings.placement)()
  return state.replace(gather_state=lay.gatherer.init_states(lay.mesh, warmed_up=restored),
                       placement=placement)


def make_init(cfg: Config, tx: optax.GradientTransformation, lay: StateLayout):
  """key -> step 0, params and optimizer state placed on `lay`'s shardings: one jitted function
  (make it once; every seed reuses its executable)."""
  def init(key):
    params = olmoe.init_params(cfg, key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return jax.jit(init, out_shardings=_without_gather_state(lay.shardings))


def state_from_params(params, tx: optax.GradientTransformation, lay: StateLayout) -> TrainState:
  """A fresh train state (step 0, new optimizer state) around given parameters."""
  def init(params):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  state = jax.jit(init, out_shardings=_without_gather_state(lay.shardings))(params)
  return with_rebuilt_state(lay, state)
