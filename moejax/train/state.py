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

from moejax.config import Config
from moejax.models import olmoe
from moejax.sharding import layout as layout_lib
from moejax.sharding.mesh import num_devices


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Static description of where every piece of the train state lives."""
  param_shapes: Any
  layouts: Any          # pytree of layout_lib.Layout, like params
  param_specs: Any      # pytree of PartitionSpec, like params
  shardings: Any        # TrainState of NamedSharding


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
  shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
  return StateLayout(param_shapes, layouts, specs, shardings)


def init_state(cfg: Config, tx: optax.GradientTransformation, lay: StateLayout,
               key: jax.Array) -> TrainState:
  def init(key):
    params = olmoe.init_params(cfg, key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return jax.jit(init, out_shardings=lay.shardings)(key)


def state_from_params(params, tx: optax.GradientTransformation, lay: StateLayout) -> TrainState:
  """A fresh train state (step 0, new optimizer state) around given parameters."""
  def init(params):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return jax.jit(init, out_shardings=lay.shardings)(params)
