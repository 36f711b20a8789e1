"""Scoring held-out batches through the inference path.

A model is scored the way it runs at inference, not with a training forward
pass: the prompt (all but its last `exact_tail` tokens) goes through
`phase='prefill'`, which fills the cache, and every later token is fed,
teacher-forced, through `phase='decode'` (exact attention over the cache).
Position t's logits come from the prefill when t < boundary, else from the
decode. The three routes ('inference', 'prefill', 'forward') and the
boundary are defined once in `orthros_jax/evaluation/routes.py`; batches
follow the training contract (orthros_jax/data/pipeline.py).

Rows without a prompt (plain text, the filler task) are given one: the first
half of their tokens is prefilled and the loss counts on the second half,
so plain-text perplexity is also a prefill-then-decode number.

Exact match: an example is correct when the argmax at every scored position
equals the target. Under teacher forcing this is exactly the condition for
greedy decoding to reproduce the answer, so it equals the exact-match score
of greedy generation (ties in the argmax aside).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax.cache import init_cache
from orthros_jax.config import ModelConfig
from orthros_jax.evaluation import routes
from orthros_jax.model import Transformer

_DECODE_BUCKET = 16  # decode lengths are padded to a multiple (fewer compiles)


def pure_linear(config: ModelConfig) -> ModelConfig:
  """The floor of every report: the same model with window 0, no sinks and
  no exact tail (score it with route='prefill'). A length scale is dropped:
  it multiplies all of a query's linear weights by one factor, which the
  pure-linear normalisation cancels (its `length_exponent` params are then
  unused)."""
  return config.replace(attention={'window': 0, 'exact_tail': 0, 'sinks': 0,
                                   'length_scale': False})


def scoring_layout(batch: dict, config: ModelConfig, route: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(weights, boundary [B], end [B]) of the scored positions of `batch`.

  weights: the batch's weights, zeroed on the first half of prompt-less rows;
  boundary: positions t < boundary go through the prefill; end: one past the
  last scored position (the decode covers boundary .. end - 1).
  """
  routes.check(route)
  weights = np.asarray(batch['weights'], np.float32).copy()
  b, t = weights.shape
  scored = weights > 0
  end = np.where(scored.any(1), t - np.argmax(scored[:, ::-1], axis=1), 0)
  prompt = np.asarray(batch['prompt_lengths'], np.int32).reshape(b)
  # Prompt-less rows: prefill the first half, score the rest.
  half = (end + 1) // 2
  prompt = np.where(prompt > 0, prompt, half)
  plain = np.asarray(batch['prompt_lengths']).reshape(b) == 0
  weights[plain] *= (np.arange(t)[None, :] >= prompt[plain, None] - 1)
  if route == 'prefill':
    boundary = np.full((b,), t, np.int32)
  else:
    tail = config.attention.exact_tail if config.is_orthros else 0
    boundary = np.maximum(prompt - tail, 0).astype(np.int32)
  return weights, boundary, end.astype(np.int32)


@functools.partial(jax.jit, static_argnames=('config', 'decode_len'))
def _inference_logits(config: ModelConfig, params, inputs, boundary, *,
                      decode_len: int):
  """Logits [B, T, V] with t < boundary from the prefill, the rest decoded."""
  b, t = inputs.shape
  model = Transformer(config)
  cache = init_cache(config, b, t + decode_len)
  pre_logits, cache = model.apply({'params': params}, inputs, phase='prefill',
                                  cache=cache, lengths=boundary,
                                  all_logits=True)
  if not decode_len:
    return pre_logits
  idx = boundary[:, None] + jnp.arange(decode_len)[None, :]
  dec_tokens = jnp.take_along_axis(inputs, jnp.minimum(idx, t - 1), axis=1)
  dec_logits, _ = model.apply({'params': params}, dec_tokens, phase='decode',
                              cache=cache)
  # Back to sequence positions: position p reads decode row p - boundary.
  pos = jnp.arange(t)[None, :] - boundary[:, None]
  from_decode = jnp.take_along_axis(
      dec_logits, jnp.clip(pos, 0, decode_len - 1)[..., None], axis=1)
  return jnp.where((pos >= 0)[..., None], from_decode, pre_logits)


@functools.partial(jax.jit, static_argnames=('config',))
def _forward_logits(config: ModelConfig, params, inputs, split):
  logits, _ = Transformer(config).apply({'params': params}, inputs,
                                        phase='forward', split=split)
  return logits


@jax.jit
def _per_example(logits, targets, weights):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  hit = jnp.argmax(logits, axis=-1) == targets
  nll_sum = jnp.sum(nll * weights, axis=1)
  count = jnp.sum(weights, axis=1)
  exact = jnp.all(hit | (weights == 0), axis=1) & (count > 0)
  return nll_sum, count, jnp.sum(hit * weights, axis=1), exact


def score_batch(config: ModelConfig, params, batch: dict, *,
                route: str = 'inference') -> dict[str, np.ndarray]:
  """Per-example scores of one batch: nll_sum, tokens, correct_tokens (all
  [B] float) and exact [B] bool (see the module docstring)."""
  weights, boundary, end = scoring_layout(batch, config, route)
  inputs = jnp.asarray(batch['inputs'], jnp.int32)
  t = inputs.shape[1]
  if route == 'forward':
    logits = _forward_logits(config, params, inputs,
                             jnp.asarray(boundary) if config.is_orthros
                             else None)
  else:
    need = int(np.max(end - boundary, initial=0))
    decode_len = 0 if need <= 0 else min(
        -(-need // _DECODE_BUCKET) * _DECODE_BUCKET, t)
    logits = _inference_logits(config, params, inputs, jnp.asarray(boundary),
                               decode_len=decode_len)
  out = _per_example(logits, jnp.asarray(batch['targets'], jnp.int32),
                     jnp.asarray(weights))
  nll_sum, count, correct, exact = (np.asarray(x) for x in out)
  return {'nll_sum': nll_sum.astype(np.float64), 'tokens': count,
          'correct_tokens': correct, 'exact': exact}


def wilson_interval(successes: int, n: int, z: float = 1.96
                    ) -> tuple[float, float]:
  """The Wilson score interval (95% by default) of a binomial proportion."""
  if n <= 0:
    return (math.nan, math.nan)
  p = successes / n
  denom = 1 + z * z / n
  center = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return (max(0.0, center - half), min(1.0, center + half))


def score(config: ModelConfig, params, batches: Iterable[dict], *,
          route: str = 'inference', progress=None) -> dict[str, float]:
  """Corpus-level scores over `batches`: loss (mean nll per scored token),
  token_accuracy, exact_match (fraction of examples) with its Wilson 95%
  interval, and the counts. `progress(n)` is called after each batch."""
  nll = tokens = correct = 0.0
  exact = examples = 0
  for batch in batches:
    s = score_batch(config, params, batch, route=route)
    has = s['tokens'] > 0
    nll += float(s['nll_sum'].sum())
    tokens += float(s['tokens'].sum())
    correct += float(s['correct_tokens'].sum())
    exact += int(s['exact'][has].sum())
    examples += int(has.sum())
    if progress is not None:
      progress(1)
  if not examples:
    raise ValueError('no scored examples: the batches hold no positions with '
                     'weight > 0 (empty data source?)')
  lo, hi = wilson_interval(exact, examples)
  return {'loss': nll / tokens, 'token_accuracy': correct / tokens,
          'exact_match': exact / examples, 'exact_match_ci95': [lo, hi],
          'examples': examples, 'tokens': tokens}
