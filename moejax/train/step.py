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
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from moejax import profiling
from moejax.codec import gather as codec
from moejax.config import Config, num_moe_layers
from moejax.errors import ConfigError
from moejax.models import olmoe
from moejax.routing import balance
from moejax.sharding import hook
from moejax.sharding.gatherer import expand_device_axis, squeeze_device_axis
from moejax.sharding.mesh import DEVICES, num_devices
from moejax.train.state import StateLayout, TrainState, placement_of

BATCH_SPEC = {"inputs": P(DEVICES), "targets": P(DEVICES)}


def check_divisibility(cfg: Config, mesh, lay: StateLayout | None = None) -> None:
  check_batch_divides(cfg, num_devices(mesh))
  (lay.placement if lay is not None else placement_of(cfg, mesh)).check()


def check_batch_divides(cfg: Config, n: int) -> None:
  if cfg.batch_size % n:
    raise ConfigError(f"config.batch_size={cfg.batch_size} is not divisible by the {n} devices "
                      "of the mesh (each device takes an equal slice of the batch)")


def _forward_local(cfg: Config, lay: StateLayout, params, inputs_BxS, step, gather_state=None,
                   placement_state=None):
  """The forward pass on this device's batch slice; gather_state as stored ([1, ...] slices)."""
  states = squeeze_device_axis(gather_state) if gather_state is not None else None
  params, owners_L, predicted_LxE, replicas_L = lay.placement.local_params(
      params, placement_state, me=jax.lax.axis_index(DEVICES))
  logits, aux_L, new_states, stats = olmoe.forward_with_state(
      cfg, params, inputs_BxS, gather=lay.gatherer.gather, states=states,
      dispatch=lay.placement.dispatch, axis_name=DEVICES, remat=cfg.remat,
      prefetch=cfg.prefetch, scatter_ahead=cfg.scatter_ahead, step=step,
      predicted_load_LxE=predicted_LxE,
      expert_owners_L=owners_L, replica_state_L=replicas_L)
  return logits, aux_L, expand_device_axis(new_states), stats


def _loss_share(cfg: Config, lay: StateLayout, params, batch, step, gather_state,
                placement_state):
  logits_BxSxV, aux_L, new_gather_state, gather_stats = _forward_local(
      cfg, lay, params, batch["inputs"], step, gather_state, placement_state)
  global_tokens = cfg.batch_size * cfg.seq_len
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, batch["targets"])
  ce_share = jnp.sum(ce) / global_tokens
  aux_share = jnp.mean(aux_L["aux_loss"])
  z_share = jnp.mean(aux_L["z_loss"])
  locality_share = jnp.mean(aux_L["locality_loss"])
  loss = (ce_share + cfg.moe.aux_loss_weight * aux_share + cfg.moe.z_loss_weight * z_share
          + cfg.routing.locality_weight * locality_share)
  extra = {}
  if "index_loss" in aux_L:    # DeepSeek-V3.2's indexers: KL per token, averaged over layers
    extra["index_loss"] = jnp.mean(aux_L["index_loss"]) / global_tokens
    loss = loss + extra["index_loss"]      # it alone reaches the indexer (model.train_indexer)
  parts = {"loss": ce_share, "aux_loss": aux_share, "z_loss": z_share, **extra,
           "locality_loss": locality_share, "routing_L": aux_L["routing"],
           "ep_dropped_L": aux_L["dropped"].astype(jnp.float32),
           "load_LxE": aux_L["load_E"].astype(jnp.float32),
           "admitted_load_LxE": aux_L["admitted_load_E"].astype(jnp.float32)}
  if "placement" in aux_L:
    parts["placement_L"] = aux_L["placement"]
  replicas = expand_device_axis(aux_L.get("replica_state"))   # None without the replica codec
  return loss, (parts, new_gather_state, gather_stats, replicas)


def routing_metrics(cfg: Config, routing_L: dict, ep_dropped_L) -> dict:
  """Per-layer routing telemetry as [L] arrays, plus whole-model fractions."""
  metrics = {k: v for k, v in routing_L.items()}
  assignments = cfg.batch_size * cfg.seq_len * cfg.moe.top_k * num_moe_layers(cfg)
  metrics["ep_dropped_frac"] = jnp.sum(ep_dropped_L) / assignments
  return metrics


def make_grad_fn(cfg: Config, mesh, lay: StateLayout):
  """(params, batch, step, gather_state, placement_state) -> (grads sharded like params, summed
  loss parts, new gather state, gather stats, the replica codec's new states or None): the
  shard_map body."""
  def grads_body(params, batch, step, gather_state, placement_state):
    grads, (parts, new_gather_state, gather_stats, replicas) = jax.grad(
        functools.partial(_loss_share, cfg, lay), has_aux=True)(
            params, batch, step, gather_state, placement_state)
    # Gather stats are already identical on every device (static, or agreed by the codec).
    return grads, jax.lax.psum(parts, DEVICES), new_gather_state, gather_stats, replicas

  state_specs = lay.gatherer.state_specs()
  placement_specs = lay.placement.state_specs()
  replica_specs = None if placement_specs is None else placement_specs.replicas
  return jax.shard_map(grads_body, mesh=mesh,
                       in_specs=(lay.param_specs, BATCH_SPEC, P(), state_specs, placement_specs),
                       out_specs=(lay.param_specs, P(), state_specs, P(), replica_specs),
                       check_vma=False)


def gathers_per_copy(cfg: Config, gatherer, group: str) -> float:
  """Gathers per step of one copy of a group's parameters: each layer's slice of a layer group
  (`hook.gathers_per_layer` over the scans that hold the group), else 1. Of a compressed
  parameter's, `gatherer.rebuilt_share` are rebuilt from its cache."""
  if not gatherer.is_stacked(group):
    return 1.0
  return hook.gathers_per_layer(olmoe.scanned_layers(cfg, group), remat=cfg.remat,
                                prefetch=cfg.prefetch)


def gather_metrics(cfg: Config, lay: StateLayout, stats: dict) -> dict:
  """Step figures of the parameter gathers, per report group and in total.

  Bytes are what each device receives over the step: (N-1) times what each device puts into a
  gather, times the gathers of that parameter per step (`gathers_per_copy`; the plain figure
  counts every gather; the sent one counts a compressed parameter's rebuilt re-gathers
  (`gatherer.rebuilt_share`) as what the rebuild moves: nothing in word / delta mode,
  sign+mantissa in element / block mode).
  """
  n = lay.gatherer.num_devices
  sizes = codec_denominators(lay)
  stats, param_stats = lay.gatherer.split_param_stats(stats)
  by_group: dict = {}
  for group, group_stats in stats.items():
    every = gathers_per_copy(cfg, lay.gatherer, group)
    for report, s in group_stats.items():
      acc = by_group.setdefault(report, {k: 0.0 for k in hook.STAT_KEYS})
      for k in hook.STAT_KEYS:
        value = jnp.sum(s[k])
        if k.startswith("bytes"):
          value = value * (n - 1) * every
        acc[k] = acc[k] + value
    saved = every * lay.gatherer.rebuilt_share.get(group, 0.0)
    if saved:
      for path, figures in param_stats[group].items():
        sent_L = figures[..., hook.STAT_KEYS.index("bytes_sent")]
        rebuilt = codec.wire_bytes(lay.gatherer.shard_shape(group, path), hook.COMPUTE_DTYPE,
                                   lay.gatherer.specs[group][path])["rebuilt"]
        by_group[lay.gatherer.report_group(group, path)]["bytes_sent"] -= (
            (jnp.sum(sent_L) - float(rebuilt * sent_L.size)) * (n - 1) * saved)
  metrics = {}
  total = {k: sum(g[k] for g in by_group.values()) for k in hook.STAT_KEYS}
  metrics["gather_bytes"] = total["bytes_sent"]
  metrics["gather_bytes_plain"] = total["bytes_plain"]
  metrics["scatter_bytes"] = lay.gatherer.scatter_bytes()
  if lay.gatherer.enabled:
    # Python floats: a model's value count passes int32 (OLMoE-1B-7B's 6.9e9), and a Python
    # int beyond it cannot enter a jnp operation without x64
    values = float(sum(v for v, _ in sizes.values()))
    blocks = float(sum(b for _, b in sizes.values()))
    metrics["exp_change_rate"] = total["exponent_changes"] / max(values, 1)
    metrics["block_change_rate"] = total["block_changes"] / max(blocks, 1)
    metrics["codec_fallbacks"] = total["fallback"]
    metrics["codec_params"] = float(sum(len(v) for v in lay.gatherer.specs.values()))
    # codec_fallbacks counts these (a parameter per layer): their share fell back this step
    metrics["codec_rows"] = float(len(lay.gatherer.param_rows()))
    metrics.update(lay.gatherer.codec_metrics(param_stats))
    for report, g in by_group.items():
      metrics[f"codec/{report}/bytes_sent"] = g["bytes_sent"]
      metrics[f"codec/{report}/bytes_plain"] = g["bytes_plain"]
      if report in sizes:
        metrics[f"codec/{report}/exp_change_rate"] = (g["exponent_changes"]
                                                      / float(sizes[report][0]))
        metrics[f"codec/{report}/block_change_rate"] = (g["block_changes"]
                                                        / float(sizes[report][1]))
  return metrics


def codec_denominators(lay: StateLayout) -> dict:
  """{report group: (values, blocks)} over the compressed parameters (whole, all layers)."""
  out: dict = {}
  g = lay.gatherer
  for group, chosen in g.specs.items():
    shapes = dict(zip([jax.tree_util.keystr(p) for p, _ in
                       jax.tree_util.tree_leaves_with_path(g.param_meta[group])],
                      jax.tree.leaves(g.param_meta[group])))
    for path, spec in chosen.items():
      size = math.prod(shapes[path].shape)
      layers = g.copies(group)
      blocks = layers * g.num_devices * math.ceil(size / layers / g.num_devices / spec.block_size)
      report = g.report_group(group, path)
      v, b = out.get(report, (0, 0))
      out[report] = (v + size, b + blocks)
  return out


def make_train_step(cfg: Config, mesh, lay: StateLayout, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, *, trace_guard=None):
  """The jitted train step. `trace_guard(fn) -> fn` wraps the step function before it is jitted
  (tests pass `chex.assert_max_traces`, so a retrace fails instead of compiling again)."""
  check_divisibility(cfg, mesh, lay)
  sharded_grads = make_grad_fn(cfg, mesh, lay)
  tokens_per_device = cfg.batch_size * cfg.seq_len // num_devices(mesh)
  grows = lay.placement.grows_dispatch(tokens_per_device)

  def train_step(state: TrainState, batch):
    grads, parts, gather_state, gather_stats, replicas = sharded_grads(
        state.params, batch, state.step, state.gather_state, state.placement)
    with profiling.scope("optimizer"):
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    load_LxE = parts.pop("load_LxE")        # the router's choices, before admission
    params = balance.apply(params, load_LxE, cfg.moe.score_bias_rate, olmoe.moe_rows(cfg))
    # The load history plans what the experts process: the assignments admission kept (the
    # router's choices when there is no admission).
    placement_state = lay.placement.next_state(state.placement, parts["admitted_load_LxE"],
                                               replicas)
    routing = routing_metrics(cfg, parts.pop("routing_L"), parts.pop("ep_dropped_L"))
    placement = lay.placement.metrics(parts.pop("placement_L", {}),
                                      tokens_per_device=tokens_per_device, remat=cfg.remat)
    metrics = dict(parts, expert_load_LxE=load_LxE, grad_norm=optax.tree.norm(grads),
                   lr=schedule(state.step), **routing,
                   **placement, **gather_metrics(cfg, lay, gather_stats))
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           gather_state=gather_state, placement=placement_state)
    if grows:
      # moe.dispatch_overflow="grow": a step that dropped an assignment for lack of buffer room
      # applies nothing (parameters, optimizer, codec caches, load history, step all stay), and
      # the Trainer reruns it with larger buffers (`moejax.train.loop.Trainer.grow_dispatch`).
      overflow = routing["ep_dropped_frac"] > 0
      new_state = jax.tree.map(lambda new, old: jnp.where(overflow, old, new), new_state, state)
      metrics["dispatch_overflow"] = overflow.astype(jnp.int32)
    return new_state, metrics

  if trace_guard is not None:
    train_step = trace_guard(train_step)
  jitted = jax.jit(train_step, donate_argnums=0, out_shardings=(lay.shardings, None))
  if cfg.schedule_latencies == "model":
    from moejax.train import latency_profile
    return latency_profile.ModelScheduledStep(
        jitted, latency_profile.cluster_for(cfg.schedule_cluster, mesh.devices.flat[0]),
        num_devices(mesh))
  return jitted


def make_eval_step(cfg: Config, mesh, lay: StateLayout):
  """eval_step(params, batch, placement_state=None) -> (mean cross-entropy over the batch,
  assignments dropped for lack of buffer room (the loss is exact only when 0), [the most
  dispatch rows any device sent to one destination, the most rows one received for its experts])
  (placement_state: TrainState.placement, where experts are stored; None = the even start)."""
  def body(params, batch, placement_state):
    # Evaluate under the post-warm-up capacity schedule: the routing regime being trained for.
    # Plain gathers: evaluation must not advance the codec's caches. The load prediction is
    # flat: evaluation plans no replicas from training's history.
    if placement_state is not None:
      placement_state = lay.placement.init_state().replace(owner_LxE=placement_state.owner_LxE,
                                                           replicas=None)
    logits_BxSxV, aux_L, _, _ = _forward_local(cfg, lay, params, batch["inputs"],
                                               cfg.routing.warmup_steps, None, placement_state)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, batch["targets"])
    needed = (jnp.stack([jnp.max(aux_L["placement"][k])
                         for k in ("dispatch_needed", "receive_needed")])
              if "placement" in aux_L else jnp.zeros((2,), jnp.float32))
    return (jax.lax.psum(jnp.sum(ce), DEVICES) / (cfg.batch_size * cfg.seq_len),
            jax.lax.psum(jnp.sum(aux_L["dropped"]), DEVICES),
            jnp.round(jax.lax.psum(needed, DEVICES)).astype(jnp.int32))

  sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(lay.param_specs, BATCH_SPEC, P()),
                                  out_specs=(P(), P(), P()), check_vma=False))

  def eval_step(params, batch, placement_state=None):
    if placement_state is not None and placement_state.replicas is not None:
      placement_state = placement_state.replace(replicas=None)   # only the owners are read
    return sharded(params, batch, placement_state)

  return eval_step
