"""Gated DeltaNet's recurrence by chunks against token by token: `gated_delta_rule` (chunks of
64: one batched triangular solve, one scan across chunks) and `gated_delta_rule_by_token` (one
scan step per token), forward and backward (the gradients of a loss of the output to q, k, v,
the decay and beta), fp32, on CPU, side by side at each sequence length.

  python bench/linear_attention.py            # S = 512, 2048, 8192 (~1 min on 2 cores)

Per length: the median time of 5 runs of each, XLA's temporary bytes (`memory_analysis` of the
compiled program), their ratios (token / chunks), and the largest difference of the outputs and
of the gradients relative to their largest. Shapes: one sequence, 8 value heads over 4 key heads,
head widths 64. Ends with one JSON line.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moejax.layers import linear_attention as la  # noqa: E402

HK, HV, DK, DV = 4, 8, 64, 64


def operands(seq: int):
  r = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)   # noqa: E731
  return (f32(1, seq, HK, DK), f32(1, seq, HK, DK), f32(1, seq, HV, DV),
          -jnp.asarray(r.uniform(0.0, 0.2, (1, seq, HV)), jnp.float32),
          jnp.asarray(r.uniform(0.0, 1.0, (1, seq, HV)), jnp.float32))


def measure(rule, args, repeats: int = 5) -> tuple[dict, tuple]:
  """(median seconds and temporary bytes of the forward and backward, (output, gradients))."""
  def loss(*xs):
    o, _ = rule(*xs)
    return jnp.sum(jnp.sin(o)), o

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  compiled = step.lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  grads, out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return {"s": float(np.median(times)), "temp_bytes": int(temp)}, (out, grads)


def rel_diff(a, b) -> float:
  return float(max(np.abs(np.asarray(x) - np.asarray(y)).max() / np.abs(np.asarray(y)).max()
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def lengths_arg(text: str) -> list[int]:
  """Comma-separated positive sequence lengths (argparse type)."""
  try:
    lengths = [int(s) for s in text.split(",")]
  except ValueError:
    lengths = []
  if not lengths or min(lengths) < 1:
    raise argparse.ArgumentTypeError(f"expected comma-separated positive lengths, got {text!r}")
  return lengths


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq", default="512,2048,8192", type=lengths_arg,
                      help="comma-separated sequence lengths (default 512,2048,8192)")
  args = parser.parse_args(argv)
  lengths = args.seq
  print(f"{'seq':>6} {'chunks s':>9} {'token s':>9} {'token/chunks':>13} {'chunks MiB':>11} "
        f"{'token MiB':>10} {'mem ratio':>10} {'out diff':>9} {'grad diff':>10}")
  rows = {}
  for seq in lengths:
    xs = operands(seq)
    chunked, (o_c, g_c) = measure(la.gated_delta_rule, xs)
    by_token, (o_t, g_t) = measure(la.gated_delta_rule_by_token, xs)
    row = {"chunks": chunked, "token": by_token,
           "time_ratio": by_token["s"] / chunked["s"],
           "memory_ratio": by_token["temp_bytes"] / max(chunked["temp_bytes"], 1),
           "out_rel_diff": rel_diff(o_c, o_t), "grad_rel_diff": rel_diff(g_c, g_t)}
    rows[seq] = row
    print(f"{seq:>6} {chunked['s']:>9.4f} {by_token['s']:>9.4f} {row['time_ratio']:>12.1f}x "
          f"{chunked['temp_bytes'] / 2**20:>11.1f} {by_token['temp_bytes'] / 2**20:>10.1f} "
          f"{row['memory_ratio']:>9.2f}x {row['out_rel_diff']:>9.1e} {row['grad_rel_diff']:>10.1e}")
  print(json.dumps({"shapes": {"key_heads": HK, "value_heads": HV, "key_dim": DK,
                               "value_dim": DV, "chunk": la.CHUNK}, "rows": rows}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
