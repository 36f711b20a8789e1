"""Helpers both kernels share (imports nothing from orthros_jax)."""

from __future__ import annotations

import jax.numpy as jnp


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def dot_dtype(*xs):
  """The dtype the kernels' dots take: the inputs' own when all are bf16 or
  all f16 (tensor-core / MXU rate, float32 accumulation), float32 otherwise
  (float32 inputs, mixed dtypes, 8-bit caches)."""
  dts = {x.dtype for x in xs}
  if len(dts) == 1 and dts <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
    return dts.pop()
  return jnp.dtype(jnp.float32)
