"""What one expert computes of its rows, shared by every expert kernel (`experts.py`,
`hopper.py`): `ExpertFn`, the activation's gradients, and the expert of each sorted row."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


ACTIVATIONS = ("swiglu", "swiglu_clamped")


@dataclasses.dataclass(frozen=True)
class ExpertFn:
  """h = act(x W_gate + b_gate, x W_up + b_up); y = h W_down + b_down (biases with `bias`).
  `activation`: "swiglu", silu(g) * u; "swiglu_clamped" (gpt-oss), g clipped above at `limit`
  and u to [-limit, limit], then g * sigmoid(alpha * g) * (u + 1). Hashable: a static argument."""
  activation: str = "swiglu"
  alpha: float = 1.702
  limit: float = 7.0
  bias: bool = False

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"ExpertFn.activation={self.activation!r}: must be one of "
                       f"{', '.join(ACTIVATIONS)}")

  @property
  def num_weights(self) -> int:
    return 6 if self.bias else 3

  def act(self, gate, up):
    if self.activation == "swiglu":
      return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, self.limit)
    up = jnp.clip(up, -self.limit, self.limit)
    return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)


SWIGLU = ExpertFn()


def check_weights(ws, fn: ExpertFn) -> None:
  if len(ws) != fn.num_weights:
    raise ValueError(f"{fn} takes {fn.num_weights} expert arrays, got {len(ws)}")


def row_groups(group_sizes_G, num_rows: int):
  """[A] the group of each sorted row (rows past the groups: the last group; they are masked)."""
  return jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(num_rows),
                                      side="right"), group_sizes_G.shape[0] - 1)


def act_grads(fn: ExpertFn, gate_MxF, up_MxF, dh_MxF):
  """(h, d gate, d up) of the activation at (gate, up) for cotangent dh, in fp32."""
  if fn.activation == "swiglu":    # by hand: the form the default kernel was measured with
    sig = jax.nn.sigmoid(gate_MxF)
    silu = gate_MxF * sig
    return (silu * up_MxF, dh_MxF * up_MxF * (sig * (1 + gate_MxF * (1 - sig))),
            dh_MxF * silu)
  h_MxF, vjp = jax.vjp(fn.act, gate_MxF, up_MxF)
  return (h_MxF, *vjp(dh_MxF))
