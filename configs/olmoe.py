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
                   1.28B active parameters.

Override any field: --config.moe.placement=ep --config.steps=100
"""
import ml_collections

PRESETS = ("tiny", "1b7b")


def _base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = dict(vocab_size=320, d_model=64, num_layers=2, num_heads=4, head_dim=16,
                 rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)
  c.moe = dict(num_experts=8, top_k=2, expert_hidden=64, score="softmax", renormalize=False,
               aux_loss_weight=0.01, z_loss_weight=0.001, placement="fsdp",
               capacity_factor=0.0)
  c.routing = dict(admission="none", threshold=-1.0, capacity_factor=1.25,
                   capacity_factor_warmup=2.0, warmup_steps=0, locality_weight=0.0)
  c.fssdp = dict(replica_slots=2, overlap_degree=4, window=5, reshard_every=100,
                 calibrate=True, max_per_layer=0)
  c.data = dict(source="builtin", path="", tokenizer="bytes", val_fraction=0.05)
  c.optim = dict(lr=3e-3, min_lr_ratio=0.1, warmup_steps=10, weight_decay=0.1, b1=0.9,
                 b2=0.95, eps=1e-8, clip_norm=1.0)
  c.mesh = dict(shape=(1, -1))
  c.codec = dict(mode="off", block_size=512, warmup_steps=30, detect="exact",
                 capacity_fraction=0.0, delta_bits=3, select=False, cache_budget_bytes=0,
                 reselect_every=0, capacity_margin=1.25, comm_model="profile")
  c.checkpoint = dict(every=100, keep=3)
  c.steps = 200
  c.batch_size = 16
  c.seq_len = 64
  c.seed = 0
  c.log_every = 10
  c.eval_every = 50
  c.eval_batches = 4
  c.remat = True
  c.init_from = ""
  c.prefetch = True
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = _base()
  if preset == "tiny":
    pass
  elif preset == "1b7b":
    c.model.update(vocab_size=50304, d_model=2048, num_layers=16, num_heads=16, head_dim=128)
    c.moe.update(num_experts=64, top_k=8, expert_hidden=1024)
    c.data.tokenizer = "bytes"
    c.optim.update(lr=4e-4, warmup_steps=2000)
    c.checkpoint.update(every=1000)
    c.steps = 100000
    c.batch_size = 1024
    c.seq_len = 4096
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/olmoe.py (valid: {', '.join(PRESETS)})")
  return c
