"""The MoE feed-forward block, usable in any Flax NNX model (and Linen via `nnx.bridge`).

One step per stage, each replaceable:
  router -> admission -> placement/dispatch -> experts -> combine
Letters: B batch, S sequence, T = B*S tokens, D width, E experts, K chosen per token, F expert
hidden width.

`__call__(x_BxSxD) -> (y_BxSxD, aux)`. `aux` holds this device's shares of the auxiliary losses
(`aux_loss`, `z_loss`; see `moejax.routing.router` for the share convention), the assignment
counts per expert `load_E`, and `dropped` (assignments lost to a full dispatch buffer).
The block is pure: nothing is mutated, so it runs under jit, scan, remat and shard_map.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.layers import dispatch as dispatch_lib
from moejax.routing import router as router_lib


@dataclasses.dataclass(frozen=True)
class MoESpec:
  num_experts: int
  top_k: int
  score: str = "softmax"
  renormalize: bool = False


class MoEBlock(nnx.Module):
  def __init__(self, d_model: int, expert_hidden: int, spec: MoESpec, *, init_std: float = 0.02,
               rngs: nnx.Rngs):
    e, d, f = spec.num_experts, d_model, expert_hidden
    init = jax.nn.initializers.normal(init_std)
    self.router = nnx.Param(init(rngs.params(), (d, e), jnp.float32))
    self.w_gate = nnx.Param(init(rngs.params(), (e, d, f), jnp.float32))
    self.w_up = nnx.Param(init(rngs.params(), (e, d, f), jnp.float32))
    self.w_down = nnx.Param(init(rngs.params(), (e, f, d), jnp.float32))
    self.spec = spec

  def __call__(self, x_BxSxD, *, dispatch: dispatch_lib.Dispatch = dispatch_lib.LOCAL,
               axis_name=None):
    b, s, d = x_BxSxD.shape
    spec = self.spec
    x_TxD = x_BxSxD.reshape(b * s, d)
    # Router: logits in fp32 for stable softmax / z-loss.
    logits_TxE = jnp.dot(x_TxD, self.router[...].astype(x_TxD.dtype),
                         preferred_element_type=jnp.float32)
    weights_TxK, experts_TxK, scores_TxE = router_lib.top_k_route(
        logits_TxE, spec.top_k, score=spec.score, renormalize=spec.renormalize)
    aux = {
        "aux_loss": router_lib.load_balancing_loss(scores_TxE, experts_TxK, axis_name=axis_name),
        "z_loss": router_lib.router_z_loss(logits_TxE, axis_name=axis_name),
        "load_E": router_lib.expert_counts(experts_TxK, spec.num_experts),
    }
    w = (self.w_gate[...].astype(x_TxD.dtype), self.w_up[...].astype(x_TxD.dtype),
         self.w_down[...].astype(x_TxD.dtype))
    if dispatch.kind == "local":
      y_TxD, dropped = dispatch_lib.local_experts(x_TxD, experts_TxK, weights_TxK, *w)
    elif dispatch.kind == "ep":
      y_TxD, dropped = dispatch_lib.ep_experts(x_TxD, experts_TxK, weights_TxK, *w,
                                               dispatch=dispatch)
    else:
      raise ValueError(f"unknown dispatch kind {dispatch.kind!r}")
    aux["dropped"] = dropped
    return y_TxD.astype(x_BxSxD.dtype).reshape(b, s, d), aux
