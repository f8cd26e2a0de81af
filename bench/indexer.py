"""DeepSeek sparse attention's indexer, trained by its own loss against left as initialized: the
tiny DeepSeek-V3.2 preset (each of 64 tokens attending to its 32 best earlier keys) trains
side by side with model.train_indexer True (the default) and False (the indexer frozen), on the
built-in corpus, under fsdp on 8 fake CPU devices, the same data and initial weights.

  python bench/indexer.py            # 300 steps each (~2 min on 2 cores)

Printed per run: the language-model loss at the first step and its mean over the last tenth
of the steps (one batch's loss is noisy); then, on held-out
batches of the built-in corpus through the trained run's final model, the indexer's loss
(per token, averaged over the layers: the KL divergence of the indexer's softmax from the
attention's head-averaged distribution over the keys it saw) with the indexer it trained and
with the initial one in its place, and their ratio. Then the attention over a selection
(`attention.attend_selected`, forward and backward, one sequence of --seq tokens, 16 heads of
64, bf16) as one masked attention and a block of 512 queries at a time: XLA's temporary bytes
(`memory_analysis`), the median time of 5 runs, and the gradients' largest relative error
against the same attention in fp32, side by side with their ratios. Ends with one JSON line.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.cli_args import at_least  # noqa: E402
from bench.families import tiny  # noqa: E402
from moejax.convert.checkpoint_io import load_model  # noqa: E402
from moejax.layers.attention import INDEX_QUERY_BLOCK, attend_selected  # noqa: E402
from moejax.models import olmoe  # noqa: E402
from moejax.sharding.hook import local_gather  # noqa: E402
from moejax.train.loop import run, training_data  # noqa: E402

INDEXER = ("index_wq", "index_wk", "index_k_norm", "index_k_bias", "index_weights")


def train(cfg, workdir: str) -> tuple[list[float], dict]:
  """The run's logged losses and its final parameters."""
  run(cfg, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  return losses, load_model(workdir, None)[1]


def index_loss(cfg, params, tokens_BxS) -> float:
  """The indexer's loss per token, averaged over the layers."""
  forward = jax.jit(lambda p, t: olmoe.forward(
      cfg, p, t, gather=functools.partial(local_gather, dtype=jnp.float32))[1]["index_loss"])
  return float(jnp.mean(forward(params, tokens_BxS)) / tokens_BxS.size)


def with_indexer(params: dict, source: dict) -> dict:
  """`params` with the indexer's parameters of `source`."""
  out = dict(params)
  for group in ("dense_layers", "layers"):
    attn = dict(params[group]["attn"], **{n: source[group]["attn"][n] for n in INDEXER})
    out[group] = dict(params[group], attn=attn)
  return out


def selected_attention(seq: int, block: int, dtype=jnp.bfloat16) -> tuple[dict, tuple]:
  """Forward and backward of attention over a causal selection of `seq` tokens, `block` queries
  at a time: (XLA's temporary bytes and the median of 5 timed runs, the gradients of q, k, v)."""
  heads, width = 16, 64
  keys = jax.random.split(jax.random.key(0), 3)
  # the same values in either dtype (bf16's drawn in fp32 and rounded)
  q, k, v = (jax.random.normal(key, (1, seq, heads, width)).astype(dtype) for key in keys)
  selected = jnp.tril(jnp.ones((seq, seq), bool))[None]
  step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend_selected(
      q, k, v, selected, block=block).astype(jnp.float32))), (0, 1, 2)))
  temp = step.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
  grads = jax.block_until_ready(step(q, k, v))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    times.append(time.perf_counter() - start)
  return {"temp_bytes": int(temp), "s": float(np.median(times))}, grads


def relative_error(got, want) -> float:
  """The largest of the gradients' relative errors (Frobenius norm)."""
  return max(float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
             for g, w in zip(got, want))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=at_least(2), default=300)
  parser.add_argument("--seq", type=at_least(INDEX_QUERY_BLOCK + 1), default=2048,
                      help="tokens of the attention-over-a-selection comparison")
  args = parser.parse_args(argv)
  trained_cfg = tiny("deepseek_v32", args.steps)
  trained_cfg = dataclasses.replace(trained_cfg, checkpoint=dataclasses.replace(
      trained_cfg.checkpoint, every=args.steps))
  frozen_cfg = dataclasses.replace(trained_cfg, model=dataclasses.replace(
      trained_cfg.model, train_indexer=False))
  runs = {}
  with tempfile.TemporaryDirectory() as root:
    for name, cfg in (("trained", trained_cfg), ("frozen", frozen_cfg)):
      losses, params = train(cfg, os.path.join(root, name))
      tail = losses[-max(1, len(losses) // 10):]
      runs[name] = {"first_loss": losses[0], "last_tenth_loss": float(np.mean(tail)),
                    "params": params}
  initial = olmoe.init_params(trained_cfg, jax.random.key(trained_cfg.seed))
  held_out = jnp.asarray(training_data(trained_cfg).val_batches(1)[0]["inputs"], jnp.int32)
  final = runs["trained"].pop("params")
  runs["frozen"].pop("params")
  kl_trained = index_loss(trained_cfg, final, held_out)
  kl_initial = index_loss(trained_cfg, with_indexer(final, initial), held_out)
  print(f"{'run':8} {'loss at step 1':>15} {'mean of the last tenth':>23}")
  for name, r in runs.items():
    print(f"{name:8} {r['first_loss']:15.3f} {r['last_tenth_loss']:23.3f}")
  print(f"indexer loss on held-out batches, the trained model: its trained indexer "
        f"{kl_trained:.4f}, the initial one {kl_initial:.4f} ({kl_initial / kl_trained:.1f}x)")
  whole, whole_grads = selected_attention(args.seq, args.seq)
  blocked, blocked_grads = selected_attention(args.seq, INDEX_QUERY_BLOCK)
  _, exact = selected_attention(args.seq, args.seq, jnp.float32)
  whole["grad_error"] = relative_error(whole_grads, exact)
  blocked["grad_error"] = relative_error(blocked_grads, exact)
  print(f"attention over a selection of {args.seq} tokens, forward+backward, bf16: whole "
        f"{whole['temp_bytes'] / 2 ** 20:.0f} MiB {whole['s']:.3f} s; blocks of "
        f"{INDEX_QUERY_BLOCK} queries {blocked['temp_bytes'] / 2 ** 20:.0f} MiB "
        f"{blocked['s']:.3f} s ({whole['temp_bytes'] / blocked['temp_bytes']:.2f}x less memory, "
        f"{whole['s'] / blocked['s']:.2f}x the speed); gradients' relative error against fp32: "
        f"whole {whole['grad_error']:.2e}, blocks {blocked['grad_error']:.2e}")
  print(json.dumps({"steps": args.steps, "runs": runs, "index_loss_trained": kl_trained,
                    "index_loss_initial": kl_initial,
                    "selected_attention": {"seq": args.seq, "whole": whole, "blocks": blocked}}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
