"""AdamW with linear warm-up, cosine decay and global-norm clipping (optax)."""
from __future__ import annotations

import jax
import optax

from moejax.config import Config
from moejax.models import olmoe
from moejax.sharding import axes


def lr_schedule(cfg: Config) -> optax.Schedule:
  o = cfg.optim
  if o.warmup_steps >= cfg.steps:   # a short run that never leaves warm-up
    return optax.linear_schedule(0.0, o.lr, o.warmup_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
      decay_steps=cfg.steps, end_value=o.lr * o.min_lr_ratio)


def decay_mask(cfg: Config):
  """A tree of bools like the parameters: weight decay on all but the norm scales and biases, by
  the group each parameter declares."""
  return jax.tree.map(lambda meta: meta.group not in axes.NO_DECAY, olmoe.param_meta(cfg))


def frozen_mask(cfg: Config):
  """A tree of bools like the parameters: True where the optimizer leaves the parameter as it is
  (`axes.FROZEN`: DeepSeek-V3.2's indexer, which no loss reaches); None where nothing is."""
  meta = olmoe.param_meta(cfg)
  if not any(m.group in axes.FROZEN for m in jax.tree.leaves(meta)):
    return None
  return jax.tree.map(lambda m: m.group in axes.FROZEN, meta)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  o = cfg.optim
  parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
  parts.append(optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                           weight_decay=o.weight_decay, mask=decay_mask(cfg)))
  frozen = frozen_mask(cfg)
  if frozen is not None:       # zero updates, so weight decay cannot move them either
    parts.append(optax.masked(optax.set_to_zero(), frozen))
  return optax.chain(*parts)
