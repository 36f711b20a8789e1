"""The training loop shared by train.py and convert.py.

    restore-or-init -> for each step: next(batch) -> jitted step -> NaN guard
                       -> log every `log_every` -> eval every `eval_every`
                       -> checkpoint every `checkpoint_every` (and at the end)

Generic: it takes the step function and the data iterator, so a conversion
stage passes its own step (same `(state, batch, rng) -> (state, metrics)`
signature, metrics with 'loss' and 'finite'). The rng of step s is
fold_in(PRNGKey(seed), s) and the iterator state is checkpointed with the
train state, so a resumed run (even after SIGKILL) sees exactly the data and
randomness it would have seen.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from orthros_jax.config import ModelConfig
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.training import metrics as metrics_lib
from orthros_jax.training import optim
from orthros_jax.training import state as state_lib
from orthros_jax.training import step as step_lib
from orthros_jax.training.state import TrainState


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop and optimizer settings (defaults in code; configs override a few).

  num_steps counts batches; with grad_accum_steps k the optimizer updates
  every k batches and the schedule spans num_steps // k updates.
  trainable: None trains all params, else substrings of the param paths to
  train (e.g. ('phi_q', 'phi_k', 'window_logit') or ('lora',)).
  lr_multipliers: {substring: multiplier}: params whose path contains the
  substring learn at multiplier x learning_rate (stored as sorted pairs).
  eval_every / log_every / checkpoint_every: in steps; eval_every=0 evaluates
  only at the end. keep_checkpoints: newest N kept.
  """

  num_steps: int = 1000
  learning_rate: float = 3e-4
  warmup_steps: int = 100
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float | None = 1.0
  grad_accum_steps: int = 1
  split_mode: str = 'prompt'
  trainable: tuple[str, ...] | None = None
  lr_multipliers: tuple[tuple[str, float], ...] = ()
  log_every: int = 50
  eval_every: int = 0
  checkpoint_every: int = 1000
  keep_checkpoints: int = 3
  async_checkpoint: bool = True
  seed: int = 0
  progress: bool = True

  def __post_init__(self):
    for name in ('num_steps', 'grad_accum_steps', 'log_every',
                 'checkpoint_every', 'keep_checkpoints'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'{name}={value!r} is invalid: expected an integer '
                         '>= 1.')
    if not isinstance(self.eval_every, int) or self.eval_every < 0:
      raise ValueError(f'eval_every={self.eval_every!r} is invalid: expected '
                       'an integer >= 0 (0 = only at the end).')
    step_lib.check_split_mode(self.split_mode)
    if self.trainable is not None:
      object.__setattr__(self, 'trainable', tuple(self.trainable))
    mults = self.lr_multipliers
    if isinstance(mults, Mapping):
      mults = sorted(dict(mults).items())
    try:
      mults = tuple((str(s), float(m)) for s, m in (mults or ()))
    except (TypeError, ValueError):
      mults = None
    if mults is None or any(m <= 0 or not s for s, m in mults):
      raise ValueError(f'lr_multipliers={self.lr_multipliers!r} is invalid: '
                       "expected {param path substring: multiplier > 0}, "
                       "e.g. {'window_logit': 30.0}.")
    object.__setattr__(self, 'lr_multipliers', mults)

  @property
  def total_updates(self) -> int:
    return max(self.num_steps // self.grad_accum_steps, 1)

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any], *, strict: bool = False
                   ) -> 'TrainConfig':
    """From a dict / ConfigDict. Keys that are not fields are ignored (a
    run's config may also hold model and data settings), or with `strict`
    an error naming them (a config's own train section)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if strict and unknown:
      raise ValueError(f'train has unknown keys {unknown}; valid keys: '
                       f'{sorted(names)}')
    return cls(**{k: v for k, v in dict(values).items() if k in names})

  def optimizer(self) -> optax.GradientTransformation:
    """AdamW with warmup + cosine, clipping, accumulation, the trainable
    mask and lr multipliers of this config (`optim.make_optimizer`)."""
    return optim.make_optimizer(
        self.learning_rate, self.warmup_steps, self.total_updates,
        self.weight_decay, self.b1, self.b2, self.clip_norm,
        self.grad_accum_steps, self.trainable, self.lr_multipliers)


def train(config: TrainConfig | Mapping[str, Any], workdir: str | os.PathLike,
          model_config: ModelConfig, params_init: Callable[[], Any] | Any,
          data_iterator, *, train_step: Callable | None = None,
          optimizer: optax.GradientTransformation | None = None,
          eval_fn: Callable[[TrainState, int], Mapping[str, float]] | None
          = None, partitioner=None) -> tuple[TrainState, list[dict]]:
  """Trains for `config.num_steps` steps, resuming from `workdir` if it holds
  a checkpoint. Returns (final state, history: one dict of metrics per step
  run in this call).

  params_init: params, or a zero-argument function returning them (only
    called when there is no checkpoint).
  data_iterator: yields batches (see step.py); with get_state()/set_state()
    its position is checkpointed and restored.
  train_step: default `make_train_step(model_config, split_mode=...)`.
  optimizer: default AdamW from `config` (`TrainConfig.optimizer`).
  eval_fn: (state, step) -> scalars, logged with an 'eval/' prefix.
  partitioner: a sharding.Partitioner: the state is initialized (or
    restored) directly sharded, params and Adam moments like the model's
    params under its rules, and the default train step runs on its mesh
    (a custom `train_step` must be built with the same partitioner).

  Raises FloatingPointError when a step's loss or gradient norm is not
  finite; nothing is saved for that step, so the last good checkpoint stays.
  """
  if not isinstance(config, TrainConfig):
    config = TrainConfig.from_mapping(config)
  workdir = os.fspath(workdir)
  tx = optimizer or config.optimizer()
  train_step = train_step or step_lib.make_train_step(
      model_config, split_mode=config.split_mode, partitioner=partitioner,
      trainable=config.trainable)
  if not hasattr(data_iterator, '__next__'):
    data_iterator = iter(data_iterator)

  manager = ckpt_lib.CheckpointManager(
      os.path.join(workdir, 'checkpoints'),
      max_to_keep=config.keep_checkpoints,
      save_interval_steps=config.checkpoint_every, model_config=model_config,
      async_save=config.async_checkpoint)
  init = state_lib.init_fn(params_init, tx)
  shardings = None
  if partitioner is not None:
    abstract = jax.eval_shape(init)
    shardings = partitioner.state_shardings(
        abstract, partitioner.model_param_shardings(model_config))
    # The out_shardings place the state on the mesh (no rules needed).
    init = jax.jit(init, out_shardings=shardings)
  state, restored = ckpt_lib.restore_or_init(
      manager, init, data_iterator, shardings)
  if partitioner is None:
    state = commit_to_device(state)
  start = restored or 0
  if restored is not None:
    logging.info('resumed from %s at step %d', manager.directory, start)
  writer = metrics_lib.MetricsWriter(workdir, resume_step=start)
  bar = metrics_lib.ProgressBar(config.num_steps, start,
                                enabled=None if config.progress else False)
  rng = jax.random.PRNGKey(config.seed)
  history: list[dict] = []
  window: list[dict] = []
  step = start
  try:
    while step < config.num_steps:
      try:
        batch = next(data_iterator)
      except StopIteration:
        logging.warning('data ran out after %d steps (num_steps=%d)', step,
                        config.num_steps)
        break
      state, metrics = train_step(state, batch, jax.random.fold_in(rng, step))
      metrics = {k: np.asarray(v).item()
                 for k, v in jax.device_get(metrics).items()}
      # Every input position of the global batch (the progress bar's
      # tok_s); 'tokens' is the loss's own count.
      metrics['input_tokens'] = float(np.size(batch['inputs'])
                                      * jax.process_count())
      step += 1
      if not metrics.pop('finite', True):
        manager.wait()
        raise FloatingPointError(
            f'non-finite loss or gradient at step {step} (loss='
            f"{metrics.get('loss')}, grad_norm={metrics.get('grad_norm')}); "
            'training stopped without saving it, the last good checkpoint '
            f'(step {manager.latest_step()}) in {manager.directory} is kept. '
            'Lower learning_rate or clip_norm, or check the data.')
      history.append(dict(metrics, step=step))
      window.append(metrics)
      if step % config.log_every == 0 or step == config.num_steps:
        _log(writer, bar, step, window)
        window = []
      if config.eval_every and step % config.eval_every == 0 and eval_fn:
        _log_eval(writer, step, eval_fn(state, step))
      manager.save(step, state, data_iterator)
    if window:
      _log(writer, bar, step, window)
    if eval_fn and not (config.eval_every and step % config.eval_every == 0):
      _log_eval(writer, step, eval_fn(state, step))
    manager.save(step, state, data_iterator, force=True)
    manager.wait()
  finally:
    bar.close()
    writer.close()
    manager.close()
  return state, history


def commit_to_device(tree):
  """`tree` with its uncommitted arrays committed to the one device its
  committed arrays live on, as a jitted step's outputs are. A fresh state
  mixes committed arrays (loaded weights, and what is computed from them)
  with uncommitted ones (the step and optimizer counters, freshly
  initialised params and their moments); jit lowers committed and
  uncommitted arguments differently, so the second step, whose state is
  all committed outputs, compiled the whole train step again (4-8 s per
  stage of the tiny conversion on a 2-core CPU). A tree with nothing
  committed (jit's outputs stay uncommitted then) or spread over several
  devices is returned as it is. No copy: an array already on the device
  keeps its buffer."""
  arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  devices = {d for x in arrays if x.committed for d in x.devices()}
  if len(devices) != 1 or all(x.committed for x in arrays):
    return tree
  (device,) = devices
  return jax.tree.map(
      lambda x: (jax.device_put(x, device)
                 if isinstance(x, jax.Array) and not x.committed else x),
      tree)


def _log(writer, bar, step: int, window: list[dict]) -> None:
  inputs = sum(m.get('input_tokens', 0.0) for m in window)
  tokens = sum(m.get('tokens', 0.0) for m in window)
  means = {k: sum(m[k] for m in window) / len(window) for k in window[-1]}
  rate, loss_rate = bar.update(len(window), inputs,
                               means.get('loss', math.nan), tokens)
  writer.write(step, dict(means, tokens_per_s=rate,
                          loss_tokens_per_s=loss_rate))
  logging.info('step %d: %s', step, means)


def _log_eval(writer, step: int, scalars: Mapping[str, float]) -> None:
  writer.write(step, {f'eval/{k}': v for k, v in scalars.items()})
