"""The optimizer: AdamW on a linear-warmup + cosine schedule, global-norm
clipping, optional gradient accumulation, per-parameter learning-rate
multipliers and frozen parameters.

    MultiSteps(k)                     # only when grad_accum_steps > 1
      multi_transform
        'train':  clip_by_global_norm -> adamw(warmup_cosine)
                  -> x lr multiplier  # only when lr_multipliers is given
        'freeze': set_to_zero          # exactly zero updates, no weight decay

The clip norm is taken over the trainable gradients only, and the schedule
counts optimizer updates (one per `grad_accum_steps` micro-batches), so
`total_steps` is the number of updates, not of batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
import optax

from orthros_jax.treepath import path_str

# What `trainable_mask` may be: None (train everything); a pytree of bools
# shaped like the params; a predicate on the '/'-joined param path; or a
# sequence of substrings, a param trains when its path contains any of them
# (e.g. ('phi_q', 'phi_k', 'window_logit') or ('lora',)).
TrainableMask = Union[None, Any, Callable[[str], bool], Sequence[str]]


def _check(ok: bool, field: str, value, expected: str) -> None:
  if not ok:
    raise ValueError(f'{field}={value!r} is invalid: expected {expected}.')


def trainable_labels(params, trainable_mask: TrainableMask):
  """A pytree like `params` of 'train' / 'freeze' labels."""
  if trainable_mask is None:
    return jax.tree.map(lambda _: 'train', params)
  if isinstance(trainable_mask, (list, tuple)) and all(
      isinstance(s, str) for s in trainable_mask):
    subs = tuple(trainable_mask)
    predicate = lambda p: any(s in p for s in subs)
  elif callable(trainable_mask):
    predicate = trainable_mask
  else:  # a pytree of bools
    return jax.tree.map(lambda _, m: 'train' if m else 'freeze', params,
                        trainable_mask)
  return jax.tree_util.tree_map_with_path(
      lambda p, _: 'train' if predicate(path_str(p)) else 'freeze', params)


def make_schedule(lr: float, warmup_steps: int,
                  total_steps: int) -> optax.Schedule:
  """Linear warmup 0 -> lr over `warmup_steps`, cosine to 0 at `total_steps`."""
  _check(lr > 0, 'learning_rate', lr, 'a number > 0')
  _check(isinstance(warmup_steps, int) and warmup_steps >= 0, 'warmup_steps',
         warmup_steps, 'an integer >= 0')
  _check(isinstance(total_steps, int) and total_steps > warmup_steps,
         'total_steps', total_steps, f'an integer > warmup_steps={warmup_steps}')
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
      decay_steps=total_steps, end_value=0.0)


def scale_by_multipliers(multipliers: Sequence[tuple[str, float]]
                         ) -> optax.GradientTransformation:
  """Multiplies the update of every param whose '/'-joined path contains
  substring s by m, for each (s, m); when several substrings match, the
  longest (most specific) wins, whatever their order; others x 1.

  After adamw this is a per-parameter learning rate: the AdamW update
  -lr * (adam direction + weight_decay * param) is scaled as a whole.
  """
  multipliers = tuple((str(s), float(m)) for s, m in multipliers)

  def factor(path) -> float:
    name = path_str(path)
    matches = [(len(s), m) for s, m in multipliers if s in name]
    return max(matches)[1] if matches else 1.0

  def update_fn(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(
        lambda p, u: u * factor(p), updates), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(),
                                      update_fn)


def make_optimizer(lr: float, warmup_steps: int, total_steps: int,
                   weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.95, clip_norm: float | None = 1.0,
                   grad_accum_steps: int = 1,
                   trainable_mask: TrainableMask = None,
                   lr_multipliers: Sequence[tuple[str, float]] = ()
                   ) -> optax.GradientTransformation:
  """AdamW + warmup-cosine + clipping (+ accumulation, + frozen params,
  + per-parameter learning-rate multipliers).

  clip_norm: None or 0 disables clipping. trainable_mask: see TrainableMask;
  frozen params get exactly zero updates (and no weight decay).
  lr_multipliers: (substring, multiplier) pairs, see `scale_by_multipliers`
  (e.g. (('window_logit', 30.0),): the window weights of a conversion move
  30x faster than the feature maps).
  """
  schedule = make_schedule(lr, warmup_steps, total_steps)
  _check(weight_decay >= 0, 'weight_decay', weight_decay, 'a number >= 0')
  _check(0 <= b1 < 1, 'b1', b1, 'a number in [0, 1)')
  _check(0 <= b2 < 1, 'b2', b2, 'a number in [0, 1)')
  _check(clip_norm is None or clip_norm >= 0, 'clip_norm', clip_norm,
         'None, 0 (no clipping) or a number > 0')
  _check(isinstance(grad_accum_steps, int) and grad_accum_steps >= 1,
         'grad_accum_steps', grad_accum_steps, 'an integer >= 1')
  _check(trainable_mask is None or callable(trainable_mask) or
         not isinstance(trainable_mask, str), 'trainable_mask',
         trainable_mask, 'None, a predicate, a bool pytree or a sequence of '
         "substrings such as ('lora',)")
  lr_multipliers = tuple(lr_multipliers or ())
  _check(all(isinstance(p, (tuple, list)) and len(p) == 2 and
             isinstance(p[0], str) and float(p[1]) > 0
             for p in lr_multipliers), 'lr_multipliers', lr_multipliers,
         "(substring, multiplier > 0) pairs such as (('window_logit', 30.0),)")

  parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  if lr_multipliers:
    parts.append(scale_by_multipliers(lr_multipliers))
  tx = optax.chain(*parts)
  if trainable_mask is not None:
    tx = optax.multi_transform(
        {'train': tx, 'freeze': optax.set_to_zero()},
        lambda params: trainable_labels(params, trainable_mask))
  if grad_accum_steps > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=grad_accum_steps)
  return tx
