"""Analytic FLOPs and memory traffic of one layer, and their times at a calibrated efficiency.

Forward FLOPs per token (a multiply-add is 2 FLOPs):
  attention   2 * (weights of Q, K, V, O, or MLA's projections)
              + S * H * (d_qk + d_v)        (causal: each query sees S/2 keys on average)
  linear      2 * (its projections and taps) + 2 * Hv * (C (2 Dk + Dv) + C (Dk + Dv) / 2
              + 3 Dk Dv)                    (Gated DeltaNet by chunks of C = 64: within a
                                             chunk k.k, q.k and their products with the
                                             updates, the triangular solve for two
                                             right-hand sides; across chunks the memory read
                                             twice and updated once)
  router      2 * D * E
  experts     2 * 3 * D * F per routed assignment (counted where the assignment is computed)
  shared      2 * 3 * D * F_shared;  dense MLP  2 * 3 * D * F_dense
  lm head     2 * V * D
Backward is twice the forward; recomputation (activation checkpointing) adds one forward.
Times: FLOPs / (peak bf16 FLOP/s * efficiency of the GPU kind); memory-bound passes (optimizer
step, codec kernels, quantization) at the HBM bandwidth.

The CPU lowering's cost analysis is no cross-check for the experts: XLA:CPU's `ragged_dot`
counts every expert for every token (E/K times the work), so tests/perf compare these counts
with the closed forms instead.
"""
from __future__ import annotations

from moejax.perf.shapes import ModelShape

BACKWARD = 2.0
"""Backward FLOPs per forward FLOP."""


def attention_flops(shape: ModelShape, seq_len: int) -> float:
  """Forward FLOPs per token of one layer's attention (projections and the causal core; a
  sliding layer's core over its window, a chunked layer's within its chunk, averaged over the
  layers; DeepSeek-V3.2's indexer scoring every earlier key, and its attention's core as dense,
  since moejax masks the unselected keys rather than skipping them)."""
  vd = shape.v_head_dim or shape.head_dim
  # The causal core is 2 FLOPs x the S/2 keys a query sees on average; a query of a sliding
  # layer sees min(i + 1, W) keys, W - W(W - 1) / 2S on average.
  context = seq_len
  window = shape.sliding_window
  if window and window < seq_len:
    sliding = 2 * window - window * (window - 1) / seq_len
    context -= shape.sliding_layers / shape.num_layers * (seq_len - sliding)
  chunk = shape.attention_chunk
  if chunk and chunk < seq_len:    # a query at offset j of its chunk sees j + 1 keys
    whole, rest = divmod(seq_len, chunk)
    chunked = (whole * chunk * (chunk + 1) + rest * (rest + 1)) / seq_len
    context -= shape.chunked_layers / shape.num_layers * (seq_len - chunked)
  core = context * shape.num_heads * (shape.head_dim + vd)
  # the indexer: its projections, then per earlier key each head's q.k and weight; training it,
  # its loss scores the keys again beside the attention's q.k (its distribution). (The backward
  # factor is applied to all of it, though the selection and that q.k have no backward.)
  scoring = context * shape.index_heads * (shape.index_head_dim + 1)
  index = 2.0 * shape.indexer_params() + scoring
  if shape.index_loss:
    index += scoring + context * shape.num_heads * shape.head_dim
  return 2.0 * shape.attention_params() + core + (index if shape.index_heads else 0.0)


LINEAR_CHUNK = 64     # moejax.layers.linear_attention.CHUNK


def linear_attention_flops(shape: ModelShape) -> float:
  """Forward FLOPs per token of one linear layer by chunks (the module docstring). Mamba-2: per
  group C . B over the chunk (C N), per head the chunk's decayed products (C P), C^T M and the
  state's update (2 N P)."""
  dk, dv, c = shape.linear_key_dim, shape.linear_value_dim, LINEAR_CHUNK
  if shape.linear_kind == "mamba2":
    core = 2.0 * (shape.linear_key_heads * c * dk
                  + shape.linear_value_heads * (c * dv + 2 * dk * dv))
  else:
    core = 2.0 * shape.linear_value_heads * (c * (2 * dk + dv) + c * (dk + dv) / 2
                                             + 3 * dk * dv)
  return 2.0 * shape.linear_attention_params() + core


def router_flops(shape: ModelShape) -> float:
  return 2.0 * shape.router_params()


def expert_flops(shape: ModelShape) -> float:
  """Forward FLOPs of one routed assignment (one token through one expert)."""
  return 2.0 * shape.expert_params()


def shared_flops(shape: ModelShape) -> float:
  return 2.0 * shape.shared_params()


def dense_flops(shape: ModelShape) -> float:
  return 2.0 * shape.dense_params()


def head_flops(shape: ModelShape) -> float:
  return 2.0 * shape.vocab_size * shape.d_model


def layer_flops(shape: ModelShape, seq_len: int, moe: bool = True,
                linear: bool = False) -> dict[str, float]:
  """Forward FLOPs per token of one layer by part, experts at top-k assignments per token
  (`linear`: a layer with linear attention)."""
  out = {"attention": linear_attention_flops(shape) if linear
         else attention_flops(shape, seq_len)}
  if moe:
    out["router"] = router_flops(shape)
    out["experts"] = shape.top_k * expert_flops(shape)
    out["shared"] = shared_flops(shape)
  else:
    out["dense"] = dense_flops(shape)
  return out


def model_flops_per_token(shape: ModelShape, seq_len: int, recompute: bool = True) -> float:
  """Training FLOPs per token of the whole model (forward, backward, recomputation)."""
  fwd = (sum(sum(layer_flops(shape, seq_len, moe, linear).values())
             for moe, linear in shape.layers()) + head_flops(shape))
  return fwd * (1 + BACKWARD + (1 if recompute else 0))


def seconds(flops: float, peak_flops: float, efficiency: float) -> float:
  return flops / (peak_flops * efficiency)


OPTIMIZER_BYTES_PER_PARAM = 30.0
"""AdamW with fp32 master weights: read weight, gradient, m, v (4 B each), write weight, m, v
(4 B each) and the bf16 copy (2 B)."""


def memory_seconds(bytes_: float, hbm_bandwidth: float) -> float:
  return bytes_ / hbm_bandwidth
