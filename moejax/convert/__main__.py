"""Hugging Face <-> moejax checkpoints, every family (OLMoE, Mixtral, Qwen2-MoE, Qwen3-MoE).

  python -m moejax.convert from-hf HF_DIR OUT_DIR
      HF_DIR: config.json + model.safetensors (or shards + model.safetensors.index.json).
      OUT_DIR: a parameters-only moejax checkpoint (see moejax.convert.checkpoint_io).
  python -m moejax.convert to-hf CKPT OUT_DIR [--step N] [--dtype bfloat16] [--max-shard-size 5GB]
      CKPT: a from-hf OUT_DIR, a training workdir, its checkpoints/ directory or a step directory.
      OUT_DIR: config.json + safetensors in the family's Hub layout; transformers loads it with
      AutoModelForCausalLM.from_pretrained(OUT_DIR).

Bad input stops with one line `error: ...` and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from moejax.config import num_params
from moejax.errors import CheckpointError, run_command

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
  """'5GB' -> 5_000_000_000 (decimal units, as transformers' max_shard_size; KiB.. binary)."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
  if not match or match.group(2).upper() not in _SIZE_UNITS:
    raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1000000")
  size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
  if size <= 0:
    raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
  return size


def _describe(cfg) -> str:
  m, moe = cfg.model, cfg.moe
  return (f"{m.family} {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads, "
          f"{moe.num_experts} experts top-{moe.top_k}, {num_params(cfg)['total']:,} parameters")


def from_hf(args) -> None:
  from moejax import weights
  from moejax.convert import hf, quantization_summary
  weights.check_new_dir(args.out_dir)   # before reading every weight into host memory
  hf_config = hf.read_hf_config(args.hf_dir)
  cfg, params = hf.load_hf(args.hf_dir, progress=lambda line: print(line, file=sys.stderr,
                                                                     flush=True))
  # What would make the output unusable is refused before anything is written: a tokenizer
  # that does not load or does not fit the model, weights that are not finite.
  tokenizer = os.path.join(args.hf_dir, "tokenizer.json")
  if os.path.isfile(tokenizer):
    from moejax.data.tokenizer import check_vocab, load_tokenizer
    check_vocab(load_tokenizer(tokenizer), cfg.model.vocab_size)
  bad = weights.first_non_finite(params)
  if bad is not None:
    raise CheckpointError(f"{args.hf_dir}: parameter {bad} holds NaN or infinite values: these "
                          "weights would train to NaN; nothing was written")
  from moejax.convert import checkpoint_io   # orbax: imported once there is something to save
  checkpoint_io.save_params(args.out_dir, cfg, params, hf_config=hf_config,
                            source=os.path.abspath(args.hf_dir))
  if os.path.isfile(os.path.join(args.hf_dir, checkpoint_io.TOKENIZER_FILE)):
    weights.keep_tokenizer(args.hf_dir, args.out_dir)   # generate/evaluate find it beside them
  quantized = quantization_summary(hf_config)
  print(f"wrote {args.out_dir}: {_describe(cfg)} (from {args.hf_dir}"
        + (f"; weights {quantized}, dequantized to fp32)" if quantized else ")"))


def to_hf(args) -> None:
  from moejax import weights
  from moejax.convert import checkpoint_io, hf
  hf.check_out_dir(args.out_dir, args.overwrite)   # before reading every weight
  cfg, params, hf_config = checkpoint_io.load_params(args.ckpt, args.step)
  tokenizer = _tokenizer_file(args.ckpt, cfg)
  files = hf.save_hf(params, cfg, args.out_dir, dtype=args.dtype,
                     max_shard_bytes=args.max_shard_size, hf_config_base=hf_config,
                     overwrite=args.overwrite,
                     eos_token_id=None if hf_config else _eos_id(tokenizer, cfg),
                     bytes_tokenizer=tokenizer is None and cfg.data.tokenizer == "bytes")
  shards = sum(f.endswith(".safetensors") for f in files)
  if tokenizer is not None:   # transformers (and generate / evaluate) read it beside the weights
    weights.keep_tokenizer(tokenizer, args.out_dir)
  elif args.overwrite and os.path.isfile(os.path.join(args.out_dir, checkpoint_io.TOKENIZER_FILE)):
    # the export it overwrote had one; these weights have none (bytes), and a stale one beside
    # them would be read as theirs
    os.remove(os.path.join(args.out_dir, checkpoint_io.TOKENIZER_FILE))
  print(f"wrote {args.out_dir}: {_describe(cfg)}, {shards} safetensors file(s), {args.dtype}"
        + (f", {checkpoint_io.TOKENIZER_FILE}" if tokenizer else
           (" (no tokenizer.json: the run trained on UTF-8 bytes, which config.json says; "
            "generate and evaluate read it so)" if cfg.data.tokenizer == "bytes" else
            " (no tokenizer.json: the run's tokenizer was not found; copy it there)")))


def _eos_id(tokenizer: str | None, cfg) -> int | None:
  """The EOS id the run's documents ended with: its tokenizer.json's (as it resolves beside the
  file), the byte tokenizer's, or None when the run's tokenizer cannot be found."""
  from moejax.data.tokenizer import ByteTokenizer, load_tokenizer
  if tokenizer is not None:
    return load_tokenizer(tokenizer).eos_id
  return ByteTokenizer.eos_id if cfg.data.tokenizer == "bytes" else None


def _tokenizer_file(ckpt: str, cfg) -> str | None:
  """The tokenizer.json a checkpoint was trained with: the one kept beside it, else the file
  its config names (`data.tokenizer`); None for the byte tokenizer."""
  from moejax import weights
  from moejax.errors import CheckpointError
  found = weights.tokenizer_beside(ckpt)
  if found is not None:
    return found
  try:
    return weights.tokenizer_file(weights.tokenizer_of(cfg))
  except CheckpointError:   # init_from's weights moved: nothing to copy
    return None


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m moejax.convert",
                                   description="Hugging Face <-> moejax checkpoints.")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("from-hf", help="Hugging Face directory (any family) -> moejax checkpoint")
  p.add_argument("hf_dir")
  p.add_argument("out_dir")
  p.set_defaults(run=from_hf)
  p = sub.add_parser("to-hf", help="moejax checkpoint -> Hugging Face directory of its family")
  p.add_argument("ckpt")
  p.add_argument("out_dir")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="stored dtype (float32 is exact; bfloat16 rounds to nearest even)")
  p.add_argument("--max-shard-size", type=parse_size, default="5GB",
                 help="largest safetensors file, e.g. 5GB (default) or 500MB")
  p.add_argument("--overwrite", action="store_true",
                 help="replace safetensors files already in OUT_DIR")
  p.set_defaults(run=to_hf)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  return run_command(lambda: args.run(args))


if __name__ == "__main__":
  sys.exit(main())
