"""OLMoE configs.

Run (CPU, about a minute on 2 cores):
  python train.py --config configs/olmoe.py:tiny --workdir runs/tiny

It prints a line every `log_every` steps, e.g.
  step   10/200 | loss 4.912 | val - | 41k tok/s | 0.025 s/step | ETA 0:00:05
and the loss falls from about 5.8 (ln 320) to under 60% of its first value by the end; the
validation loss is reported every `eval_every` steps and falls too. Metrics go to
runs/tiny/metrics.jsonl.

Presets:
  tiny  (default)  2 layers, d_model 64, 8 experts top-2, byte-level vocab; trains on CPU.
  1b7b             the published OLMoE-1B-7B shapes (16 layers, d_model 2048, 16 heads,
                   64 experts, top-8, expert hidden 1024, vocab 50304): 6.92B total,
                   1.28B active parameters (published: 6.9B, 1.3B). Reads the checkpoint's
                   tokenizer.json (data.tokenizer=init_from): fine-tune with
                   --config.init_from=HF_DIR.

Each preset sets only what differs from the typed defaults in moejax/config.py.
Override any field: --config.moe.placement=ep --config.steps=100
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "1b7b")
# Published (total, active) parameters and where the figures come from.
PUBLISHED = {"1b7b": (6.9e9, 1.3e9, "OLMoE paper (arXiv 2409.02060) and the "
                                    "allenai/OLMoE-1B-7B-0924 model card: 6.9B total, 1.3B "
                                    "active")}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The typed defaults of `moejax.config`, plus what the preset changes."""
  preset = arg or "tiny"
  c = default_config_dict()
  if preset == "tiny":
    pass   # the typed defaults are the tiny model
  elif preset == "1b7b":
    c.model.update(vocab_size=50304, d_model=2048, num_layers=16, num_heads=16, head_dim=128)
    c.moe.update(num_experts=64, top_k=8, expert_hidden=1024)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/olmoe.py (valid: {', '.join(PRESETS)})")
  return c
