"""Chooses the implementation of the prefill and decode attention.

`AttentionConfig.impl`:
  'auto'   the fastest implementation that runs on this platform;
  'xla'    the pure-XLA functions of this package (run everywhere);
  'pallas' Pallas kernels; raises if they cannot run here.
This version ships the XLA implementation only, so 'auto' resolves to 'xla'
and 'pallas' raises a ValueError that says so.
"""

from __future__ import annotations

from typing import Callable

from orthros_jax.attention.orthros import orthros_prefill
from orthros_jax.attention.softmax import decode_attention


def resolve_impl(impl: str) -> str:
  if impl in ('auto', 'xla'):
    return 'xla'
  if impl == 'pallas':
    raise ValueError(
        "attention.impl='pallas' was requested, but no Pallas kernels are "
        "available in this build of orthros_jax; use impl='auto' or 'xla'.")
  raise ValueError(f"attention.impl={impl!r} is unknown: expected 'auto', "
                   "'xla' or 'pallas'.")


def prefill_impl(impl: str) -> Callable:
  """The function computing `orthros_prefill` for this impl."""
  resolve_impl(impl)
  return orthros_prefill


def decode_impl(impl: str) -> Callable:
  """The function computing `decode_attention` for this impl."""
  resolve_impl(impl)
  return decode_attention
