"""Sample text from a checkpoint.

  python -m moejax.generate CKPT --prompt TEXT [--max-new-tokens 64] [--temperature 0]
      [--top-p 1.0] [--seed 0] [--dtype float32] [--step N]

CKPT: a training workdir (its latest checkpoint, or --step), a from-hf output directory, or a
Hugging Face model directory; the tokenizer is the tokenizer.json found there, else the one the
config names (`data.tokenizer`). Temperature 0 is greedy; otherwise nucleus sampling with
`--top-p`, reproducible for a fixed `--seed`. One prompt, a KV cache (`moejax.models.decode`),
on one device. Prints the continuation; bad input stops with one line and exit code 2.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from moejax.errors import DataError, run_command

DTYPES = ("float32", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m moejax.generate",
                                   description="Sample text from a moejax or HF checkpoint.")
  parser.add_argument("ckpt", help="workdir, from-hf output or Hugging Face directory")
  parser.add_argument("--prompt", required=True)
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", choices=DTYPES, default="float32")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
  parser.add_argument("--tokenizer", default=None,
                      help="'bytes' or a tokenizer.json (default: the one beside CKPT)")
  return parser


def encode_prompt(tokenizer, prompt: str, vocab_size: int) -> np.ndarray:
  """[1, P] ids, or a DataError naming --prompt."""
  try:
    # With the tokenizer's special tokens (a Llama-style BOS), as transformers encodes a prompt.
    ids = np.asarray(tokenizer.encode(prompt, special_tokens=True), np.int32)
  except Exception as e:  # noqa: BLE001  tokenizers raise bare exceptions
    raise DataError(f"--prompt {prompt!r}: the tokenizer {tokenizer.name} cannot encode it "
                    f"({e})") from None
  if ids.size == 0:
    raise DataError(f"--prompt {prompt!r}: encodes to no tokens with {tokenizer.name}; give at "
                    "least one character it knows")
  if ids.max() >= vocab_size:
    raise DataError(f"--prompt {prompt!r}: token id {int(ids.max())} is outside the model's "
                    f"vocabulary of {vocab_size}")
  return ids[None, :]


def run(args) -> str:
  if args.max_new_tokens < 1:
    raise DataError(f"--max-new-tokens={args.max_new_tokens}: must be at least 1")
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    raise DataError(f"--temperature={args.temperature}: must be a finite number >= 0 (0 is "
                    "greedy)")
  if not 0 < args.top_p <= 1:   # NaN fails this too
    raise DataError(f"--top-p={args.top_p}: must be in (0, 1]")
  if not -2 ** 63 <= args.seed < 2 ** 63:
    raise DataError(f"--seed={args.seed}: must fit in 64 bits, in [-2^63, 2^63)")
  import jax.numpy as jnp
  from moejax.convert.checkpoint_io import load_model
  from moejax.data.tokenizer import check_vocab, load_tokenizer
  from moejax.models import decode
  cfg, params, tokenizer_spec = load_model(args.ckpt, args.step, tokenizer=args.tokenizer)
  tokenizer = load_tokenizer(tokenizer_spec)
  check_vocab(tokenizer, cfg.model.vocab_size)
  prompt_1xP = encode_prompt(tokenizer, args.prompt, cfg.model.vocab_size)
  dtype = jnp.dtype(args.dtype)
  positions = prompt_1xP.shape[1] + args.max_new_tokens
  check_cache_fits(cfg, positions, dtype)
  if positions > cfg.seq_len and trained_here(args.ckpt):
    print(f"moejax: note: generating to position {positions:,}, past the run's "
          f"seq_len={cfg.seq_len}: positions it never trained at (each new token attends to "
          "every earlier one: time grows with the square of the length)", file=sys.stderr)
  tokens_1xN, _ = decode.generate(cfg, params, prompt_1xP, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, dtype=dtype, eos_id=tokenizer.eos_id,
                                  vocab_limit=tokenizer.vocab_size)
  prompt_ids = prompt_1xP[0]
  new = np.asarray(tokens_1xN)[0, prompt_ids.size:]
  if new.size and new[-1] == tokenizer.eos_id:
    new = new[:-1]
  return continuation(tokenizer, prompt_ids, new)


def trained_here(path: str) -> bool:
  """Whether `path` holds a moejax run's checkpoint, whose config's seq_len is the length it
  trained at (a Hugging Face directory or a from-hf output names none: theirs is a default)."""
  import os
  from moejax.convert.checkpoint_io import _find_hf_config, is_hf_dir
  path = os.path.abspath(path)
  return not (os.path.isdir(path) and is_hf_dir(path)) and _find_hf_config(path) is None


def continuation(tokenizer, prompt_ids: np.ndarray, new_ids: np.ndarray) -> str:
  """The text the new ids add to the prompt's. Decoded with the prompt, then the prompt's own
  text cut off: tokenizers that mark word starts in the token (SentencePiece's metaspace) drop
  a leading space when a sequence is decoded alone, so decoding the new ids by themselves would
  glue the first new word to the prompt."""
  whole = tokenizer.decode(np.concatenate([prompt_ids, new_ids]))
  head = tokenizer.decode(prompt_ids)
  return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new_ids)


def check_cache_fits(cfg, positions: int, dtype) -> None:
  """DataError naming --max-new-tokens when the KV cache for `positions` cannot fit in the
  device's memory (its allocator's limit; on CPU the machine's physical memory)."""
  import jax
  from moejax.models import decode
  cache = jax.eval_shape(lambda: decode.init_cache(cfg, 1, positions, dtype))
  need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  limit = cache_limit_bytes(jax.devices()[0])
  if limit and need > limit:
    raise DataError(f"--max-new-tokens: a KV cache of {positions:,} positions needs "
                    f"{need / 2**30:.1f} GiB, more than the device's {limit / 2**30:.1f} GiB; "
                    "ask for fewer new tokens")


def cache_limit_bytes(device) -> int | None:
  """The device's memory as XLA reports it (GPUs), else on CPU the machine's physical memory."""
  from moejax.train.memory import device_memory_bytes
  limit = device_memory_bytes(device)
  if limit or device.platform != "cpu":
    return limit
  import os
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    return None


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  return run_command(lambda: print(args.prompt + run(args)))


if __name__ == "__main__":
  sys.exit(main())
