"""Exact softmax attention and decode attention against float64 numpy.

`softmax_attention` (one einsum, and the blocked online softmax with its
own flash-style backward) and `decode_attention` over a ragged cache:
outputs and gradients against `tests/reference.py`, random non-zero
inputs, odd sizes and GQA; the long-sequence case checks that the blocked
path never builds the T x S score matrix. (Split from
tests/test_attention.py, which keeps the Orthros prefill.)
"""

from __future__ import annotations

import functools
import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orthros_jax import attention
from orthros_jax.attention import softmax
from tests.test_attention import D
from tests.test_attention import assert_close
from tests.test_attention import jitted
try:
  from tests import hlo_entry
  from tests import reference as ref
except ImportError:  # tests/ itself on sys.path (no package)
  import hlo_entry
  import reference as ref


def _softmax_inputs(seed, b, t, s, h, k_heads, d):
  rng = np.random.default_rng(seed)
  q = (1.5 * rng.standard_normal((b, t, h, d))).astype(np.float32)
  k = rng.standard_normal((b, s, k_heads, d)).astype(np.float32)
  v = rng.standard_normal((b, s, k_heads, d)).astype(np.float32)
  return q, k, v


SOFTMAX_SHAPES = [  # (t, s, h, k_heads)
    (37, 37, 4, 2), (13, 37, 4, 4), (1, 29, 8, 2)]


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('t,s,h,k_heads', SOFTMAX_SHAPES)
def test_softmax_attention_naive(t, s, h, k_heads, causal):
  q, k, v = _softmax_inputs(50, 2, t, s, h, k_heads, D)
  y = jitted(attention.softmax_attention, causal=causal)(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  assert y.dtype == jnp.float32
  assert_close(y, ref.softmax_attention(q, k, v, causal=causal))


@pytest.mark.parametrize(
    't,s,h,k_heads,causal,block_size',
    [(37, 37, 4, 2, True, b) for b in (1, 7, 16, 64)]
    + [(13, 37, 4, 1, True, 5), (13, 37, 4, 1, True, 16),
       (37, 37, 4, 2, False, 7), (13, 37, 4, 1, False, 16)])
def test_softmax_attention_blocked(t, s, h, k_heads, causal, block_size):
  q, k, v = _softmax_inputs(51, 2, t, s, h, k_heads, D)
  y = jitted(attention.softmax_attention, causal=causal,
             block_size=block_size)(jnp.asarray(q), jnp.asarray(k),
                                    jnp.asarray(v))
  assert y.shape == q.shape and y.dtype == jnp.float32
  assert_close(y, ref.softmax_attention(q, k, v, causal=causal))


@pytest.mark.parametrize(
    't,s,h,k_heads,causal,block_size',
    [(37, 37, 4, 2, True, 7), (13, 37, 4, 1, True, 5),
     (37, 37, 4, 2, False, 16), (37, 37, 4, 2, True, None)])
def test_softmax_attention_gradient(t, s, h, k_heads, causal, block_size):
  """The blocked path's hand-written backward (flash attention's, in XLA)
  and autodiff of the one-einsum path, against the float64 Jacobian."""
  q, k, v = _softmax_inputs(52, 2, t, s, h, k_heads, D)
  dout = np.random.default_rng(53).standard_normal(q.shape).astype(
      np.float32)
  grads = jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(attention.softmax_attention(
          q, k, v, causal=causal, block_size=block_size) * dout),
      argnums=(0, 1, 2)))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  pos = np.broadcast_to(np.arange(t) + (s - t if causal else t + s), (2, t))
  expected = ref.attention_vjp(q, k, v, dout, pos, np.full(2, s))
  for got, want in zip(grads, expected):
    assert got.dtype == jnp.float32
    assert_close(got, want)


def test_softmax_attention_gradient_bf16():
  """bf16 inputs: the blocked backward returns bf16 gradients within bf16's
  rounding (tol 2e-2, as the bf16 prefill test) of the float64 Jacobian of
  the same bf16-rounded inputs."""
  t, s, h, k_heads = 37, 37, 4, 2
  q, k, v = (jnp.asarray(x, jnp.bfloat16)
             for x in _softmax_inputs(56, 2, t, s, h, k_heads, D))
  dout = np.random.default_rng(57).standard_normal(q.shape).astype(
      np.float32)
  grads = jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(attention.softmax_attention(
          q, k, v, causal=True, block_size=8).astype(jnp.float32) * dout),
      argnums=(0, 1, 2)))(q, k, v)
  pos = np.broadcast_to(np.arange(t), (2, t))
  expected = ref.attention_vjp(*(np.asarray(x.astype(jnp.float32))
                                 for x in (q, k, v)), dout, pos,
                               np.full(2, s))
  for got, want in zip(grads, expected):
    assert got.dtype == jnp.bfloat16
    assert_close(got, want, tol=2e-2)


@pytest.mark.parametrize('block_size', [None, 5, 16])
def test_softmax_attention_skip_before(block_size):
  """Queries before each example's skip_before give 0 and no gradient; the
  rest, and every key's gradient, are exact causal attention's (ragged
  skips over a batch of 3, one skipping everything; the first 17 positions
  are skipped by every row, so whole query blocks are left out)."""
  t, h, k_heads = 37, 4, 2
  q, k, v = _softmax_inputs(54, 3, t, t, h, k_heads, D)
  skip = np.asarray([17, 23, t], np.int32)
  dout = np.random.default_rng(55).standard_normal(q.shape).astype(
      np.float32)
  fn = lambda q, k, v: attention.softmax_attention(
      q, k, v, causal=True, block_size=block_size,
      skip_before=jnp.asarray(skip))
  y, vjp = jax.vjp(jax.jit(fn), *(jnp.asarray(x) for x in (q, k, v)))
  needed = np.arange(t)[None, :] >= skip[:, None]  # [B, T]
  want = np.where(needed[..., None, None],
                  ref.softmax_attention(q, k, v, causal=True), 0.0)
  assert_close(y, want)
  pos = np.where(needed, np.arange(t)[None, :], -1)
  expected = ref.attention_vjp(q, k, v, dout, pos, np.full(3, t))
  for got, want in zip(vjp(jnp.asarray(dout)), expected):
    assert_close(got, want)
  with pytest.raises(ValueError, match='causal'):
    attention.softmax_attention(jnp.asarray(q), jnp.asarray(k),
                                jnp.asarray(v), causal=False,
                                skip_before=jnp.asarray(skip))


@pytest.mark.parametrize('block_size', [None, 4])
def test_decode_attention_gradient_ignores_stale_cache(block_size):
  """Keys past each example's length (here NaN) get zero gradient and
  leave every other gradient finite and exact: ragged lengths, GQA, a
  cache longer than every length (whole key blocks past them)."""
  lengths = np.asarray([29, 11, 5], np.int32)
  q, k, v = _decode_inputs(63, lengths, 5, 37, 8, 2, D)
  for i, n in enumerate(lengths):
    k[i, n:], v[i, n:] = np.nan, np.nan
  dout = np.random.default_rng(64).standard_normal(q.shape).astype(
      np.float32)
  grads = jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(attention.decode_attention(
          q, k, v, jnp.asarray(lengths), block_size=block_size) * dout),
      argnums=(0, 1, 2)))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  pos = lengths[:, None] - 5 + np.arange(5)[None, :]
  expected = ref.attention_vjp(np.nan_to_num(q), np.nan_to_num(k),
                               np.nan_to_num(v), dout, pos, lengths)
  for got, want in zip(grads, expected):
    assert np.isfinite(np.asarray(got)).all()
    assert_close(got, want)


def _decode_inputs(seed, lengths, tq, smax, h, k_heads, d):
  rng = np.random.default_rng(seed)
  b = len(lengths)
  q = (1.5 * rng.standard_normal((b, tq, h, d))).astype(np.float32)
  k = rng.standard_normal((b, smax, k_heads, d))
  v = rng.standard_normal((b, smax, k_heads, d))
  for i, n in enumerate(lengths):  # garbage in the cache past the length
    k[i, n:] = 1e3 * rng.standard_normal(k[i, n:].shape)
    v[i, n:] = 1e3 * rng.standard_normal(v[i, n:].shape)
  return q, k.astype(np.float32), v.astype(np.float32)


@pytest.mark.parametrize('block_size', [None, 3, 8])
@pytest.mark.parametrize('tq', [1, 5])
def test_decode_attention(tq, block_size):
  lengths = np.asarray([29, 11, 5], np.int32)
  q, k, v = _decode_inputs(60, lengths, tq, 29, 8, 2, D)  # GQA group 4
  y = jitted(attention.decode_attention, block_size=block_size)(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
  assert y.shape == q.shape and y.dtype == jnp.float32
  assert_close(y, ref.decode_attention(q, k, v, lengths))


def test_decode_attention_under_jit():
  lengths = np.asarray([6, 29, 17], np.int32)
  q, k, v = _decode_inputs(61, lengths, 5, 29, 4, 4, D)
  y = jax.jit(attention.decode_attention)(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
  assert_close(y, ref.decode_attention(q, k, v, lengths))


def test_decode_attention_full_cache_is_causal_softmax():
  """lengths = Smax and Tq = Smax: decode is plain causal softmax."""
  q, k, v = _softmax_inputs(62, 2, 19, 19, 4, 2, D)
  lengths = jnp.asarray([19, 19], jnp.int32)
  y = attention.decode_attention(jnp.asarray(q), jnp.asarray(k),
                                 jnp.asarray(v), lengths)
  assert_close(y, ref.softmax_attention(q, k, v, causal=True))


# ----------------------------------------------------------------------------
# Long sequence: blocked softmax must not build the T x S matrix.
# ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize('block_size', [None, 1024])
def test_softmax_attention_long_sequence(block_size):
  n, h, k_heads, d = 32768, 2, 1, 64
  q, k, v = _softmax_inputs(80, 1, n, n, h, k_heads, d)
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
  y = attention.softmax_attention(jnp.asarray(q), jnp.asarray(k),
                                  jnp.asarray(v), causal=True,
                                  block_size=block_size)
  y = np.asarray(jax.block_until_ready(y))
  rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # One f32 [H, T, S] score matrix would be 8 GiB.
  assert (rss_after - rss_before) < 4 * 2**20, 'peak memory grew > 4 GiB'
  assert np.isfinite(y).all()
  rows = [0, 1, 777, 16383, 16384, 32766, 32767]
  expected = ref.softmax_attention(q, k, v, causal=True, rows=rows)
  assert_close(y[:, rows], expected[:, rows])


# name: (lengths, tq, smax, h, k_heads, d, garbage, dtype)
CROSS_HEAD_CASES = {
    'gqa3_tq1_nan': ((45, 16, 7), 1, 45, 9, 3, 16, 'nan', jnp.float32),
    'gqa4_tq5_inf': ((29, 11, 5), 5, 37, 8, 2, 16, 'inf', jnp.float32),
    'mha_tq3_large': ((33, 3, 20), 3, 33, 4, 4, 8, 'large', jnp.float32),
    'mqa_tq1_nan': ((20, 1), 1, 21, 6, 1, 8, 'nan', jnp.float32),
    'bf16_gqa3_tq2_nan': ((45, 16, 7), 2, 45, 9, 3, 16, 'nan', jnp.bfloat16),
}


@pytest.mark.parametrize('case', sorted(CROSS_HEAD_CASES))
def test_decode_attention_cross_head(case):
  """Decode on the CPU reads the cache in place (`_attend_cross_head`):
  against float64 and the one-einsum path it replaces, with ragged
  lengths, GQA / MHA / MQA, several query rows, bf16, and garbage past the
  lengths: NaN and inf (which take the recomputation that zeroes stale
  rows) and large finite values (which add exactly 0)."""
  if jax.default_backend() != 'cpu':
    pytest.skip('the cross-head path is the CPU\'s')
  lengths, tq, smax, h, k_heads, d, garbage, dtype = CROSS_HEAD_CASES[case]
  lengths = np.asarray(lengths, np.int32)
  q, k, v = _decode_inputs(65, lengths, tq, smax, h, k_heads, d)
  for i, n in enumerate(lengths):
    fill = {'nan': np.nan, 'inf': np.inf, 'large': 1e4}[garbage]
    k[i, n:], v[i, n:] = fill, -fill
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  assert softmax._use_cross_head(q.shape, k.shape)  # the path under test
  y = jax.jit(attention.decode_attention)(q, k, v, jnp.asarray(lengths))
  assert y.shape == q.shape and y.dtype == dtype
  assert np.isfinite(np.asarray(y.astype(jnp.float32))).all()
  pos = jnp.asarray(lengths[:, None] - tq + np.arange(tq)[None, :])
  one_einsum = jax.jit(lambda q, k, v: softmax._attend_naive(
      q, k, v, pos, jnp.asarray(lengths), causal=True))(q, k, v)
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  want = ref.decode_attention(f64(q), f64(k), f64(v), lengths)
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  assert_close(y, want, tol=tol)
  assert_close(y, f64(one_einsum), tol=tol)


def test_decode_attention_cross_head_choice():
  """The cross-head path is the CPU's for decode shapes (SmolLM2 one token,
  a 32 / 8-head model one token) and not where its wasted multiply-adds
  or its scores grow too large; never with cross_head=False."""
  if jax.default_backend() != 'cpu':
    pytest.skip('the cross-head path is the CPU\'s')
  use = softmax._use_cross_head
  assert use((1, 1, 9, 64), (1, 4097, 3, 64))
  assert use((4, 1, 32, 64), (4, 8192, 8, 64))
  assert not use((1, 16, 32, 64), (1, 4097, 8, 64))  # 16 x 32 x 8 > 512
  assert not use((1, 64, 9, 64), (1, 4097, 3, 64))
  assert not use((8, 1, 32, 64), (8, 1 << 17, 8, 64))  # scores too large
  q = jax.ShapeDtypeStruct((1, 1, 9, 32), jnp.float32)
  k = jax.ShapeDtypeStruct((1, 257, 3, 32), jnp.float32)
  n = jax.ShapeDtypeStruct((1,), jnp.int32)
  off = functools.partial(attention.decode_attention, cross_head=False)
  assert max(_entry_outputs(off, q, k, k, n)) >= 257 * 3 * 32  # copies


def _entry_outputs(fn, *args):
  """Element counts of what the compiled program's entry computation
  computes (parameters and bitcasts excluded)."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  return [size for _, _, size in hlo_entry.entry_results(text)]


def test_decode_attention_reads_cache_in_place():
  """No intermediate as large as the cache in the compiled decode (the
  one-einsum path, shown for contrast, copies it to batch over kv heads);
  the zeroing recomputation lives in the conditional's other branch."""
  if jax.default_backend() != 'cpu':
    pytest.skip('the cross-head path is the CPU\'s')
  q = jax.ShapeDtypeStruct((1, 1, 9, 32), jnp.float32)
  k = jax.ShapeDtypeStruct((1, 257, 3, 32), jnp.float32)
  n = jax.ShapeDtypeStruct((1,), jnp.int32)
  cache = 257 * 3 * 32
  got = _entry_outputs(attention.decode_attention, q, k, k, n)
  assert got and max(got) < cache, got
  naive = _entry_outputs(lambda q, k, v, n: softmax._attend_naive(
      q, k, v, n[:, None] - 1, n, causal=True), q, k, k, n)
  assert max(naive) >= cache, naive
