"""The floor for bench/step.py: moejax's one-device train step written as plain JAX.

The same math as `moejax.train.step` with `placement=fsdp` on one device and no admission:
embedding, L x (RMSNorm, rotary attention with QK-norm, RMSNorm, softmax top-k MoE with SwiGLU
experts), RMSNorm, untied head; cross-entropy plus the load-balancing and z-losses; AdamW with
clipping (`moejax.train.optim.make_optimizer`, which is plain optax). It calls moejax's pure
functions for the norms, rotary embeddings and router losses. bf16 compute, fp32 master
weights, one `jit`, no `shard_map`, no gather hook, no telemetry. The experts run through
`moejax.placement.experts.grouped_swiglu` (the kernel both sides share), so the ratio
moejax / reference is the cost of everything around the kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from moejax.config import Config
from moejax.layers.attention import apply_rotary, rotary_tables
from moejax.layers.matmul import dense
from moejax.layers.norm import rms_norm
from moejax.placement.experts import grouped_swiglu
from moejax.routing.router import load_balancing_loss, router_z_loss
from moejax.sharding.prefetch import checkpointed
from moejax.train import optim

BF16 = jnp.bfloat16


def _attention(cfg: Config, p, x_BxSxD, cos_SxDh, sin_SxDh):
  m = cfg.model
  b, s, _ = x_BxSxD.shape
  heads = (b, s, m.num_heads, m.head_dim)
  q = rms_norm(dense(x_BxSxD, p["wq"].astype(BF16)), p["q_norm"], m.norm_eps).reshape(heads)
  k = rms_norm(dense(x_BxSxD, p["wk"].astype(BF16)), p["k_norm"], m.norm_eps).reshape(heads)
  v = (dense(x_BxSxD, p["wv"].astype(BF16))).reshape(heads)
  out = jax.nn.dot_product_attention(apply_rotary(q, cos_SxDh, sin_SxDh),
                                     apply_rotary(k, cos_SxDh, sin_SxDh), v, is_causal=True)
  return dense(out.reshape(b, s, -1), p["wo"].astype(BF16))


def _moe(cfg: Config, p, x_BxSxD):
  e, k = cfg.moe.num_experts, cfg.moe.top_k
  b, s, d = x_BxSxD.shape
  x_TxD = x_BxSxD.reshape(b * s, d)
  logits_TxE = dense(x_TxD, p["router"].astype(BF16), jnp.float32)
  scores_TxE = jax.nn.softmax(logits_TxE, axis=-1)
  weights_TxK, experts_TxK = jax.lax.top_k(scores_TxE, k)
  expert_A = experts_TxK.reshape(-1)
  counts_E = jnp.bincount(expert_A, length=e)
  aux, z = load_balancing_loss(scores_TxE, experts_TxK), router_z_loss(logits_TxE)
  order_A = jnp.argsort(expert_A, stable=True)
  token_A = order_A // k
  y_sorted_AxD = grouped_swiglu(x_TxD[token_A], counts_E.astype(jnp.int32),
                                p["w_gate"].astype(BF16), p["w_up"].astype(BF16),
                                p["w_down"].astype(BF16))
  y_AxD = jnp.zeros_like(y_sorted_AxD).at[order_A].set(y_sorted_AxD)
  y_TxD = jnp.einsum("tkd,tk->td", y_AxD.reshape(b * s, k, d).astype(jnp.float32), weights_TxK)
  return y_TxD.astype(BF16).reshape(b, s, d), aux, z


def loss_fn(cfg: Config, params, inputs_BxS, targets_BxS, *, remat: str):
  m = cfg.model
  cos_SxDh, sin_SxDh = rotary_tables(inputs_BxS.shape[1], m.head_dim, m.rope_theta)

  def layer(h_BxSxD, p):
    h_BxSxD = h_BxSxD + _attention(cfg, p["attn"], rms_norm(h_BxSxD, p["attn_norm"]["scale"],
                                                       m.norm_eps), cos_SxDh, sin_SxDh)
    y, aux, z = _moe(cfg, p["moe"], rms_norm(h_BxSxD, p["ffn_norm"]["scale"], m.norm_eps))
    return h_BxSxD + y, (aux, z)

  h_BxSxD = params["embed"].astype(BF16)[inputs_BxS]
  h_BxSxD, (aux_L, z_L) = jax.lax.scan(checkpointed(layer, remat), h_BxSxD, params["layers"])
  h_BxSxD = rms_norm(h_BxSxD, params["final_norm"], m.norm_eps)
  logits = dense(h_BxSxD, params["lm_head"].astype(BF16), jnp.float32)
  ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxS))
  return ce + cfg.moe.aux_loss_weight * jnp.mean(aux_L) + cfg.moe.z_loss_weight * jnp.mean(z_L), ce


def make_train_step(cfg: Config, *, remat: str):
  """(train_step(params, opt_state, batch) -> (params, opt_state, ce), optimizer)."""
  tx = optim.make_optimizer(cfg)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    grads, ce = jax.grad(loss_fn, argnums=1, has_aux=True)(
        cfg, params, batch["inputs"], batch["targets"], remat=remat)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ce

  return train_step, tx
