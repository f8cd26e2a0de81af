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


def own_loss_mask(cfg: Config):
  """A tree of bools like the parameters: True for those a loss of their own alone trains
  (`axes.OWN_LOSS`: DeepSeek-V3.2's indexer); None where the model has none."""
  meta = olmoe.param_meta(cfg)
  if not any(m.group in axes.OWN_LOSS for m in jax.tree.leaves(meta)):
    return None
  return jax.tree.map(lambda m: m.group in axes.OWN_LOSS, meta)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  o = cfg.optim
  own = own_loss_mask(cfg)
  parts = []
  if o.clip_norm > 0:
    clip = optax.clip_by_global_norm(o.clip_norm)
    # apart: the indexer's gradients must not scale the rest's (nor theirs the indexer's)
    parts = [clip] if own is None else [
        optax.masked(clip, jax.tree.map(lambda x: not x, own)), optax.masked(clip, own)]
  parts.append(optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                           weight_decay=o.weight_decay, mask=decay_mask(cfg)))
  if own is not None and not cfg.model.train_indexer:
    # their loss off: zero updates, so nothing moves them (weight decay neither)
    parts.append(optax.masked(optax.set_to_zero(), own))
  return optax.chain(*parts)
