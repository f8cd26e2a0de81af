"""SwiGLU experts as grouped matmuls (`lax.ragged_dot`).

Letters: A rows (token-expert assignments), D model width, F expert hidden width, G experts held
here. Rows must be sorted by expert; `group_sizes_G` says how many rows each expert takes; rows
past the sum of the group sizes come out as zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def grouped_swiglu(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD):
  dtype = x_AxD.dtype
  gate_AxF = lax.ragged_dot(x_AxD, w_gate_GxDxF, group_sizes_G, preferred_element_type=jnp.float32)
  up_AxF = lax.ragged_dot(x_AxD, w_up_GxDxF, group_sizes_G, preferred_element_type=jnp.float32)
  h_AxF = (jax.nn.silu(gate_AxF) * up_AxF).astype(dtype)
  y_AxD = lax.ragged_dot(h_AxF, w_down_GxFxD, group_sizes_G, preferred_element_type=jnp.float32)
  rows_used = jnp.sum(group_sizes_G)
  return jnp.where(jnp.arange(x_AxD.shape[0])[:, None] < rows_used, y_AxD, 0.0).astype(dtype)


def run_sorted(x_AxD, expert_A, num_local_experts: int, w_gate, w_up, w_down):
  """Runs each row through expert `expert_A[a]` (ids >= num_local_experts: no expert, zeros)."""
  order_A = jnp.argsort(expert_A, stable=True)
  group_sizes_G = jnp.bincount(expert_A, length=num_local_experts).astype(jnp.int32)
  y_sorted_AxD = grouped_swiglu(x_AxD[order_A], group_sizes_G, w_gate, w_up, w_down)
  return jnp.zeros_like(y_sorted_AxD).at[order_A].set(y_sorted_AxD)
