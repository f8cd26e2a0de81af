"""The sharded train and eval steps.

`train_step(state, batch) -> (state, metrics)` is one jitted function with donated state. Its
gradient computation runs under `shard_map` over all devices (explicit SPMD): each device sees
its slice of the batch and its parameter shards; every parameter passes through the one gather
hook (`moejax.sharding.hook`), whose VJP returns the gradient to the shard that owns it. The
optimizer then updates the shards in place (fp32 master weights, sharded optimizer state).

Each device's loss is its *share* of the global-batch loss (local sums divided by the global
token count), so gradients summed over devices are exactly the gradients of the global loss.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from moejax.config import Config
from moejax.errors import ConfigError
from moejax.layers.dispatch import LOCAL, Dispatch
from moejax.models import olmoe
from moejax.sharding import hook
from moejax.sharding.layout import Layout
from moejax.sharding.mesh import DEVICES, num_devices, topology
from moejax.train.state import StateLayout, TrainState

BATCH_SPEC = {"inputs": P(DEVICES), "targets": P(DEVICES)}


def check_divisibility(cfg: Config, mesh) -> None:
  n = num_devices(mesh)
  if cfg.batch_size % n:
    raise ConfigError(f"config.batch_size={cfg.batch_size} is not divisible by the {n} devices "
                      "of the mesh (each device takes an equal slice of the batch)")
  if cfg.moe.placement == "ep" and cfg.moe.num_experts % n:
    raise ConfigError(f"config.moe.num_experts={cfg.moe.num_experts} is not divisible by the {n} "
                      "devices: moe.placement='ep' gives every device the same number of experts")


def make_gather(layouts):
  """gather(name, shards) for `olmoe.forward`: layer groups use their per-layer layouts."""
  def gather(name, shards):
    lays = layouts[name]
    if name == "layers":
      lays = jax.tree.map(Layout.unstacked, lays)
    return hook.gather_tree(shards, lays)
  return gather


def moe_dispatch(cfg: Config, mesh) -> Dispatch:
  if cfg.moe.placement == "ep":
    return Dispatch("ep", DEVICES, num_devices(mesh), topology(mesh).devices_per_node,
                    cfg.moe.capacity_factor)
  return LOCAL


def _forward_local(cfg: Config, lay: StateLayout, mesh, params, inputs_BxS, step):
  return olmoe.forward(cfg, params, inputs_BxS, gather=make_gather(lay.layouts),
                       dispatch=moe_dispatch(cfg, mesh), axis_name=DEVICES, remat=cfg.remat,
                       prefetch=cfg.prefetch, step=step)


def _loss_share(cfg: Config, lay: StateLayout, mesh, params, batch, step):
  logits_BxSxV, aux_L = _forward_local(cfg, lay, mesh, params, batch["inputs"], step)
  global_tokens = cfg.batch_size * cfg.seq_len
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, batch["targets"])
  ce_share = jnp.sum(ce) / global_tokens
  aux_share = jnp.mean(aux_L["aux_loss"])
  z_share = jnp.mean(aux_L["z_loss"])
  locality_share = jnp.mean(aux_L["locality_loss"])
  loss = (ce_share + cfg.moe.aux_loss_weight * aux_share + cfg.moe.z_loss_weight * z_share
          + cfg.routing.locality_weight * locality_share)
  return loss, {"loss": ce_share, "aux_loss": aux_share, "z_loss": z_share,
                "locality_loss": locality_share,
                "routing_L": aux_L["routing"],
                "ep_dropped_L": aux_L["dropped"].astype(jnp.float32)}


def routing_metrics(cfg: Config, routing_L: dict, ep_dropped_L) -> dict:
  """Per-layer routing telemetry as [L] arrays, plus whole-model fractions."""
  metrics = {k: v for k, v in routing_L.items()}
  assignments = cfg.batch_size * cfg.seq_len * cfg.moe.top_k * cfg.model.num_layers
  metrics["ep_dropped_frac"] = jnp.sum(ep_dropped_L) / assignments
  return metrics


def make_grad_fn(cfg: Config, mesh, lay: StateLayout):
  """(params, batch) -> (grads sharded like params, summed loss parts): the shard_map body."""
  def grads_body(params, batch, step):
    grads, parts = jax.grad(functools.partial(_loss_share, cfg, lay, mesh), has_aux=True)(
        params, batch, step)
    return grads, jax.lax.psum(parts, DEVICES)

  return jax.shard_map(grads_body, mesh=mesh, in_specs=(lay.param_specs, BATCH_SPEC, P()),
                       out_specs=(lay.param_specs, P()), check_vma=False)


def make_train_step(cfg: Config, mesh, lay: StateLayout, tx: optax.GradientTransformation,
                    schedule: optax.Schedule):
  check_divisibility(cfg, mesh)
  sharded_grads = make_grad_fn(cfg, mesh, lay)

  def train_step(state: TrainState, batch):
    grads, parts = sharded_grads(state.params, batch, state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    routing = routing_metrics(cfg, parts.pop("routing_L"), parts.pop("ep_dropped_L"))
    metrics = dict(parts, grad_norm=optax.tree.norm(grads), lr=schedule(state.step), **routing)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return jax.jit(train_step, donate_argnums=0, out_shardings=(lay.shardings, None))


def make_eval_step(cfg: Config, mesh, lay: StateLayout):
  """eval_step(params, batch) -> mean cross-entropy over the batch."""
  def body(params, batch):
    # Evaluate under the post-warm-up capacity schedule: the routing regime being trained for.
    logits_BxSxV, _ = _forward_local(cfg, lay, mesh, params, batch["inputs"],
                                     cfg.routing.warmup_steps)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, batch["targets"])
    return jax.lax.psum(jnp.sum(ce), DEVICES) / (cfg.batch_size * cfg.seq_len)

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(lay.param_specs, BATCH_SPEC),
                               out_specs=P(), check_vma=False))
