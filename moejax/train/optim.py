"""AdamW with linear warm-up, cosine decay and global-norm clipping (optax)."""
from __future__ import annotations

import jax
import optax

from moejax.config import Config


def lr_schedule(cfg: Config) -> optax.Schedule:
  o = cfg.optim
  if o.warmup_steps >= cfg.steps:   # a short run that never leaves warm-up
    return optax.linear_schedule(0.0, o.lr, o.warmup_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
      decay_steps=cfg.steps, end_value=o.lr * o.min_lr_ratio)


def _decay_mask(params):
  # No weight decay on norm scales. Layer parameters carry a leading layer axis, so a stacked
  # norm scale is 2-D: decide by the name, not the rank.
  return jax.tree_util.tree_map_with_path(
      lambda path, p: not any("norm" in str(getattr(k, "key", k)) for k in path), params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  o = cfg.optim
  parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
  parts.append(optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                           weight_decay=o.weight_decay, mask=_decay_mask))
  return optax.chain(*parts)
