"""The floor for bench/step.py: moejax's one-device train step written as plain JAX.

The same math as `moejax.train.step` with `placement=fsdp` on one device and no admission:
embedding, L x (RMSNorm, rotary attention with QK-norm, RMSNorm, softmax top-k MoE with SwiGLU
experts), RMSNorm, untied head; cross-entropy plus the load-balancing and z-losses; AdamW with
clipping (`moejax.train.optim.make_optimizer`, which is plain optax). It calls moejax's pure
functions for the norms, rotary embeddings and router losses. bf16 compute, fp32 master
weights, one `jit`, no `shard_map`, no gather hook, no telemetry. The experts run through
`moejax.placement.experts.grouped_swiglu` (the kernel both sides share), so the ratio
moejax / reference is the cost of everything around the kernel.

`make_sharded_train_step` is the same step on several devices (data parallel, ZeRO-1, one
`shard_map`): the floor for moejax's 8-device rows, which pay for the split as it does.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import Config, rope_scaling
from moejax.layers.attention import apply_rotary, rotary_tables
from moejax.layers.matmul import dense
from moejax.layers.norm import rms_norm
from moejax.models import olmoe
from moejax.placement.experts import grouped_swiglu
from moejax.routing.router import load_balancing_loss, router_z_loss
from moejax.sharding.prefetch import checkpointed
from moejax.train import optim

BF16 = jnp.bfloat16


def check_modelled(cfg: Config) -> None:
  """ValueError naming the first option of `cfg` this floor does not write (it is OLMoE's step:
  a config with other options would be timed against different math)."""
  m, moe = cfg.model, cfg.moe
  plain = dict(qk_norm="full", num_kv_heads=0, qkv_bias=False, attention_out_bias=False,
               kv_lora_rank=0, dense_layers=(),
               rotary_dim=0, rotary_interleaved=False, rope_scaling="none",
               tie_embeddings=False, attention_gate=False, attention_sinks=False,
               sliding_window=0, nope_layers=(),
               norm_position="pre", norm_kind="rms", embed_scale=1.0, residual_scale=1.0,
               attention_scale=0.0, logit_divisor=1.0)
  routing = dict(score="softmax", renormalize=False, score_bias=False, router_float32=False,
                 expert_groups=1, shared_expert_hidden=0, routed_scale=1.0, router_bias=False,
                 expert_bias=False, activation="swiglu")
  for group, fields in (("model", plain), ("moe", routing)):
    for field, want in fields.items():
      value = getattr(getattr(cfg, group), field)
      if value != want:
        raise ValueError(f"bench/reference.py writes OLMoE's step only: config.{group}.{field}="
                         f"{value!r} (it needs {want!r})")


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


def _moe(cfg: Config, p, x_BxSxD, axis_name=None):
  e, k = cfg.moe.num_experts, cfg.moe.top_k
  b, s, d = x_BxSxD.shape
  x_TxD = x_BxSxD.reshape(b * s, d)
  logits_TxE = dense(x_TxD, p["router"].astype(BF16), jnp.float32)
  scores_TxE = jax.nn.softmax(logits_TxE, axis=-1)
  weights_TxK, experts_TxK = jax.lax.top_k(scores_TxE, k)
  expert_A = experts_TxK.reshape(-1)
  counts_E = jnp.bincount(expert_A, length=e)
  aux = load_balancing_loss(scores_TxE, experts_TxK, axis_name=axis_name)
  z = router_z_loss(logits_TxE, axis_name=axis_name)
  order_A = jnp.argsort(expert_A, stable=True)
  token_A = order_A // k
  y_sorted_AxD = grouped_swiglu(x_TxD[token_A], counts_E.astype(jnp.int32),
                                p["w_gate"].astype(BF16), p["w_up"].astype(BF16),
                                p["w_down"].astype(BF16))
  y_AxD = jnp.zeros_like(y_sorted_AxD).at[order_A].set(y_sorted_AxD)
  y_TxD = jnp.einsum("tkd,tk->td", y_AxD.reshape(b * s, k, d).astype(jnp.float32), weights_TxK)
  return y_TxD.astype(BF16).reshape(b, s, d), aux, z


def loss_fn(cfg: Config, params, inputs_BxS, targets_BxS, *, remat: str, axis_name=None):
  """(loss, ce). With `axis_name` (inside shard_map, each device its slice of the batch), this
  device's share: the sums over the axis are the loss and ce of the whole batch."""
  m = cfg.model
  cos_SxDh, sin_SxDh = rotary_tables(inputs_BxS.shape[1], m.rotary_dim or m.head_dim,
                                     m.rope_theta, rope_scaling(m))

  def layer(h_BxSxD, p):
    h_BxSxD = h_BxSxD + _attention(cfg, p["attn"], rms_norm(h_BxSxD, p["attn_norm"]["scale"],
                                                       m.norm_eps), cos_SxDh, sin_SxDh)
    y, aux, z = _moe(cfg, p["moe"], rms_norm(h_BxSxD, p["ffn_norm"]["scale"], m.norm_eps),
                     axis_name)
    return h_BxSxD + y, (aux, z)

  h_BxSxD = olmoe.embed(params["embed"].astype(BF16), inputs_BxS)
  h_BxSxD, (aux_L, z_L) = jax.lax.scan(checkpointed(layer, remat), h_BxSxD, params["layers"])
  h_BxSxD = rms_norm(h_BxSxD, params["final_norm"], m.norm_eps)
  logits = dense(h_BxSxD, params["lm_head"].astype(BF16), jnp.float32)
  ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxS))
  if axis_name is not None:
    ce = ce / jax.lax.axis_size(axis_name)
  return ce + cfg.moe.aux_loss_weight * jnp.mean(aux_L) + cfg.moe.z_loss_weight * jnp.mean(z_L), ce


def make_train_step(cfg: Config, *, remat: str):
  """(train_step(params, opt_state, batch) -> (params, opt_state, ce), optimizer)."""
  check_modelled(cfg)
  tx = optim.make_optimizer(cfg)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    grads, ce = jax.grad(loss_fn, argnums=1, has_aux=True)(
        cfg, params, batch["inputs"], batch["targets"], remat=remat)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ce

  return train_step, tx


def _shard_axis(shape, n: int) -> int:
  """The first axis of `shape` that `n` devices split evenly; -1: none (kept whole on each)."""
  return next((a for a, size in enumerate(shape) if size % n == 0), -1)


def _spec(shape, n: int, axis_names) -> P:
  a = _shard_axis(shape, n)
  return P() if a < 0 else P(*([None] * a + [axis_names] + [None] * (len(shape) - a - 1)))


def make_sharded_train_step(cfg: Config, mesh: Mesh, *, remat: str):
  """The floor on several devices: the same math, data parallel as plainly as JAX writes it.

  One `shard_map` over every device of `mesh`: each device takes its slice of the batch with the
  full fp32 parameters (replicated), its gradients are reduce-scattered (each leaf over the first
  axis the devices split evenly; a leaf no axis splits is summed whole), AdamW updates each
  device's slice with its slice of the optimizer state (ZeRO-1), and the updated slices are
  all-gathered. Clipping uses the norm of the whole gradient, as `make_optimizer` does.

  Returns (train_step(params, opt_state, inputs_BxS, targets_BxS) -> (params, opt_state, ce),
  init(params) -> (params, opt_state), both placed on the mesh).
  """
  check_modelled(cfg)
  names, n = tuple(mesh.axis_names), mesh.size
  clip = cfg.optim.clip_norm
  tx = optim.make_optimizer(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                               clip_norm=0.0)))
  shapes = jax.eval_shape(lambda: olmoe.init_params(cfg, jax.random.key(0)))
  axes = jax.tree.map(lambda x: _shard_axis(x.shape, n), shapes)
  opt_specs = jax.tree.map(lambda x: _spec(x.shape, n, names), jax.eval_shape(tx.init, shapes))

  def reduce(g, a):
    if a < 0:
      return jax.lax.psum(g, names)
    return jax.lax.psum_scatter(g, names, scatter_dimension=a, tiled=True)

  def my_slice(p, a):
    if a < 0:
      return p
    size = p.shape[a] // n
    return jax.lax.dynamic_slice_in_dim(p, jax.lax.axis_index(names) * size, size, a)

  def local(params, opt_state, inputs_BxS, targets_BxS):
    grads, ce = jax.grad(loss_fn, argnums=1, has_aux=True)(
        cfg, params, inputs_BxS, targets_BxS, remat=remat, axis_name=names)
    grads = jax.tree.map(reduce, grads, axes)
    if clip > 0:   # optax.clip_by_global_norm, over the whole gradient
      sq = [(jnp.sum(jnp.square(g)), a) for g, a in zip(jax.tree.leaves(grads),
                                                        jax.tree.leaves(axes))]
      norm = jnp.sqrt(jax.lax.psum(sum(s for s, a in sq if a >= 0), names)
                      + sum(s for s, a in sq if a < 0))
      grads = jax.tree.map(
          lambda g: jax.lax.select(norm < clip, g, (g / norm.astype(g.dtype)) * clip), grads)
    mine = jax.tree.map(my_slice, params, axes)
    updates, opt_state = tx.update(grads, opt_state, mine)
    mine = optax.apply_updates(mine, updates)
    params = jax.tree.map(
        lambda p, a: p if a < 0 else jax.lax.all_gather(p, names, axis=a, tiled=True), mine, axes)
    return params, opt_state, jax.lax.psum(ce, names)

  train_step = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), opt_specs, P(names), P(names)),
      out_specs=(P(), opt_specs, P()), check_vma=False), donate_argnums=(0, 1))

  def init(params):
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    return put(params, P()), jax.tree.map(put, tx.init(params), opt_specs)

  return train_step, init
