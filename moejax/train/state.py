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
from moejax.config import Config
from moejax.models import olmoe
from moejax.placement import planner, reshard
from moejax.sharding import layout as layout_lib
from moejax.sharding.gatherer import Gatherer
from moejax.sharding.mesh import num_devices


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # Per-device state of the compressed gather ({group: {param: state}}; empty dicts when the
  # codec is off). Rebuilt, not checkpointed: after a restore the first gather sends everything.
  gather_state: Any = None
  # fssdp: the load predictor's recent per-layer expert loads (planner.LoadHistory).
  load_history: Any = None
  # fssdp: int32 [L, E], the device owning each expert; says where it is stored
  # (moejax.placement.reshard). Changed only by re-sharding; checkpointed.
  expert_owner: Any = None


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


def state_layout(cfg: Config, mesh, tx: optax.GradientTransformation) -> StateLayout:
  param_shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  layouts = layout_lib.param_layouts(param_shapes, cfg.moe.placement, num_devices(mesh))
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
  gatherer = Gatherer.create(param_shapes, layouts, n, codec_spec(cfg))
  gather_state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), gatherer.state_specs(),
                                        is_leaf=lambda s: isinstance(s, P))
  history_shardings = owner_sharding = None
  if cfg.moe.placement == "fssdp":
    history_shardings = jax.tree.map(lambda _: replicated, _init_history(cfg))
    owner_sharding = replicated
  shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                         gather_state=gather_state_shardings, load_history=history_shardings,
                         expert_owner=owner_sharding)
  return StateLayout(param_shapes, layouts, specs, shardings, gatherer, mesh, cfg)


def codec_spec(cfg: Config) -> CodecSpec | None:
  c = cfg.codec
  if c.mode == "off" or c.controlled:   # controlled: plain until codec_control chooses
    return None
  return CodecSpec(c.mode, block_size=c.block_size, detect=c.detect,
                   capacity_fraction=c.capacity_fraction or None, warmup_steps=c.warmup_steps,
                   delta_bits=c.delta_bits)


def _init_history(cfg: Config):
  return planner.init_history(window=cfg.fssdp.window, num_layers=cfg.model.num_layers,
                                 num_experts=cfg.moe.num_experts)


def _without_gather_state(shardings: TrainState) -> TrainState:
  return shardings.replace(gather_state=None, load_history=None, expert_owner=None)


def with_rebuilt_state(lay: StateLayout, state: TrainState, *,
                       restored: bool = False) -> TrainState:
  """Adds the state that is not part of the parameters: codec caches (rebuilt, never saved), and
  the fssdp load history and expert owners as they start (a restore then sets the saved ones).
  `restored`: the weights are past the codec warm-up, so only the first gather sends
  everything (to refill the caches)."""
  history = owner = None
  if lay.cfg.moe.placement == "fssdp":
    history = jax.device_put(_init_history(lay.cfg), lay.shardings.load_history)
    owner = jax.device_put(reshard.initial_owner(
        lay.cfg.model.num_layers, lay.cfg.moe.num_experts, num_devices(lay.mesh)),
        lay.shardings.expert_owner)
  return state.replace(gather_state=lay.gatherer.init_states(lay.mesh, warmed_up=restored),
                       load_history=history, expert_owner=owner)


def init_state(cfg: Config, tx: optax.GradientTransformation, lay: StateLayout,
               key: jax.Array) -> TrainState:
  def init(key):
    params = olmoe.init_params(cfg, key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  state = jax.jit(init, out_shardings=_without_gather_state(lay.shardings))(key)
  return with_rebuilt_state(lay, state)


def state_from_params(params, tx: optax.GradientTransformation, lay: StateLayout) -> TrainState:
  """A fresh train state (step 0, new optimizer state) around given parameters."""
  def init(params):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  state = jax.jit(init, out_shardings=_without_gather_state(lay.shardings))(params)
  return with_rebuilt_state(lay, state)
