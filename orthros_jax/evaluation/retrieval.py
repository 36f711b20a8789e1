"""Retrieval accuracy from generated tokens (greedy), for the three models of
every report.

A model is run as it would be deployed, on one of the generation routes of
`orthros_jax/evaluation/routes.py`: 'inference' is `orthros_jax.generate`
(the prompt but its exact tail through the prefill, the answer decoded
exactly over the cache); 'prefill' runs the prompt in one prefill and each
generated token as a one-token continued prefill (with window 0, no sinks
and no exact tail: the pure linear-attention floor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax.cache import init_cache
from orthros_jax.config import ModelConfig
from orthros_jax.evaluation import routes
from orthros_jax.evaluation import tasks as tasks_lib
from orthros_jax.generate import generate
from orthros_jax.generate import pad_prompts
from orthros_jax.model import Transformer

@functools.partial(jax.jit, static_argnames=('config', 'max_new_tokens'))
def _prefill_only_generate(config: ModelConfig, params, tokens, lengths, *,
                           max_new_tokens: int):
  model = Transformer(config)
  b, t = tokens.shape
  cache = init_cache(config, b, t + max_new_tokens)
  logits, cache = model.apply({'params': params}, tokens, phase='prefill',
                              cache=cache, lengths=lengths)
  first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  ones = jnp.ones((b,), jnp.int32)

  def body(carry, _):
    token, cache = carry
    logits, cache = model.apply({'params': params}, token[:, None],
                                phase='prefill', cache=cache, lengths=ones)
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return (nxt, cache), nxt

  _, rest = jax.lax.scan(body, (first, cache), None,
                         length=max_new_tokens - 1)
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def greedy(config: ModelConfig, params, prompts: Sequence[Sequence[int]], *,
           max_new_tokens: int, route: str = 'inference',
           width: int | None = None, batch: int | None = None) -> np.ndarray:
  """Greedy continuations [B, max_new_tokens] of ragged `prompts`.

  width / batch: pad the prompt array to this many columns / rows (repeating
  the last prompt), so calls with different prompts share one compiled
  program; the padding rows are dropped from the result.
  """
  routes.check(route, routes.GENERATION_ROUTES)
  tokens, lengths = pad_prompts(prompts)
  n = len(lengths)
  if width is not None and width > tokens.shape[1]:
    tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
  if batch is not None and batch > n:
    tokens = np.concatenate([tokens, np.repeat(tokens[-1:], batch - n, 0)])
    lengths = np.concatenate([lengths, np.repeat(lengths[-1:], batch - n)])
  if route == 'inference':
    out = generate(config, params, tokens, lengths=lengths,
                   max_len=tokens.shape[1] + max_new_tokens,
                   max_new_tokens=max_new_tokens).tokens
  else:
    out = np.asarray(_prefill_only_generate(
        config, params, jnp.asarray(tokens), jnp.asarray(lengths),
        max_new_tokens=max_new_tokens))
  return out[:n]


def run_task(models: Mapping[str, tuple[ModelConfig, dict, str]], task: str,
             tokenizer, *, length: int, num_examples: int, seed: int,
             batch_size: int = 8, options: Mapping | None = None,
             max_new_tokens: int | None = None,
             progress: Callable[[int], None] | None = None) -> dict:
  """Accuracy of every model on `num_examples` examples of `task` at
  `length` tokens: {model: {accuracy, exact, n, ci95, exact_ci95, scores
  (per example, in order), samples (the first 3)}}.

  accuracy: mean of tasks_lib.score_output (RULER-style recall of the
  answers in the generated text) with the Wilson 95% interval of
  round(sum of scores) successes (exact for single-answer tasks); exact:
  fraction of fully correct examples, with its own interval (exact_ci95).
  max_new_tokens: the generation budget (default: the longest answer plus
  its eos, enough for a model trained on the templates; an instruct model
  that answers in a sentence needs more). Generation stops at eos.
  """
  examples = tasks_lib.make_examples(task, seed, tokenizer, length,
                                     num_examples, **dict(options or {}))
  new_tokens = max(max(len(e.target) for e in examples) + 1,
                   int(max_new_tokens or 0))
  # One prompt width for the whole task (a multiple of 64): one compile.
  width = -(-max(len(e.prompt) for e in examples) // 64) * 64
  out = {}
  for name, (config, params, route) in models.items():
    scores, samples = [], []
    for i in range(0, len(examples), batch_size):
      chunk = examples[i:i + batch_size]
      gen = greedy(config, params, [e.prompt for e in chunk],
                   max_new_tokens=new_tokens, route=route, width=width,
                   batch=batch_size)
      for e, row in zip(chunk, gen):
        ids = [int(x) for x in row]
        if tokenizer.eos_id in ids:
          ids = ids[:ids.index(tokenizer.eos_id)]
        text = tokenizer.decode(ids)
        scores.append(tasks_lib.score_output(e, text))
        if len(samples) < 3:
          samples.append({'answers': list(e.answers), 'output': text})
      if progress:
        progress(len(chunk))
    agg = tasks_lib.accuracy(scores)
    out[name] = {'accuracy': agg['mean'], 'exact': agg['all_correct'],
                 'n': agg['n'], 'scores': [float(x) for x in scores],
                 'ci95': list(agg['ci95']),
                 'exact_ci95': list(agg['all_correct_ci95']),
                 'samples': samples}
  return out
