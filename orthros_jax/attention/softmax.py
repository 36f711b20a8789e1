"""Exact softmax attention (XLA): full-sequence causal attention and decode
attention over a padded KV cache.

Einsum legend: B batch, T query length, S key length, H query heads,
K kv heads, G group (H / K), D head dim.

Both public functions share one core that takes, per example, the absolute
position of every query and the number of valid keys, and masks
`key <= query position` and `key < kv length`. Small problems use one einsum
with a [T, S] score matrix; large ones use a blocked online softmax (flash
attention written in XLA): query blocks are processed one after another and
each streams over key blocks, skipping blocks that are entirely masked, so
memory is O(block^2) per head instead of O(T * S). The blocked path has its
own backward pass (`jax.custom_vjp`, flash attention's): it keeps only the
output and each query's log-sum-exp, and one sweep over key blocks
recomputes the probabilities and accumulates dQ, dK and dV, about 2.5
forward passes of work. Autodiff through the forward loop (its scan, conds
and a checkpoint per query block) took 5.2 forward passes at the SmolLM2
shape and 4096 tokens (benchmarks/RESULTS.md, "Exact attention's
backward").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import normalize
from pallas_kernels.common import stable_max
from pallas_kernels.common import zero_unwritten

Array = jax.Array

# Above this many (query, key) pairs per head the blocked path is used, with
# this block size. On the CPU the one-einsum path is the slower one beyond
# a few hundred tokens (its [T, S] passes are memory bound, and blocks skip
# the masked half of a causal problem): measured with the SmolLM2 shape
# (9 / 3 heads of 64), blocks of 256 beat it 2.5x forward at T = S = 512,
# 5x forward and 2.8x forward + backward at 1024, 1.6x forward at 2048
# (benchmarks/RESULTS.md); up to 256 x 256 the single einsum stays (1.7x
# slower there, but milliseconds, and it compiles faster). Accelerators
# keep the large single einsum, which they run as a few big matmuls.
# Where a length is not a multiple of the block, padding to whole blocks
# costs work: the CPU takes a smaller candidate only where it pads at least
# a quarter less block area (more, smaller blocks cost loop steps of their
# own), else the larger (at T = S = 384, blocks of 256 pad to 512 x 512 and
# ran the tiny recipe's shape forward + backward 1.8x slower than blocks of
# 128: benchmarks/RESULTS.md, "Conversion throughput").
_NAIVE_MAX_PAIRS = {'cpu': 1 << 16}
_NAIVE_MAX_PAIRS_DEFAULT = 1 << 20
_BLOCKS = {'cpu': (256, 128)}
_BLOCKS_OTHER = (512,)
# Decode on the CPU: a few query rows over a long cache. Both einsums of
# the one-einsum path batch over the kv heads, which sit between the
# position and head_dim axes of the [B, S, K, D] cache, so XLA transposed
# the whole cache into [B, K, S, D] for each (zeroing stale rows on the
# way): at the SmolLM2 shape and 4K tokens, cache-sized copies took about
# 39 ms of a decode step the profiler timed at about 84 ms (66 ms without
# it). `_attend_cross_head` reads the cache in place instead, as one
# [S * K, D] matrix, and computes every (query head, kv head) pair,
# keeping the matching ones: K times the minimal multiply-adds, cheap while
# a step reads far more bytes than it multiplies (benchmarks/RESULTS.md,
# "Decode reads the KV cache in place on the CPU"). Taken on the CPU while
# query rows x heads x kv heads stay within _CROSS_HEAD_MAX_WASTE (above it
# the wasted work costs more than the copies: in an ad-hoc timing 16 rows
# of a 32 / 8-head model ran 1.7x slower than the one-einsum path) and the
# [B, T * H, S * K] scores within _CROSS_HEAD_MAX_SCORES elements.
_CROSS_HEAD_BACKENDS = ('cpu',)
_CROSS_HEAD_MAX_WASTE = 512
_CROSS_HEAD_MAX_SCORES = 1 << 24


def _padded_area(t: int, s: int, block: int) -> int:
  bq, bk = min(block, t), min(block, s)
  return -(-t // bq) * bq * (-(-s // bk) * bk)


def _auto_block(t: int, s: int) -> int | None:
  """None (one einsum) or the block size the blocked path uses for a
  [t, s] problem on this backend."""
  backend = jax.default_backend()
  if t * s <= _NAIVE_MAX_PAIRS.get(backend, _NAIVE_MAX_PAIRS_DEFAULT):
    return None
  blocks = _BLOCKS.get(backend, _BLOCKS_OTHER)  # largest first
  best = blocks[0]
  for blk in blocks[1:]:
    if _padded_area(t, s, blk) <= 0.75 * _padded_area(t, s, best):
      best = blk
  return best


def softmax_attention(q: Array, k: Array, v: Array, *, causal: bool = True,
                      block_size: int | None = None,
                      skip_before: Array | None = None) -> Array:
  """Exact attention with GQA; queries aligned to the end of the keys.

  Args:
    q: [B, T, H, D] queries (RoPE applied).
    k, v: [B, S, K, D] keys and values, S >= T when causal; H % K == 0.
    causal: query i sits at position S - T + i and sees keys j <= S - T + i.
    block_size: None picks the naive path for small T * S and the blocked one
      otherwise; an int forces the blocked path with that block size.
    skip_before: None, or [B] int: query i of example b is not needed when
      its position is below skip_before[b] (the split forward of an Orthros
      model computes those by the prefill formula); its output is 0 and it
      passes no gradient, and the blocked path skips every query block that
      no example needs, forward and backward.

  Returns:
    [B, T, H, D] in q.dtype.
  """
  _check_shapes(q, k, v)
  b, t = q.shape[:2]
  s = k.shape[1]
  q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (s - t), (b, t))
  if skip_before is not None:
    if not causal:
      raise ValueError('skip_before needs causal=True (it marks queries by '
                       'their position, which only causal attention reads)')
    # Position -1 sees no key (as a padding query does).
    skip = jnp.broadcast_to(jnp.asarray(skip_before, jnp.int32), (b,))
    q_pos = jnp.where(q_pos >= skip[:, None], q_pos, -1)
  kv_len = jnp.full((b,), s, jnp.int32)
  return _attend(q, k, v, q_pos, kv_len, causal=causal, block_size=block_size)


def decode_attention(q: Array, k_cache: Array, v_cache: Array, lengths: Array,
                     *, block_size: int | None = None,
                     cross_head: bool = True) -> Array:
  """Exact attention of T_q new tokens over a padded KV cache.

  Args:
    q: [B, Tq, H, D] queries of the new tokens.
    k_cache, v_cache: [B, S_max, K, D]; entries at j >= lengths[b] are ignored.
    lengths: [B] int32, valid keys per example including the Tq new tokens,
      which are the last Tq of them: query i of example b is at position
      lengths[b] - Tq + i and sees keys j <= that position (causal inside the
      block of new tokens).
    block_size: as in `softmax_attention`; with None (and cross_head), a
      few query rows on the CPU read the cache in place instead
      (`_attend_cross_head`).
    cross_head: False never takes that path (a cache sharded over kv heads,
      whose [B, S * K, D] view would be gathered).

  Returns:
    [B, Tq, H, D] in q.dtype.
  """
  _check_shapes(q, k_cache, v_cache)
  tq = q.shape[1]
  lengths = jnp.asarray(lengths, jnp.int32)
  q_pos = lengths[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)[None, :]
  if (cross_head and block_size is None
      and _use_cross_head(q.shape, k_cache.shape)):
    return _attend_cross_head(q, k_cache, v_cache, q_pos, lengths)
  return _attend(q, k_cache, v_cache, q_pos, lengths, causal=True,
                 block_size=block_size)


def cross_head_backend() -> bool:
  """Whether this backend's `decode_attention` may read the cache through
  its [B, S * K, D] view (the CPU)."""
  return jax.default_backend() in _CROSS_HEAD_BACKENDS


def _use_cross_head(q_shape, k_shape) -> bool:
  """Whether `decode_attention` takes `_attend_cross_head` (see
  _CROSS_HEAD_MAX_WASTE)."""
  b, t, h, _ = q_shape
  s, kh = k_shape[1], k_shape[2]
  return (cross_head_backend()
          and t * h * kh <= _CROSS_HEAD_MAX_WASTE
          and b * t * h * s * kh <= _CROSS_HEAD_MAX_SCORES)


@jax.custom_vjp
def _attend_cross_head(q, k, v, q_pos, kv_len):
  """`_attend_naive(..., causal=True)` with the cache read in place: the
  scores are q [T * H, D] times k [S * K, D]^T, of which each query head
  keeps its own kv head's columns, and the output is p [T * H, S] times v
  [S, K * D], of which it keeps its kv head's D columns. No [B, K, S, D]
  copy of the cache is made.

  Stale rows (j >= kv_len) get probability exactly 0, so a finite value
  there adds exactly 0; a non-finite one (0 * NaN) shows as a non-finite
  output, and only then is p @ v recomputed with the stale rows of v
  zeroed (a copy, as the one-einsum path always makes). The backward pass
  is the one-einsum path's, which zeroes stale rows of k and v (a
  `custom_vjp`: forward-mode differentiation, `jax.jvp`, is not defined).
  A bfloat16 cache is read as float32 for p @ v (a converted copy of v)."""
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  scores = jnp.einsum('byd,bxd->byx', q.reshape(b, t * h, d),
                      k.reshape(b, s * kh, d),
                      preferred_element_type=jnp.float32)
  scores = _own_kv_head(scores.reshape(b, t, kh, h // kh, s, kh), axis=5)
  scores = scores / jnp.sqrt(jnp.float32(d))  # [B, T, K, G, S]
  mask = _mask(q_pos, kv_len, s, causal=True)[:, :, None, None]  # [B,T,1,1,S]
  scores = jnp.where(mask, scores, -jnp.inf)
  p = jnp.exp(scores - stable_max(jnp.max(scores, axis=-1, keepdims=True)))
  o = _cross_head_pv(p, v.astype(jnp.float32))
  o = jax.lax.cond(jnp.all(jnp.isfinite(o)), lambda: o,
                   lambda: _cross_head_pv(p, _zero_invalid(v, kv_len, 0)))
  return normalize(o, jnp.sum(p, axis=-1)[..., None]).reshape(q.shape).astype(
      q.dtype)


def _own_kv_head(x, axis):
  """x [B, T, K, G, ..., K', ...] -> the entries with K' = K (K' at `axis`,
  dropped): each query head's own kv head."""
  kh = x.shape[2]
  take = lambda i: jax.lax.index_in_dim(x[:, :, i], i, axis - 1,
                                        keepdims=False)
  return jnp.stack([take(i) for i in range(kh)], axis=2)


def _cross_head_pv(p, v):
  """p [B, T, K, G, S] times v [B, S, K, D] float32 -> [B, T, K, G, D]."""
  b, t, kh, g, s = p.shape
  d = v.shape[-1]
  o = jnp.einsum('bys,bsx->byx', p.reshape(b, t * kh * g, s),
                 v.reshape(b, s, kh * d), preferred_element_type=jnp.float32)
  return _own_kv_head(o.reshape(b, t, kh, g, kh, d), axis=4)


def _cross_head_fwd(q, k, v, q_pos, kv_len):
  return _attend_cross_head(q, k, v, q_pos, kv_len), (q, k, v, q_pos, kv_len)


def _cross_head_bwd(residuals, dout):
  q, k, v, q_pos, kv_len = residuals
  _, vjp = jax.vjp(
      lambda q, k, v: _attend_naive(q, k, v, q_pos, kv_len, causal=True),
      q, k, v)
  return (*vjp(dout), None, None)


_attend_cross_head.defvjp(_cross_head_fwd, _cross_head_bwd)


def _check_shapes(q, k, v):
  if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
    raise ValueError(f'expected q [B,T,H,D] and k, v [B,S,K,D]; got q '
                     f'{q.shape}, k {k.shape}, v {v.shape}')
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f'batch and head_dim of q {q.shape} and k {k.shape} '
                     'must match')
  if q.shape[2] % k.shape[2]:
    raise ValueError(f'query heads ({q.shape[2]}) must be a multiple of kv '
                     f'heads ({k.shape[2]})')


def _attend(q, k, v, q_pos, kv_len, *, causal, block_size):
  t, s = q.shape[1], k.shape[1]
  if block_size is None:
    block_size = _auto_block(t, s)
    if block_size is None:
      return _attend_naive(q, k, v, q_pos, kv_len, causal=causal)
  if block_size < 1:
    raise ValueError(f'block_size={block_size} must be >= 1')
  return _attend_blocked(q, k, v, q_pos, kv_len, causal=causal,
                         block=block_size)


def _mask(q_pos, kv_len, s, causal):
  """[B, T, S] bool: which keys each query sees."""
  j = jnp.arange(s, dtype=jnp.int32)
  mask = j[None, None, :] < kv_len[:, None, None]
  if causal:
    mask = mask & (j[None, None, :] <= q_pos[:, :, None])
  return mask


def _zero_invalid(v, kv_len, start):
  """v [B, N, K, D] as float32 with keys at start + n >= kv_len zeroed."""
  j = start + jnp.arange(v.shape[1], dtype=jnp.int32)
  return zero_unwritten(v, j[None, :] < kv_len[:, None])


def _attend_naive(q, k, v, q_pos, kv_len, *, causal):
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, d)
  # Stale keys (j >= kv_len) are masked below; zeroed too, so that even a
  # NaN there leaves the gradient of q finite.
  written = (jnp.arange(s) < kv_len[:, None])[:, :, None, None]
  scores = jnp.einsum('btkgd,bskd->bkgts', qg,
                      jnp.where(written, k, jnp.zeros((), k.dtype)),
                      preferred_element_type=jnp.float32) / jnp.sqrt(d)
  mask = _mask(q_pos, kv_len, s, causal)[:, None, None]  # [B, 1, 1, T, S]
  scores = jnp.where(mask, scores, -jnp.inf)
  p = jnp.exp(scores - stable_max(jnp.max(scores, axis=-1, keepdims=True)))
  l = jnp.sum(p, axis=-1)  # [B, K, G, T]
  o = jnp.einsum('bkgts,bskd->btkgd', p, _zero_invalid(v, kv_len, 0))
  l = jnp.moveaxis(l, 3, 1)[..., None]  # [B, T, K, G, 1]
  return normalize(o, l).reshape(b, t, h, d).astype(q.dtype)


def _pad_axis(x, axis, multiple, value=0):
  n = x.shape[axis]
  pad = (-n) % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _attend_blocked(q, k, v, q_pos, kv_len, *, causal, block):
  return _blocked(q, k, v, q_pos, kv_len, causal, block)


def _blocked_layout(q, k, v, q_pos, block):
  """Block-major views: q [nq, B, bq, K, G, D], pos [nq, B, bq] (padding
  queries at position -1), k and v [nk, B, bk, K, D], and (bq, bk)."""
  b, t = q.shape[:2]
  s, kh, d = k.shape[1:]
  bq, bk = min(block, t), min(block, s)
  # Pad to whole blocks; padded keys are masked by kv_len (< S), padded
  # queries see no key and are dropped at the end.
  posp = _pad_axis(q_pos, 1, bq, value=-1).reshape(b, -1, bq)
  kp = _pad_axis(k, 1, bk).reshape(b, -1, bk, kh, d)
  vp = _pad_axis(v, 1, bk).reshape(b, -1, bk, kh, d)
  return (_query_blocks(q, kh, bq), jnp.moveaxis(posp, 1, 0),
          jnp.moveaxis(kp, 1, 0), jnp.moveaxis(vp, 1, 0), bq, bk)


def _query_blocks(x, kv_heads, bq):
  """[B, T, H, D] -> [nq, B, bq, K, G, D], padded to whole blocks."""
  b, _, h, d = x.shape
  xp = _pad_axis(x, 1, bq).reshape(b, -1, bq, kv_heads, h // kv_heads, d)
  return jnp.moveaxis(xp, 1, 0)


def _block_scores(qb, kb, pos, start, kv_len, causal, scale):
  """[B, K, G, bq, bk] float32 scores of a query block against a key block
  starting at `start`, -inf where masked."""
  sc = jnp.einsum('bqkgd,bskd->bkgqs', qb, kb,
                  preferred_element_type=jnp.float32) * scale
  j = start + jnp.arange(kb.shape[1], dtype=jnp.int32)
  mask = j[None, None, :] < kv_len[:, None, None]
  if causal:
    mask = mask & (j[None, None, :] <= pos[:, :, None])
  return jnp.where(mask[:, None, None], sc, -jnp.inf)


def _block_needed(start, pos, max_len, causal):
  """Whether a key block starting at `start` holds a key some query of the
  block (positions `pos`) sees."""
  needed = start < max_len
  if causal:
    needed = needed & (start <= jnp.max(pos))
  return needed


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _blocked(q, k, v, q_pos, kv_len, causal, block):
  return _blocked_forward(q, k, v, q_pos, kv_len, causal, block)[0]


def _blocked_forward(q, k, v, q_pos, kv_len, causal, block):
  """(out [B, T, H, D] in q.dtype, lse [nq, B, K, G, bq] float32): the
  online softmax over key blocks, one query block after another; lse is
  each query's log-sum-exp (+inf for a query that sees no key), all the
  backward pass keeps of the probabilities."""
  b, t, h, d = q.shape
  kh = k.shape[2]
  g = h // kh
  q_blocks, pos_blocks, k_blocks, v_blocks, bq, bk = _blocked_layout(
      q, k, v, q_pos, block)
  nk = k_blocks.shape[0]
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  max_len = jnp.max(kv_len)

  def one_query_block(args):
    qb, pos = args  # [B, bq, K, G, D], [B, bq]

    def visit(carry, xs):
      start, kb, vb = xs

      def compute(carry):
        m, l, acc = carry
        sc = _block_scores(qb, kb, pos, start, kv_len, causal, scale)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        m_safe = stable_max(m_new)
        p = jnp.exp(sc - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum(
            'bkgqs,bskd->bkgqd', p, _zero_invalid(vb, kv_len, start))
        return m_new, l, acc

      needed = _block_needed(start, pos, max_len, causal)
      return jax.lax.cond(needed, compute, lambda c: c, carry), None

    init = (jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, d), jnp.float32))
    starts = jnp.arange(nk, dtype=jnp.int32) * bk
    (m, l, acc), _ = jax.lax.scan(visit, init, (starts, k_blocks, v_blocks))
    o = normalize(acc, l[..., None])
    lse = jnp.where(l > 0, stable_max(m) + jnp.log(jnp.where(l > 0, l, 1.0)),
                    jnp.inf)
    return jnp.einsum('bkgqd->bqkgd', o), lse

  out, lse = jax.lax.map(one_query_block, (q_blocks, pos_blocks))
  out = jnp.moveaxis(out, 0, 1).reshape(b, -1, h, d)[:, :t]
  return out.astype(q.dtype), lse


def _blocked_fwd(q, k, v, q_pos, kv_len, causal, block):
  out, lse = _blocked_forward(q, k, v, q_pos, kv_len, causal, block)
  return out, (q, k, v, q_pos, kv_len, out, lse)


def _blocked_bwd(causal, block, residuals, dout):
  """Flash attention's backward pass in XLA: one sweep over key blocks,
  each over the query blocks that see it, recomputing the probabilities
  from lse; dK and dV accumulate per key block, dQ in place across key
  blocks. About 2.5 forward passes of work, and no [T, S] residual."""
  q, k, v, q_pos, kv_len, out, lse = residuals
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = h // kh
  q_blocks, pos_blocks, k_blocks, v_blocks, bq, bk = _blocked_layout(
      q, k, v, q_pos, block)
  do_blocks = _query_blocks(dout.astype(jnp.float32), kh, bq)
  # delta_i = sum_d dO_i O_i: the softmax Jacobian's row term.
  delta = jnp.einsum('nbqkgd,nbqkgd->nbkgq', do_blocks,
                     _query_blocks(out.astype(jnp.float32), kh, bq))
  nq = q_blocks.shape[0]
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  max_len = jnp.max(kv_len)

  def key_block(dq, xs):
    start, kb, vb = xs
    # Keys past kv_len get probability 0, but a stale or NaN row there
    # must not reach dP or dQ (0 * NaN is NaN).
    kz, vz = (_zero_invalid(x, kv_len, start) for x in (kb, vb))

    def query_block(carry, i):
      dq, dk, dv = carry
      qb, pos = q_blocks[i], pos_blocks[i]

      def compute(dk, dv):
        sc = _block_scores(qb, kb, pos, start, kv_len, causal, scale)
        p = jnp.exp(sc - lse[i][..., None])  # [B, K, G, bq, bk]
        dob = do_blocks[i]  # [B, bq, K, G, D]
        dv = dv + jnp.einsum('bkgqs,bqkgd->bskd', p, dob)
        dp = jnp.einsum('bqkgd,bskd->bkgqs', dob, vz)
        ds = p * (dp - delta[i][..., None]) * scale
        dk = dk + jnp.einsum('bkgqs,bqkgd->bskd', ds,
                             qb.astype(jnp.float32))
        dq_i = jnp.einsum('bkgqs,bskd->bqkgd', ds, kz)
        return dq_i, dk, dv

      def skip(dk, dv):
        return jnp.zeros((b, bq, kh, g, d), jnp.float32), dk, dv

      needed = _block_needed(start, pos, max_len, causal)
      dq_i, dk, dv = jax.lax.cond(needed, compute, skip, dk, dv)
      dq = dq.at[i].add(dq_i)
      return (dq, dk, dv), None

    zeros = jnp.zeros((b, bk, kh, d), jnp.float32)
    (dq, dk, dv), _ = jax.lax.scan(query_block, (dq, zeros, zeros),
                                   jnp.arange(nq))
    return dq, (dk, dv)

  starts = jnp.arange(k_blocks.shape[0], dtype=jnp.int32) * bk
  dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
  dq, (dk, dv) = jax.lax.scan(key_block, dq0, (starts, k_blocks, v_blocks))
  dq = jnp.moveaxis(dq, 0, 1).reshape(b, -1, h, d)[:, :t]
  dk = jnp.moveaxis(dk, 0, 1).reshape(b, -1, kh, d)[:, :s]
  dv = jnp.moveaxis(dv, 0, 1).reshape(b, -1, kh, d)[:, :s]
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None, None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
