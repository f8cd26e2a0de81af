"""The training loop: `run(cfg, workdir)`.

Metrics come back to the host one step late (the next step is dispatched before the previous
step's metrics are read), so the host never blocks the device.
"""
from __future__ import annotations

import math
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from moejax.config import Config
from moejax.data import DataSpec, check_vocab, make_data
from moejax.errors import ConfigError, TrainingError
from moejax.layers.dispatch import ep_a2a_bytes
from moejax.sharding import hook
from moejax.sharding.mesh import make_mesh, num_devices
from moejax.train import optim, state as state_lib, step as step_lib
from moejax.train.metrics import MetricsWriter, log, progress_line


def prepare_workdir(workdir: str) -> None:
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, ".write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"workdir {workdir!r} is not writable: {e.strerror or e}") from None


def put_batch(batch: dict, mesh) -> dict:
  """Global host batch -> arrays sharded over the devices (each process fills its shards)."""
  sharding = NamedSharding(mesh, step_lib.BATCH_SPEC["inputs"])
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in batch.items()}


def comm_figures(cfg: Config, mesh, lay) -> dict[str, float]:
  """Bytes per device per step moved by the hook's and the MoE block's collectives."""
  n = num_devices(mesh)
  layer_bytes = hook.comm_bytes(lay.param_shapes["layers"], lay.layouts["layers"], n,
                                remat=cfg.remat)
  rest = {k: v for k, v in lay.param_shapes.items() if k != "layers"}
  rest_bytes = hook.comm_bytes(rest, {k: lay.layouts[k] for k in rest}, n, remat=False)
  figures = {k: layer_bytes[k] + rest_bytes[k] for k in layer_bytes}
  a2a = 0.0
  if cfg.moe.placement == "ep" and n > 1:
    a2a = cfg.model.num_layers * ep_a2a_bytes(
        cfg.batch_size * cfg.seq_len // n, cfg.moe.top_k, cfg.model.d_model, n,
        cfg.moe.capacity_factor, remat=cfg.remat)
  figures["a2a_bytes"] = a2a
  return figures


class Trainer:
  """Everything compiled and placed for one config on one mesh."""

  def __init__(self, cfg: Config, mesh=None):
    self.cfg = cfg
    self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh.shape)
    step_lib.check_divisibility(cfg, self.mesh)
    self.tx = optim.make_optimizer(cfg)
    self.schedule = optim.lr_schedule(cfg)
    self.layout = state_lib.state_layout(cfg, self.mesh, self.tx)
    self.train_step = step_lib.make_train_step(cfg, self.mesh, self.layout, self.tx,
                                               self.schedule)
    self.eval_step = step_lib.make_eval_step(cfg, self.mesh, self.layout)
    self.comm = comm_figures(cfg, self.mesh, self.layout)

  def init_state(self, seed: int | None = None):
    seed = self.cfg.seed if seed is None else seed
    return state_lib.init_state(self.cfg, self.tx, self.layout, jax.random.key(seed))

  def evaluate(self, params, batches) -> float:
    return float(np.mean([float(self.eval_step(params, b)) for b in batches]))


def _check_finite(step: int, metrics: dict) -> None:
  loss = float(metrics["loss"])
  if not math.isfinite(loss):
    raise TrainingError(f"loss became {loss} at step {step}; stopping (try a lower optim.lr "
                        "or a smaller optim.clip_norm)")


def run(cfg: Config, workdir: str) -> dict:
  """Trains `cfg` and writes workdir/metrics.jsonl. Returns the last logged record."""
  prepare_workdir(workdir)
  data = make_data(DataSpec(cfg.data.source, cfg.data.path or None, cfg.data.tokenizer,
                            cfg.data.val_fraction, cfg.seed),
                   batch_size=cfg.batch_size, seq_len=cfg.seq_len)
  check_vocab(data.tokenizer, cfg.model.vocab_size)
  trainer = Trainer(cfg)
  state = trainer.init_state()
  val_batches = [put_batch(b, trainer.mesh)
                 for b in data.val_batches(min(cfg.eval_batches, data.num_val_batches))]
  log(f"moejax: {data.name}, {num_devices(trainer.mesh)} device(s), "
      f"placement={cfg.moe.placement}, {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len}")
  writer = MetricsWriter(workdir)
  try:
    return _train(trainer, state, data, val_batches, writer)
  finally:
    writer.close()


def _train(trainer: Trainer, state, data, val_batches, writer) -> dict:
  cfg = trainer.cfg
  record: dict = {}
  previous = None                        # (step, metrics) read one step late
  t_start = t_log = time.perf_counter()
  steps_since_log = 0
  for step in range(int(state.step) + 1, cfg.steps + 1):
    state, metrics = trainer.train_step(state, put_batch(next(data.train), trainer.mesh))
    if previous is not None:
      _check_finite(*previous)
    previous = (step, metrics)
    steps_since_log += 1
    if steps_since_log == 1 and t_log == t_start:
      # The first step compiles; time the steps after it.
      jax.block_until_ready(metrics)
      t_log, steps_since_log = time.perf_counter(), 0
      if step % cfg.log_every:
        continue
    evaluate = step % cfg.eval_every == 0 or step == cfg.steps
    if step % cfg.log_every and not evaluate:
      continue
    values = jax.device_get(metrics)     # waits for this step: the timing below is honest
    _check_finite(step, values)
    step_time = (time.perf_counter() - t_log) / max(steps_since_log, 1)
    record = {"step": step, **values, "step_time_s": step_time,
              "tokens_per_s": cfg.batch_size * cfg.seq_len / step_time, **trainer.comm}
    if evaluate:
      record["val_loss"] = trainer.evaluate(state.params, val_batches)
    writer.write(record)
    log(progress_line(step, cfg.steps, record, (cfg.steps - step) * step_time))
    t_log, steps_since_log = time.perf_counter(), 0
  return record
