"""The jitted train and eval steps, shared by train.py and convert.py.

A batch is a dict of arrays: 'inputs' [B, T] int32, 'targets' [B, T] int32,
'weights' [B, T] float32, 'prompt_lengths' [B] int32 (0 for plain text).

For an Orthros model the forward pass takes a per-example `split` P (positions
t < P prefill formula, t >= P exact softmax), chosen by `split_mode`:
  'prompt': where a row has a prompt (prompt_lengths > 0), the boundary
            `generate` uses at inference, P = max(prompt_length - exact_tail,
            0); a row without one (plain text, the 'filler' task) gets the
            random split below, so every row trains the prefill formula;
  'random': every row gets the random split;
  'none':   no split: the prefill formula at every position (the exact
            softmax that decode runs is never used).
The random split is uniform in [min(W + S + 1, T), T] (W = attention.window,
S = attention.sinks, T = seq_len), drawn per example from the step's rng:
the prefill formula differs from exact softmax only at positions
t >= W + S (query t reads keys S <= j <= t - W through the feature maps;
the window and sink keys are a softmax), so a split of W + S or less is the
all-exact forward and would train nothing of it. Only when W + S >= T does
no split reach a linear key (then P = T, which equals the exact forward;
convert.py refuses such a config).
'prompt_or_random', the former name of today's 'prompt', is rejected with
a ValueError that says so.
Dense models ignore `split_mode`.

With a `Partitioner` (orthros_jax/sharding/) the steps take process-local
numpy batches, split them over the mesh's batch axes
(`make_array_from_process_local_data`, so each host feeds its own rows), and
run jitted with the state's own shardings in and out inside
`partitioner.activate()`: data, FSDP, tensor and mixed parallelism come from
the mesh and the rules alone; the model's attention takes the
partitioner's placement (`model.transformer(config, placement)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from orthros_jax.config import ModelConfig
from orthros_jax.model import transformer
from orthros_jax.training import loss as loss_lib
from orthros_jax.training import optim
from orthros_jax.training.state import TrainState

SPLIT_MODES = ('prompt', 'random', 'none')
LossFn = Callable[[jax.Array, dict], tuple[jax.Array, dict]]


def check_split_mode(split_mode: str) -> None:
  """ValueError unless `split_mode` is one of SPLIT_MODES."""
  if split_mode == 'prompt_or_random':
    raise ValueError(
        "split_mode='prompt_or_random' was removed: use 'prompt', which now "
        'gives rows without a prompt (plain text, filler) a random split.')
  if split_mode not in SPLIT_MODES:
    raise ValueError(f'split_mode={split_mode!r} is invalid: expected one of '
                     f'{SPLIT_MODES}.')


def first_linear_position(attention) -> int:
  """W + S for an AttentionConfig: the first query position that reads a
  key (j = S) through the feature maps; before it the prefill formula is
  exact softmax."""
  return attention.window + getattr(attention, 'sinks', 0)


def random_split(config: ModelConfig, batch_size: int, seq_len: int, rng):
  """[batch_size] int32 uniform in [min(W + S + 1, T), T]: every split has
  at least one position (t = W + S) whose query reads a key through the
  feature maps, when W + S < T."""
  low = min(first_linear_position(config.attention) + 1, seq_len)
  return jax.random.randint(rng, (batch_size,), low, seq_len + 1, jnp.int32)


def make_split(config: ModelConfig, split_mode: str, batch, rng):
  """The per-example split [B] int32 (or None) for `batch`; see the module
  docstring. `rng` is required for an Orthros model unless split_mode is
  'none'."""
  check_split_mode(split_mode)
  if not config.is_orthros or split_mode == 'none':
    return None
  if rng is None:
    raise ValueError(f'split_mode={split_mode!r} draws random splits (every '
                     "row in 'random', rows without a prompt in 'prompt') "
                     'and needs an rng, got None.')
  b, t = batch['inputs'].shape
  random = random_split(config, b, t, rng)
  if split_mode == 'random':
    return random
  p = jnp.asarray(batch['prompt_lengths'], jnp.int32)
  at_prompt = jnp.maximum(p - config.attention.exact_tail, 0)
  return jnp.where(p > 0, at_prompt, random)


def _forward_loss(config, split_mode, loss_fn, params, batch, rng,
                  placement=None):
  split = make_split(config, split_mode, batch, rng)
  logits, _ = transformer(config, placement).apply(
      {'params': params}, batch['inputs'], phase='forward', split=split)
  return loss_fn(logits, batch)


Objective = Callable[[Any, dict, jax.Array], tuple[jax.Array, dict]]


def make_train_step(config: ModelConfig, *, split_mode: str = 'prompt',
                    loss_fn: LossFn | None = None, donate: bool = True,
                    partitioner=None, trainable=None
                    ) -> Callable[[TrainState, dict, jax.Array],
                                  tuple[TrainState, dict]]:
  """A jitted `(state, batch, rng) -> (state, metrics)`; the state is donated.

  metrics: those of `loss_fn` ('loss', 'tokens', 'accuracy' by default) plus
  'grad_norm' (over the trainable params) and 'finite' (bool). When the
  loss or gradient norm is not finite the returned state is the input
  state (no update, step unchanged): the loop reports the error and keeps
  the last good checkpoint. trainable: see `make_objective_step`.
  """
  check_split_mode(split_mode)
  loss_fn = loss_fn or loss_lib.next_token_loss
  placement = None if partitioner is None else partitioner.placement
  return make_objective_step(
      lambda p, batch, rng: _forward_loss(config, split_mode, loss_fn, p,
                                          batch, rng, placement),
      donate=donate, partitioner=partitioner, trainable=trainable)


def trainable_value_and_grad(fn, params, trainable):
  """((value, aux), grads) of `fn(params) -> (value, aux)`, differentiated
  only with respect to the trainable leaves (`optim.trainable_labels`
  semantics: None = all). Frozen leaves get zero gradients, which the
  optimizer ignores (optax.set_to_zero), and are never differentiated: a
  LoRA or feature-map stage does not pay for the full model's weight
  gradients."""
  if trainable is None:
    return jax.value_and_grad(fn, has_aux=True)(params)
  labels = jax.tree.leaves(optim.trainable_labels(params, trainable))
  leaves, treedef = jax.tree.flatten(params)
  train = [x for x, lab in zip(leaves, labels) if lab == 'train']

  def of_trainable(train_leaves):
    it = iter(train_leaves)
    full = [next(it) if lab == 'train' else jax.lax.stop_gradient(x)
            for x, lab in zip(leaves, labels)]
    return fn(jax.tree.unflatten(treedef, full))

  out, g_train = jax.value_and_grad(of_trainable, has_aux=True)(train)
  it = iter(g_train)
  grads = [next(it) if lab == 'train' else jnp.zeros_like(x)
           for x, lab in zip(leaves, labels)]
  return out, jax.tree.unflatten(treedef, grads)


def make_objective_step(objective: Objective, *, donate: bool = True,
                        partitioner=None, trainable=None
                        ) -> Callable[[TrainState, dict, jax.Array],
                                      tuple[TrainState, dict]]:
  """The train step for any `objective(params, batch, rng) -> (loss,
  metrics)` (a conversion stage's loss, say), with the same NaN guard and
  donation as `make_train_step`.

  trainable: None, or what TrainConfig.trainable holds (substrings of the
  param paths): only those params are differentiated, and 'grad_norm' is
  their norm (the one the optimizer clips); pass the same value the
  optimizer's mask uses.
  """

  def step(state: TrainState, batch, rng):
    (loss, metrics), grads = trainable_value_and_grad(
        lambda p: objective(p, batch, rng), state.params, trainable)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = state.apply_gradients(grads)
    # Select, not cond: both branches are cheap and donation stays simple.
    new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state,
                             state)
    return new_state, dict(metrics, loss=loss, grad_norm=grad_norm,
                           finite=finite)

  if partitioner is not None:
    return ShardedStep(step, partitioner, donate=donate)
  return jax.jit(step, donate_argnums=(0,) if donate else ())


class ShardedStep:
  """`fn(first, batch, rng) -> (first', metrics)` or `-> metrics`, jitted on
  the mesh: `first` (a train state or params) keeps its shardings in and
  out, the batch is split over the batch axes, metrics are replicated.
  Compiled at the first call, when the shardings are known."""

  def __init__(self, fn, partitioner, *, donate: bool = True,
               returns_first: bool = True):
    self.fn, self.partitioner = fn, partitioner
    self.donate, self.returns_first = donate, returns_first
    self._jitted = None

  def __call__(self, first, batch, rng):
    part = self.partitioner
    batch = part.shard_batch(batch)
    if self._jitted is None:
      first_sh = jax.tree.map(lambda x: x.sharding, first)
      batch_sh = jax.tree.map(lambda x: x.sharding, batch)
      out = (first_sh, part.replicated) if self.returns_first else (
          part.replicated)
      self._jitted = jax.jit(
          self.fn, in_shardings=(first_sh, batch_sh, part.replicated),
          out_shardings=out,
          donate_argnums=(0,) if self.donate and self.returns_first else ())
    with part.activate():
      return self._jitted(first, batch, rng)


def make_eval_step(config: ModelConfig, *, split_mode: str = 'prompt',
                   loss_fn: LossFn | None = None, partitioner=None
                   ) -> Callable[[Any, dict, jax.Array], dict]:
  """A jitted `(params, batch, rng) -> metrics` with no update."""
  check_split_mode(split_mode)
  loss_fn = loss_fn or loss_lib.next_token_loss

  placement = None if partitioner is None else partitioner.placement

  def step(params, batch, rng):
    _, metrics = _forward_loss(config, split_mode, loss_fn, params, batch, rng,
                               placement)
    return metrics

  if partitioner is not None:
    return ShardedStep(step, partitioner, donate=False, returns_first=False)
  return jax.jit(step)


def evaluate(eval_step, params, batches: Iterable[dict],
             rng: jax.Array | None = None) -> dict[str, float]:
  """Token-weighted means of the eval metrics over `batches` (an exact
  corpus-level loss and accuracy, not a mean of per-batch means)."""
  rng = jax.random.PRNGKey(0) if rng is None else rng
  sums: dict[str, float] = {}
  total = 0.0
  for i, batch in enumerate(batches):
    m = jax.device_get(eval_step(params, batch, jax.random.fold_in(rng, i)))
    n = float(m.get('tokens', 1.0))
    total += n
    for k, v in m.items():
      if k != 'tokens':
        sums[k] = sums.get(k, 0.0) + float(v) * n
  if total == 0:
    raise ValueError('evaluate got no batches (or only zero-weight ones)')
  return dict({k: v / total for k, v in sums.items()}, tokens=total)
