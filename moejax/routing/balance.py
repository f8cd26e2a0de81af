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

# Each MoE layer group's bias, [its layers, E] in the parameter tree: the MoE layers ("layers"),
# and those with linear attention ("linear_layers"), whose rows of the step's [L, E] load (all MoE
# layers in model order) `apply`'s `rows` names.
BIAS_PATH = ("layers", "moe", "score_bias")


def updated_bias(bias_LxE, load_LxE, rate: float):
  """The bias after one step whose router chose `load_LxE` assignments (all devices)."""
  load_LxE = load_LxE.astype(jnp.float32)
  mean_Lx1 = jnp.mean(load_LxE, axis=-1, keepdims=True)
  return bias_LxE + rate * jnp.sign(mean_Lx1 - load_LxE)


def apply(params: dict, load_LxE, rate: float, rows: dict | None = None) -> dict:
  """`params` with the MoE layers' score bias moved (unchanged if rate is 0). `rows`: {MoE layer
  group: the rows of `load_LxE` its layers are, in its order} (`olmoe.moe_rows`; None: one
  group, "layers", all of them)."""
  if rate == 0:
    return params
  layers_key, moe_key, bias_key = BIAS_PATH
  rows = {layers_key: None} if rows is None else rows
  for group, at in rows.items():
    load = load_LxE if at is None else load_LxE[jnp.asarray(at)]
    moe = params[group][moe_key]
    moe = dict(moe, **{bias_key: updated_bias(moe[bias_key], load, rate)})
    params = dict(params, **{group: dict(params[group], **{moe_key: moe})})
  return params
