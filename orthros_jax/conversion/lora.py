"""Low-rank adapters on the attention projections, kept beside the frozen
base params and merged into them on the fly (no model changes).

For a projection kernel W with input dims I and output dims O (q/k/v:
[E | H, D]; o: [H, D | E]) the adapter is A [prod I, r], B [r, prod O] with
B = 0 at init, and the merged kernel is W + (alpha / r) * reshape(A @ B).
The base params are never written: training differentiates only the adapter
tree, and `merge_lora` produces the plain params a checkpoint or `generate`
uses.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from orthros_jax.layer_layout import stack_layers
from orthros_jax.layer_layout import unstack_layers

Array = jax.Array
DEFAULT_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
# Number of leading input dims of each projection's kernel.
_INPUT_DIMS = {'q_proj': 1, 'k_proj': 1, 'v_proj': 1, 'o_proj': 2}


def _targets(params, targets):
  """Yields (layer name, projection name, kernel) for every adapted kernel."""
  unknown = set(targets) - set(_INPUT_DIMS)
  if unknown:
    raise ValueError(f'LoRA targets {sorted(unknown)} are unknown: expected '
                     f'a subset of {tuple(_INPUT_DIMS)}')
  layers = sorted((k for k in params if k.startswith('layers_')),
                  key=lambda k: int(k.split('_')[1]))
  if not layers:
    raise ValueError('params hold no layers_* entries: pass the model params')
  for layer in layers:
    for name in targets:
      yield layer, name, params[layer]['attn'][name]['kernel']


def init_lora(params: dict, rng: Array, *, rank: int = 8,
              targets: Sequence[str] = DEFAULT_TARGETS,
              dtype=jnp.float32) -> dict:
  """Adapters {layer: {proj: {'a': [in, r], 'b': [r, out]}}}; A ~ N(0, 1/in),
  B = 0, so the merged model starts equal to the base model. Stacked params
  (scan_layers, `layer_layout.stack_layers`) get the same adapters stacked:
  {'layers': {proj: {'a': [L, in, r], 'b': [L, r, out]}}}."""
  if not isinstance(rank, int) or rank < 1:
    raise ValueError(f'lora rank={rank!r} must be an integer >= 1')
  if 'layers' in params:  # scan_layers: the unrolled draws, stacked
    return stack_layers(init_lora(unstack_layers(params), rng, rank=rank,
                                  targets=targets, dtype=dtype))
  lora = {}
  entries = list(_targets(params, targets))
  for key, (layer, name, kernel) in zip(jax.random.split(rng, len(entries)),
                                        entries):
    n_in = math.prod(kernel.shape[:_INPUT_DIMS[name]])
    n_out = math.prod(kernel.shape[_INPUT_DIMS[name]:])
    lora.setdefault(layer, {})[name] = {
        'a': jax.random.normal(key, (n_in, rank), dtype) / math.sqrt(n_in),
        'b': jnp.zeros((rank, n_out), dtype)}
  return lora


def merge_lora(params: dict, lora: dict, *, alpha: float = 16.0) -> dict:
  """Params with every adapted kernel replaced by W + (alpha/r) A B; the
  input `params` are not modified."""
  merged = jax.tree.map(lambda x: x, params)  # fresh containers
  for layer, projections in lora.items():
    for name, ab in projections.items():
      node = dict(merged[layer]['attn'][name])
      kernel = node['kernel']
      rank = ab['a'].shape[-1]
      delta = (ab['a'] @ ab['b']) * (alpha / rank)  # batched when stacked
      node['kernel'] = (kernel.astype(jnp.float32) + delta.reshape(
          kernel.shape)).astype(kernel.dtype)
      attn = dict(merged[layer]['attn'])
      attn[name] = node
      merged[layer] = dict(merged[layer], attn=attn)
  return merged
