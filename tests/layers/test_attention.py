"""`attend` with key and value widths that differ either way (latent attention) against plain
causal softmax attention written out; on CUDA it is cuDNN's flash attention (lowered here, run
by scripts/device_check.py on an H200), where cuDNN takes the shapes."""
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from moejax.layers import attention
from moejax.layers.attention import attend
from moejax.models import olmoe


@pytest.mark.parametrize("dk,dv", [(6, 4), (4, 6), (5, 5)])
def test_attend_any_widths(dk, dv):
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 5, 3, w)) for i, w in
             enumerate((dk, dk, dv)))
  logits = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(dk)
  logits = jnp.where(jnp.tril(jnp.ones((5, 5), bool)), logits, -jnp.inf)
  want = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, axis=-1), v)
  np.testing.assert_allclose(attend(q, k, v, is_causal=True), want, rtol=1e-5, atol=1e-6)


def _lowered_grad(platform: str, dtype=jnp.bfloat16, head_dim: int = 32, mask=None,
                  window: int = 0, chunk: int = 0) -> str:
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 64, 4, head_dim)).astype(dtype)
             for i in range(3))
  loss = lambda q, k, v: attend(q, k, v, mask=mask, is_causal=mask is None,  # noqa: E731
                                window=window, chunk=chunk).astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
      lowering_platforms=(platform,)).as_text()


def test_cuda_attention_is_cudnn_flash_attention_where_it_applies():
  assert "cudnn" not in _lowered_grad("cpu")
  # As on a GPU: jax checks the installed cuDNN while tracing its attention.
  with mock.patch.object(attention, "on_gpu", lambda: True), \
      mock.patch("jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version", lambda: None):
    for window, chunk in ((0, 0), (16, 0), (0, 24)):   # a sliding window is cuDNN's too, and
      text = _lowered_grad("cuda", window=window, chunk=chunk)   # Llama 4's chunks as a batch
      assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text
    for other in (dict(dtype=jnp.float32), dict(head_dim=160),
                  dict(mask=jnp.tril(jnp.ones((64, 64), bool)))):
      assert "cudnn" not in _lowered_grad("cuda", **other), other


def test_bias_and_embedding_gradients_sum_every_token_in_fp32():
  """A bf16 step's gradients that sum over every token: the qkv biases' (broadcast over the
  tokens in bf16) and an embedding row's (the lookup's scatter-add). 4096 tokens with cotangents
  in [0.5, 1.5): in bf16 the bias sums came out rounded (4096 for 4104), the row's stalled at
  512."""
  weights_BxSx8 = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, (2, 2048, 8)),
                              jnp.bfloat16)
  want_8 = np.asarray(weights_BxSx8, np.float64).sum(axis=(0, 1))
  att = attention.Attention(8, 2, 4, rope_theta=1e4, norm_eps=1e-6, init_std=0.02,
                            rngs=nnx.Rngs(0), qk_norm="none", qkv_bias=True)
  x = jnp.ones((2, 2048, 8), jnp.bfloat16)
  rotary = attention.rotary_tables(2048, 4, 1e4)
  g = nnx.grad(lambda att: jnp.sum(att.qkv(x, rotary)[2].reshape(2, 2048, 8).astype(jnp.float32)
                                   * weights_BxSx8))(att)
  np.testing.assert_allclose(g.bv[...], want_8, rtol=1e-5)
  table = jnp.ones((5, 8), jnp.bfloat16)
  g = jax.grad(lambda t: jnp.sum(olmoe.embed(t, jnp.full((2, 2048), 3)).astype(jnp.float32)
                                 * weights_BxSx8))(table)
  np.testing.assert_allclose(np.asarray(g, np.float32)[3], want_8, rtol=4e-3)
  assert not np.any(np.asarray(g, np.float32)[[0, 1, 2, 4]])


def _attention_out(window=0, rotary=True, x=None):
  att = attention.Attention(8, 2, 4, rope_theta=1e4, norm_eps=1e-6, init_std=0.5,
                            rngs=nnx.Rngs(0), qk_norm="none", window=window, rotary=rotary)
  return np.asarray(att(x))


def test_a_sliding_window_sees_the_window_and_no_further():
  """window W: position i's output depends on inputs i - W + 1 .. i only: changing the input
  just outside the window leaves it as it was, just inside changes it (the whole sequence's
  attention sees both)."""
  x = np.random.default_rng(0).normal(size=(1, 10, 8)).astype(np.float32)
  outside, inside = x.copy(), x.copy()
  outside[0, 9 - 3] += 1.0       # W = 3: position 9 sees 7, 8, 9
  inside[0, 9 - 2] += 1.0
  base = _attention_out(window=3, x=x)
  np.testing.assert_array_equal(_attention_out(window=3, x=outside)[0, 9], base[0, 9])
  assert np.max(np.abs(_attention_out(window=3, x=inside)[0, 9] - base[0, 9])) > 1e-3
  whole = _attention_out(x=x)
  assert np.max(np.abs(_attention_out(x=outside)[0, 9] - whole[0, 9])) > 1e-3


def test_attention_without_rotary_does_not_see_positions():
  """rotary=False (NoPE): the last position's output is the same whatever the order of the
  tokens before it; rotated, it is not."""
  x = np.random.default_rng(1).normal(size=(1, 6, 8)).astype(np.float32)
  swapped = x[:, [1, 0, 2, 3, 4, 5]]
  np.testing.assert_allclose(_attention_out(rotary=False, x=x)[0, 5],
                             _attention_out(rotary=False, x=swapped)[0, 5], rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(_attention_out(x=x)[0, 5] - _attention_out(x=swapped)[0, 5])) > 1e-3


def test_sinks_join_the_softmax_denominator_and_carry_its_gradient():
  """With sinks the output is the plain attention's scaled by sigmoid(logsumexp(scores) - sink)
  per head (grouped-query, sliding window); a sink far below every score changes nothing; the
  gradient reaches q, k and the sinks through the denominator as the written-out softmax's
  does (a logsumexp taken beside the attention, as jax's residual, would carry none)."""
  b, s, h, g, d, window = 2, 7, 4, 2, 8, 3
  q = jax.random.normal(jax.random.key(0), (b, s, h, d))
  k, v = (jax.random.normal(jax.random.key(i), (b, s, g, d)) for i in (1, 2))
  sinks_H = jax.random.normal(jax.random.key(3), (h,))
  plain = attend(q, k, v, is_causal=True, window=window)
  np.testing.assert_allclose(attend(q, k, v, is_causal=True, window=window,
                                    sinks_H=jnp.full((h,), -1e9)), plain, atol=1e-6)

  def written_out(q, k, sinks_H):
    kk, vv = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, kk) / np.sqrt(d)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    scores = jnp.where((j <= i) & (i - j < window), scores, -jnp.inf)
    lse_BxHxS = jax.nn.logsumexp(scores, axis=-1)
    out = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, axis=-1), vv)
    return out * jax.nn.sigmoid(lse_BxHxS - sinks_H[None, :, None]).transpose(0, 2, 1)[..., None]

  got = attend(q, k, v, is_causal=True, window=window, sinks_H=sinks_H)
  np.testing.assert_allclose(got, written_out(q, k, sinks_H), atol=1e-6)
  assert float(jnp.max(jnp.abs(got - plain))) > 1e-2
  loss = lambda f: lambda q, k, s_: jnp.sum(f(q, k, s_) ** 2)  # noqa: E731
  # jitted: op by op, autodiff compiled each primitive apart (5 s of this test)
  ours = jax.jit(jax.grad(loss(lambda q, k, s_: attend(q, k, v, is_causal=True, window=window,
                                                         sinks_H=s_)), argnums=(0, 1, 2)))(
      q, k, sinks_H)
  want = jax.jit(jax.grad(loss(written_out), argnums=(0, 1, 2)))(q, k, sinks_H)
  for a, w in zip(ours, want):
    np.testing.assert_allclose(a, w, atol=1e-5)


@pytest.mark.parametrize("seq,sinks", [(11, False), (12, True)])
def test_chunked_attention_equals_the_masked_sequence(seq, sinks):
  """Llama 4's chunks of 4: each query sees the keys before it in its own chunk. The chunks run
  as a batch (11 tokens padded to 12); the values and gradients equal attention over the whole
  sequence under that mask, with sinks too."""
  q, k, v = (jax.random.normal(jax.random.key(i), (2, seq, 4, 8)) for i in range(3))
  k, v = k[:, :, :2], v[:, :, :2]         # grouped-query: 2 kv heads
  sinks_H = jnp.asarray([0.5, -1.0, 0.0, 2.0]) if sinks else None
  pos = np.arange(seq)
  mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] // 4 == pos[:, None] // 4)

  def chunked(q, k, v):
    return attend(q, k, v, is_causal=True, chunk=4, sinks_H=sinks_H)

  def masked(q, k, v):
    return attend(q, k, v, mask=jnp.asarray(mask)[None, None], sinks_H=sinks_H)

  cot = jax.random.normal(jax.random.key(9), (2, seq, 4, 8))

  @jax.jit
  def both(q, k, v):      # one compile for all of it
    outs = []
    for f in (chunked, masked):
      y, vjp = jax.vjp(f, q, k, v)
      outs.append((y, vjp(cot)))
    return outs, attend(q, k, v, is_causal=True, sinks_H=sinks_H)

  ((got, got_grads), (want, want_grads)), plain = both(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  assert not np.allclose(got, plain, atol=1e-3)       # the chunks hide keys
  with pytest.raises(ValueError, match="chunk needs is_causal self-attention"):
    attend(q, k, v, mask=jnp.asarray(mask)[None, None], chunk=4)


def test_chunked_attention_keeps_an_explicit_batch_sharding():
  """Under a mesh of Explicit axes (jax.make_mesh's default) the chunks fold into the batch
  axis with its sharding kept (a reshape jax refused to type before: found by review)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("data",))
  x = jax.random.normal(jax.random.key(0), (8, 10, 2, 4))
  run = jax.jit(lambda q: attend(q, q, q, is_causal=True, chunk=4))
  want = run(x)
  with jax.set_mesh(mesh):
    got = run(jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert jax.typeof(got).sharding.spec[0] == "data"
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _sparse_attention(**options):
  """A small latent attention with DeepSeek-V3.2's indexer (5 keys per query, 16 heads of 12),
  its parameters, and `jitted(name)`: a fresh jitted function of (parameters, *args) calling
  its method `name` (fresh: traced again, so a patched INDEX_QUERY_BLOCK takes effect)."""
  from moejax.layers.attention import LatentAttention
  attn = LatentAttention(32, 4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8, rope_theta=10000.0, init_std=0.3,
                         rngs=nnx.Rngs(0), index=(5, 16, 12), **options)
  graph, params = nnx.split(attn)

  def jitted(name):
    return jax.jit(lambda p, *args: getattr(nnx.merge(graph, p), name)(*args))
  return attn, params, jitted


def _indexer_parts(attn, x):
  """(rotary, the indexer's keys; those keys, its queries and head weights, the attention's q
  and k in float64 numpy)."""
  graph, params = nnx.split(attn)

  @jax.jit            # one program (op by op these compiled some 90 small ones)
  def parts(params, x):
    attn = nnx.merge(graph, params)
    rotary = attn.rotary_at(jnp.arange(x.shape[1], dtype=jnp.float32))
    keys = attn.index_keys(x, rotary)
    q, w = attn._index_queries(x, rotary)
    q_a, k_a, _ = attn.qkv(x, rotary)
    return rotary, keys, q, w, q_a, k_a

  rotary, keys, q, w, q_a, k_a = parts(params, x)
  return rotary, keys, *(np.asarray(a, np.float64) for a in (keys, q, w, q_a, k_a))


def test_sparse_attention_selects_each_querys_best_keys():
  """DeepSeek-V3.2's indexer: each query keeps exactly index_topk of its visible keys, the best
  by sum_h w_h relu(q_h . k / sqrt(Di)) (numpy's reference of the formula, on the module's own
  projections); scored a block of queries at a time (a 13-token sequence in blocks of 4, the
  last padded) as in one piece; attention over the selection equals attention under that mask,
  by blocks of queries too (gradients alike);
  under a mesh of Explicit axes the batch keeps its sharding (found by review)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  attn, params, jitted = _sparse_attention()
  s, topk = 13, 5
  x = jax.random.normal(jax.random.key(1), (8, s, 32))
  rotary, keys, keys_np, q, w, q_a, k_a = _indexer_parts(attn, x)
  causal = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]
  selected = np.asarray(jitted("select_keys")(params, x, rotary, keys, causal))
  with mock.patch.object(attention, "INDEX_QUERY_BLOCK", 4):
    np.testing.assert_array_equal(jitted("select_keys")(params, x, rotary, keys, causal),
                                  selected)
  score = np.einsum("bsh,bsht->bst", w, np.maximum(
      np.einsum("bshd,btd->bsht", q, keys_np) / np.sqrt(12), 0))
  for b in range(x.shape[0]):
    for i in range(s):
      best = np.argsort(-score[b, i, :i + 1], kind="stable")[:topk]
      assert sorted(np.nonzero(selected[b, i])[0]) == sorted(best), (b, i)
  call = jitted("__call__")
  want = np.asarray(call(params, x))
  qkv = attn.qkv(x, rotary)
  masked = attend(*qkv, mask=jnp.asarray(selected)[:, None], is_causal=True,
                  scale=attn.softmax_scale)
  np.testing.assert_allclose(want, attn.project_out(masked), rtol=1e-5, atol=1e-6)
  # over the selection a block of queries at a time (blocks of 4, the last padded), each
  # rematerialized: the whole masked attention's output and gradients
  def grads(block):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attention.attend_selected(
        q, k, v, jnp.asarray(selected), scale=attn.softmax_scale, block=block))), (0, 1, 2)))

  for whole, blocked in zip(grads(s)(*qkv), grads(4)(*qkv)):
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6)
  # in bf16 the gradients of k and v, summed over 32 blocks, round once, not once a block
  # (found by review): no further from fp32's than one masked attention's
  causal = jnp.tril(jnp.ones((256, 256), bool))[None]
  q, k, v = jax.random.normal(jax.random.key(2), (3, 1, 256, 2, 16))

  def kv_grads(block, dtype):
    return jax.jit(jax.grad(lambda k, v: jnp.sum(jnp.sin(attention.attend_selected(
        q.astype(dtype), k.astype(dtype), v.astype(dtype), causal, block=block)).astype(
            jnp.float32)), (0, 1)))(k, v)

  exact = kv_grads(256, jnp.float32)
  error = lambda got: max(float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))  # noqa: E731
                          for g, e in zip(got, exact))
  assert error(kv_grads(8, jnp.bfloat16)) <= 1.2 * error(kv_grads(256, jnp.bfloat16))
  assert attn.sparse_over(s) and not attn.sparse_over(topk)
  mesh = jax.make_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    got = call(params, jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert jax.typeof(got).sharding.spec[0] == "data"
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_the_indexer_loss_is_the_kl_to_the_attention_and_trains_the_indexer_alone():
  """DeepSeek-V3.2's indexer loss (`with_index_loss`): per query, KL(p || softmax(I)) over the
  keys the attention saw, p its softmax averaged over the heads (numpy's reference), summed over
  the queries, with the selection (13 queries of 5 keys) and without (5 tokens, dense: every
  earlier key); by blocks of queries as in one; its gradient reaches the indexer's parameters
  only, the output's never does, and steps along the loss's lower it."""
  attn, params, jitted = _sparse_attention(index_loss=True)
  run = jitted("with_index_loss")
  for s in (13, 5):
    x = jax.random.normal(jax.random.key(s), (2, s, 32))
    out, loss = run(params, x)
    rotary, keys, _, q, w, q_a, k_a = _indexer_parts(attn, x)
    causal = np.tril(np.ones((s, s), bool))
    seen = (np.asarray(attn.select_keys(x, rotary, keys, jnp.asarray(causal))) if s > 5
            else np.broadcast_to(causal, (2, s, s)))
    index = np.einsum("bsh,bsht->bst", w, np.maximum(
        np.einsum("bshd,btd->bsht", q, np.asarray(keys, np.float64)) / np.sqrt(12), 0))
    scores = np.where(seen[:, None], np.einsum("bshd,bthd->bhst", q_a, k_a) * attn.softmax_scale,
                      -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).mean(1)
    index = np.where(seen, index, -np.inf)
    log_q = index - index.max(-1, keepdims=True)
    log_q = log_q - np.log(np.exp(log_q).sum(-1, keepdims=True))
    terms = p * (np.log(np.where(p > 0, p, 1)) - np.where(seen, log_q, 0))
    np.testing.assert_allclose(float(loss), np.sum(np.where(seen, terms, 0)), rtol=1e-4)
    with mock.patch.object(attention, "INDEX_QUERY_BLOCK", 4):
      np.testing.assert_allclose(float(jitted("with_index_loss")(params, x)[1]), float(loss),
                                 rtol=1e-6)
  for part, indexer_only in ((1, True), (0, False)):      # the loss; the output (an LM loss)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(run(p, x)[part] ** 2)))(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
      name = str(path[0].key)
      assert bool(np.any(np.asarray(g) != 0)) == (name.startswith("index_") == indexer_only), (
          part, name)
  step = jax.jit(lambda p: jax.tree.map(lambda a, g: a - 0.05 * g, p, jax.grad(
      lambda p: run(p, x)[1])(p)))
  trained = params
  for _ in range(5):
    trained = step(trained)
  assert float(run(trained, x)[1]) < 0.8 * float(run(params, x)[1])
