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
memory is O(block^2) per head instead of O(T * S).
"""

from __future__ import annotations

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
                      block_size: int | None = None) -> Array:
  """Exact attention with GQA; queries aligned to the end of the keys.

  Args:
    q: [B, T, H, D] queries (RoPE applied).
    k, v: [B, S, K, D] keys and values, S >= T when causal; H % K == 0.
    causal: query i sits at position S - T + i and sees keys j <= S - T + i.
    block_size: None picks the naive path for small T * S and the blocked one
      otherwise; an int forces the blocked path with that block size.

  Returns:
    [B, T, H, D] in q.dtype.
  """
  _check_shapes(q, k, v)
  b, t = q.shape[:2]
  s = k.shape[1]
  q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (s - t), (b, t))
  kv_len = jnp.full((b,), s, jnp.int32)
  return _attend(q, k, v, q_pos, kv_len, causal=causal, block_size=block_size)


def decode_attention(q: Array, k_cache: Array, v_cache: Array, lengths: Array,
                     *, block_size: int | None = None) -> Array:
  """Exact attention of T_q new tokens over a padded KV cache.

  Args:
    q: [B, Tq, H, D] queries of the new tokens.
    k_cache, v_cache: [B, S_max, K, D]; entries at j >= lengths[b] are ignored.
    lengths: [B] int32, valid keys per example including the Tq new tokens,
      which are the last Tq of them: query i of example b is at position
      lengths[b] - Tq + i and sees keys j <= that position (causal inside the
      block of new tokens).
    block_size: as in `softmax_attention`.

  Returns:
    [B, Tq, H, D] in q.dtype.
  """
  _check_shapes(q, k_cache, v_cache)
  tq = q.shape[1]
  lengths = jnp.asarray(lengths, jnp.int32)
  q_pos = lengths[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)[None, :]
  return _attend(q, k_cache, v_cache, q_pos, lengths, causal=True,
                 block_size=block_size)


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
  scores = jnp.einsum('btkgd,bskd->bkgts', qg, k,
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
  b, t, h, d = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = h // kh
  bq, bk = min(block, t), min(block, s)
  # Pad to whole blocks; padded keys are masked by kv_len (< S), padded
  # queries are dropped at the end.
  qp = _pad_axis(q, 1, bq).reshape(b, -1, bq, kh, g, d)
  posp = _pad_axis(q_pos, 1, bq, value=-1).reshape(b, -1, bq)
  kp = _pad_axis(k, 1, bk).reshape(b, -1, bk, kh, d)
  vp = _pad_axis(v, 1, bk).reshape(b, -1, bk, kh, d)
  nk = kp.shape[1]
  k_blocks = jnp.moveaxis(kp, 1, 0)  # [nk, B, bk, K, D]
  v_blocks = jnp.moveaxis(vp, 1, 0)
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  max_len = jnp.max(kv_len)

  # Recompute each query block's inner loop in the backward pass instead of
  # storing its [bq, S] probabilities.
  @jax.checkpoint
  def one_query_block(args):
    qb, pos = args  # [B, bq, K, G, D], [B, bq]
    last_pos = jnp.max(pos)

    def visit(carry, xs):
      m, l, acc = carry
      start, kb, vb = xs
      needed = start < max_len
      if causal:
        needed = needed & (start <= last_pos)

      def compute(carry):
        m, l, acc = carry
        sc = jnp.einsum('bqkgd,bskd->bkgqs', qb, kb,
                        preferred_element_type=jnp.float32) * scale
        j = start + jnp.arange(bk, dtype=jnp.int32)
        mask = j[None, None, :] < kv_len[:, None, None]
        if causal:
          mask = mask & (j[None, None, :] <= pos[:, :, None])
        sc = jnp.where(mask[:, None, None], sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        m_safe = stable_max(m_new)
        p = jnp.exp(sc - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum(
            'bkgqs,bskd->bkgqd', p, _zero_invalid(vb, kv_len, start))
        return m_new, l, acc

      return jax.lax.cond(needed, compute, lambda c: c, carry), None

    init = (jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, d), jnp.float32))
    starts = jnp.arange(nk, dtype=jnp.int32) * bk
    (_, l, acc), _ = jax.lax.scan(visit, init, (starts, k_blocks, v_blocks))
    o = normalize(acc, l[..., None])
    return jnp.einsum('bkgqd->bqkgd', o)

  out = jax.lax.map(one_query_block,
                    (jnp.moveaxis(qp, 1, 0), jnp.moveaxis(posp, 1, 0)))
  out = jnp.moveaxis(out, 0, 1).reshape(b, -1, h, d)[:, :t]
  return out.astype(q.dtype)
