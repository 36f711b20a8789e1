"""Pallas split-KV flash decoding (docs/ARCHITECTURE.md section 6).

Einsum legend: B batch, Tq new tokens, H query heads, K kv heads, G = H / K,
M = G * Tq query rows of one kv head, S cache length, L split length, D head
dim.

Decode reads the whole KV cache for a handful of queries, so it is bound by
memory bandwidth. The cache [B, S, K, D] is cut into splits of L keys; grid
(B, K, splits) runs them all in parallel. One program loads one split of one
kv head once and serves all M query rows of that head (GQA grouping: the G
query heads times the Tq new tokens), producing a partial result in float32:
row max m, row sum l and normalised output o. A log-sum-exp combine over the
splits (a few KB, in XLA) gives the exact softmax. Splits past a sequence's
length are skipped (and on TPU not even fetched: the block index is clamped
with the scalar-prefetched lengths). The split length is chosen from the
cache length. Reference: `orthros_jax.attention.decode_attention`, which
callers pass as `fallback` (it serves platforms without a kernel).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import dot_dtype
from pallas_kernels.common import lse_combine
from pallas_kernels.common import next_pow2
from pallas_kernels.common import normalize
from pallas_kernels.common import stable_max

# Triton launch settings of the GPU kernel and the largest split it takes:
# on an H200 (232,448 bytes of shared memory per block) a split of 512 keys
# fails to compile at head_dim 128 (294,912 bytes asked) and runs at 64;
# at 128 the split of 128 was the fastest that fits (benchmarks/pallas_fit.py,
# benchmarks/RESULTS.md "Accelerators").
GPU_COMPILER_PARAMS = {'num_warps': 4, 'num_stages': 2}
GPU_MAX_SPLIT_D64 = 512
GPU_MAX_SPLIT_D128 = 128
Array = jax.Array

__all__ = ['flash_decode', 'split_length']


def split_length(cache_len: int, max_split: int = 512) -> int:
  """Keys per split: a power of two, at most `max_split`, no larger than the
  cache needs (so short caches are not over-split or over-padded)."""
  return max(16, min(max_split, next_pow2(cache_len)))


def _partial(q, k, v, qpos, key_pos, key_pos_col, same_head=None, *, scale):
  """Partial softmax of one split.

  q [R, D], k/v [N, D], qpos [R, 1] (-1 for padding rows); key_pos [1, N] and
  key_pos_col [N, 1] the keys' absolute positions; same_head [R, N] bool or
  None (rows and keys of one kv head). Returns (o [R, D] normalised,
  m [R, 1], l [R, 1]) in float32.
  """
  f32 = jnp.float32
  # bf16 / f16 inputs stay in their dtype for the dots (tensor-core / MXU
  # rate) with float32 accumulation; float32 inputs keep the float32 path.
  dt = dot_dtype(q, k, v)
  q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
  seen = key_pos <= qpos  # causal over the cache; qpos < lengths
  if same_head is not None:
    seen = seen & same_head
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=f32) * scale
  s = jnp.where(seen, s, -jnp.inf)
  m = jnp.max(s, axis=1, keepdims=True)
  p = jnp.where(seen, jnp.exp(s - stable_max(m)), 0.0)
  l = jnp.sum(p, axis=1, keepdims=True)
  # Keys no query sees may be garbage (a partial last block reads past the
  # cache end, possibly NaN): zero them before p @ v, as 0 * NaN is NaN.
  # (zeroed in float32 and cast back: no select on packed 16-bit rows)
  v = jnp.where(key_pos_col <= jnp.max(qpos), v.astype(f32), 0.0).astype(dt)
  # p in [0, 1] rounded to the input dtype, as flash attention does.
  o = jnp.dot(p.astype(dt), v, preferred_element_type=f32)
  return normalize(o, l), m, l


def _tpu_call(lengths, q, qpos, k_cache, v_cache, *, split, scale, interpret):
  """TPU tiling wants whole trailing dims, so a program takes one split of
  every kv head: the cache viewed as [B, S * K, D] (a free reshape) gives a
  block of split * K rows, and all K * M query rows attend to it with a
  same-head mask (K times the FLOPs of one head, irrelevant next to the
  bytes streamed)."""
  b, kh, m, d = q.shape
  s = k_cache.shape[1]
  n_split = -(-s // split)
  rows = kh * m
  q = q.reshape(b, rows, d)
  qpos = qpos.reshape(b, rows, 1)
  q_head = jnp.repeat(jnp.arange(kh, dtype=jnp.int32), m)[:, None]  # [R, 1]
  key_head = jnp.tile(jnp.arange(kh, dtype=jnp.int32), split)[None, :]
  key_off = jnp.repeat(jnp.arange(split, dtype=jnp.int32), kh)[None, :]
  key_off_col = key_off.reshape(-1, 1)
  k_rows = k_cache.reshape(b, s * kh, d)
  v_rows = v_cache.reshape(b, s * kh, d)

  def kernel(len_ref, q_ref, pos_ref, qh_ref, kh_ref, ko_ref, koc_ref, k_ref,
             v_ref, o_ref, m_ref, l_ref):
    start = pl.program_id(1) * split

    @pl.when(start < len_ref[pl.program_id(0)])
    def _():
      same = qh_ref[...] == kh_ref[...]
      o, mx, l = _partial(q_ref[...], k_ref[...], v_ref[...], pos_ref[...],
                          start + ko_ref[...], start + koc_ref[...], same,
                          scale=scale)
      o_ref[...], m_ref[...], l_ref[...] = o, mx, l

    @pl.when(start >= len_ref[pl.program_id(0)])
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
      m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
      l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

  def kv_index(i, c, len_ref):
    last = jax.lax.div(jnp.maximum(len_ref[i] - 1, 0), split)
    return i, jnp.minimum(c, last), 0  # skipped splits are not re-fetched

  fixed = lambda shape: pl.BlockSpec(shape, lambda i, c, _: (0, 0))
  per_b = lambda shape: pl.BlockSpec((None,) + shape, lambda i, c, _: (i, 0, 0))
  out = lambda w: pl.BlockSpec((None, None, rows, w),
                               lambda i, c, _: (i, c, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b, n_split),
      in_specs=[per_b((rows, d)), per_b((rows, 1)), fixed((rows, 1)),
                fixed((1, split * kh)), fixed((1, split * kh)),
                fixed((split * kh, 1)),
                pl.BlockSpec((None, split * kh, d), kv_index),
                pl.BlockSpec((None, split * kh, d), kv_index)],
      out_specs=[out(d), out(1), out(1)])
  o, mx, l = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, n_split, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, n_split, rows, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, n_split, rows, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel')),
      interpret=interpret, name='orthros_flash_decode',
  )(lengths, q, qpos, q_head, key_head, key_off, key_off_col, k_rows, v_rows)
  # -> [B, K, n, M, X] like the GPU kernel.
  regroup = lambda x: jnp.swapaxes(x.reshape(b, n_split, kh, m, -1), 1, 2)
  return regroup(o), regroup(mx), regroup(l)


def _gpu_call(lengths, q, qpos, k_cache, v_cache, *, split, scale, interpret):
  b, kh, m, d = q.shape
  s = k_cache.shape[1]
  n_split = -(-s // split)
  len_rows = jnp.broadcast_to(lengths[:, None], (b, 16))

  def kernel(len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, m_ref, l_ref):
    start = pl.program_id(2) * split
    needed = start < len_ref[0]

    @pl.when(needed)
    def _():
      key_pos = start + jax.lax.broadcasted_iota(jnp.int32, (1, split), 1)
      key_col = start + jax.lax.broadcasted_iota(jnp.int32, (split, 1), 0)
      # The last split may extend past the cache: Triton does not bound
      # block loads, so mask them (no read outside the buffer).
      inside = jnp.broadcast_to(key_col < s, (split, d))
      load = lambda ref: pltr.load(ref, mask=inside, other=0.0)
      o, mx, l = _partial(q_ref[...], load(k_ref),
                          load(v_ref), pos_ref[...], key_pos, key_col,
                          scale=scale)
      o_ref[...], m_ref[...], l_ref[...] = o, mx, l

    @pl.when(jnp.logical_not(needed))
    def _():  # past this sequence's length: no loads, an empty partial
      o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
      m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
      l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

  out_index = lambda i, j, c: (i, j, c, 0, 0)
  return pl.pallas_call(
      kernel, grid=(b, kh, n_split),
      in_specs=[pl.BlockSpec((None, 16), lambda i, j, c: (i, 0)),
                pl.BlockSpec((None, None, m, d), lambda i, j, c: (i, j, 0, 0)),
                pl.BlockSpec((None, None, m, 1), lambda i, j, c: (i, j, 0, 0)),
                pl.BlockSpec((None, split, None, d),
                             lambda i, j, c: (i, c, j, 0)),
                pl.BlockSpec((None, split, None, d),
                             lambda i, j, c: (i, c, j, 0))],
      out_specs=[pl.BlockSpec((None, None, None, m, d), out_index),
                 pl.BlockSpec((None, None, None, m, 1), out_index),
                 pl.BlockSpec((None, None, None, m, 1), out_index)],
      out_shape=[jax.ShapeDtypeStruct((b, kh, n_split, m, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, n_split, m, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, n_split, m, 1), jnp.float32)],
      compiler_params=pltr.CompilerParams(**GPU_COMPILER_PARAMS),
      interpret=interpret, name='orthros_flash_decode',
  )(len_rows, q, qpos, k_cache, v_cache)


def _kernel(q, k_cache, v_cache, lengths, *, interpret, platform, max_split):
  b, tq, h, d = q.shape
  s, kh = k_cache.shape[1], k_cache.shape[2]
  g = h // kh
  m = g * tq
  gpu = platform == 'gpu'
  # Query rows per kv head, ordered (token, group): row r is token r // G.
  m_pad = max(16, next_pow2(m)) if gpu else -(-m // 8) * 8
  d_pad = next_pow2(d) if gpu else d
  if d_pad != d:
    raise ValueError(f'flash_decode on GPU needs a power-of-two head_dim; got '
                     f'{d}')
  rows = jnp.swapaxes(q.reshape(b, tq, kh, g, d), 1, 2).reshape(b, kh, m, d)
  rows = jnp.pad(rows, [(0, 0), (0, 0), (0, m_pad - m), (0, 0)])
  tok = jnp.arange(m_pad) // g
  qpos = lengths[:, None] - tq + tok[None, :]
  qpos = jnp.where(tok[None, :] < tq, qpos, -1)  # padded rows see nothing
  qpos = jnp.broadcast_to(qpos[:, None, :, None], (b, kh, m_pad, 1))
  call = _gpu_call if gpu else _tpu_call
  if gpu:  # shared memory per block grows with split x head_dim
    max_split = min(max_split, GPU_MAX_SPLIT_D64 if d_pad <= 64
                    else GPU_MAX_SPLIT_D128)
  o, mx, l = call(lengths, rows, qpos.astype(jnp.int32), k_cache, v_cache,
                  split=split_length(s, max_split), scale=1.0 / d ** 0.5,
                  interpret=interpret)
  out = lse_combine(o, mx, l, axis=2)[:, :, :m]  # [B, K, M, D]
  out = jnp.swapaxes(out.reshape(b, kh, tq, g, d), 1, 2).reshape(b, tq, h, d)
  return out.astype(q.dtype)


def flash_decode(q: Array, k_cache: Array, v_cache: Array, lengths: Array, *,
                 interpret: bool = False, platform: str | None = None,
                 max_split: int = 512,
                 fallback: Callable | None = None) -> Array:
  """Exact attention of Tq new tokens over the cache; same arguments and
  output as `orthros_jax.attention.decode_attention`.

  interpret: run the kernel body in the Pallas interpreter (CPU tests).
  platform: None picks the kernel when lowering ('tpu' on TPU, 'gpu' on
    CUDA/ROCm, `fallback` elsewhere); 'tpu'/'gpu' forces one.
  max_split: upper bound on keys per split (a power of two).
  fallback: the XLA reference with decode_attention's signature
    (`orthros_jax.attention.decode_attention`), for platforms without a
    kernel and GPU head dims that are not a power of two. Without it, an
    unforced call takes the kernel of `jax.default_backend()` (lowering for
    that platform only) and is a ValueError where there is none.
  """
  if q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
    raise ValueError(f'expected q [B,Tq,H,D], caches [B,S,K,D]; got '
                     f'{q.shape}, {k_cache.shape}, {v_cache.shape}')
  if q.shape[2] % k_cache.shape[2] or q.shape[3] != k_cache.shape[3]:
    raise ValueError(f'q {q.shape} and cache {k_cache.shape} disagree on '
                     'heads or head_dim')
  if platform not in (None, 'tpu', 'gpu'):
    raise ValueError(f"platform={platform!r}: expected None, 'tpu' or 'gpu'")
  lengths = jnp.asarray(lengths, jnp.int32)
  run = functools.partial(_kernel, interpret=interpret, max_split=max_split)
  if platform is not None:
    return run(q, k_cache, v_cache, lengths, platform=platform)
  if fallback is None:  # the kernel of this backend, or a clear error
    backend = jax.default_backend()
    if backend not in ('tpu', 'gpu'):
      raise ValueError(
          f'flash_decode has no kernel for {backend!r} and no XLA reference '
          'was given: pass fallback=orthros_jax.attention.decode_attention '
          '(or call through orthros_jax.attention.dispatch)')
    return run(q, k_cache, v_cache, lengths, platform=backend)
  reference = fallback
  # Every branch is traced, so one the GPU schedule cannot take (a head_dim
  # that is not a power of two) must not be built: XLA serves GPUs then.
  gpu = (functools.partial(run, platform='gpu')
         if next_pow2(q.shape[3]) == q.shape[3] else reference)
  return jax.lax.platform_dependent(
      q, k_cache, v_cache, lengths,
      tpu=functools.partial(run, platform='tpu'), cuda=gpu, rocm=gpu,
      default=reference)
