"""Fine-tuning a Hugging Face checkpoint end to end: a random Qwen2-MoE model of the tiny preset's
shapes (every option the family has: grouped-query attention, qkv biases, a gated shared expert),
with its own tokenizer.json, trained on a JSONL file through train.py --config.init_from. The
first step's per-token losses equal transformers' on the same batch (compute_dtype=float32)."""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from moejax.convert import __main__ as cli
from moejax.convert import hf_config_from, load_hf
from moejax.data import DataSpec, make_data
from moejax.data.sources import load_documents
from moejax.models import olmoe
from moejax.sharding import hook
from tests.helpers import run_train, tiny_config

FAMILY = "qwen2_moe"
BATCH, SEQ = 4, 32
RTOL = 1e-4


def _tokenizer(texts, vocab_size: int) -> Tokenizer:
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["[UNK]", "<|endoftext|>"]))
  return tok


def test_fine_tune_a_hugging_face_checkpoint_through_train_py(hf_reference, tmp_path):
  cfg = tiny_config(FAMILY)
  hf_dir, workdir = str(tmp_path / "hf"), str(tmp_path / "run")
  hf_reference.call("random_model", config=hf_config_from(cfg), out_dir=hf_dir, seed=3)
  docs = load_documents("builtin", None)[:40]
  _tokenizer(docs, cfg.model.vocab_size - 20).save(os.path.join(hf_dir, "tokenizer.json"))
  data_path = str(tmp_path / "docs.jsonl")
  with open(data_path, "w") as f:
    f.writelines(json.dumps({"text": d}) + "\n" for d in docs)

  proc = run_train(["--config", f"configs/{FAMILY}.py:tiny", f"--workdir={workdir}",
                    f"--config.init_from={hf_dir}", "--config.data.tokenizer=init_from",
                    "--config.data.source=jsonl", f"--config.data.path={data_path}",
                    "--config.compute_dtype=float32", "--config.steps=2",
                    f"--config.batch_size={BATCH}", f"--config.seq_len={SEQ}",
                    "--config.eval_batches=1", "--config.log_every=1"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"initialized from {hf_dir}" in proc.stderr + proc.stdout
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = next(r for r in map(json.loads, f) if r.get("step") == 1)

  # The batch train.py's first step saw: the same data, tokenizer, split and seed.
  spec = DataSpec("jsonl", data_path, os.path.join(hf_dir, "tokenizer.json"),
                  cfg.data.val_fraction, cfg.seed)
  batch = next(iter(make_data(spec, batch_size=BATCH, seq_len=SEQ, prefetch=0).train))
  np.save(tmp_path / "inputs.npy", batch["inputs"])
  np.save(tmp_path / "targets.npy", batch["targets"])
  reply = hf_reference.call("token_losses", hf_dir=hf_dir, inputs=str(tmp_path / "inputs.npy"),
                            targets=str(tmp_path / "targets.npy"),
                            out=str(tmp_path / "losses.npy"))
  assert reply["loading_info"] == {}
  want_BxS = np.load(tmp_path / "losses.npy")

  imported, params = load_hf(hf_dir)
  gather = functools.partial(hook.local_gather, dtype=jnp.float32)
  logits = jax.jit(lambda p, t: olmoe.forward(imported, p, t, gather=gather, remat="none")[0])(
      params, batch["inputs"])
  got_BxS = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))
  np.testing.assert_allclose(got_BxS, want_BxS, rtol=RTOL)
  assert abs(first["loss"] - float(want_BxS.mean())) <= RTOL * float(want_BxS.mean())

  # The workdir keeps the tokenizer, and exports with the source checkpoint's config.json
  # fields (here max_window_layers, which only transformers writes).
  assert os.path.isfile(os.path.join(workdir, "tokenizer.json"))
  out = str(tmp_path / "exported")
  assert cli.main(["to-hf", workdir, out]) == 0
  with open(os.path.join(hf_dir, "config.json")) as f:
    source = json.load(f)
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert exported["model_type"] == FAMILY and exported["max_window_layers"] == source[
      "max_window_layers"]
  # ... and the tokenizer it was trained with, which transformers and generate read from there.
  with open(os.path.join(out, "tokenizer.json")) as a, open(os.path.join(hf_dir,
                                                                          "tokenizer.json")) as b:
    assert a.read() == b.read()
