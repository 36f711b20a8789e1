"""Attention math against float64 numpy references and exact identities.

Every test uses random non-zero inputs with odd sizes (T=37, D=12, ...); the
expected values come from `tests/reference.py`, written from docs/ARCHITECTURE.md
section 3, or from an identity the formula implies (W >= T is softmax, W = 0
is linear attention, the result does not depend on the chunk size, continued
prefill equals one piece).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orthros_jax import attention
from orthros_jax.feature_maps import feature_map
try:
  from tests import reference as ref
except ImportError:  # tests/ itself on sys.path (no package)
  import reference as ref

FEATURE_MAPS = ('hedgehog', 'elu', 'relu', 'taylor')
JUNK = 20.0  # scale of the values placed where tokens do not exist


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------


def assert_close(actual, expected, tol=1e-5, mask=None):
  """rtol = tol, atol = tol * (largest |expected|, at least 1)."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32), dtype=np.float64)
  expected = np.asarray(expected, dtype=np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  if mask is not None:
    actual, expected = actual[mask], expected[mask]
  scale = max(1.0, float(np.abs(expected).max()))
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def valid_mask(lengths, t, *trailing):
  """[B, T, ...] bool: True where t < lengths[b]."""
  m = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
  return np.broadcast_to(m.reshape(m.shape + (1,) * len(trailing)),
                         m.shape + tuple(trailing))


def make_prefill_inputs(seed, *, b, t, h, k_heads, d, p, fmap, lengths=None):
  """Random q, k, v and the matching phi_q, phi_k (float32) and gamma.

  Positions t >= lengths[b] hold large junk: they must not matter.
  phi is computed by the numpy reference so that prefill tests do not depend
  on the feature-map implementation.
  """
  rng = np.random.default_rng(seed)
  q = 1.5 * rng.standard_normal((b, t, h, d))
  k = rng.standard_normal((b, t, k_heads, d))
  v = rng.standard_normal((b, t, k_heads, d))
  if lengths is not None:
    for i, n in enumerate(lengths):
      q[i, n:] *= JUNK
      k[i, n:] *= JUNK
      v[i, n:] *= JUNK
  w_q = rng.standard_normal((h, d, p)) / np.sqrt(d)
  w_k = rng.standard_normal((h, d, p)) / np.sqrt(d)
  k_rep = np.repeat(k, h // k_heads, axis=2)  # [B, T, H, D], head h <- h // G
  phi_q = ref.feature_map(fmap, q, w_q)
  phi_k = ref.feature_map(fmap, k_rep, w_k)
  gamma = rng.uniform(0.05, 0.95, size=(h,))
  f32 = lambda x: np.asarray(x, np.float32)
  return dict(q=f32(q), k=f32(k), v=f32(v), phi_q=f32(phi_q),
              phi_k=f32(phi_k), gamma=f32(gamma))


@functools.lru_cache(maxsize=None)
def jitted(fn, **static):
  """jax.jit(fn) with static keyword arguments, one compilation per shape.

  The model always calls these functions inside jit; a few tests call them
  eagerly as well.
  """
  return jax.jit(functools.partial(fn, **static))


def run_prefill(x, *, window, chunk_size, lengths=None, **kw):
  lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  return jitted(attention.orthros_prefill, window=window,
                chunk_size=chunk_size)(
      *(jnp.asarray(x[n]) for n in ('q', 'k', 'v', 'phi_q', 'phi_k', 'gamma')),
      lengths=lengths, **kw)


def ref_prefill(x, *, window, lengths=None, sinks=0):
  return ref.orthros_prefill(x['q'], x['k'], x['v'], x['phi_q'], x['phi_k'],
                             x['gamma'], window=window, lengths=lengths,
                             sinks=sinks)


def make_sinks(x, n, ends, starts=None):
  """attention.Sinks of the first n tokens of x (those before ends[b])."""
  b = x['k'].shape[0]
  starts = np.zeros(b, np.int32) if starts is None else np.asarray(starts)
  valid = np.arange(n)[None, :] < np.asarray(ends)[:, None]
  return attention.Sinks(jnp.asarray(x['k'][:, :n]), jnp.asarray(x['v'][:, :n]),
                         jnp.asarray(valid), jnp.asarray(starts, jnp.int32))


def check_prefill(x, y, state, *, window, lengths=None, tol=1e-5, sinks=0):
  y_ref, s_ref, z_ref = ref_prefill(x, window=window, lengths=lengths,
                                    sinks=sinks)
  b, t = y_ref.shape[:2]
  mask = None if lengths is None else valid_mask(lengths, t, *y_ref.shape[2:])
  assert y.shape == y_ref.shape and y.dtype == x['q'].dtype
  assert isinstance(state, attention.LinearState)
  assert state.S.shape == s_ref.shape and state.S.dtype == jnp.float32
  assert state.z.shape == z_ref.shape and state.z.dtype == jnp.float32
  assert_close(y, y_ref, tol, mask=mask)
  assert_close(state.S, s_ref, tol)
  assert_close(state.z, z_ref, tol)


# ----------------------------------------------------------------------------
# 1. Feature maps.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('name', FEATURE_MAPS)
def test_feature_map_matches_numpy(name):
  rng = np.random.default_rng(1)
  h, d, p = 3, 12, 5
  x = rng.standard_normal((2, 7, h, d)).astype(np.float32)
  w = (rng.standard_normal((h, d, p)) / np.sqrt(d)).astype(np.float32)
  phi = feature_map(name, jnp.asarray(x), jnp.asarray(w))
  expected = ref.feature_map(name, x, w)
  assert phi.shape == (2, 7, h, ref.feature_dim(name, p))
  np.testing.assert_allclose(np.asarray(phi), expected, rtol=1e-5, atol=1e-6)


def test_taylor_feature_map_identity():
  rng = np.random.default_rng(2)
  h, d, p = 2, 12, 6
  a = rng.standard_normal((9, h, d)).astype(np.float32)
  b = rng.standard_normal((9, h, d)).astype(np.float32)
  w = (rng.standard_normal((h, d, p)) / np.sqrt(d)).astype(np.float32)
  phi_a = np.asarray(feature_map('taylor', jnp.asarray(a), jnp.asarray(w)),
                     np.float64)
  phi_b = np.asarray(feature_map('taylor', jnp.asarray(b), jnp.asarray(w)),
                     np.float64)
  ua = np.einsum('nhd,hdp->nhp', a.astype(np.float64), w.astype(np.float64))
  ub = np.einsum('nhd,hdp->nhp', b.astype(np.float64), w.astype(np.float64))
  ab = (ua * ub).sum(-1)
  expected = 1.0 + ab / np.sqrt(p) + ab**2 / (2 * p)
  np.testing.assert_allclose((phi_a * phi_b).sum(-1), expected, rtol=1e-5)


# ----------------------------------------------------------------------------
# 2. orthros_prefill against the float64 formula.
# ----------------------------------------------------------------------------

T, D, P, C = 37, 12, 5, 8
RAGGED = [37, 23, 9]


WINDOWS = (0, 1, 7, C, 3 * C, 40)  # 40 >= T


# Every window with the two maps whose features differ most (positive and
# normalised; signed and wide); elu and relu on a few (relu W=0 with exact-zero
# denominators is in test_prefill_zero_window_is_linear_attention).
@pytest.mark.parametrize(
    'fmap,window',
    [(f, w) for f in ('hedgehog', 'taylor') for w in WINDOWS]
    + [('elu', 0), ('elu', 7), ('relu', 7), ('relu', 40)])
def test_prefill_matches_formula_ragged(fmap, window):
  x = make_prefill_inputs(10, b=3, t=T, h=4, k_heads=2, d=D, p=P, fmap=fmap,
                          lengths=RAGGED)
  y, state = run_prefill(x, window=window, chunk_size=C, lengths=RAGGED)
  check_prefill(x, y, state, window=window, lengths=RAGGED)


@pytest.mark.parametrize('h,k_heads,window',
                         [(4, 4, 7), (4, 1, 3 * C), (8, 2, 0)])
def test_prefill_matches_formula_gqa(h, k_heads, window):
  x = make_prefill_inputs(11, b=2, t=T, h=h, k_heads=k_heads, d=D, p=P,
                          fmap='hedgehog')
  y, state = run_prefill(x, window=window, chunk_size=C)
  check_prefill(x, y, state, window=window)


def test_prefill_without_lengths_scans_without_cond():
  """With no lengths every chunk is read: the scan body has no `lax.cond`
  (attention transfer's path), and its outputs, state and gradients equal
  those with every length given (which go through the per-chunk cond)."""
  x = make_prefill_inputs(14, b=2, t=T, h=4, k_heads=2, d=D, p=P,
                          fmap='hedgehog')
  args = tuple(jnp.asarray(x[n]) for n in
               ('q', 'k', 'v', 'phi_q', 'phi_k', 'gamma'))
  full = jnp.full((2,), T, jnp.int32)

  def loss(lengths, *a):
    y, st = attention.orthros_prefill(*a, window=7, chunk_size=5,
                                      lengths=lengths)
    w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * w) + jnp.sum(st.S) + jnp.sum(st.z), (y, st)

  grad = jax.grad(loss, argnums=(1, 2, 3, 4, 5, 6), has_aux=True)
  jaxpr = str(jax.make_jaxpr(lambda *a: loss(None, *a))(*args))
  assert 'cond[' not in jaxpr and 'scan[' in jaxpr
  assert 'cond[' in str(jax.make_jaxpr(lambda *a: loss(full, *a))(*args))
  g_none, (y_none, st_none) = jax.jit(lambda *a: grad(None, *a))(*args)
  g_full, (y_full, st_full) = jax.jit(lambda *a: grad(full, *a))(*args)
  check_prefill(x, y_none, st_none, window=7)
  for a, b in zip(jax.tree.leaves((g_none, y_none, st_none)),
                  jax.tree.leaves((g_full, y_full, st_full))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)


def test_prefill_under_jit_with_traced_lengths():
  x = make_prefill_inputs(12, b=3, t=T, h=4, k_heads=2, d=D, p=P, fmap='elu',
                          lengths=RAGGED)
  fn = jax.jit(functools.partial(attention.orthros_prefill, window=7,
                                 chunk_size=5))
  y, state = fn(*(jnp.asarray(x[n]) for n in
                  ('q', 'k', 'v', 'phi_q', 'phi_k', 'gamma')),
                lengths=jnp.asarray(RAGGED, jnp.int32))
  check_prefill(x, y, state, window=7, lengths=RAGGED)


@pytest.mark.parametrize('window,sinks,chunk', [(7, 4, 8), (0, 3, 5),
                                                 (3, 12, 4), (40, 2, 8)])
def test_prefill_sinks_match_formula(window, sinks, chunk):
  """The first `sinks` keys join every query's exact set, never (S, z); a
  row shorter than the sinks (9 < 12) keeps only its own."""
  x = make_prefill_inputs(13, b=3, t=T, h=4, k_heads=2, d=D, p=P,
                          fmap='hedgehog', lengths=RAGGED)
  y, state = run_prefill(x, window=window, chunk_size=chunk, lengths=RAGGED,
                         sinks=make_sinks(x, sinks, RAGGED))
  check_prefill(x, y, state, window=window, lengths=RAGGED, sinks=sinks)
  if window < T:  # sinks change the result wherever they are not in-window
    y0, _ = run_prefill(x, window=window, chunk_size=chunk, lengths=RAGGED)
    assert np.abs(np.asarray(y0) - np.asarray(y))[0, window + sinks:].max() \
        > 1e-3


# ----------------------------------------------------------------------------
# 3. Exact identities: W >= T is causal softmax, W = 0 is linear attention.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('window', [T])  # the boundary; W > T is in the matrix
def test_prefill_full_window_is_softmax(window):
  x = make_prefill_inputs(20, b=2, t=T, h=4, k_heads=2, d=D, p=P,
                          fmap='taylor')
  y, _ = attention.orthros_prefill(  # eager, not jitted
      *(jnp.asarray(x[n]) for n in ('q', 'k', 'v', 'phi_q', 'phi_k', 'gamma')),
      window=window, chunk_size=C)
  y_soft = attention.softmax_attention(jnp.asarray(x['q']), jnp.asarray(x['k']),
                                       jnp.asarray(x['v']), causal=True)
  assert_close(y, y_soft)
  assert_close(y, ref.softmax_attention(x['q'], x['k'], x['v'], causal=True))


@pytest.mark.parametrize('fmap', ['relu', 'elu'])
def test_prefill_zero_window_is_linear_attention(fmap):
  x = make_prefill_inputs(21, b=2, t=T, h=4, k_heads=2, d=D, p=P, fmap=fmap)
  if fmap == 'relu':
    # Force exact-zero denominators: the first key has no features, and a few
    # queries have none either; the rule says their output is 0.
    x['phi_k'][:, 0] = 0.0
    x['phi_q'][0, [3, 17, 30]] = 0.0
  y, state = run_prefill(x, window=0, chunk_size=C)
  expected = ref.causal_linear_attention(x['v'], x['phi_q'], x['phi_k'],
                                         n_kv_heads=2)
  assert np.isfinite(np.asarray(y)).all()
  assert_close(y, expected)
  if fmap == 'relu':
    np.testing.assert_array_equal(np.asarray(y)[:, 0], 0.0)
    np.testing.assert_array_equal(np.asarray(y)[0, [3, 17, 30]], 0.0)
  check_prefill(x, y, state, window=0)


# ----------------------------------------------------------------------------
# 4. The chunk size does not change the result.
# ----------------------------------------------------------------------------


def test_prefill_chunk_size_invariance():
  x = make_prefill_inputs(30, b=3, t=T, h=4, k_heads=2, d=D, p=P, fmap='elu',
                          lengths=RAGGED)
  mask = valid_mask(RAGGED, T, 4, D)
  outs = {}
  for c in (1, 5, 16, 64):
    y, state = run_prefill(x, window=7, chunk_size=c, lengths=RAGGED)
    check_prefill(x, y, state, window=7, lengths=RAGGED)
    outs[c] = (np.asarray(y), state)
  for c in (1, 5, 16):
    assert_close(outs[c][0], outs[64][0], mask=mask)
    assert_close(outs[c][1].S, outs[64][1].S)
    assert_close(outs[c][1].z, outs[64][1].z)


# ----------------------------------------------------------------------------
# 5. Continued prefill (multi-turn) equals one piece.
# ----------------------------------------------------------------------------


def _pad_rows(rows, length, rng):
  """Right-pad a list of [n_b, ...] arrays to [B, length, ...] with junk."""
  out = []
  for r in rows:
    pad = JUNK * rng.standard_normal((length - r.shape[0],) + r.shape[1:])
    out.append(np.concatenate([r, pad.astype(r.dtype)], axis=0))
  return np.stack(out)


def _make_prefix(x, starts, size, rng):
  """The `size` tokens before starts[b]; positions < 0 are invalid junk."""
  ks, vs, phis, valid = [], [], [], []
  for b, a in enumerate(starts):
    pos = np.arange(a - size, a)
    ok = pos >= 0
    idx = np.clip(pos, 0, None)
    junk = lambda arr: np.where(
        ok.reshape((-1,) + (1,) * (arr.ndim - 1)), arr,
        JUNK * rng.standard_normal(arr.shape).astype(np.float32))
    ks.append(junk(x['k'][b, idx]))
    vs.append(junk(x['v'][b, idx]))
    phis.append(junk(x['phi_k'][b, idx]))
    valid.append(ok)
  return attention.WindowPrefix(
      k=jnp.asarray(np.stack(ks)), v=jnp.asarray(np.stack(vs)),
      phi_k=jnp.asarray(np.stack(phis)), valid=jnp.asarray(np.stack(valid)))


def _ref_state_before(x, b, end):
  """(S, z) summed over positions j < end of example b (float64)."""
  h = x['q'].shape[2]
  group = h // x['k'].shape[2]
  phi = x['phi_k'][b, :max(end, 0)].astype(np.float64)  # [n, H, F]
  v = np.repeat(x['v'][b, :max(end, 0)], group, axis=1).astype(np.float64)
  return np.einsum('nhf,nhd->hfd', phi, v), phi.sum(0)


def _multi_turn(x, bounds, *, window, chunk_size, prefix_size=None,
                plain_first=False, seed=0, sinks=0):
  """Prefill x turn by turn; bounds[r][b] is where turn r starts in example b.

  Every turn is padded to the same length and gets an initial state and a
  prefix (turn 0: zero state, all-invalid prefix), so one compilation serves
  all turns; `plain_first` instead calls turn 0 with neither. Returns the
  outputs scattered back to [B, T_total, H, D] and the last state.
  """
  rng = np.random.default_rng(seed)
  prefix_size = window if prefix_size is None else prefix_size
  b_, _, h_, d_ = x['q'].shape
  f_ = x['phi_k'].shape[-1]
  y_all = np.full((b_, bounds[-1].max(), h_, d_), np.nan)
  turn_len = max((bounds[r + 1] - bounds[r]).max()
                 for r in range(len(bounds) - 1))
  state = attention.LinearState(S=jnp.zeros((b_, h_, f_, d_), jnp.float32),
                                z=jnp.zeros((b_, h_, f_), jnp.float32))
  for r in range(len(bounds) - 1):
    starts, ends = bounds[r], bounds[r + 1]
    n = ends - starts
    turn = {name: _pad_rows([x[name][b, starts[b]:ends[b]] for b in range(b_)],
                            turn_len, rng)
            for name in ('q', 'k', 'v', 'phi_q', 'phi_k')}
    turn['gamma'] = x['gamma']
    if r > 0:
      if prefix_size != window:
        # The caller's contract: the state holds every token before the prefix.
        sz = [_ref_state_before(x, b, starts[b] - prefix_size)
              for b in range(b_)]
        state = attention.LinearState(
            S=jnp.asarray(np.stack([s for s, _ in sz]), jnp.float32),
            z=jnp.asarray(np.stack([z for _, z in sz]), jnp.float32))
    kw = dict(initial_state=state,
              prefix=_make_prefix(x, starts, prefix_size, rng))
    if r == 0 and plain_first:
      kw = {}
    if sinks:
      kw['sinks'] = make_sinks(x, sinks, ends, starts)
    y, state = run_prefill(turn, window=window, chunk_size=chunk_size,
                           lengths=n, **kw)
    y = np.asarray(y)
    for b in range(b_):
      y_all[b, starts[b]:ends[b]] = y[b, :n[b]]
  return y_all, state


CONTINUED_CASES = {
    # name: (window, chunk, bounds per turn: [B] start of each turn, then ends)
    # Example 1 of 'ragged' has a = 4 < W; example 0 has a = 20 > W. The
    # first turn of 'ragged' is a plain call (no initial state, no prefix).
    'ragged': (7, 5, [[0, 0, 0], [20, 4, 13], [37, 30, 22]]),
    'ragged_three_turns': (6, 4, [[0, 0, 0], [3, 15, 9], [11, 16, 24],
                                  [37, 29, 30]]),
    'window_exceeds_history': (40, 8, [[0, 0, 0], [20, 4, 13],
                                       [37, 30, 22]]),
    'window_one': (1, 3, [[0, 0, 0], [20, 4, 13], [37, 30, 22]]),
}


@pytest.mark.parametrize('case', sorted(CONTINUED_CASES))
def test_continued_prefill_equals_one_piece(case):
  window, chunk, bounds = CONTINUED_CASES[case]
  bounds = [np.asarray(bd) for bd in bounds]
  b_ = len(bounds[0])
  x = make_prefill_inputs(40, b=b_, t=T, h=4, k_heads=2, d=D, p=P,
                          fmap='hedgehog')
  y, state = _multi_turn(x, bounds, window=window, chunk_size=chunk,
                         plain_first=(case == 'ragged'))
  total = bounds[-1]
  y_ref, s_ref, z_ref = ref_prefill(x, window=window, lengths=total)
  y_ref = y_ref[:, :total.max()]
  mask = valid_mask(total, total.max(), 4, D)
  assert_close(y, y_ref, mask=mask)
  assert_close(state.S, s_ref)
  assert_close(state.z, z_ref)


@pytest.mark.parametrize('window,sinks', [(6, 5), (0, 3), (3, 25)])
def test_continued_prefill_with_sinks_equals_one_piece(window, sinks):
  """Sinks come from the history in later turns (25: beyond a turn)."""
  bounds = [np.asarray(bd) for bd in ([0, 0, 0], [3, 15, 9], [11, 16, 24],
                                      [37, 29, 30])]
  x = make_prefill_inputs(43, b=3, t=T, h=4, k_heads=2, d=D, p=P,
                          fmap='hedgehog')
  y, state = _multi_turn(x, bounds, window=window, chunk_size=4, sinks=sinks)
  y_ref, s_ref, z_ref = ref_prefill(x, window=window, lengths=bounds[-1],
                                    sinks=sinks)
  mask = valid_mask(bounds[-1], T, 4, D)
  assert_close(y, y_ref, mask=mask)
  assert_close(state.S, s_ref)
  assert_close(state.z, z_ref)


def test_continued_prefill_zero_window():
  """W = 0: the prefix is empty (P = 0) and the state carries everything."""
  bounds = [np.asarray(bd) for bd in ([0, 0, 0], [20, 4, 13], [37, 30, 22])]
  x = make_prefill_inputs(41, b=3, t=T, h=4, k_heads=2, d=D, p=P, fmap='elu')
  y, state = _multi_turn(x, bounds, window=0, chunk_size=5)
  y_ref, s_ref, z_ref = ref_prefill(x, window=0, lengths=bounds[-1])
  mask = valid_mask(bounds[-1], T, 4, D)
  assert_close(y, y_ref, mask=mask)
  assert_close(state.S, s_ref)
  assert_close(state.z, z_ref)


def test_continued_prefill_prefix_longer_than_window():
  """P > W: prefix entries older than the window count through phi_k."""
  bounds = [np.asarray(bd) for bd in ([0, 0, 0], [20, 4, 13], [37, 30, 22])]
  x = make_prefill_inputs(42, b=3, t=T, h=4, k_heads=2, d=D, p=P,
                          fmap='taylor')
  y, state = _multi_turn(x, bounds, window=5, chunk_size=4, prefix_size=11)
  y_ref, s_ref, z_ref = ref_prefill(x, window=5, lengths=bounds[-1])
  mask = valid_mask(bounds[-1], T, 4, D)
  assert_close(y, y_ref, mask=mask)
  assert_close(state.S, s_ref)
  assert_close(state.z, z_ref)


# ----------------------------------------------------------------------------
# 6. bf16 activations: bf16 output, float32 state, close to float32.
# ----------------------------------------------------------------------------


def test_prefill_bf16_smoke():
  x = make_prefill_inputs(70, b=3, t=T, h=4, k_heads=2, d=D, p=P,
                          fmap='hedgehog', lengths=RAGGED)
  names = ('q', 'k', 'v', 'phi_q', 'phi_k')
  x16 = {n: jnp.asarray(x[n], jnp.bfloat16) for n in names}
  # The float32 run sees the same (bf16-rounded) numbers.
  x32 = {n: np.asarray(x16[n].astype(jnp.float32)) for n in names}
  x32['gamma'] = x['gamma']
  lengths = jnp.asarray(RAGGED, jnp.int32)
  y16, st16 = attention.orthros_prefill(
      *(x16[n] for n in names), jnp.asarray(x['gamma']), window=7,
      chunk_size=5, lengths=lengths)
  y32, st32 = run_prefill(x32, window=7, chunk_size=5, lengths=RAGGED)
  assert y16.dtype == jnp.bfloat16
  assert st16.S.dtype == jnp.float32 and st16.z.dtype == jnp.float32
  mask = valid_mask(RAGGED, T, 4, D)
  assert np.isfinite(np.asarray(y16.astype(jnp.float32))[mask]).all()
  assert_close(y16, np.asarray(y32), tol=1e-2, mask=mask)
  assert_close(st16.S, np.asarray(st32.S), tol=1e-2)
  assert_close(st16.z, np.asarray(st32.z), tol=1e-2)
