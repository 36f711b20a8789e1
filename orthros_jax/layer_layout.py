"""The two layer layouts of a model's params, and conversion between them.

Unrolled (the default, and the layout of importers, adapters and converted
checkpoints): one entry per block, 'layers_0' .. 'layers_{L-1}'. Scanned
(`ModelConfig.scan_layers`): one entry 'layers' whose every leaf carries a
leading layer axis [L, ...], the params of the `nn.scan` over the blocks.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from orthros_jax.config import ModelConfig



def _layer_keys(params) -> list[str]:
  keys = [k for k in params if k.startswith('layers_')]
  return sorted(keys, key=lambda k: int(k.split('_')[1]))


def stack_layers(params) -> dict:
  """Unrolled params ({'layers_0': ..., 'layers_{L-1}': ...}) in the
  layout of a `scan_layers` model ({'layers': ...}, every leaf with a
  leading layer axis); the other entries are kept. Already stacked params
  are returned as they are."""
  params = nn.unbox(params)
  keys = _layer_keys(params)
  if 'layers' in params and not keys:
    return dict(params)
  if not keys or keys != [f'layers_{i}' for i in range(len(keys))]:
    raise ValueError(f'params hold layers {keys}: expected layers_0 .. '
                     'layers_{L-1} (or a stacked "layers" entry)')
  trees = [params[k] for k in keys]
  if any(jax.tree.structure(t) != jax.tree.structure(trees[0])
         for t in trees):
    raise ValueError('the layers hold different parameters: they cannot be '
                     'stacked')
  out = {k: v for k, v in params.items() if k not in keys}
  out['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  return out


def unstack_layers(params) -> dict:
  """The inverse of `stack_layers`: {'layers': [L, ...]} -> layers_0 ..
  layers_{L-1}. Unrolled params are returned as they are."""
  params = nn.unbox(params)
  if 'layers' not in params:
    return dict(params)
  stacked = params['layers']
  n = jax.tree.leaves(stacked)[0].shape[0]
  out = {k: v for k, v in params.items() if k != 'layers'}
  for i in range(n):
    out[f'layers_{i}'] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return out


def layers_for(config: ModelConfig, params) -> dict:
  """`params` in the layer layout `config.scan_layers` asks for."""
  return stack_layers(params) if config.scan_layers else unstack_layers(
      params)
