"""Pallas kernels (docs/ARCHITECTURE.md section 6) against the XLA references.

Both kernels have two launch schedules, selected with `platform=`:
  'tpu'  grid over chunks / splits, VMEM scratch state, scalar prefetch;
  'gpu'  the prefill chunk-parallel in three passes (chunk states, prefix
         sum, outputs over a (batch, head, chunk) grid) or a (batch, kv
         head, split) grid (decode), power-of-two padding.
The prefill has a third, 'gpu_sequential' (one program per (batch, head)
looping over the chunks with fori_loop), checked on a subset of the cases.
With `interpret=True` all run on CPU in the Pallas interpreter, so every
numerical case below runs on both main schedules (the `platform` parameter).

Expected values come from the XLA references `orthros_jax.attention.
orthros_prefill` / `decode_attention` (themselves checked against float64
numpy in tests/test_attention.py) or, where the XLA reference cannot be the
oracle (NaN garbage in the cache, continued prefill vs one piece), from the
float64 formulas of tests/reference.py.

Sizes are small and odd (T = 37 / 29, D = 12, F = 10) so that the chunk
padding and, on the GPU schedule, the power-of-two padding of D and F are
exercised. Kernel calls are jitted with static arguments (one compilation per
shape); interpret mode is slow, so the parametrizations are chosen rather
than crossed.

Sections: 1. prefill values, 2. continued prefill, 3. decode values,
4. gradients, 5. the platform=None fallback on CPU, 6. NaN past the
lengths. Lowering for TPU and CUDA: tests/test_kernels_export.py; argument
errors: tests/test_kernels_errors.py.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orthros_jax import attention
from orthros_jax.attention import LinearState
from orthros_jax.attention import WindowPrefix
from orthros_jax.attention import dispatch
from orthros_jax.feature_maps import feature_map
from pallas_kernels.flash_decode import flash_decode
from pallas_kernels.linear_prefill import linear_prefill
try:
  from tests import reference as ref
except ImportError:  # tests/ itself on sys.path (no package)
  import reference as ref

PLATFORMS = ('tpu', 'gpu')
JUNK = 20.0  # scale of the values placed where tokens do not exist
TOL32, TOL16 = 1e-5, 1e-2
TPU_CALL = 'tpu_custom_call'
SDS = jax.ShapeDtypeStruct


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------


def assert_close(actual, expected, tol=TOL32, mask=None):
  """rtol = tol, atol = tol * (largest |expected|, at least 1)."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32), dtype=np.float64)
  expected = np.asarray(jnp.asarray(expected, jnp.float32), dtype=np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  if mask is not None:
    actual, expected = actual[mask], expected[mask]
  assert np.isfinite(expected).all()
  scale = max(1.0, float(np.abs(expected).max()))
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def valid_mask(lengths, t, *trailing):
  """[B, T, ...] bool: True where t < lengths[b]."""
  m = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
  return np.broadcast_to(m.reshape(m.shape + (1,) * len(trailing)),
                         m.shape + tuple(trailing))


@functools.lru_cache(maxsize=None)
def jitted(fn, **static):
  """jax.jit(fn) with static keyword arguments, one compilation per shape."""
  return jax.jit(functools.partial(fn, **static))


def kernel_prefill(platform, window, chunk):
  return jitted(linear_prefill, window=window, chunk_size=chunk,
                interpret=True, platform=platform)


def xla_prefill(window, chunk):
  return jitted(attention.orthros_prefill, window=window, chunk_size=chunk)


def make_prefill_inputs(seed, *, b, t, h, kh, d, f, lengths=None,
                        phi='uniform', dtype=jnp.float32):
  """Random non-zero q, k, v [dtype], phi_q, phi_k [float32], gamma [H].

  phi='uniform': independent positive features in [0.1, 1]; 'hedgehog': the
  project's feature map of q and k (F = 2 * P, so f must be even). Tokens at
  t >= lengths[b] hold large junk: they must not change any valid output or
  the state.
  """
  rng = np.random.default_rng(seed)
  q = 1.5 * rng.standard_normal((b, t, h, d))
  k = rng.standard_normal((b, t, kh, d))
  v = rng.standard_normal((b, t, kh, d))
  if phi == 'uniform':
    phi_q = rng.uniform(0.1, 1.0, (b, t, h, f))
    phi_k = rng.uniform(0.1, 1.0, (b, t, h, f))
  else:
    w_q = rng.standard_normal((h, d, f // 2)) / np.sqrt(d)
    w_k = rng.standard_normal((h, d, f // 2)) / np.sqrt(d)
    k_rep = np.repeat(k, h // kh, axis=2)
    phi_q = np.array(feature_map(phi, jnp.asarray(q, jnp.float32), w_q))
    phi_k = np.array(feature_map(phi, jnp.asarray(k_rep, jnp.float32), w_k))
  if lengths is not None:
    for i, n in enumerate(lengths):
      q[i, n:] *= JUNK
      k[i, n:] *= JUNK
      v[i, n:] *= JUNK
      phi_q[i, n:] *= JUNK
      phi_k[i, n:] *= JUNK
  gamma = rng.uniform(0.05, 0.95, size=(h,))
  cast = lambda x, dt: jnp.asarray(np.asarray(x, np.float32), dt)
  return dict(q=cast(q, dtype), k=cast(k, dtype), v=cast(v, dtype),
              phi_q=cast(phi_q, jnp.float32), phi_k=cast(phi_k, jnp.float32),
              gamma=cast(gamma, jnp.float32))


ARGS = ('q', 'k', 'v', 'phi_q', 'phi_k', 'gamma')


def check_prefill_pair(got, want, *, lengths, tol):
  (y, st), (y_ref, st_ref) = got, want
  assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
  assert isinstance(st, LinearState)
  assert st.S.shape == st_ref.S.shape and st.S.dtype == jnp.float32
  assert st.z.shape == st_ref.z.shape and st.z.dtype == jnp.float32
  b, t = y.shape[:2]
  mask = valid_mask(lengths if lengths is not None else [t] * b, t,
                    *y.shape[2:])
  assert np.isfinite(np.asarray(y.astype(jnp.float32))[mask]).all()
  assert_close(y, y_ref, tol, mask=mask)
  assert_close(st.S, st_ref.S, tol)
  assert_close(st.z, st_ref.z, tol)


# ----------------------------------------------------------------------------
# 1. linear_prefill == orthros_prefill.
# ----------------------------------------------------------------------------

# name: (t, h, kh, d, f, chunk, window, lengths, dtype, phi)
# Defaults below: B = 3 ragged with one example shorter than most windows and
# one length on a chunk boundary; T = 37 (not a multiple of 8 or 16).
RAGGED = (37, 16, 3)
PREFILL_CASES = {
    # every window class for chunk 8: 0, 1, 7, C, 2C, 17 (nb = 2, rounded up
    # to 3 on the GPU schedule), >= T (nb capped by the number of chunks).
    'w0': (37, 4, 2, 12, 10, 8, 0, RAGGED, 'f32', 'uniform'),
    'w1': (37, 4, 2, 12, 10, 8, 1, RAGGED, 'f32', 'uniform'),
    'w7': (37, 4, 2, 12, 10, 8, 7, RAGGED, 'f32', 'uniform'),
    'w_chunk': (37, 4, 2, 12, 10, 8, 8, RAGGED, 'f32', 'uniform'),
    'w_2chunk': (37, 4, 2, 12, 10, 8, 16, RAGGED, 'f32', 'uniform'),
    'w17': (37, 4, 2, 12, 10, 8, 17, RAGGED, 'f32', 'uniform'),
    'w_ge_T': (37, 4, 2, 12, 10, 8, 40, RAGGED, 'f32', 'uniform'),
    'no_lengths': (37, 4, 2, 12, 10, 8, 7, None, 'f32', 'uniform'),
    # chunk 16, T = 29: window = C and 2C.
    'c16_w_chunk': (29, 4, 2, 12, 10, 16, 16, (29, 16, 5), 'f32', 'uniform'),
    'c16_w_2chunk': (29, 4, 2, 12, 10, 16, 32, (29, 16, 5), 'f32',
                     'uniform'),
    # GQA groups 1 and 4 (2 is the default above).
    'gqa1': (37, 2, 2, 12, 10, 8, 7, RAGGED, 'f32', 'uniform'),
    'gqa4': (37, 4, 1, 12, 10, 8, 16, RAGGED, 'f32', 'uniform'),
    # Power-of-two D and F (no GPU padding) and the project's feature map.
    'pow2_dims': (29, 4, 2, 16, 8, 8, 8, (29, 16, 5), 'f32', 'uniform'),
    'hedgehog': (37, 4, 2, 12, 10, 8, 7, RAGGED, 'f32', 'hedgehog'),
    # bf16 q, k, v.
    'bf16_w7': (37, 4, 2, 12, 10, 8, 7, RAGGED, 'bf16', 'uniform'),
    'bf16_gqa4_c16': (29, 4, 1, 12, 10, 16, 16, (29, 16, 5), 'bf16',
                      'uniform'),
}
DTYPES = {'f32': jnp.float32, 'bf16': jnp.bfloat16}


# The sequential GPU prefill on the cases that exercise its loop: a window
# over several chunks (nb rounded up), GQA 4, bf16, no lengths.
SEQUENTIAL = 'gpu_sequential'


@pytest.mark.parametrize(
    'case,platform', [(c, p) for c in PREFILL_CASES for p in PLATFORMS] +
    [(c, SEQUENTIAL) for c in ('w17', 'gqa4', 'bf16_w7', 'no_lengths')])
def test_prefill_matches_xla(case, platform):
  t, h, kh, d, f, chunk, window, lengths, dt, phi = PREFILL_CASES[case]
  b = 3 if lengths is None else len(lengths)
  x = make_prefill_inputs(zlib.crc32(case.encode()), b=b, t=t, h=h, kh=kh,
                          d=d, f=f, lengths=lengths, phi=phi,
                          dtype=DTYPES[dt])
  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  args = [x[n] for n in ARGS]
  got = kernel_prefill(platform, window, chunk)(*args, lengths=lens)
  want = xla_prefill(window, chunk)(*args, lengths=lens)
  check_prefill_pair(got, want, lengths=lengths,
                     tol=TOL16 if dt == 'bf16' else TOL32)


# ----------------------------------------------------------------------------
# 2. Continued prefill: initial_state + WindowPrefix.
# ----------------------------------------------------------------------------
#
# CONTRACT: the kernel assumes the prefix's valid entries are the LAST ones
# (a history shorter than P is left-padded), which is how the model builds
# it (`pos = start - W + arange(W)`, valid = pos >= 0). The XLA reference
# accepts any valid mask; the kernel keeps only a scalar "first valid key"
# per example. So the prefixes below are always left-padded; invalid entries
# hold junk.


def _continued_inputs(seed, *, starts, news, prefix_size, h, kh, d, f):
  """Turn 2 of a conversation: history x[b, :starts[b]] is already in the
  cache, the new tokens are x[b, starts[b]:starts[b] + news[b]] (right-padded
  to max(news) with junk). Returns the whole sequence (numpy, float32), the
  turn's kernel arguments and the float64 one-piece reference."""
  rng = np.random.default_rng(seed)
  starts, news = np.asarray(starts), np.asarray(news)
  b = len(starts)
  total = starts + news
  n_all, t = int(total.max()), int(news.max())
  full = make_prefill_inputs(seed, b=b, t=n_all, h=h, kh=kh, d=d, f=f,
                             lengths=total)
  full = {n: np.asarray(full[n]) for n in ARGS}
  turn = {}
  for n in ('q', 'k', 'v', 'phi_q', 'phi_k'):
    rows = []
    for i in range(b):
      r = full[n][i, starts[i]:total[i]]
      pad = JUNK * rng.standard_normal((t - news[i],) + r.shape[1:])
      rows.append(np.concatenate([r, pad.astype(np.float32)], axis=0))
    turn[n] = jnp.asarray(np.stack(rows))
  turn['gamma'] = jnp.asarray(full['gamma'])
  # Left-padded prefix: the prefix_size tokens before starts[b].
  pk, pv, pphi, valid = [], [], [], []
  for i in range(b):
    pos = starts[i] - prefix_size + np.arange(prefix_size)
    ok = pos >= 0
    idx = np.clip(pos, 0, None)
    junk = lambda a: np.where(
        ok.reshape((-1,) + (1,) * (a.ndim - 1)), a,
        JUNK * rng.standard_normal(a.shape)).astype(np.float32)
    pk.append(junk(full['k'][i, idx]))
    pv.append(junk(full['v'][i, idx]))
    pphi.append(junk(full['phi_k'][i, idx]))
    valid.append(ok)
  prefix = WindowPrefix(jnp.asarray(np.stack(pk)), jnp.asarray(np.stack(pv)),
                        jnp.asarray(np.stack(pphi)),
                        jnp.asarray(np.stack(valid)))
  assert all(np.all(np.diff(v.astype(int)) >= 0) for v in valid)  # left-padded
  # The state holds every history token before the prefix.
  group = h // kh
  s0, z0 = [], []
  for i in range(b):
    end = max(int(starts[i]) - prefix_size, 0)
    phi = full['phi_k'][i, :end].astype(np.float64)
    v = np.repeat(full['v'][i, :end], group, axis=1).astype(np.float64)
    s0.append(np.einsum('nhf,nhd->hfd', phi, v))
    z0.append(phi.sum(0))
  state = LinearState(jnp.asarray(np.stack(s0), jnp.float32),
                      jnp.asarray(np.stack(z0), jnp.float32))
  return full, turn, prefix, state, total


# name: (window, chunk, prefix_size, h, kh, starts, news)
# Example 1 has a history (4) shorter than the prefix: left-padded prefix.
CONTINUED_CASES = {
    'w8_c8': (8, 8, 8, 4, 2, (20, 4, 13), (17, 25, 9)),
    'w17_c8_gqa4': (17, 8, 17, 4, 1, (20, 4, 13), (17, 25, 9)),
    'w5_prefix11_c8': (5, 8, 11, 4, 2, (20, 4, 13), (17, 25, 9)),
    'w0_state_only': (0, 16, 0, 2, 2, (20, 4, 13), (17, 25, 9)),
}


@pytest.mark.parametrize(
    'case,platform', [(c, p) for c in CONTINUED_CASES for p in PLATFORMS] +
    [(c, SEQUENTIAL) for c in ('w17_c8_gqa4', 'w0_state_only')])
def test_continued_prefill(case, platform):
  """Kernel == XLA reference with the same (initial_state, prefix), and the
  pair of turns == the float64 formula over the whole conversation."""
  window, chunk, psize, h, kh, starts, news = CONTINUED_CASES[case]
  full, turn, prefix, state, total = _continued_inputs(
      7, starts=starts, news=news, prefix_size=psize, h=h, kh=kh, d=12, f=10)
  kw = dict(lengths=jnp.asarray(news, jnp.int32), initial_state=state,
            prefix=None if psize == 0 else prefix)
  args = [turn[n] for n in ARGS]
  got = kernel_prefill(platform, window, chunk)(*args, **kw)
  want = xla_prefill(window, chunk)(*args, **kw)
  check_prefill_pair(got, want, lengths=news, tol=TOL32)
  # One piece, float64: turn-2 outputs and the final state.
  y64, s64, z64 = ref.orthros_prefill(
      full['q'], full['k'], full['v'], full['phi_q'], full['phi_k'],
      full['gamma'], window=window, lengths=total)
  y, st = got
  y = np.asarray(y)
  for i, (a, n) in enumerate(zip(starts, news)):
    assert_close(y[i, :n], y64[i, a:a + n])
  assert_close(st.S, s64)
  assert_close(st.z, z64)


# ----------------------------------------------------------------------------
# 3. flash_decode == decode_attention.
# ----------------------------------------------------------------------------


def _decode_inputs(seed, *, lengths, tq, s, h, kh, d, garbage, dtype):
  """Random q and cache; entries at j >= lengths[b] hold garbage: 'large'
  (|x| ~ 1e4) or 'nan'."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  q = 1.5 * rng.standard_normal((b, tq, h, d))
  k = rng.standard_normal((b, s, kh, d))
  v = rng.standard_normal((b, s, kh, d))
  for i, n in enumerate(lengths):
    if garbage == 'nan':
      k[i, n:], v[i, n:] = np.nan, np.nan
    else:
      k[i, n:] = 1e4 * rng.standard_normal(k[i, n:].shape)
      v[i, n:] = 1e4 * rng.standard_normal(v[i, n:].shape)
  cast = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype)
  return cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32)


# S = 45 with max_split 16: splits [0,16) [16,32) [32,45+pad). Lengths end
# mid-split (45, 23, 7), exactly on one split boundary (16) and on two (32).
LENGTHS = (45, 16, 23, 32, 7)
# name: (tq, h, kh, d, garbage, dtype, max_split, platforms)
DECODE_CASES = {
    'tq1_gqa1': (1, 4, 4, 16, 'large', 'f32', 16, PLATFORMS),
    'tq5_gqa2_nan': (5, 4, 2, 16, 'nan', 'f32', 16, PLATFORMS),
    'tq1_gqa4_nan': (1, 8, 2, 16, 'nan', 'f32', 16, PLATFORMS),
    'tq5_gqa4': (5, 8, 2, 16, 'large', 'f32', 16, PLATFORMS),
    'tq5_gqa2_default_split': (5, 4, 2, 16, 'large', 'f32', 512, PLATFORMS),
    'bf16_tq1_gqa2': (1, 4, 2, 16, 'large', 'bf16', 16, PLATFORMS),
    'bf16_tq5_gqa4_nan': (5, 8, 2, 16, 'nan', 'bf16', 16, PLATFORMS),
    # Non-power-of-two head_dim: TPU schedule only.
    'd12_tq1_gqa4_nan': (1, 8, 2, 12, 'nan', 'f32', 16, ('tpu',)),
    'd12_tq5_gqa1': (5, 4, 4, 12, 'large', 'f32', 16, ('tpu',)),
}
DECODE_PARAMS = [(c, p) for c, spec in DECODE_CASES.items() for p in spec[-1]]


@pytest.mark.parametrize('case,platform', DECODE_PARAMS)
def test_decode_matches_reference(case, platform):
  tq, h, kh, d, garbage, dt, max_split, _ = DECODE_CASES[case]
  q, k, v, lengths = _decode_inputs(zlib.crc32(case.encode()),
                                    lengths=LENGTHS, tq=tq, s=45, h=h, kh=kh,
                                    d=d, garbage=garbage, dtype=DTYPES[dt])
  y = jitted(flash_decode, interpret=True, platform=platform,
             max_split=max_split)(q, k, v, lengths)
  assert y.shape == q.shape and y.dtype == q.dtype
  assert np.isfinite(np.asarray(y.astype(jnp.float32))).all()
  tol = TOL16 if dt == 'bf16' else TOL32
  want = jitted(attention.decode_attention)(q, k, v, lengths)
  if garbage == 'nan':
    # Garbage (even NaN) past the lengths must not reach either output; the
    # float64 formula never reads past the length.
    assert_close(want, ref.decode_attention(
        np.asarray(q.astype(jnp.float32)), np.asarray(k.astype(jnp.float32)),
        np.asarray(v.astype(jnp.float32)), np.asarray(lengths)), tol)
  assert_close(y, want, tol)


def test_decode_gpu_schedule_rejects_non_pow2_head_dim():
  q, k, v, lengths = _decode_inputs(0, lengths=(9,), tq=1, s=16, h=2, kh=1,
                                    d=12, garbage='large', dtype=jnp.float32)
  with pytest.raises(ValueError, match='power-of-two head_dim'):
    flash_decode(q, k, v, lengths, interpret=True, platform='gpu')


# ----------------------------------------------------------------------------
# 4. Gradients: the custom VJP equals the gradient through the reference.
# ----------------------------------------------------------------------------


def _grad_setup(seed, continued):
  if continued:
    window, chunk, psize = 8, 8, 8
    full, turn, prefix, state, _ = _continued_inputs(
        seed, starts=(20, 4), news=(13, 9), prefix_size=psize, h=4, kh=2,
        d=12, f=10)
    lengths = (13, 9)
  else:
    window, chunk = 7, 8
    turn = make_prefill_inputs(seed, b=2, t=21, h=4, kh=2, d=12, f=10,
                               lengths=(21, 12))
    prefix = state = None
    lengths = (21, 12)
  diff = {n: turn[n] for n in ARGS}
  if continued:
    diff['S0'], diff['z0'] = state.S, state.z
    diff['pk'], diff['pv'], diff['pphi'] = prefix.k, prefix.v, prefix.phi_k
  rng = np.random.default_rng(seed + 1)
  y_shape = turn['q'].shape
  b, h, f, d = y_shape[0], y_shape[2], turn['phi_q'].shape[-1], y_shape[3]
  # Outputs past a length are unspecified: no cotangent there.
  r_y = rng.standard_normal(y_shape) * valid_mask(lengths, y_shape[1], h, d)
  weights = tuple(jnp.asarray(x, jnp.float32) for x in (
      r_y, rng.standard_normal((b, h, f, d)), rng.standard_normal((b, h, f))))
  valid = None if prefix is None else prefix.valid
  return diff, weights, valid, jnp.asarray(lengths, jnp.int32), window, chunk


def _loss(fn, diff, weights, valid, lengths):
  kw = dict(lengths=lengths)
  if 'S0' in diff:
    kw['initial_state'] = LinearState(diff['S0'], diff['z0'])
    kw['prefix'] = WindowPrefix(diff['pk'], diff['pv'], diff['pphi'], valid)
  y, st = fn(*(diff[n] for n in ARGS), **kw)
  r_y, r_s, r_z = weights
  return (jnp.sum(y.astype(jnp.float32) * r_y) + jnp.sum(st.S * r_s)
          + jnp.sum(st.z * r_z))


def _value_and_grad(fn, continued):
  diff, weights, valid, lengths, _, _ = _grad_setup(11, continued)
  return jax.jit(jax.value_and_grad(
      lambda p: _loss(fn, p, weights, valid, lengths)))(diff)


@functools.lru_cache(maxsize=None)
def _reference_value_and_grad(continued):
  *_, window, chunk = _grad_setup(11, continued)
  return _value_and_grad(functools.partial(
      attention.orthros_prefill, window=window, chunk_size=chunk), continued)


@pytest.mark.parametrize('platform', PLATFORMS)
@pytest.mark.parametrize('continued', [False, True],
                         ids=['lengths', 'state_and_prefix'])
def test_prefill_gradients(continued, platform):
  diff, _, _, _, window, chunk = _grad_setup(11, continued)
  loss, g = _value_and_grad(functools.partial(
      linear_prefill, window=window, chunk_size=chunk, interpret=True,
      platform=platform, fallback=attention.orthros_prefill), continued)
  loss_ref, g_ref = _reference_value_and_grad(continued)
  assert_close(loss, loss_ref)
  assert set(g) == set(g_ref) == set(diff)
  for name in diff:
    assert g[name].shape == diff[name].shape, name
    assert np.abs(np.asarray(g_ref[name])).max() > 0, name  # not vacuous
    assert_close(g[name], g_ref[name])


# ----------------------------------------------------------------------------
# 5. platform=None on CPU (no interpret): the XLA reference.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('use_jit', [False, True], ids=['eager', 'jit'])
def test_prefill_default_platform_on_cpu_is_reference(use_jit):
  lengths = (21, 12)
  x = make_prefill_inputs(21, b=2, t=21, h=4, kh=2, d=12, f=10,
                          lengths=lengths)
  args = [x[n] for n in ARGS]
  lens = jnp.asarray(lengths, jnp.int32)
  # With its XLA fallback (as dispatch calls it); without one: below.
  fn = functools.partial(dispatch.pallas_prefill, window=7, chunk_size=8)
  got = (jax.jit(fn) if use_jit else fn)(*args, lengths=lens)
  want = xla_prefill(7, 8)(*args, lengths=lens)
  check_prefill_pair(got, want, lengths=lengths, tol=TOL32)


@pytest.mark.parametrize('use_jit', [False, True], ids=['eager', 'jit'])
def test_decode_default_platform_on_cpu_is_reference(use_jit):
  q, k, v, lengths = _decode_inputs(22, lengths=LENGTHS, tq=5, s=45, h=4,
                                    kh=2, d=16, garbage='large',
                                    dtype=jnp.float32)
  fn = jax.jit(dispatch.pallas_decode) if use_jit else dispatch.pallas_decode
  assert_close(fn(q, k, v, lengths),
               jitted(attention.decode_attention)(q, k, v, lengths))


@pytest.mark.parametrize('where', ['cpu_jit', 'tpu_export'])
def test_decode_default_platform_non_pow2_head_dim(where):
  if where == 'tpu_export':
    args = (SDS((2, 1, 8, 96), jnp.float32), SDS((2, 256, 2, 96), jnp.float32),
            SDS((2, 256, 2, 96), jnp.float32), SDS((2,), jnp.int32))
    text = jax.export.export(jax.jit(dispatch.pallas_decode),
                             platforms=['tpu'])(*args).mlir_module()
    assert TPU_CALL in text
    return
  q, k, v, lengths = _decode_inputs(23, lengths=(9, 20), tq=1, s=20, h=4,
                                    kh=2, d=12, garbage='large',
                                    dtype=jnp.float32)
  assert_close(jax.jit(dispatch.pallas_decode)(q, k, v, lengths),
               jitted(attention.decode_attention)(q, k, v, lengths))


# ----------------------------------------------------------------------------
# 6. NaN garbage past the lengths (found in review). Lowering for TPU and
#    CUDA: tests/test_kernels_export.py.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('platform', (None,) + PLATFORMS)
def test_prefill_ignores_nan_past_the_lengths(platform):
  """Padding and invalid prefix entries may hold anything, NaN included:
  valid outputs and the state must not change."""
  rng = np.random.default_rng(5)
  b, t, h, kh, d, f, w = 2, 21, 4, 2, 8, 6, 8
  arr = lambda *s: rng.normal(size=s).astype(np.float32)
  q, k, v = arr(b, t, h, d), arr(b, t, kh, d), arr(b, t, kh, d)
  pq = rng.uniform(0.1, 1, size=(b, t, h, f)).astype(np.float32)
  pk = rng.uniform(0.1, 1, size=(b, t, h, f)).astype(np.float32)
  gamma = jnp.asarray(rng.uniform(0.1, 0.9, size=h), jnp.float32)
  lengths = np.array([21, 9])
  prefix_k, prefix_v = arr(b, w, kh, d), arr(b, w, kh, d)
  prefix_phi = rng.uniform(0.1, 1, size=(b, w, h, f)).astype(np.float32)
  valid = np.arange(w)[None, :] >= np.array([0, 5])[:, None]
  state = LinearState(jnp.asarray(rng.uniform(size=(b, h, f, d)), jnp.float32),
                      jnp.asarray(rng.uniform(size=(b, h, f)), jnp.float32))

  def call(k, v, pk, prefix_k, prefix_v, prefix_phi):
    fn = attention.orthros_prefill if platform is None else functools.partial(
        linear_prefill, interpret=True, platform=platform)
    return fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pq),
              jnp.asarray(pk), gamma, window=w, chunk_size=8,
              lengths=jnp.asarray(lengths), initial_state=state,
              prefix=WindowPrefix(jnp.asarray(prefix_k), jnp.asarray(prefix_v),
                                  jnp.asarray(prefix_phi),
                                  jnp.asarray(valid)))

  clean = call(k, v, pk, prefix_k, prefix_v, prefix_phi)
  dirty = [x.copy() for x in (k, v, pk, prefix_k, prefix_v, prefix_phi)]
  for x in dirty[:3]:
    x[1, 9:] = np.nan
  for x in dirty[3:]:
    x[~valid] = np.nan
  got = call(*dirty)
  mask = np.arange(t)[None, :] < lengths[:, None]
  np.testing.assert_array_equal(np.asarray(got[0])[mask],
                                np.asarray(clean[0])[mask])
  np.testing.assert_array_equal(got[1].S, clean[1].S)
  np.testing.assert_array_equal(got[1].z, clean[1].z)
