"""One run's expert placement: what the train step, the loop and the checkpoints ask of it.

`Placement` (static, built from the config by `moejax.train.state.placement_of`) is the one
object the rest of the code talks to:

  dispatch            how the MoE block reaches its experts (`moejax.placement.dispatch`)
  init_state()        fssdp: the `FssdpState` a run starts from (None for fsdp and ep)
  local_params(...)   inside the step's shard_map: fssdp's owned windows of the expert weights,
                      the owners and the predicted loads the layers plan replicas from
  state_specs()       fssdp: how its state lies on the mesh (the replica codec's caches per
                      device, the rest replicated)
  next_state(...)     fssdp: the load history after this step's loads, the replica caches
  metrics(...)        per-layer placement figures and bytes moved by kind
  reshard(...)        between steps: new owners; parameters and optimizer moments move together
  checkpoint_items    fssdp: its checkpoint item (`FssdpCheckpoint`): load history and owners

Letters: L layers, E experts per layer, N devices, C the most experts of one layer one device
owns (`max_per_layer`), W history window.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from moejax.codec import replicas as replicas_lib
from moejax.errors import ConfigError
from moejax.placement import fssdp, ownership, planner, reshard
from moejax.placement.dispatch import (LOCAL, Dispatch, ep_a2a_bytes, ep_capacity,
                                       max_rows as dispatch_max_rows, receive_capacity)
from moejax.sharding.gatherer import squeeze_device_axis
from moejax.sharding.prefetch import recomputes


@struct.dataclass
class FssdpState:
  """fssdp's state across steps: the load predictor's recent loads and the owner of each expert
  (int32 [L, E], says where it is stored; changed only by re-sharding), both checkpointed; and
  `replicas`, the layers' `moejax.codec.replicas` states stacked, each device's behind a leading
  device axis, like the gather state: "held", what every device's replica slots held last step
  (the planner prefers those devices for the same experts; checkpointed, so a resumed run plans
  as the uninterrupted one), and with the replica codec the caches the patches apply to
  (rebuilt, not checkpointed: a resumed run's first step sends its replicas plain)."""
  history: planner.LoadHistory
  owner_LxE: jax.Array
  replicas: dict | None = None


@dataclasses.dataclass(frozen=True)
class Placement:
  kind: str                      # fsdp | ep | fssdp (`moejax.placement.PLACEMENTS`)
  num_layers: int
  num_experts: int
  top_k: int
  d_model: int
  expert_hidden: int
  num_devices: int
  devices_per_node: int
  axis_names: tuple
  dispatch_capacity_factor: float = 0.0
  dispatch_overflow: str = "grow"     # `moejax.placement.dispatch.OVERFLOW_POLICIES`
  dispatch_chunks: int = 1            # the exchange in this many pieces (`Dispatch.chunks`)
  receive_capacity_factor: float = 0.0  # rows run through the experts (`dispatch.receive_capacity`)
  packed_exchange: bool = False       # packed exchange buffers (`Dispatch.packed`: GPU/TPU)
  replica_slots: int = 0
  overlap_degree: int = 0
  owner_sends: int = 0                # fssdp.owner_sends resolved (0 = no bound)
  calibrate: bool = False
  window: int = 5
  max_per_layer_setting: int = 0      # fssdp.max_per_layer as configured (0 = default)
  # Paths (key names) of the parameters holding one matrix per expert, as the model declares
  # them (`moejax.sharding.axes.expert_paths`), e.g. ("layers", "moe", "w_up").
  expert_paths: tuple = ()
  # fssdp storage pools ((group, its rows of [L, E]), ...) where the MoE layers stack as more than
  # one parameter group (`moejax.placement.reshard`, Pools); empty: one pool of every layer.
  pools: tuple = ()
  itemsize: int = 2                   # bytes of one compute-dtype value (config.compute_dtype)
  replica_codec: Any = None           # fssdp: `codec.replicas.ReplicaCodec`; None = plain
  expert_values: int = 0              # values of one expert (`config.expert_values`); 0: its
                                      # three matrices
  rows_leave_tokens: bool = False     # the exchange sees each assignment as a token of its own
                                      # (moe.weights_on_input): no per-token bound it can see

  # -- static ------------------------------------------------------------------------------------
  @property
  def max_per_layer(self) -> int:
    """fssdp: C, the most experts of one layer one device may own (the owned window's length)."""
    return self.max_per_layer_setting or ownership.default_max_per_layer(self.num_experts,
                                                                        self.num_devices)

  @property
  def experts_held(self) -> int:
    """ep/fssdp: the most experts of one layer a device holds (ep: E / N; fssdp: its owned
    window and its replica slots), which bounds the rows one destination can be sent
    (`dispatch.max_rows`); 0 for fsdp."""
    if self.kind == "ep":
      return self.num_experts // self.num_devices
    if self.kind == "fssdp":
      return self.max_per_layer + self.replica_slots
    return 0

  def max_rows(self, tokens_per_device: int) -> int:
    """The most rows one destination can be sent (`dispatch.max_rows`): a dropless buffer. With
    `rows_leave_tokens` the exchange gets T x K rows of one assignment each and bounds them by
    T x K, so this does too (the two must agree on what is dropless)."""
    if self.rows_leave_tokens:
      return tokens_per_device * self.top_k
    return dispatch_max_rows(tokens_per_device, self.top_k, self.experts_held)

  @property
  def pool_rows(self) -> tuple | None:
    """Each storage pool's rows of [L, E] (`reshard.pool_rows`); None: one pool."""
    return tuple(rows for _, rows in self.pools) or None

  @property
  def owns_experts(self) -> bool:
    return self.kind in ("ep", "fssdp")

  def check(self) -> None:
    """ConfigError naming the field when the mesh cannot hold this placement."""
    n = self.num_devices
    if self.owns_experts and self.num_experts % n:
      raise ConfigError(f"config.moe.num_experts={self.num_experts} is not divisible by the {n} "
                        f"devices: moe.placement={self.kind!r} gives every device the same "
                        "number of experts")
    if self.kind == "fssdp" and self.max_per_layer < self.num_experts // n:
      per_device = self.num_experts // n
      raise ConfigError(f"config.fssdp.max_per_layer={self.max_per_layer} is below the "
                        f"{per_device} experts per device of the even start on {n} devices; use "
                        f"at least {per_device} (or 0 for the default)")

  @property
  def dispatch(self) -> Dispatch:
    if not self.owns_experts:
      return LOCAL
    return Dispatch(self.kind, self.axis_names, self.num_devices, self.devices_per_node,
                    self.applied_dispatch_factor, replica_slots=self.replica_slots,
                    overlap_degree=self.overlap_degree, owner_sends=self.owner_sends,
                    calibrate=self.calibrate,
                    replica_codec=self.replica_codec if self.kind == "fssdp" else None,
                    chunks=self.dispatch_chunks,
                    receive_capacity_factor=self.applied_receive_factor,
                    packed=self.packed_exchange)

  @property
  def uncapped_sends(self) -> bool:
    """Packed buffers whose receive capacity bounds what a device takes, where an overflow grows
    it: a packed send buffer holds the T x K rows whatever the dispatch cap, so a cap there would
    only drop rows and rerun steps; every row is sent. (Under "drop" the cap is the drop rule;
    with every received row run, moe.receive_capacity_factor 0, it bounds the receive buffer.)"""
    return (self.packed_exchange and self.dispatch_overflow == "grow"
            and self.receive_capacity_factor > 0)

  @property
  def applied_dispatch_factor(self) -> float:
    """The dispatch capacity factor the exchange applies: none (0) with `uncapped_sends`, or on
    one device under "grow" (nothing travels, and a cap below 1 would drop rows with no step to
    grow it: `grows_dispatch` needs two devices)."""
    one_device = self.num_devices == 1 and self.dispatch_overflow == "grow"
    return 0.0 if self.uncapped_sends or one_device else self.dispatch_capacity_factor

  @property
  def applied_receive_factor(self) -> float:
    """The receive capacity factor the exchange applies: only where an overflow grows the
    buffers and reruns the step (under "drop" a cut would drop the last experts' rows of a busy
    device, where the dispatch buffer drops each source's last tokens)."""
    return self.receive_capacity_factor if self.dispatch_overflow == "grow" else 0.0

  def receive_capacity(self, tokens_per_device: int) -> int:
    """R: rows of one exchange piece's receive buffer run through the experts here (ep/fssdp)."""
    if not self.owns_experts:
      return 0
    return receive_capacity(tokens_per_device * self.top_k, self.num_devices,
                            self.applied_dispatch_factor, self.applied_receive_factor,
                            self.dispatch_chunks, self.packed_exchange,
                            self.max_rows(tokens_per_device))

  def dispatch_capacity(self, tokens_per_device: int) -> int:
    """C: the dispatch buffer's rows per destination (ep/fssdp; 0 for fsdp)."""
    if not self.owns_experts:
      return 0
    return ep_capacity(tokens_per_device * self.top_k, self.num_devices,
                       self.applied_dispatch_factor, self.max_rows(tokens_per_device))

  def grows_dispatch(self, tokens_per_device: int) -> bool:
    """Whether a step can overflow its buffers and is then rerun with larger ones
    (dispatch_overflow "grow"): a destination's rows past C (below the dropless `max_rows`), or a
    device's received rows past the rows its experts run (`receive_capacity`)."""
    if not (self.owns_experts and self.num_devices > 1 and self.dispatch_overflow == "grow"):
      return False
    # (with every received row run, under the cap this placement sends by)
    every_row = dataclasses.replace(self, receive_capacity_factor=0.0,
                                    dispatch_capacity_factor=self.applied_dispatch_factor)
    return (self.dispatch_capacity(tokens_per_device) < self.max_rows(tokens_per_device)
            or self.receive_capacity(tokens_per_device)
            < every_row.receive_capacity(tokens_per_device))

  @property
  def expert_bytes(self) -> int:
    """Bytes of one expert (its matrices, and biases where it has them) in the compute
    dtype."""
    return self._expert_values * self.itemsize

  @property
  def _expert_values(self) -> int:
    return self.expert_values or 3 * self.d_model * self.expert_hidden

  # -- state -------------------------------------------------------------------------------------
  def init_state(self) -> FssdpState | None:
    """The state a run starts from: an empty history and the even owners (host arrays)."""
    if self.kind != "fssdp":
      return None
    n, layers = self.num_devices, self.num_layers
    one = {"held": replicas_lib.init_held(n, self.replica_slots)}
    if self.replica_codec is not None:
      one = replicas_lib.init_state(n, self.replica_slots, self.max_per_layer, self.replica_codec)
    replicas = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, layers) + x.shape), one)
    return FssdpState(
        planner.init_history(window=self.window, num_layers=self.num_layers,
                             num_experts=self.num_experts),
        jnp.asarray(ownership.initial_placement(self.num_layers, self.num_experts,
                                                self.num_devices)), replicas)

  def state_specs(self):
    """PartitionSpecs of `init_state()`'s leaves (None without a state): the replica codec's
    states per device (a leading device axis), everything else replicated."""
    if self.kind != "fssdp":
      return None
    specs = jax.tree.map(lambda _: P(), jax.eval_shape(self.init_state))
    return specs.replace(replicas=jax.tree.map(lambda _: P(self.axis_names), specs.replicas))

  # -- in the step -------------------------------------------------------------------------------
  def local_params(self, params: dict, pstate: FssdpState | None, *, me):
    """Inside shard_map: (params, owners_L, predicted_load_LxE, replica_state_L). fssdp replaces
    each expert leaf by this device's [L, C, ...] windows of owned experts (the gradient flows
    back into the stored slots); without a state (evaluation) the even start and a flat
    prediction. replica_state_L: the replica codec's per-layer states, this device's caches
    (None without the codec, or without a state)."""
    if self.kind != "fssdp":
      return params, None, None, None
    if pstate is None:   # an empty history predicts flat loads; replicas go plain
      pstate = self.init_state().replace(replicas=None)
    predicted_LxE = planner.predict(pstate.history)
    owner_LxE = pstate.owner_LxE
    rank_LxE = jnp.zeros_like(owner_LxE) if self.pools else None
    for group, rows in self.pools or ((None, None),):   # each pool's windows from its own slots
      experts = {path: _at(params, path) for path in self.expert_paths if group in (None, path[0])}
      owners, windows = fssdp.owned_windows(
          owner_LxE if rows is None else owner_LxE[np.asarray(rows)], experts, me,
          num_devices=self.num_devices, max_per_layer=self.max_per_layer)
      rank_LxE = (owners.rank_E if rows is None
                  else rank_LxE.at[np.asarray(rows)].set(owners.rank_E))
      for path, window in windows.items():
        params = _replace_at(params, path, window)
    owners_L = fssdp.Owners(owner_LxE, rank_LxE)
    return params, owners_L, predicted_LxE, squeeze_device_axis(pstate.replicas)

  def next_state(self, pstate: FssdpState | None, load_LxE,
                 replicas: dict | None = None) -> FssdpState | None:
    """The load history after this step's loads; `replicas` the step's replica states as stored
    (with the device axis), or None to keep them."""
    if pstate is None:
      return None
    pstate = pstate.replace(history=planner.update_history(pstate.history, load_LxE))
    return pstate if replicas is None else pstate.replace(replicas=replicas)

  def metrics(self, placement_L: dict, *, tokens_per_device: int, remat: str) -> dict:
    """Per-layer figures from the layers, plus bytes moved per device and step by kind: the token
    exchange of ep and fssdp (`a2a_bytes`, its static buffer: packed, the rows sent),
    SparseReduceScatter (`sprs_bytes`, its [N, M] buffer), and
    SparseAllGather's: `spag_bytes` (its ragged form, patches included: what a GPU moves; the
    mean over devices of what each receives), `spag_bytes_plain` (the same replicas plain),
    `spag_bytes_capacity` (the static [N, M] buffer XLA:CPU moves), all for every pass (remat
    runs the gather again), and `spag_bytes_needed` (the plan's replicas, once)."""
    metrics = dict(placement_L)
    n = self.num_devices
    if "dispatch_needed" in metrics:   # [L] shares summed over devices: the most rows any
      # device sent to one destination, per layer; the buffer holds dispatch_capacity of them
      metrics["dispatch_needed"] = jnp.round(jnp.max(metrics["dispatch_needed"]))
      metrics["dispatch_capacity"] = float(self.dispatch_capacity(tokens_per_device))
      # the most rows one device received for its experts (pieces x one piece's), per layer;
      # each piece runs receive_capacity of them
      metrics["receive_needed"] = jnp.round(jnp.max(metrics["receive_needed"]))
      metrics["receive_capacity"] = float(self.receive_capacity(tokens_per_device)
                                          * self.dispatch_chunks)
    metrics["a2a_bytes"] = 0.0
    if self.owns_experts and n > 1:     # fssdp's tokens travel in ep's exchange buffer
      metrics["a2a_bytes"] = self.num_layers * ep_a2a_bytes(
          tokens_per_device, self.top_k, self.d_model, n, self.applied_dispatch_factor,
          remat=remat, itemsize=self.itemsize, packed=self.packed_exchange,
          most=self.max_rows(tokens_per_device))
    if self.kind == "fssdp":
      m, layers = self.replica_slots, self.num_layers
      buffer = (n - 1) / n * n * m * self.expert_bytes
      # SparseAllGather runs again in backward when the layer is recomputed; its transpose once,
      # in fp32.
      passes = 2 if recomputes(remat) else 1
      metrics["spag_bytes_capacity"] = jnp.full((layers,), buffer * passes, jnp.float32)
      metrics["sprs_bytes"] = jnp.full((layers,), buffer * 4 / self.itemsize, jnp.float32)
      metrics["spag_bytes_needed"] = placement_L["replicas"] / n * self.expert_bytes
      metrics["spag_bytes"] = metrics.pop("replica_bytes") * passes
      metrics["spag_bytes_plain"] = metrics.pop("replica_bytes_plain") * passes
    return metrics

  def checkpoint_items(self, state_shardings, param_shardings) -> tuple:
    """The placement's checkpoint items (fssdp: `FssdpCheckpoint`), on the run's shardings of
    its state and of (params, opt_state)."""
    if self.kind != "fssdp":
      return ()
    return (FssdpCheckpoint(self, state_shardings, param_shardings),)

  # -- between steps -----------------------------------------------------------------------------
  def reshard(self, params, opt_state, pstate: FssdpState, shardings):
    """New owners balancing the predicted loads, heterogeneous across layers; the experts'
    parameters and optimizer moments move together (`shardings`: (params, opt_state) targets).
    -> (params, opt_state, pstate, `reshard.Resharding`)."""
    resharding = reshard.plan_reshard(
        np.asarray(planner.predict(pstate.history)), np.asarray(pstate.owner_LxE),
        self.num_devices, self.devices_per_node, max_per_layer=self.max_per_layer,
        # fp32 master weights and two Adam moments, whatever the compute dtype
        bytes_per_expert=self._expert_values * 4 * 3, pools=self.pool_rows)
    params, opt_state = self.permute((params, opt_state), resharding.perm_LxE, shardings,
                                     donate=True)
    owner = jax.device_put(resharding.owner_LxE, pstate.owner_LxE.sharding)
    pstate = pstate.replace(owner_LxE=owner)
    if self.replica_codec is not None:   # owned windows now hold other experts
      pstate = pstate.replace(replicas=replicas_lib.invalidate(pstate.replicas))
    return params, opt_state, pstate, resharding


  def permute(self, tree, perm_LxE, shardings, *, donate: bool):
    """`reshard.permute_experts` of the expert leaves, jitted once per target shardings: the
    one place stored experts move (re-sharding, and to and from a checkpoint's canonical
    order)."""
    leaves, treedef = jax.tree.flatten(shardings)
    return _permute_fn(tuple(leaves), treedef, self.expert_paths, self.pools, donate)(tree,
                                                                                      perm_LxE)


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _replace_at(tree, path, value):
  if not path:
    return value
  return dict(tree, **{path[0]: _replace_at(tree[path[0]], path[1:], value)})


@functools.cache
def _permute_fn(shardings_leaves, treedef, expert_paths, pools, donate: bool):
  shardings = jax.tree.unflatten(treedef, shardings_leaves)
  return jax.jit(functools.partial(reshard.permute_experts, expert_paths=expert_paths,
                                   group_pools=pools),
                 donate_argnums=0 if donate else (), out_shardings=shardings)


@dataclasses.dataclass(frozen=True)
class FssdpCheckpoint:
  """fssdp's checkpoint item "fssdp": {"load_history": {"loads_WxLxE", "count"},
  "expert_owner", "replica_plan" (int32 [L, N, M]: what each device's replica slots held after
  the step, which the next step's plan prefers)}. Checkpoints hold experts in canonical order
  (expert (l, e) at [l, e]), the order `load_params` and every placement read; a restore moves
  them to the saved owners."""
  placement: Placement
  state_shardings: FssdpState      # NamedShardings like the state
  param_shardings: tuple           # (params, opt_state) shardings
  name: str = "fssdp"

  def item(self, state):
    """(the item to save, the state with experts in canonical order)."""
    pstate = state.placement
    item = {"load_history": {"loads_WxLxE": pstate.history.loads_WxLxE,
                             "count": pstate.history.count},
            "expert_owner": pstate.owner_LxE}
    # The same on every device: this process's first copy, saved replicated.
    held = np.asarray(pstate.replicas["held"].addressable_shards[0].data)[0]
    item["replica_plan"] = jax.make_array_from_callback(
        held.shape, self.state_shardings.owner_LxE, lambda index: held[index])
    perm = reshard.to_canonical(np.asarray(pstate.owner_LxE), self.placement.num_devices,
                                self.placement.pool_rows)
    if not reshard.is_identity(perm):
      params, opt_state = self.placement.permute((state.params, state.opt_state), perm,
                                                 self.param_shardings, donate=False)
      state = state.replace(params=params, opt_state=opt_state)
    return item, state

  def target(self, saved_keys):
    """What the item restores into (ShapeDtypeStructs on the run's shardings); `saved_keys`
    maps the saved leaves to their (shape, dtype), so an item saved before the owners or the
    replica plan were kept restores without them, and a replica plan for another mesh restores
    as saved (then `restore` drops it)."""
    shapes = jax.eval_shape(self.placement.init_state)
    history, owner = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        (shapes.history, shapes.owner_LxE),
        (self.state_shardings.history, self.state_shardings.owner_LxE))
    target = {"load_history": {"loads_WxLxE": history.loads_WxLxE, "count": history.count},
              "expert_owner": owner}
    if not any(k.startswith("expert_owner") for k in saved_keys):
      del target["expert_owner"]
    if "replica_plan" in saved_keys:
      shape, dtype = saved_keys["replica_plan"]
      target["replica_plan"] = jax.ShapeDtypeStruct(shape, dtype,
                                                    sharding=self.state_shardings.owner_LxE)
    return target

  def restore(self, state, item, where: str, log):
    """The restored canonical state with its history, experts moved to the saved owners; an
    absent item (another placement, an older version) starts afresh with a log line."""
    if item is None:
      log(f"moejax: {where} holds no fssdp load history (written with another moe.placement or "
          "by an older version): the load predictor starts empty and the experts from the even "
          "placement, so this resume is not bit-exact")
      return state
    history = item["load_history"]
    pstate = state.placement.replace(
        history=planner.LoadHistory(history["loads_WxLxE"], history["count"]),
        replicas=self._replica_plan(state.placement.replicas, item.get("replica_plan"), where,
                                    log))
    state = state.replace(placement=pstate)
    if "expert_owner" not in item:
      return state
    owner = np.asarray(item["expert_owner"])
    n = self.placement.num_devices
    pools = reshard.pool_rows(self.placement.pool_rows, owner.shape[0])
    counts = ([ownership.experts_per_device(owner[list(rows)], n) for rows in pools]
              if owner.max() < n else None)
    if counts is None or any(len(set(c.sum(axis=0))) > 1 for c in counts):
      log(f"moejax: {where}: its expert owners are for another number of devices; experts "
          f"start from the even placement on {n} devices")
      return state
    perm = reshard.from_canonical(owner, n, self.placement.pool_rows)
    if not reshard.is_identity(perm):
      params, opt_state = self.placement.permute((state.params, state.opt_state), perm,
                                                 self.param_shardings, donate=True)
      state = state.replace(params=params, opt_state=opt_state)
    owner = jax.device_put(owner, self.state_shardings.owner_LxE)
    return state.replace(placement=pstate.replace(owner_LxE=owner))

  def _replica_plan(self, replicas: dict, saved, where: str, log) -> dict:
    """`replicas` with the saved plan as every device's `held`; unchanged, with a log line, when
    the checkpoint has none or one for another mesh (the next step plans afresh)."""
    want = replicas["held"].shape[1:]
    if saved is None or tuple(saved.shape) != want:
      log(f"moejax: {where} holds no replica plan for {want[1]} devices x {want[2]} slots "
          "(an older version or another mesh wrote it): the next step plans its replicas "
          "without last step's, so this resume is not bit-exact")
      return replicas
    held = np.broadcast_to(np.asarray(saved)[None], replicas["held"].shape)
    return {**replicas, "held": jax.make_array_from_callback(
        held.shape, self.state_shardings.replicas["held"], lambda index: held[index])}
