"""Loss and perplexity of a checkpoint on a text or JSONL file, a prepared corpus (or the
built-in corpus).

  python -m moejax.evaluate CKPT --data PATH [--source text|jsonl|tokens] [--split all|val]
      [--batches N] [--step N] [--seq-len N] [--batch-size N]

CKPT as for `moejax.generate`. PATH: a .jsonl file (one {"text": ...} per line), any other
file as plain text (one document; `--source jsonl|text` overrides the name), a directory that
`python -m moejax.data.prepare` wrote (tokenized with the checkpoint's tokenizer), or `builtin`.
`--split all` (default) scores every window of the file in order, its batches made one at a
time (a prepared directory is mapped; a file is tokenized whole); `--split val` the batches the
training loop validates on (the config's `data.val_fraction` split, its first `eval_batches`
batches, in order), so on the training data it gives the run's `val_loss` (exactly for fsdp on
the run's device count; with admission, whose capacity is per device, or ep, whose buffers are,
another device count routes slightly differently). Windows are the config's batch_size x seq_len (`--batch-size`, `--seq-len`: a
Hugging Face directory's config names no training shape, so moejax's defaults, 16 x 64, unless
given), the last partial batch left out. The evaluation runs the training loop's own eval step
(`Trainer.evaluate`: routing as after the admission warm-up, plain gathers) on all local
devices, placement fsdp.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys


from moejax.errors import DataError, MoejaxError, run_command

SPLITS = ("all", "val")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m moejax.evaluate",
                                   description="Loss and perplexity of a checkpoint on a file.")
  parser.add_argument("ckpt", help="workdir, from-hf output or Hugging Face directory")
  parser.add_argument("--data", required=True,
                      help="a .jsonl or text file, a prepared corpus's directory, or 'builtin'")
  parser.add_argument("--source", choices=("text", "jsonl", "tokens"), default=None,
                      help="how to read --data (default: tokens for a directory, jsonl for a "
                           ".jsonl file, else text)")
  parser.add_argument("--split", choices=SPLITS, default="all")
  parser.add_argument("--batches", type=int, default=None,
                      help="at most this many batches (--split val: default eval_batches)")
  parser.add_argument("--tokenizer", default=None,
                      help="'bytes' or a tokenizer.json (default: the one beside CKPT)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
  parser.add_argument("--seq-len", type=int, default=None,
                      help="tokens per window (default: the checkpoint config's seq_len; a "
                           "Hugging Face directory's is moejax's default, 64)")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="windows per batch (default: the checkpoint config's batch_size)")
  return parser


def batches(cfg, data: str, split: str, tokenizer_spec: str, max_batches: int | None = None,
            source: str | None = None):
  """The evaluation batches ({"inputs", "targets"} int32 [batch_size, seq_len]) of `data`."""
  from moejax.data import iterator, pipeline, prepared
  from moejax.data.sources import load_documents, source_of
  from moejax.data.tokenizer import check_vocab, load_tokenizer
  source = source_of(data, source)
  path = None if source == "builtin" else data
  if split == "val" and cfg.data.val_fraction == 0:
    raise DataError(f"--split val: the run trained with no validation split "
                    "(data.val_fraction=0); use --split all on a held-out file")
  if split == "val":
    spec = pipeline.DataSpec(source, path, tokenizer_spec, cfg.data.val_fraction, cfg.seed)
    try:
      loaded = pipeline.make_data(spec, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    except DataError as e:   # the split is training's: its training half must fit a batch too
      raise DataError(f"--split val takes the run's validation windows, splitting {data} as "
                      f"training did (data.val_fraction={cfg.data.val_fraction}), which fails: "
                      f"{e}") from None
    check_vocab(loaded.tokenizer, cfg.model.vocab_size)
    # As the loop: its first eval_batches validation batches (unless --batches says otherwise).
    count = min(cfg.eval_batches if max_batches is None else max_batches, loaded.num_val_batches)
    if count == 0:
      raise DataError(f"{data}: the validation split (val_fraction={cfg.data.val_fraction}) "
                      f"holds less than one batch of {cfg.batch_size}x{cfg.seq_len}")
    return loaded.val_batches(count)
  tokenizer = load_tokenizer(tokenizer_spec)
  check_vocab(tokenizer, cfg.model.vocab_size)
  corpus = prepared.read(path, tokenizer) if source == "tokens" else None
  tokens_N = (corpus.tokens_N if corpus is not None else
              tokenizer.encode_documents(load_documents(source, path)))
  windows_WxL = iterator.windows(tokens_N, cfg.seq_len)
  count = len(windows_WxL) // cfg.batch_size
  if count == 0:
    raise DataError(f"{data}: {len(windows_WxL)} windows of {cfg.seq_len + 1} tokens, fewer than "
                    f"one batch of {cfg.batch_size}")
  if max_batches is not None:
    count = min(count, max_batches)
  return iterator.WindowBatches(windows_WxL, cfg.batch_size, count,
                                corpus.ids if corpus is not None else None)


def evaluation_trainer(cfg):
  """A Trainer for evaluating `cfg`'s parameters on all local devices (placement fsdp)."""
  import jax
  from moejax.sharding.mesh import make_mesh
  from moejax.train.loop import Trainer
  cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, placement="fsdp"))
  devices = jax.local_devices()
  while cfg.batch_size % len(devices):
    devices = devices[:-1]
  return Trainer(cfg, mesh=make_mesh((1, -1), devices))


def differences_from_training(cfg, num_devices: int) -> list[str]:
  """Where this evaluation (every assignment run, on `num_devices` local devices under fsdp)
  computes other than the run's own validation did: its `val_loss` is then not reproduced."""
  notes = []
  if cfg.moe.placement != "fsdp" and cfg.moe.dispatch_overflow == "drop":
    notes.append(f"the run's val_loss dropped the assignments past its {cfg.moe.placement} "
                 "dispatch buffers (moe.dispatch_overflow='drop'); this evaluation runs every "
                 "assignment")
  if cfg.routing.admission != "none":
    notes.append(f"routing.admission={cfg.routing.admission!r} admits each expert's capacity "
                 f"per device: the loss depends on the device count ({num_devices} here), as "
                 "the run's val_loss did on its own")
  return notes


def mean_loss(trainer, params, eval_batches) -> float:
  """The mean cross-entropy (nats/token) of host `params` over `eval_batches`."""
  import jax
  from moejax.train.loop import put_batch
  params = jax.device_put(params, trainer.layout.shardings.params)
  return trainer.evaluate(params, (put_batch(b, trainer.mesh) for b in eval_batches))


def perplexity(loss: float) -> float:
  """exp(loss), inf past float64's range (a diverged model's loss can pass 709 nats)."""
  return math.exp(loss) if loss < 709.0 else math.inf


def _why_not_finite(params) -> str:
  """Where a non-finite loss comes from: the first non-finite parameter, or the data."""
  from moejax.weights import first_non_finite
  bad = first_non_finite(params)
  if bad is not None:
    return f"parameter {bad} holds non-finite values (evaluate another step with --step)"
  return ("every parameter is finite: the forward pass overflowed on this data (logits or "
          "activations: a diverged model, or data unlike its training corpus)")


def run(args) -> dict:
  if args.batches is not None and args.batches < 1:
    raise DataError(f"--batches={args.batches}: must be at least 1")
  for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
    if value is not None and value < 1:
      raise DataError(f"{flag}={value}: must be at least 1")
  from moejax.convert.checkpoint_io import load_model
  cfg, params, tokenizer_spec = load_model(args.ckpt, args.step, tokenizer=args.tokenizer)
  from moejax.generate import trained_here
  if args.seq_len and args.seq_len > cfg.seq_len and trained_here(args.ckpt):
    print(f"moejax: note: --seq-len={args.seq_len} scores positions past the run's "
          f"seq_len={cfg.seq_len}, which it never trained at", file=sys.stderr)
  cfg = dataclasses.replace(cfg, seq_len=args.seq_len or cfg.seq_len,
                            batch_size=args.batch_size or cfg.batch_size)
  eval_batches = batches(cfg, args.data, args.split, tokenizer_spec, args.batches, args.source)
  windows = getattr(eval_batches, "windows_WxL", None)      # --split all: the file's windows
  if windows is not None and args.batches is None and len(windows) % cfg.batch_size:
    print(f"moejax: note: {len(windows) % cfg.batch_size} of {args.data}'s {len(windows):,} "
          f"windows are left out (batches are whole: {len(eval_batches)} of {cfg.batch_size}; a "
          "--batch-size that divides the windows scores every one)", file=sys.stderr)
  trainer = evaluation_trainer(cfg)
  for note in differences_from_training(cfg, trainer.mesh.devices.size):
    print(f"moejax: note: {note}", file=sys.stderr)
  loss = mean_loss(trainer, params, eval_batches)
  tokens = len(eval_batches) * cfg.batch_size * cfg.seq_len
  if not math.isfinite(loss):
    raise MoejaxError(f"{args.ckpt}: the loss on {args.data} ({args.split}) is {loss} over "
                      f"{tokens:,} tokens: {_why_not_finite(params)}")
  return {"loss": loss, "perplexity": perplexity(loss), "tokens": tokens,
          "batches": len(eval_batches), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)

  def body():
    result = run(args)
    print(f"{args.data} ({args.split}): loss {result['loss']:.4f} nats/token, perplexity "
          f"{result['perplexity']:.2f} over {result['tokens']:,} tokens "
          f"({result['batches']} batch{'es' * (result['batches'] != 1)} of "
          f"{result['batch_size']} x {result['seq_len']})")

  return run_command(body)


if __name__ == "__main__":
  sys.exit(main())
