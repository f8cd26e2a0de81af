"""The MoE feed-forward block, usable in any Flax NNX model (and Linen via `nnx.bridge`).

One step per stage, each replaceable:
  router (top-k) -> admission (capacity, affinity) -> placement/dispatch -> experts -> combine
The router's options: softmax or sigmoid scores, renormalized or not, scaled (`routed_scale`),
chosen among the best expert groups (`groups`, `top_groups`) and with a selection-only per-expert
bias (`score_bias`, moved from the load by the train step: `moejax.routing.balance`),
the routed weights applied to the experts' outputs, or to their inputs (`weights_on_input`,
Llama 4's), plus, with `shared_hidden` > 0, a shared expert every token passes through
(DeepSeek's shared experts side by side as one SwiGLU of their summed width; Qwen2-MoE's scaled
by a sigmoid gate of the token, `shared_gate`). The shared expert is a dense layer parameter: it is gathered like
attention, never placed like the routed experts, and routing, admission and telemetry ignore it.
Letters: B batch, S sequence, T = B*S tokens, D width, E experts, K chosen per token, F expert
hidden width.

`__call__(x_BxSxD) -> (y_BxSxD, aux)`. `aux` holds this device's shares of the auxiliary losses
(`aux_loss`, `z_loss`, `locality_loss`; see `moejax.routing.router` for the share convention),
the router's assignment counts per expert `load_E` (before admission) and `admitted_load_E`
(after it), `dropped` (assignments lost to a full dispatch buffer), `routing`, the telemetry of
`moejax.routing.stats` after admission, and with fssdp's replica codec the layer's next
`replica_state` (`moejax.codec.replicas`). With `defer_reductions`, the losses' and statistics'
per-device terms (`unreduced`) stand in for them until `finish_aux`. The block is pure: it runs
under jit, scan, remat and shard_map.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from moejax import profiling
from moejax.layers.matmul import dense
from moejax.placement import dispatch as dispatch_lib
from moejax.placement import experts as experts_lib
from moejax.routing import admission as admission_lib
from moejax.routing import router as router_lib
from moejax.routing import stats as stats_lib
from moejax.placement import fssdp as sparse
from moejax.layers.mlp import swiglu, swiglu_weights
from moejax.sharding.axes import (BIASES, EMBED, EXPERT, EXPERT_SCORE, EXPERTS, MLP, ROUTER,
                                  ROUTER_BIAS, ROUTER_FP32, SHARED_EXPERTS, param)


@dataclasses.dataclass(frozen=True)
class MoESpec:
  num_experts: int
  top_k: int
  score: str = "softmax"
  renormalize: bool = False
  # Capacity-limited affinity admission (moejax.routing.admission): "none" | "strict" | "reroute".
  admission: str = "none"
  threshold: float = -1.0
  capacity_factor: float = 1.25           # capacity = ceil(factor * T * K / E) per expert
  capacity_factor_warmup: float = 2.0     # ... while step < warmup_steps
  warmup_steps: int = 0
  locality_weight: float = 0.0            # > 0: add the locality loss (ep placement)
  shared_hidden: int = 0                  # width of the shared expert; 0 = none
  shared_gate: bool = False               # scale the shared expert by sigmoid(x . w) (Qwen2-MoE)
  shared_scale: float = 1.0               # ... and by this (Cohere2-MoE's average: 0.5)
  routed_scale: float = 1.0               # multiplies the routed weights (routed_scaling_factor)
  groups: int = 1                         # group-limited top-k: expert groups (n_group) ...
  top_groups: int = 1                     # ... of which a token uses the best (topk_group)
  group_score: str = "top2"               # ... scored by their two best experts, or the best
  score_bias: bool = False                # a selection-only score bias (e_score_correction_bias)
  bias_on_logits: bool = False            # ... added to the logits rather than the scores
  router_float32: bool = False            # the router in float32 (always with a score bias)
  router_bias: bool = False               # a trained bias in the router's logits (gpt-oss)
  expert_bias: bool = False               # biases on the experts' projections (gpt-oss)
  activation: str = "swiglu"              # the experts': "swiglu" | "swiglu_clamped" (gpt-oss)
  swiglu_alpha: float = 1.702             # ... its sigmoid's slope
  swiglu_limit: float = 7.0               # ... and clamp
  weights_on_input: bool = False          # expert(w x), not w expert(x) (Llama 4)

  @property
  def expert_fn(self) -> experts_lib.ExpertFn:
    return experts_lib.ExpertFn(self.activation, self.swiglu_alpha, self.swiglu_limit,
                                self.expert_bias)

  def __post_init__(self):
    """ValueError naming the field, so a block built from a bad spec fails here, not with a
    shape or division error at its first call (train.py's config checks the same fields)."""
    def need(ok, message):
      if not ok:
        raise ValueError(f"MoESpec.{message}")
    for field in ("num_experts", "top_k", "warmup_steps", "shared_hidden", "groups",
                  "top_groups"):
      value = getattr(self, field)
      need(isinstance(value, (int, np.integer)) and not isinstance(value, bool),
           f"{field}={value!r}: must be an int")
    need(self.num_experts >= 1, f"num_experts={self.num_experts}: must be >= 1")
    need(1 <= self.top_k <= self.num_experts,
         f"top_k={self.top_k}: must be in [1, num_experts={self.num_experts}]")
    need(self.score in router_lib.SCORE_FUNCTIONS,
         f"score={self.score!r}: must be one of {', '.join(router_lib.SCORE_FUNCTIONS)}")
    need(self.group_score in router_lib.GROUP_SCORES,
         f"group_score={self.group_score!r}: must be one of "
         f"{', '.join(router_lib.GROUP_SCORES)}")
    need(self.admission in admission_lib.POLICIES,
         f"admission={self.admission!r}: must be one of {', '.join(admission_lib.POLICIES)}")
    need(-1.0 <= self.threshold <= 1.0, f"threshold={self.threshold}: a cosine similarity, in "
         "[-1, 1]")
    for field in ("capacity_factor", "capacity_factor_warmup", "routed_scale", "shared_scale"):
      need(0 < getattr(self, field) < math.inf,
           f"{field}={getattr(self, field)}: must be positive and finite")
    for field in ("warmup_steps", "locality_weight", "shared_hidden"):
      need(0 <= getattr(self, field) < math.inf,
           f"{field}={getattr(self, field)}: must be >= 0 and finite")
    need(self.activation in experts_lib.ACTIVATIONS,
         f"activation={self.activation!r}: must be one of {', '.join(experts_lib.ACTIVATIONS)}")
    for field in ("swiglu_alpha", "swiglu_limit"):
      need(0 < getattr(self, field) < math.inf,
           f"{field}={getattr(self, field)}: must be positive and finite")
    need(self.shared_hidden > 0 or not self.shared_gate,
         "shared_gate=True needs a shared expert (shared_hidden > 0)")
    need(self.groups >= 1 and self.num_experts % self.groups == 0
         and (self.groups == 1 or self.num_experts // self.groups >= 2),
         f"groups={self.groups}: must divide num_experts={self.num_experts} into groups of at "
         "least 2 experts (or be 1)")
    need(1 <= self.top_groups <= self.groups
         and self.top_groups * (self.num_experts // self.groups) >= self.top_k,
         f"top_groups={self.top_groups}: must be in [1, groups={self.groups}] with enough "
         f"experts for top_k={self.top_k}")


def local_experts_mask(dispatch: dispatch_lib.Dispatch, num_experts: int):
  """[E] bool: experts owned by a device on this device's node (ep placement)."""
  per_device = num_experts // dispatch.num_devices
  my_node = lax.axis_index(dispatch.axis_names) // dispatch.devices_per_node
  owner_node_E = (jnp.arange(num_experts) // per_device) // dispatch.devices_per_node
  return owner_node_E == my_node


def finish_aux(aux: dict, top_k: int, axis_name=None,
               dispatch: dispatch_lib.Dispatch = dispatch_lib.LOCAL) -> dict:
  """The block's aux with its per-device terms (`aux["unreduced"]`, from `defer_reductions`)
  turned into the losses (`aux_loss`, `z_loss`, `locality_loss`: this device's shares) and the
  statistics (`routing`; under ep and fssdp, `dispatch`'s, the straggler and the dispatch rows
  needed in `placement`). The terms may be stacked over leading axes (a scan's layers): their
  counts are summed over `axis_name` in one collective for all of them."""
  if "unreduced" not in aux:
    raise ValueError("finish_aux: this aux holds no per-device terms (aux['unreduced']): it "
                     "comes from a call with defer_reductions=True, whose aux this finishes")
  aux = dict(aux)
  if "rows_received" in aux.get("placement", {}):
    aux["placement"] = sparse.finish_placement(aux["placement"], dispatch)
  terms = aux.pop("unreduced")
  total = router_lib.total_tokens(terms["tokens"], axis_name)
  aux["aux_loss"] = router_lib.balance_from_terms(terms["balance_E"], aux["load_E"], total, top_k,
                                                  axis_name)
  aux["z_loss"] = router_lib.from_token_terms(terms["z"], total)
  aux["locality_loss"] = (router_lib.from_token_terms(terms["locality"], total)
                          if "locality" in terms else jnp.zeros_like(total))
  aux["routing"] = stats_lib.stats_from_counts(aux["admitted_load_E"], terms["rerouted"],
                                               terms["tokens"], top_k, axis_name)
  return aux


def _explicit_axes(*arrays) -> tuple[tuple, object]:
  """(the Explicit mesh axes any of `arrays` is sharded over, their mesh); ((), None) outside
  such a mesh."""
  used, found = set(), None
  for x in arrays:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
      continue
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind == jax.sharding.AxisType.Explicit}
    for entry in sharding.spec:
      axes = (set(entry if isinstance(entry, tuple) else (entry,)) - {None}) & explicit
      if axes:
        used |= axes
        found = mesh
  return tuple(sorted(used)), found


def _check_input(block, x, dispatch, materialized, token_mask=None) -> None:
  """One line naming what is wrong with a call's arguments, before anything traces."""
  d = block.router.shape[0]
  shape = tuple(getattr(x, "shape", ()))
  if len(shape) != 3 or shape[-1] != d or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"MoEBlock: x_BxSxD must be a float array [batch, seq, d_model={d}], got "
                     f"{getattr(x, 'dtype', type(x).__name__)}{list(shape)}")
  if 0 in shape:
    raise ValueError(f"MoEBlock: x_BxSxD {list(shape)} holds no token")
  if token_mask is not None and (tuple(getattr(token_mask, "shape", ())) != shape[:2]
                                 or getattr(token_mask, "dtype", None) != jnp.bool_):
    raise ValueError(f"MoEBlock: token_mask must be bool [batch, seq] = {list(shape[:2])}, got "
                     f"{getattr(token_mask, 'dtype', type(token_mask).__name__)}"
                     f"{list(getattr(token_mask, 'shape', ()))}")
  if not isinstance(dispatch, dispatch_lib.Dispatch):
    raise ValueError(f"MoEBlock: dispatch must be a moejax.placement.dispatch.Dispatch, got "
                     f"{type(dispatch).__name__}")
  if dispatch.kind == "fssdp" and materialized is None:
    raise ValueError("MoEBlock: dispatch kind 'fssdp' needs materialized= (from "
                     "MoEBlock.materialize)")
  if dispatch.kind == "ep" and block.w_gate.shape[0] * dispatch.num_devices != block.spec.num_experts:
    raise ValueError(f"MoEBlock: ep dispatch over num_devices={dispatch.num_devices} with "
                     f"{block.w_gate.shape[0]} experts here makes "
                     f"{block.w_gate.shape[0] * dispatch.num_devices}, not the spec's "
                     f"{block.spec.num_experts}: shard the experts over the dispatch's devices")
  for name in dispatch.axis_names if dispatch.kind != "local" else ():
    try:
      lax.axis_size(name)
    except NameError:
      raise ValueError(f"MoEBlock: dispatch kind {dispatch.kind!r} exchanges over mesh axis "
                       f"{name!r}, which is not bound here: call the block inside jax.shard_map "
                       "over a mesh with that axis") from None


class MoEBlock(nnx.Module):
  """See the module docstring. With `fssdp` dispatch, call `materialize` first (before the
  layer's attention, so its collective overlaps it) and pass the result as `materialized`."""

  def __init__(self, d_model: int, expert_hidden: int, spec: MoESpec, *, init_std: float = 0.02,
               rngs: nnx.Rngs):
    for name, value in (("d_model", d_model), ("expert_hidden", expert_hidden)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"MoEBlock: {name}={value!r}: must be a positive int")
    if not isinstance(spec, MoESpec):
      raise ValueError(f"MoEBlock: spec must be a moejax.layers.moe.MoESpec, got "
                       f"{type(spec).__name__}")
    e, d, f = spec.num_experts, d_model, expert_hidden
    init = jax.nn.initializers.normal(init_std)
    # With a score bias (DeepSeek-V3) the router is gathered in float32, as its bias is; so it is
    # where asked (Flint).
    self.router = param(init(rngs.params(), (d, e), jnp.float32), (EMBED, EXPERT_SCORE),
                        ROUTER_FP32 if spec.score_bias or spec.router_float32 else ROUTER)
    if spec.score_bias:
      self.score_bias = param(jnp.zeros((e,), jnp.float32), (EXPERT_SCORE,), ROUTER_BIAS)
    if spec.router_bias:
      self.router_b = param(jnp.zeros((e,), jnp.float32), (EXPERT_SCORE,), BIASES)
    self.w_gate = param(init(rngs.params(), (e, d, f), jnp.float32), (EXPERT, EMBED, MLP), EXPERTS)
    self.w_up = param(init(rngs.params(), (e, d, f), jnp.float32), (EXPERT, EMBED, MLP), EXPERTS)
    self.w_down = param(init(rngs.params(), (e, f, d), jnp.float32), (EXPERT, MLP, EMBED), EXPERTS)
    if spec.expert_bias:     # placed with the experts (their expert axis), not decayed
      self.b_gate = param(jnp.zeros((e, f), jnp.float32), (EXPERT, MLP), BIASES)
      self.b_up = param(jnp.zeros((e, f), jnp.float32), (EXPERT, MLP), BIASES)
      self.b_down = param(jnp.zeros((e, d), jnp.float32), (EXPERT, EMBED), BIASES)
    if spec.shared_hidden:
      self.shared_w_gate, self.shared_w_up, self.shared_w_down = swiglu_weights(
          d, spec.shared_hidden, SHARED_EXPERTS, init, rngs)
      if spec.shared_gate:
        self.shared_gate = param(init(rngs.params(), (d, 1), jnp.float32), (EMBED, EXPERT_SCORE),
                                 ROUTER)
    self.spec = spec

  def expert_weights(self, dtype) -> tuple:
    """The expert arrays `spec.expert_fn` takes, in `dtype`: (w_gate, w_up, w_down) and, with
    expert biases, (b_gate, b_up, b_down)."""
    names = ("w_gate", "w_up", "w_down") + (("b_gate", "b_up", "b_down")
                                            if self.spec.expert_bias else ())
    return tuple(getattr(self, name)[...].astype(dtype) for name in names)

  def shared_expert(self, x_TxD):
    """The shared expert's output [T, D] in x's dtype (SwiGLU, then the gate if any)."""
    dtype = x_TxD.dtype
    y_TxD = swiglu(x_TxD, self.shared_w_gate[...], self.shared_w_up[...], self.shared_w_down[...])
    if self.spec.shared_gate:
      gate_Tx1 = jax.nn.sigmoid(dense(x_TxD, self.shared_gate[...].astype(dtype), jnp.float32))
      y_TxD = (gate_Tx1 * y_TxD.astype(jnp.float32)).astype(dtype)
    if self.spec.shared_scale != 1.0:
      y_TxD = (y_TxD.astype(jnp.float32) * self.spec.shared_scale).astype(dtype)
    return y_TxD

  def materialize(self, predicted_load_E, dtype, *, dispatch: dispatch_lib.Dispatch,
                  owners: sparse.Owners | None = None, replica_state: dict | None = None):
    """fssdp: this step's plan and replicas (`fssdp.Materialized`). With `owners`
    (heterogeneous ownership) the expert weights hold this device's experts of the layer by rank
    (`fssdp.owned_windows`); with `replica_state` (the replica codec) slots that kept their
    expert receive patches."""
    return sparse.materialize(predicted_load_E, *self.expert_weights(dtype), dispatch=dispatch,
                              owners=owners, replica_state=replica_state)

  def __call__(self, x_BxSxD, *, dispatch: dispatch_lib.Dispatch = dispatch_lib.LOCAL,
               axis_name=None, step=0, materialized=None, token_mask=None,
               defer_reductions=False):
    """`token_mask` [B, S] bool marks the real tokens: padding (False) routes to no expert, takes
    no admission capacity, is left out of the losses and statistics, and its y is 0.
    `defer_reductions`: aux holds the losses' and statistics' per-device terms
    (`aux["unreduced"]`) in their place, for `finish_aux` after the caller's scan over layers:
    the block then issues no collective but its placement's exchanges (none under fsdp)."""
    _check_input(self, x_BxSxD, dispatch, materialized, token_mask)
    if axis_name is None and dispatch.kind != "local":
      # Each device holds its own tokens: the losses and statistics are their shares over the
      # exchange's axes (per-device figures summed over devices would count N times over).
      axis_name = dispatch.axis_names
    graphdef, state = nnx.split(self)
    explicit, mesh = _explicit_axes(x_BxSxD, *jax.tree.leaves(state),
                                    *jax.tree.leaves(materialized))
    if not explicit:
      return self._forward(x_BxSxD, dispatch=dispatch, axis_name=axis_name, step=step,
                           materialized=materialized, token_mask=token_mask,
                           defer_reductions=defer_reductions)
    # x or the weights sharded over Explicit mesh axes (jax.make_mesh's default): the sort and the
    # experts' gathers run over every token, which explicit sharding types refuse. The block
    # runs with those axes Auto (XLA's partitioner places it; the parameters enter as arguments,
    # typed there too) and returns y sharded as x, aux replicated.

    def run(state, x, step, materialized, token_mask):
      return nnx.merge(graphdef, state)._forward(x, dispatch=dispatch, axis_name=axis_name,
                                                 step=step, materialized=materialized,
                                                 token_mask=token_mask,
                                                 defer_reductions=defer_reductions)

    x_spec = jax.typeof(x_BxSxD).sharding.spec
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.sharding.auto_axes(run, axes=explicit, out_sharding=(x_spec, P()))(
          state, x_BxSxD, step, materialized, token_mask)

  def _forward(self, x_BxSxD, *, dispatch, axis_name, step, materialized, token_mask=None,
               defer_reductions=False):
    b, s, d = x_BxSxD.shape
    spec = self.spec
    x_TxD = x_BxSxD.reshape(b * s, d)
    mask_T = None if token_mask is None else token_mask.reshape(b * s)
    if mask_T is not None:
      # Padding zeroed before anything reads it: the outputs below are masked, but a NaN or inf
      # in a padded row would still reach the router's and shared expert's gradients (0 x inf).
      x_TxD = jnp.where(mask_T[:, None], x_TxD, jnp.zeros((), x_TxD.dtype))
    x_shared_TxD = x_TxD     # the shared expert's input (x_TxD may become the assignments')
    with profiling.scope("router"):
      router_DxE = self.router[...]
      if router_DxE.dtype != jnp.float32:
        router_DxE = router_DxE.astype(x_TxD.dtype)
      # Router: logits in fp32 for a stable softmax and z-loss (from fp32 inputs when the router
      # is kept in fp32).
      logits_TxE = dense(x_TxD.astype(router_DxE.dtype), router_DxE, jnp.float32)
      if spec.router_bias:
        logits_TxE = logits_TxE + self.router_b[...].astype(jnp.float32)[None, :]
      weights_TxK, experts_TxK, scores_TxE = router_lib.top_k_route(
          logits_TxE, spec.top_k, score=spec.score, renormalize=spec.renormalize,
          bias_E=self.score_bias[...] if spec.score_bias else None, groups=spec.groups,
          top_groups=spec.top_groups, scale=spec.routed_scale, group_score=spec.group_score,
          bias_on_logits=spec.bias_on_logits)
      if mask_T is not None:    # padding: empty slots (expert E), which nothing keeps
        experts_TxK = jnp.where(mask_T[:, None], experts_TxK, spec.num_experts)
        weights_TxK = jnp.where(mask_T[:, None], weights_TxK, 0.0)
      # The losses' and statistics' per-device terms; `finish_aux` sums their counts over the
      # axis (here, or after the caller's scan over the layers: no collective in the layer).
      unreduced = {
          "balance_E": router_lib.balance_terms(scores_TxE, mask_T),
          "z": router_lib.z_terms(logits_TxE, mask_T),
          "tokens": router_lib.local_tokens(b * s, mask_T),
      }
      # Padding's slots hold expert E, which counts nowhere.
      aux = {"load_E": router_lib.expert_counts(experts_TxK, spec.num_experts)}
      kept_TxK = rerouted_TxK = None
      if spec.admission != "none":
        capacity_E = admission_lib.capacity_schedule(
            step, num_tokens=b * s, k=spec.top_k, num_experts=spec.num_experts,
            factor=spec.capacity_factor, factor_warmup=spec.capacity_factor_warmup,
            warmup_steps=spec.warmup_steps)
        allowed_TxE = None
        if spec.admission == "reroute":   # rerouted assignments stay in the token's groups
          allowed_TxE = router_lib.allowed_experts(
              logits_TxE if spec.bias_on_logits else scores_TxE,
              bias_E=self.score_bias[...] if spec.score_bias else None,
              groups=spec.groups, top_groups=spec.top_groups, group_score=spec.group_score)
        admitted = admission_lib.admit(x_TxD, router_DxE, experts_TxK, weights_TxK, scores_TxE,
                                       capacity_E=capacity_E, threshold=spec.threshold,
                                       policy=spec.admission, allowed_TxE=allowed_TxE)
        experts_TxK, weights_TxK = admitted.experts_TxK, admitted.weights_TxK
        kept_TxK, rerouted_TxK = admitted.kept_TxK, admitted.rerouted_TxK
      if spec.locality_weight > 0 and dispatch.kind == "ep":
        unreduced["locality"] = router_lib.locality_terms(
            scores_TxE, local_experts_mask(dispatch, spec.num_experts), mask_T)
      aux["admitted_load_E"] = router_lib.expert_counts(experts_TxK, spec.num_experts, kept_TxK)
      unreduced["rerouted"] = stats_lib.rerouted_count(experts_TxK, spec.num_experts, kept_TxK,
                                                       rerouted_TxK, mask_T)
      aux["unreduced"] = unreduced
    with profiling.scope("experts"):
      w, fn = self.expert_weights(x_TxD.dtype), spec.expert_fn
      t, k = experts_TxK.shape
      if spec.weights_on_input:
        # Each assignment its own token, scaled by its weight on the way in (in fp32), routed to
        # its one expert with weight 1; the K outputs are summed below. The dispatch sees the
        # same T*K rows it repeats otherwise.
        x_TxD = (jnp.repeat(x_TxD, k, axis=0).astype(jnp.float32)
                 * weights_TxK.reshape(-1, 1).astype(jnp.float32)).astype(x_TxD.dtype)
        experts_TxK = experts_TxK.reshape(-1, 1)
        weights_TxK = jnp.ones_like(weights_TxK).reshape(-1, 1)
      if dispatch.kind == "local":
        y_TxD, dropped = dispatch_lib.local_experts(x_TxD, experts_TxK, weights_TxK, *w, fn=fn)
      elif dispatch.kind == "ep":
        y_TxD, dropped, received, needed = dispatch_lib.ep_experts(
            x_TxD, experts_TxK, weights_TxK, *w, dispatch=dispatch, fn=fn)
        aux["placement"] = sparse.ep_stats(experts_TxK, received, needed, dispatch, d,
                                           w[0].shape[0], x_TxD.dtype.itemsize)
      elif dispatch.kind == "fssdp":
        y_TxD, dropped, aux["placement"], replica_state = sparse.fssdp_experts(
            x_TxD, experts_TxK, weights_TxK, materialized, dispatch=dispatch, fn=fn)
        if replica_state is not None:
          aux["replica_state"] = replica_state
      else:
        raise ValueError(f"unknown dispatch kind {dispatch.kind!r}")
    aux["dropped"] = dropped
    if spec.weights_on_input:      # the K assignments' outputs back to their token, in fp32
      y_TxD = y_TxD.reshape(t, k, d).sum(axis=1)
    y_TxD = y_TxD.astype(x_BxSxD.dtype)
    if spec.shared_hidden:
      y_TxD = y_TxD + self.shared_expert(x_shared_TxD)
    if mask_T is not None:
      y_TxD = jnp.where(mask_T[:, None], y_TxD, jnp.zeros((), y_TxD.dtype))
    if not defer_reductions:
      aux = finish_aux(aux, spec.top_k, axis_name, dispatch)
    return y_TxD.reshape(b, s, d), aux
