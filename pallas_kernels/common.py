"""Types and helpers the kernels share with the model's XLA paths.

pallas_kernels imports nothing from orthros_jax (a test checks it): the
linear-attention state and the window prefix are defined here and
re-exported by `orthros_jax.attention`; the kernels take the XLA reference
they fall back to as an argument (`fallback`), which
`orthros_jax.attention.dispatch` supplies.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class LinearState(NamedTuple):
  """Linear-attention state of the tokens older than the window.

  S: [B, H, F, D] float32, sum of phi_k(k_j) v_j^T.
  z: [B, H, F] float32, sum of phi_k(k_j).
  """
  S: Array
  z: Array


class WindowPrefix(NamedTuple):
  """The tokens just before a continued prefill (a later chat turn).

  k, v: [B, P, K, D]; phi_k: [B, P, H, F]; valid: [B, P] bool. Entry P-1 is
  the token directly before the first new token. Invalid entries (a history
  shorter than P) are ignored.
  """
  k: Array
  v: Array
  phi_k: Array
  valid: Array


def zero_state(batch: int, num_heads: int, feature_dim: int,
               head_dim: int) -> LinearState:
  """The state of no tokens: zeros, float32."""
  return LinearState(
      jnp.zeros((batch, num_heads, feature_dim, head_dim), jnp.float32),
      jnp.zeros((batch, num_heads, feature_dim), jnp.float32))


def stable_max(m: Array) -> Array:
  """A softmax row's stabiliser: its max score, or 0 where the row sees no
  key (max -inf), so that exp(score - m) is exactly 0 there, never NaN.
  (`m > -inf` rather than isfinite: it lowers in every Pallas backend.)"""
  return jnp.where(m > -jnp.inf, m, 0.0)


def normalize(num: Array, den: Array) -> Array:
  """num / den, and 0 where den is 0 (a query that saw no key): the one
  normalisation of every attention path, softmax and Orthros (den
  broadcasts against num)."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def zero_unwritten(v: Array, written: Array) -> Array:
  """v [B, N, K, D] as float32 with the rows where written [B, N] is False
  zeroed: such keys get weight 0, but a stale or uninitialised value there
  (even NaN) must not reach p @ v, as 0 * NaN is NaN."""
  return jnp.where(written[:, :, None, None], v.astype(jnp.float32), 0.0)


def lse_combine(o: Array, m: Array, l: Array, axis: int) -> Array:
  """Merges softmax attention computed in parts along `axis` (log-sum-exp):
  o each part's normalised output, m its max score, l its sum of
  exp(score - m) (m and l broadcast against o). Returns the normalised
  attention over all parts; a query no part saw gets 0."""
  m_all = stable_max(jnp.max(m, axis=axis, keepdims=True))
  w = jnp.where(l > 0, jnp.exp(m - m_all) * l, 0.0)
  return normalize(jnp.sum(w * o, axis=axis), jnp.sum(w, axis=axis))


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
