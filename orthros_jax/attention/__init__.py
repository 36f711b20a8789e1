"""Attention math (pure functions, XLA): the single source of truth.

`softmax_attention` and `decode_attention` are exact; `orthros_prefill` is the
hybrid window-softmax + linear prefill of docs/ARCHITECTURE.md section 3.
"""

from orthros_jax.attention.orthros import LinearState
from orthros_jax.attention.orthros import Sinks
from orthros_jax.attention.orthros import WindowPrefix
from orthros_jax.attention.orthros import fold_into_state
from orthros_jax.attention.orthros import length_scales
from orthros_jax.attention.orthros import orthros_prefill
from orthros_jax.attention.orthros import zero_state
from orthros_jax.attention.softmax import decode_attention
from orthros_jax.attention.softmax import softmax_attention

__all__ = [
    'LinearState', 'Sinks', 'WindowPrefix', 'decode_attention', 'fold_into_state',
    'length_scales', 'orthros_prefill', 'softmax_attention', 'zero_state',
]
