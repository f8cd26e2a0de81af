"""Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias on the router's scores,
used for the top-k choice only (`router.top_k_route(bias_E=...)`), moved after every step
against the load it saw:

  b_e <- b_e + rate * sign(mean_e' load_e' - load_e)

so an overloaded expert becomes less likely to be chosen and an idle one more, without a loss
term that pulls on the router's gradients. Letters: L MoE layers, E experts.

The bias is a parameter of each MoE layer (`moe.score_bias`, group `axes.ROUTER_BIAS`): it is
checkpointed, exported (`e_score_correction_bias`) and sharded like any other, and no gradient
or weight decay reaches it; only `apply` moves it.
"""
from __future__ import annotations

import jax.numpy as jnp

BIAS_PATH = ("layers", "moe", "score_bias")   # [L, E] in the parameter tree


def updated_bias(bias_LxE, load_LxE, rate: float):
  """The bias after one step whose router chose `load_LxE` assignments (all devices)."""
  load_LxE = load_LxE.astype(jnp.float32)
  mean_Lx1 = jnp.mean(load_LxE, axis=-1, keepdims=True)
  return bias_LxE + rate * jnp.sign(mean_Lx1 - load_LxE)


def apply(params: dict, load_LxE, rate: float) -> dict:
  """`params` with the MoE layers' score bias moved (unchanged if rate is 0)."""
  if rate == 0:
    return params
  layers_key, moe_key, bias_key = BIAS_PATH
  moe = params[layers_key][moe_key]
  moe = dict(moe, **{bias_key: updated_bias(moe[bias_key], load_LxE, rate)})
  return dict(params, **{layers_key: dict(params[layers_key], **{moe_key: moe})})
