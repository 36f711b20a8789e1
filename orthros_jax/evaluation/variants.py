"""The baselines of every evaluation: which weights, which attention.

Each row of a report is (config, params, route) plus a sentence saying
exactly what it is. On the converted weights (an Orthros checkpoint):
  dense            the converted weights with dense attention: separates the
                   attention approximation from the finetune's drift;
  window           window softmax only: the linear term removed (feature
                   maps that are exactly 0, `window_only`), no sinks;
  window_sinks     the same plus the first N tokens exact (sinks);
  orthros          as converted;
  orthros_nosinks  as converted but its sinks removed (only for a
                   checkpoint that has sinks);
  orthros_sinks    as converted plus N sinks (only for one that has none);
  linear           window 0, no sinks, no exact tail: every token through
                   the linear prefill, answers included (`pure_linear`).
Other weights: `teacher` (the dense model as loaded) and `linear_trained`
(a separately converted pure-linear model, the honest floor).
All but `linear` and `linear_trained` generate through `generate`: the
prompt through the prefill of their attention, the answer decoded with
exact attention over the KV cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orthros_jax.config import ModelConfig
from orthros_jax.evaluation.inference import pure_linear

ROWS = ('teacher', 'dense', 'window', 'window_sinks', 'orthros',
        'orthros_nosinks', 'orthros_sinks', 'linear', 'linear_trained')


def with_sinks(config: ModelConfig, sinks: int) -> ModelConfig:
  return config.replace(attention={'sinks': int(sinks)})


def window_only(config: ModelConfig, params: dict) -> tuple[ModelConfig,
                                                              dict]:
  """The linear term removed exactly: relu features of a zero projection are
  0, so every older key weighs 0 and the prefill is the window softmax
  (gamma cancels). Other params are shared, not copied."""
  if not config.is_orthros:
    raise ValueError('window_only needs an Orthros config')

  def zero_maps(path, x):
    name = jax.tree_util.keystr(path)
    return jnp.zeros_like(x) if ('phi_q' in name or 'phi_k' in name) else x

  return (config.replace(attention={'feature_map': 'relu'}),
          jax.tree_util.tree_map_with_path(zero_maps, params))


def converted_rows(config: ModelConfig, params: dict, names, *, sinks: int,
                   where: str) -> tuple[dict, dict]:
  """The rows of `names` built on one Orthros checkpoint's weights.

  sinks: N for the rows that add sinks; where: how the report names the
  checkpoint. Returns ({name: (config, params, route)}, {name: sentence}).
  """
  a = config.attention
  trained_sinks = a.sinks
  if sinks < 1:
    raise ValueError(f'sinks={sinks} must be >= 1 for the sink rows')
  base = (f'{where}: window {a.window}, {a.feature_map} features '
          f'(F = {a.state_dim})')
  exact = (f'the last {a.exact_tail} prompt tokens and the answer decoded '
           'exactly over the cache')
  models, desc = {}, {}
  for name in names:
    if name == 'dense':
      models[name] = (config.replace(attention={'kind': 'dense'}), params,
                      'inference')
      desc[name] = f'{where}, these weights with dense attention'
    elif name == 'window':
      c, p = window_only(with_sinks(config, 0), params)
      models[name] = (c, p, 'inference')
      desc[name] = (f'{where}, same weights: window {a.window} softmax only '
                    f'(linear term removed), no sinks, {exact}')
    elif name == 'window_sinks':
      c, p = window_only(with_sinks(config, sinks), params)
      models[name] = (c, p, 'inference')
      desc[name] = (f'{where}, same weights: window {a.window} softmax plus '
                    f'the first {sinks} tokens exact, no linear term, '
                    f'{exact}')
    elif name == 'orthros':
      models[name] = (config, params, 'inference')
      desc[name] = (f'{base}, {trained_sinks} sinks, as converted: hybrid '
                    f'prefill, {exact}')
    elif name == 'orthros_nosinks':
      if not trained_sinks:
        raise ValueError(f'{where} has no sinks: use orthros_sinks')
      models[name] = (with_sinks(config, 0), params, 'inference')
      desc[name] = (f'{where}, same weights, its {trained_sinks} sinks '
                    f'removed, {exact}')
    elif name == 'orthros_sinks':
      if trained_sinks:
        raise ValueError(f'{where} already has {trained_sinks} sinks: use '
                         'orthros (and orthros_nosinks)')
      models[name] = (with_sinks(config, sinks), params, 'inference')
      desc[name] = (f'{where}, same weights plus the first {sinks} tokens '
                    f'exact, {exact}')
    elif name == 'linear':
      models[name] = (pure_linear(config), params, 'prefill')
      desc[name] = (f'{where}, same weights: window 0, no sinks, no exact '
                    'tail, every token through the linear prefill')
    else:
      raise ValueError(f'{name!r} is not a row of the converted weights')
  return models, desc
