"""Orthros prefill (XLA): sliding-window softmax + linear attention, chunked.

Einsum legend: B batch, T tokens, C chunk, S keys of one chunk's block,
H query heads, K kv heads, G group (H / K), D head dim, F feature dim.

For a query at t with window W (docs/ARCHITECTURE.md section 3):
  window keys  t-W < j <= t :  w_tj = gamma_h * exp(q_t.k_j / sqrt(D) - m_t)
  older keys   j <= t-W     :  w_tj = phi_q(q_t) . phi_k(k_j)
  y_t = sum_j w_tj v_j / sum_j w_tj       (one shared denominator; 0 if it is 0)
with m_t the maximum window score.

The sequence is cut into chunks of C tokens and scanned in order. The keys a
chunk's queries can see in their windows lie in the chunk itself and the `nb`
chunks before it (nb * C >= W - 1); these (nb + 1) * C keys form the chunk's
key block, kept in a rolling buffer carried by the scan. Every key before the
block is older than the window of every query in the chunk, so its
contribution is the carried float32 linear state (S, z). Inside the block the
per-pair distance decides window softmax vs linear. After a chunk, the oldest
buffered chunk leaves the block and is folded into (S, z). The scan body
holds its arrays head-major ([B, heads, C, dim]) so that each einsum is a
batched matmul without a transpose, and the linear part's einsum covers
only the block's first (nb + 1) * C - W keys, the only ones that can be
older than a query's window (together: SmolLM2's TTFT at 8K on the CPU 2.07x -> 1.87x the
no-attention network; benchmarks/RESULTS.md, "The XLA prefill head-major").
A chunk-parallel form of the same formula is slower on the CPU
(benchmarks/prefill_schedules.py).
Cost: O(T * ((nb + 1) * C * D + ((nb + 1) * C - W) * F + F * D)) per head,
linear in T.

Attention sinks (optional, `sinks=Sinks(...)`, StreamingLLM): the first N
tokens of the sequence stay in every query's exact set, window or not:
  sink keys    j < N        :  w_tj = gamma_h * exp(q_t.k_j / sqrt(D) - m_t)
with m_t the maximum over window and sink scores; they never enter the
linear part or (S, z). Pretrained models park attention on the first tokens;
without them a short window renormalises that mass onto local tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import LinearState
from pallas_kernels.common import WindowPrefix
from pallas_kernels.common import normalize
from pallas_kernels.common import stable_max
from pallas_kernels.common import zero_state

Array = jax.Array

__all__ = ['LinearState', 'Sinks', 'WindowPrefix', 'fold_into_state',
           'length_scales', 'orthros_prefill', 'zero_state']


class Sinks(NamedTuple):
  """The first N tokens of the whole sequence (attention sinks).

  k, v: [B, N, K, D]; valid: [B, N] bool (False past a sequence shorter than
  N); start: [B] int32, the absolute position of the first new query (the
  history length of a continued prefill, 0 for a fresh prompt).
  """
  k: Array
  v: Array
  valid: Array
  start: Array


def fold_into_state(state: LinearState, phi_k: Array, v: Array,
                    mask: Array) -> LinearState:
  """Adds sum_j mask_j phi_k(j) v_j^T to the state.

  phi_k: [B, N, H, F]; v: [B, N, K, D]; mask: [B, N] bool.
  """
  b, n, h, f = phi_k.shape
  kh = v.shape[2]
  phi = jnp.where(mask[..., None, None], phi_k.astype(jnp.float32), 0.0)
  phi = phi.reshape(b, n, kh, h // kh, f)
  ds = jnp.einsum('bnkgf,bnkd->bkgfd', phi, v.astype(jnp.float32))
  return LinearState(state.S + ds.reshape(b, h, f, -1),
                     state.z + jnp.sum(phi, axis=1).reshape(b, h, f))


def length_scales(positions: Array, exponent: Array, *, window: int,
                  sinks: int) -> Array:
  """[B, T, H] float32 factors (n_old / W) ** -exponent_h of
  `AttentionConfig.length_scale`, for queries at absolute `positions`
  [B, T]; n_old = max(1, t + 1 - W - sinks) counts the query's older,
  non-sink tokens (the ones its linear weights cover). Multiplying phi_q by
  them scales every linear weight of the query and nothing else."""
  n_old = jnp.maximum(positions.astype(jnp.float32) + 1.0 - window - sinks,
                      1.0)
  log_ratio = jnp.log(n_old) - math.log(max(window, 1))
  return jnp.exp(-log_ratio[..., None] * exponent.astype(jnp.float32))


def orthros_prefill(q: Array, k: Array, v: Array, phi_q: Array, phi_k: Array,
                    gamma: Array, *, window: int, chunk_size: int,
                    lengths: Array | None = None,
                    initial_state: LinearState | None = None,
                    prefix: WindowPrefix | None = None,
                    sinks: Sinks | None = None
                    ) -> tuple[Array, LinearState]:
  """Hybrid prefill of T tokens; returns outputs and the linear state.

  Args:
    q: [B, T, H, D] queries; k, v: [B, T, K, D] keys and values (RoPE applied).
    phi_q, phi_k: [B, T, H, F] feature-mapped q and k (k repeated per query
      head for GQA).
    gamma: [H] window weights in (0, 1) (sigmoid already applied).
    window: W >= 0 tokens of exact softmax per query, self included.
    chunk_size: C >= 1; the result does not depend on it.
    lengths: [B] int32 valid tokens per right-padded example (default T).
      Outputs at t >= lengths[b] are unspecified.
    initial_state: state of every token before `prefix` (continued prefill).
    prefix: the tokens just before the new ones (at least the last W-1 of the
      history for an exact continuation).
    sinks: the first N tokens of the sequence, in every query's exact set and
      never in the linear part (None: no sinks).

  Returns:
    y [B, T, H, D] in q.dtype and LinearState with the sums over every token
    (history included) at positions < L - W, L the valid length, sinks
    excluded.
  """
  if window < 0 or chunk_size < 1:
    raise ValueError(f'window={window} must be >= 0 and chunk_size='
                     f'{chunk_size} >= 1')
  b, t, h, d = q.shape
  kh, f = k.shape[2], phi_q.shape[-1]
  if k.shape != (b, t, kh, d) or v.shape != k.shape or h % kh:
    raise ValueError(f'shapes q {q.shape}, k {k.shape}, v {v.shape} do not '
                     'form [B,T,H,D], [B,T,K,D] with H % K == 0')
  if phi_q.shape != (b, t, h, f) or phi_k.shape != (b, t, h, f):
    raise ValueError(f'phi_q {phi_q.shape} and phi_k {phi_k.shape} must both '
                     f'be [B, T, H, F] = {(b, t, h, f)}')
  every_chunk = lengths is None  # no chunk can be skipped (see the scan)
  lengths = (jnp.full((b,), t, jnp.int32) if lengths is None
             else jnp.asarray(lengths, jnp.int32))
  state = initial_state if initial_state is not None else zero_state(b, h, f, d)
  out_dtype = q.dtype
  f32 = lambda x: x.astype(jnp.float32)
  q, k, v, phi_q, phi_k = map(f32, (q, k, v, phi_q, phi_k))
  valid = jnp.ones((b, t), bool)

  p = 0
  if prefix is not None:
    # Prepend the history tokens as keys; their query rows are dummies.
    p = prefix.k.shape[1]
    q = jnp.concatenate([jnp.zeros((b, p, h, d), q.dtype), q], axis=1)
    phi_q = jnp.concatenate([jnp.zeros((b, p, h, f), q.dtype), phi_q], axis=1)
    k = jnp.concatenate([f32(prefix.k), k], axis=1)
    v = jnp.concatenate([f32(prefix.v), v], axis=1)
    phi_k = jnp.concatenate([f32(prefix.phi_k), phi_k], axis=1)
    valid = jnp.concatenate([prefix.valid.astype(bool), valid], axis=1)

  n = p + t
  # Keys that do not exist (invalid prefix entries, padding past the length)
  # get weight 0; zero them too, as 0 * NaN garbage would still be NaN.
  exists = valid & (jnp.arange(n)[None, :] < (p + lengths)[:, None])
  zero = lambda x: jnp.where(exists[:, :, None, None], x, 0.0)
  k, v, phi_k = zero(k), zero(v), zero(phi_k)
  # Tokens that end up older than the window of the last valid token.
  fold = valid & (jnp.arange(n)[None, :] < (p + lengths - window)[:, None])
  if sinks is not None:
    num_sinks = sinks.k.shape[1]
    # Absolute position of index i of the (prefix + new) sequence.
    offset = jnp.asarray(sinks.start, jnp.int32) - p  # [B]
    not_sink = (offset[:, None] + jnp.arange(n)[None, :]) >= num_sinks
    fold = fold & not_sink
    sink_k = jnp.where(sinks.valid[:, :, None, None], f32(sinks.k), 0.0)
    sink_v = jnp.where(sinks.valid[:, :, None, None], f32(sinks.v), 0.0)

  c = chunk_size
  num_chunks = -(-n // c)
  nb = min(-(-(window - 1) // c) if window > 1 else 0, num_chunks - 1)

  def chunked(x):  # [B, N, ...] -> [num_chunks, B, C, ...]
    x = jnp.pad(x, [(0, 0), (0, num_chunks * c - n)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, num_chunks, c, *x.shape[2:]), 1, 0)

  def heads_first(x):  # [num_chunks, B, C, X, ...] -> [num_chunks, B, X, C, ...]
    return jnp.moveaxis(chunked(x), 2, 3)

  # The scan body works head-major ([B, heads, tokens, dim]), so that every
  # einsum in it is a batched matmul without a transpose.
  g = h // kh
  qs = heads_first(q).reshape(num_chunks, b, kh, g, c, d)
  ks_, vs, phiqs, phiks = map(heads_first, (k, v, phi_q, phi_k))
  # Linear-eligible keys: every key, sinks excepted.
  linear_ok = valid if sinks is None else valid & not_sink
  xs = (qs, ks_, vs, phiqs, phiks) + tuple(
      map(chunked, (valid, fold, linear_ok))) + (jnp.arange(num_chunks),)
  buffer = (jnp.zeros((b, kh, nb * c, d)), jnp.zeros((b, kh, nb * c, d)),
            jnp.zeros((b, h, nb * c, f)), jnp.zeros((b, nb * c), bool),
            jnp.zeros((b, nb * c), bool), jnp.zeros((b, nb * c), bool))

  # Distance (query - key) inside a chunk's key block, and what it means.
  dist = (nb * c + jnp.arange(c)[:, None]) - jnp.arange((nb + 1) * c)[None, :]
  in_window = (dist >= 0) & (dist < window)  # [C, S]
  # Older keys of the block lie in its first n_lin keys (the linear part's
  # einsum runs over those alone: half the block at W = C).
  n_lin = min((nb + 1) * c, max(0, (nb + 1) * c - window))
  is_older = (dist >= window)[:, :n_lin]
  gamma_g = f32(gamma).reshape(kh, g)[None, :, :, None, None]
  if sinks is not None:
    sink_k, sink_v = jnp.swapaxes(sink_k, 1, 2), jnp.swapaxes(sink_v, 1, 2)

  def fold_chunk(state, phik, v, mask):
    """fold_into_state for head-major phik [B, H, N, F], v [B, K, N, D]."""
    phi = jnp.where(mask[:, None, :, None], phik, 0.0)
    phi = phi.reshape(b, kh, g, -1, f)
    ds = jnp.einsum('bkgnf,bknd->bkgfd', phi, v)
    return LinearState(state.S + ds.reshape(b, h, f, d),
                       state.z + jnp.sum(phi, axis=3).reshape(b, h, f))

  def step(carry, chunk):
    state, buf = carry
    qg, kc, vc, phiq_c, phik_c, valid_c, fold_c, lin_c, index = chunk
    kb, vb, phikb = (jnp.concatenate([old, new], axis=2)
                     for old, new in zip(buf[:3], (kc, vc, phik_c)))
    validb, foldb, linb = (jnp.concatenate([old, new], axis=1)
                           for old, new in zip(buf[3:], (valid_c, fold_c,
                                                         lin_c)))
    scale = jnp.sqrt(jnp.float32(d))
    # Window softmax part: [B, K, G, C, S].
    scores = jnp.einsum('bkgcd,bksd->bkgcs', qg, kb) / scale
    win = in_window[None, None, None] & validb[:, None, None, None, :]
    scores = jnp.where(win, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
      # Sink keys older than the query's window (younger ones are in it).
      tq = offset[:, None] + index * c + jnp.arange(c)[None, :]  # [B, C]
      j = jnp.arange(num_sinks)
      sink_on = (sinks.valid[:, None, :] &
                 (tq[:, :, None] - j[None, None, :] >= window) &
                 (j[None, None, :] <= tq[:, :, None]))  # [B, C, N]
      sink_scores = jnp.einsum('bkgcd,bknd->bkgcn', qg, sink_k) / scale
      sink_scores = jnp.where(sink_on[:, None, None], sink_scores, -jnp.inf)
      m = jnp.maximum(m, jnp.max(sink_scores, axis=-1, keepdims=True))
    m = stable_max(m)
    weights = gamma_g * jnp.exp(scores - m)
    # Linear part for the older keys inside the block.
    lin = jnp.einsum('bhcf,bhsf->bhcs', phiq_c, phikb[:, :, :n_lin])
    older = is_older[None, None] & linb[:, None, None, :n_lin]
    lin = jnp.where(older, lin, 0.0).reshape(b, kh, g, c, n_lin)
    weights = jnp.concatenate([weights[..., :n_lin] + lin,
                               weights[..., n_lin:]], axis=-1)
    # Numerator and denominator: block keys plus the carried state.
    num = jnp.einsum('bkgcs,bksd->bkgcd', weights, vb)
    den = jnp.sum(weights, axis=-1)  # [B, K, G, C]
    if sinks is not None:
      sink_w = gamma_g * jnp.exp(sink_scores - m)
      num = num + jnp.einsum('bkgcn,bknd->bkgcd', sink_w, sink_v)
      den = den + jnp.sum(sink_w, axis=-1)
    num = num.reshape(b, h, c, d) + jnp.einsum('bhcf,bhfd->bhcd', phiq_c,
                                               state.S)
    den = den.reshape(b, h, c) + jnp.einsum('bhcf,bhf->bhc', phiq_c, state.z)
    y = normalize(num, den[..., None])  # [B, H, C, D]
    # The oldest chunk of the block leaves it: fold it into the state.
    state = fold_chunk(state, phikb[:, :, :c], vb[:, :, :c], foldb[:, :c])
    buf = (kb[:, :, c:], vb[:, :, c:], phikb[:, :, c:], validb[:, c:],
           foldb[:, c:], linb[:, c:])
    return (state, buf), y

  # Chunks past the longest example hold no query anyone reads and fold
  # nothing (their keys are past every length): skipped, forward and
  # backward (a split forward passes lengths = its split, so a row's
  # exact half costs nothing here). Without lengths no chunk starts at or
  # past p + T, so none can be skipped, and the scan runs the step alone:
  # a `lax.cond` per chunk costs its residuals' bookkeeping under autodiff
  # (attention transfer, stage 1 of a conversion, runs this path).
  body = step
  if not every_chunk:
    needed_below = p + jnp.max(lengths)

    def body(carry, chunk):
      skip = lambda carry, _: (carry, jnp.zeros((b, h, c, d), jnp.float32))
      return jax.lax.cond(chunk[-1] * c < needed_below, step, skip, carry,
                          chunk)

  (state, buf), ys = jax.lax.scan(body, (state, buffer), xs)
  # Tokens still in the buffer (the last nb chunks) may also be older than
  # the last valid token's window.
  state = fold_chunk(state, buf[2], buf[1], buf[4])
  # [num_chunks, B, H, C, D] -> [B, num_chunks * C, H, D]
  y = jnp.transpose(ys, (1, 0, 3, 2, 4)).reshape(b, num_chunks * c, h, d)
  y = y[:, p:n]
  return y.astype(out_dtype), state
