"""Pallas kernel for the Orthros prefill (docs/ARCHITECTURE.md sections 3 and 6).

Einsum legend: B batch, N tokens (prefix + new), C chunk, S keys of a chunk's
block = (nb + 1) * C, H query heads, K kv heads, G = H / K, D head dim,
F feature dim.

The math is that of `orthros_jax.attention.orthros_prefill` (the XLA
reference, which callers pass as `fallback`):
per chunk of C queries, exact window softmax (weighted by gamma) and linear
terms over the chunk's key block (the chunk and the nb chunks before it,
nb * C >= W - 1), plus the carried float32 state (S [F, D], z [F]) of every
key before the block; then the block's oldest chunk is folded into the state.

Three launch schedules share `_chunk_output` (a chunk's window softmax and
linear terms against the state of every key before its block) and `_fold`:
- TPU (Mosaic), platform 'tpu': grid (B, H, chunks); the chunk axis is
  sequential ('arbitrary'), the state lives in VMEM scratch across grid
  steps, and each step's key block arrives as nb + 1 pipelined chunk-sized
  blocks, so any N fits in VMEM.
- GPU (Triton), platform 'gpu', what a GPU lowers to: chunk-parallel, as
  flash-linear-attention's chunked kernels. Pass 1, grid (B, H, key
  chunks): each chunk's own (S, z) contribution; pass 2 (XLA): an exclusive
  prefix sum over the chunks; pass 3, grid (B, H, query chunks): each
  chunk's output against its key block and its prefix state. One prompt of
  a 9-head model launches 9 x chunks programs instead of 9.
- GPU (Triton), platform 'gpu_sequential': grid (B, H); one program loops
  over the chunks of its sequence with `fori_loop`, keeping the state in
  registers (the earlier GPU schedule, kept for comparison).
Triton needs power-of-two block sizes, so on GPU D, F and the block are
padded (zero features change nothing).
Per-example masks are two scalars: keys are valid from padded index `lo`
(front padding and a history shorter than the window are invalid) and fold
into the state below `hi` (older than the last valid token's window). The
platform's variant is chosen at lowering time with
`jax.lax.platform_dependent`, so one jitted function lowers for either.

Backward: `jax.custom_vjp` whose backward pass recomputes through the XLA
reference (`jax.vjp` of `fallback`, orthros_prefill): no extra residuals are
saved by the forward kernel; the backward costs one reference forward plus
its VJP, with the reference's O(N * S) per-head memory for the scan
residuals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import LinearState
from pallas_kernels.common import WindowPrefix
from pallas_kernels.common import dot_dtype
from pallas_kernels.common import next_pow2
from pallas_kernels.common import normalize
from pallas_kernels.common import stable_max
from pallas_kernels.common import zero_state

# Triton launch settings of the GPU kernel. num_stages 1: with 2, the
# recipes' shapes (F = 128 features, chunk 64) ask for more shared memory
# than an H200 has per block (245,760 of 232,448 bytes at head_dim 64,
# 327,680 at 128); with 1 every chunk of 16-64 fits at head_dim 64 and 128
# (benchmarks/pallas_fit.py, benchmarks/RESULTS.md "Accelerators").
GPU_COMPILER_PARAMS = {'num_warps': 4, 'num_stages': 1}
Array = jax.Array

__all__ = ['linear_prefill']


def _chunk_output(q, kb, vb, phiq, phikb, s_state, z_state, *, gamma, lo,
                  key_start, window, nb, chunk, scale):
  """One chunk's output. q [C, D], kb/vb [S, D], phiq [C, F], phikb [S, F],
  s_state [F, D], z_state [1, F] (every key before the block); key_start =
  padded index of kb[0]. Returns y [C, D] (float32)."""
  f32 = jnp.float32
  # bf16 / f16 q, k, v stay in their dtype for the dots (tensor-core / MXU
  # rate) with float32 accumulation; feature maps, the state (S, z) and the
  # softmax statistics stay float32; float32 inputs keep the float32 path.
  dt = dot_dtype(q, kb, vb)
  q, kb, vb = q.astype(dt), kb.astype(dt), vb.astype(dt)
  s_len = kb.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, (chunk, s_len), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (chunk, s_len), 1)
  dist = nb * chunk + row - col
  key_idx = key_start + col
  valid = key_idx >= lo
  in_window = (dist >= 0) & (dist < window) & valid
  older = (dist >= window) & valid
  scores = jax.lax.dot_general(q, kb, (((1,), (1,)), ((), ())),
                               preferred_element_type=f32) * scale
  scores = jnp.where(in_window, scores, -jnp.inf)
  m = stable_max(jnp.max(scores, axis=1, keepdims=True))
  w = jnp.where(in_window, gamma * jnp.exp(scores - m), 0.0)
  lin = jax.lax.dot_general(phiq, phikb, (((1,), (1,)), ((), ())),
                            preferred_element_type=f32)
  w = w + jnp.where(older, lin, 0.0)
  # The window and older-key weights are rounded to the input dtype for
  # w @ v (flash attention's p @ v); the state product stays float32.
  num = jnp.dot(w.astype(dt), vb, preferred_element_type=f32) + jnp.dot(
      phiq, s_state, preferred_element_type=f32)
  den = jnp.sum(w, axis=1, keepdims=True) + jnp.sum(
      phiq * z_state, axis=1, keepdims=True)
  return normalize(num, den)


def _chunk_update(q, kb, vb, phiq, phikb, s_state, z_state, v_old, phik_old,
                  *, gamma, lo, hi, key_start, window, nb, chunk, scale):
  """One chunk of a sequential schedule: `_chunk_output`, then the block's
  oldest chunk (v_old [C, D], phik_old [C, F]: its first C keys, passed
  separately because Triton cannot slice values) folded into the state.
  Returns y [C, D] and the state after the fold."""
  y = _chunk_output(q, kb, vb, phiq, phikb, s_state, z_state, gamma=gamma,
                    lo=lo, key_start=key_start, window=window, nb=nb,
                    chunk=chunk, scale=scale)
  s_state, z_state = _fold(s_state, z_state, phik_old, v_old, key_start, lo,
                           hi)
  return y, s_state, z_state


def _fold(s_state, z_state, phik, v, key_start, lo, hi):
  """Adds the keys phik [n, F], v [n, D] at padded indices key_start + i that
  satisfy lo <= index < hi."""
  n = phik.shape[0]
  idx = key_start + jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
  phik = jnp.where((idx >= lo) & (idx < hi), phik, 0.0)
  s_state = s_state + jax.lax.dot_general(
      phik, v.astype(jnp.float32), (((0,), (0,)), ((), ())),
      preferred_element_type=jnp.float32)
  z_state = z_state + jnp.sum(phik, axis=0, keepdims=True)
  return s_state, z_state


# ----------------------------------------------------------------- TPU


def _tpu_call(scalars, gamma, q, k, v, phiq, phik, s0, z0, *, window, nb,
              chunk, groups, scale, interpret):
  b, h, n, d = q.shape
  f = phiq.shape[-1]
  num_chunks = n // chunk
  nblk = nb + 1

  def kernel(sc_ref, g_ref, q_ref, pq_ref, s0_ref, z0_ref, *refs):
    k_refs, v_refs, pk_refs = refs[:nblk], refs[nblk:2 * nblk], refs[
        2 * nblk:3 * nblk]
    y_ref, s_ref, z_ref, s_scr, z_scr = refs[3 * nblk:]
    bi, hi_, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = sc_ref[bi, 0], sc_ref[bi, 1]

    @pl.when(c == 0)
    def _():
      s_scr[...] = s0_ref[...]
      z_scr[...] = z0_ref[...]

    # Blocks are joined in float32 and cast back (exact) where Mosaic's
    # packed 16-bit rows tile (chunk % 16 == 0); otherwise the dots stay in
    # float32 (q is cast to match below).
    packed = chunk % 16 == 0
    cat = lambda rs: jnp.concatenate(
        [r[...].astype(jnp.float32) for r in rs], axis=0).astype(
            rs[0].dtype if packed else jnp.float32)
    kb, vb, phikb = cat(k_refs), cat(v_refs), cat(pk_refs)
    key_start = c * chunk
    y, s_new, z_new = _chunk_update(
        q_ref[...] if packed else q_ref[...].astype(jnp.float32), kb, vb,
        pq_ref[...], phikb, s_scr[...], z_scr[...],
        v_refs[0][...] if packed else v_refs[0][...].astype(jnp.float32),
        pk_refs[0][...], gamma=g_ref[hi_], lo=lo, hi=hi,
        key_start=key_start, window=window, nb=nb, chunk=chunk, scale=scale)
    y_ref[...] = y.astype(y_ref.dtype)
    s_scr[...] = s_new
    z_scr[...] = z_new

    @pl.when(c == num_chunks - 1)
    def _():
      s_fin, z_fin = s_new, z_new
      if nb:  # the last nb chunks never left a block
        s_fin, z_fin = _fold(s_fin, z_fin, cat(pk_refs[1:]), cat(v_refs[1:]),
                             key_start + chunk, lo, hi)
      s_ref[...] = s_fin
      z_ref[...] = z_fin

  q_spec = pl.BlockSpec((None, None, chunk, d), lambda i, j, c, *_: (i, j, c, 0))
  pq_spec = pl.BlockSpec((None, None, chunk, f),
                         lambda i, j, c, *_: (i, j, c, 0))
  state_spec = pl.BlockSpec((None, None, f, d), lambda i, j, c, *_: (i, j, 0, 0))
  z_spec = pl.BlockSpec((None, None, 1, f), lambda i, j, c, *_: (i, j, 0, 0))
  kv_specs = [pl.BlockSpec((None, None, chunk, d),
                           lambda i, j, c, *_, o=o: (i, jax.lax.div(j, groups), c + o,
                                                      0))
              for o in range(nblk)]
  pk_specs = [pl.BlockSpec((None, None, chunk, f),
                           lambda i, j, c, *_, o=o: (i, j, c + o, 0))
              for o in range(nblk)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b, h, num_chunks),
      in_specs=[q_spec, pq_spec, state_spec, z_spec] + kv_specs + kv_specs +
      pk_specs,
      out_specs=[q_spec, state_spec, z_spec],
      scratch_shapes=[pltpu.VMEM((f, d), jnp.float32),
                      pltpu.VMEM((1, f), jnp.float32)])
  return pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(s0.shape, jnp.float32),
                 jax.ShapeDtypeStruct(z0.shape, jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      interpret=interpret, name='orthros_linear_prefill',
  )(scalars, gamma, q, phiq, s0, z0, *([k] * nblk), *([v] * nblk),
    *([phik] * nblk))


# ----------------------------------------------------------------- GPU


def _gpu_call(scalars, gamma, q, k, v, phiq, phik, s0, z0, *, window, nb,
              chunk, groups, scale, interpret):
  b, h, n, d = q.shape
  f = phiq.shape[-1]
  nk = k.shape[2]
  num_chunks = n // chunk
  s_len = (nb + 1) * chunk
  # Scalars as small power-of-two rows: [B, 16] int32 and [H, 16] float32.
  sc_rows = jnp.zeros((b, 16), jnp.int32).at[:, :2].set(scalars)
  g_rows = jnp.broadcast_to(gamma[:, None], (h, 16))

  def kernel(sc_ref, g_ref, q_ref, k_ref, v_ref, pq_ref, pk_ref, s0_ref,
             z0_ref, y_ref, s_ref, z_ref):
    lo, hi = sc_ref[0], sc_ref[1]
    gamma_h = g_ref[0]

    def body(c, state):
      s_state, z_state = state
      start = pl.multiple_of(c * chunk, chunk)
      rows = pl.ds(start, chunk)   # this chunk's queries
      block = pl.ds(start, s_len)  # its key block (padded coordinates)
      oldest = pl.ds(start, chunk)  # the block's first chunk, folded after
      y, s_state, z_state = _chunk_update(
          q_ref[rows, :], k_ref[block, :], v_ref[block, :], pq_ref[rows, :],
          pk_ref[block, :], s_state, z_state,
          v_ref[oldest, :], pk_ref[oldest, :],
          gamma=gamma_h, lo=lo, hi=hi,
          key_start=start, window=window, nb=nb, chunk=chunk, scale=scale)
      y_ref[rows, :] = y.astype(y_ref.dtype)
      return s_state, z_state

    s_state, z_state = jax.lax.fori_loop(0, num_chunks, body,
                                         (s0_ref[...], z0_ref[...]))
    for o in range(nb):  # the last nb chunks never left a block; one chunk
      start = (num_chunks + o) * chunk  # at a time keeps loads power-of-two
      tail = pl.ds(start, chunk)
      s_state, z_state = _fold(s_state, z_state, pk_ref[tail, :],
                               v_ref[tail, :].astype(jnp.float32), start, lo,
                               hi)
    s_ref[...] = s_state
    z_ref[...] = z_state

  spec = lambda rows, cols, head: pl.BlockSpec((None, None, rows, cols), head)
  per_head = lambda i, j: (i, j, 0, 0)
  per_kv_head = lambda i, j: (i, jax.lax.div(j, groups), 0, 0)
  return pl.pallas_call(
      kernel, grid=(b, h),
      in_specs=[pl.BlockSpec((None, 16), lambda i, j: (i, 0)),
                pl.BlockSpec((None, 16), lambda i, j: (j, 0)),
                spec(n, d, per_head), spec(nk, d, per_kv_head),
                spec(nk, d, per_kv_head), spec(n, f, per_head),
                spec(nk, f, per_head), spec(f, d, per_head),
                spec(1, f, per_head)],
      out_specs=[spec(n, d, per_head), spec(f, d, per_head),
                 spec(1, f, per_head)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(s0.shape, jnp.float32),
                 jax.ShapeDtypeStruct(z0.shape, jnp.float32)],
      compiler_params=pltr.CompilerParams(**GPU_COMPILER_PARAMS),
      interpret=interpret, name='orthros_linear_prefill',
  )(sc_rows, g_rows, q, k, v, phiq, phik, s0, z0)


def _gpu_chunks_call(scalars, gamma, q, k, v, phiq, phik, s0, z0, *, window,
                     nb, chunk, groups, scale, interpret):
  """The chunk-parallel GPU schedule (flash-linear-attention's passes):
  1. every key chunk's contribution to (S, z), grid (B, H, key chunks);
  2. an exclusive prefix sum over the chunks (XLA): the state each query
     chunk starts from, and the final state;
  3. every query chunk's output against its key block and its state, grid
     (B, H, query chunks).
  The chunk states are held in float32 ([B, H, chunks, F, D]) between the
  passes; the sums run in another order than the sequential loop's, so the
  results agree to float32 rounding."""
  b, h, n, d = q.shape
  f = phiq.shape[-1]
  nk = k.shape[2]
  num_chunks = n // chunk
  key_chunks = nk // chunk  # nb front chunks + num_chunks
  s_len = (nb + 1) * chunk
  f32 = jnp.float32
  sc_rows = jnp.zeros((b, 16), jnp.int32).at[:, :2].set(scalars)
  g_rows = jnp.broadcast_to(gamma[:, None], (h, 16))
  params = pltr.CompilerParams(**GPU_COMPILER_PARAMS)
  per_batch = pl.BlockSpec((None, 16), lambda i, j, c: (i, 0))
  per_chunk = lambda width, head: pl.BlockSpec(
      (None, None, chunk, width), lambda i, j, c: (i, head(j), c, 0))
  per_chunk_state = (
      pl.BlockSpec((None, None, None, f, d), lambda i, j, c: (i, j, c, 0, 0)),
      pl.BlockSpec((None, None, None, 1, f), lambda i, j, c: (i, j, c, 0, 0)))
  query_head = lambda j: j
  kv_head = lambda j: jax.lax.div(j, groups)

  def state_kernel(sc_ref, pk_ref, v_ref, ds_ref, dz_ref):
    lo, hi = sc_ref[0], sc_ref[1]
    start = pl.program_id(2) * chunk
    ds, dz = _fold(jnp.zeros((f, d), f32), jnp.zeros((1, f), f32),
                   pk_ref[...], v_ref[...].astype(f32), start, lo, hi)
    ds_ref[...] = ds
    dz_ref[...] = dz

  ds, dz = pl.pallas_call(
      state_kernel, grid=(b, h, key_chunks),
      in_specs=[per_batch, per_chunk(f, query_head), per_chunk(d, kv_head)],
      out_specs=list(per_chunk_state),
      out_shape=[jax.ShapeDtypeStruct((b, h, key_chunks, f, d), f32),
                 jax.ShapeDtypeStruct((b, h, key_chunks, 1, f), f32)],
      compiler_params=params, interpret=interpret,
      name='orthros_linear_prefill_states',
  )(sc_rows, phik, v)

  # Query chunk c starts from s0 plus key chunks 0 .. c - 1 (padded key
  # coordinates: its block begins at key chunk c); the final state adds
  # every key chunk.
  cs, cz = jnp.cumsum(ds, axis=2), jnp.cumsum(dz, axis=2)
  exclusive = lambda x: jnp.pad(x[:, :, :num_chunks - 1],
                                [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0)])
  s_before = s0[:, :, None] + exclusive(cs)
  z_before = z0[:, :, None] + exclusive(cz)

  def output_kernel(sc_ref, g_ref, q_ref, pq_ref, k_ref, v_ref, pk_ref, s_ref,
                    z_ref, y_ref):
    start = pl.multiple_of(pl.program_id(2) * chunk, chunk)
    block = pl.ds(start, s_len)  # this chunk's key block (padded coordinates)
    y = _chunk_output(
        q_ref[...], k_ref[block, :], v_ref[block, :], pq_ref[...],
        pk_ref[block, :], s_ref[...], z_ref[...], gamma=g_ref[0],
        lo=sc_ref[0], key_start=start, window=window, nb=nb, chunk=chunk,
        scale=scale)
    y_ref[...] = y.astype(y_ref.dtype)

  whole = lambda width, head: pl.BlockSpec(
      (None, None, nk, width), lambda i, j, c: (i, head(j), 0, 0))
  y = pl.pallas_call(
      output_kernel, grid=(b, h, num_chunks),
      in_specs=[per_batch, pl.BlockSpec((None, 16), lambda i, j, c: (j, 0)),
                per_chunk(d, query_head), per_chunk(f, query_head),
                whole(d, kv_head), whole(d, kv_head), whole(f, query_head),
                *per_chunk_state],
      out_specs=per_chunk(d, query_head),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=interpret,
      name='orthros_linear_prefill',
  )(sc_rows, g_rows, q, phiq, k, v, phik, s_before, z_before)
  return y, s0 + cs[:, :, -1], z0 + cz[:, :, -1]


# ----------------------------------------------------------------- wrapper


def _layout(q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix, *,
            window, chunk, nb, pad_dims):
  """Builds the padded head-major operands and the per-example scalars."""
  b, t, h, d = q.shape
  f = phi_q.shape[-1]
  lengths = (jnp.full((b,), t, jnp.int32) if lengths is None
             else jnp.asarray(lengths, jnp.int32))
  p = 0 if prefix is None else prefix.k.shape[1]
  if prefix is not None:
    # The kernel assumes the valid prefix entries are the last ones (a
    # history shorter than P is left-padded), as the model builds it.
    n_valid = jnp.sum(prefix.valid.astype(jnp.int32), axis=1)
    q = jnp.concatenate([jnp.zeros((b, p, h, d), q.dtype), q], axis=1)
    phi_q = jnp.concatenate([jnp.zeros((b, p, h, f), phi_q.dtype), phi_q], 1)
    k = jnp.concatenate([prefix.k.astype(k.dtype), k], axis=1)
    v = jnp.concatenate([prefix.v.astype(v.dtype), v], axis=1)
    phi_k = jnp.concatenate([prefix.phi_k.astype(phi_k.dtype), phi_k], axis=1)
  else:
    n_valid = jnp.zeros((b,), jnp.int32)
  n = p + t
  # Zero every key that does not exist (invalid prefix entries, padding past
  # the length): their weights are 0, but 0 * NaN garbage would be NaN.
  exists = jnp.arange(n)[None, :] < (p + lengths)[:, None]
  if prefix is not None:
    exists = exists & jnp.concatenate(
        [prefix.valid.astype(bool), jnp.ones((b, t), bool)], axis=1)
  zero = lambda x: jnp.where(exists[:, :, None, None], x, jnp.zeros((), x.dtype))
  k, v, phi_k = zero(k), zero(v), zero(phi_k)
  n_pad = -(-n // chunk) * chunk
  front = nb * chunk
  lo = front + p - n_valid
  hi = front + p + lengths - window
  scalars = jnp.stack([lo, hi], axis=1).astype(jnp.int32)  # [B, 2]
  d_pad = next_pow2(d) if pad_dims else d
  f_pad = next_pow2(f) if pad_dims else f

  def arrange(x, width, front_pad):  # [B, N, X, W] -> [B, X, front+Np, W']
    x = jnp.pad(x, [(0, 0), (front_pad, n_pad - n), (0, 0), (0, width -
                                                             x.shape[-1])])
    return jnp.swapaxes(x, 1, 2)

  ops = dict(
      q=arrange(q, d_pad, 0), phiq=arrange(phi_q.astype(jnp.float32), f_pad, 0),
      k=arrange(k, d_pad, front), v=arrange(v, d_pad, front),
      phik=arrange(phi_k.astype(jnp.float32), f_pad, front))
  state = initial_state or zero_state(b, h, f, d)
  ops['s0'] = jnp.pad(state.S.astype(jnp.float32),
                      [(0, 0), (0, 0), (0, f_pad - f), (0, d_pad - d)])
  ops['z0'] = jnp.pad(state.z.astype(jnp.float32),
                      [(0, 0), (0, 0), (0, f_pad - f)])[:, :, None, :]
  return scalars, gamma.astype(jnp.float32), ops, (b, t, h, d, f, p, n)


def _kernel_forward(q, k, v, phi_q, phi_k, gamma, lengths, initial_state,
                    prefix, *, window, chunk_size, interpret, platform):
  b, t, h, d = q.shape
  groups = h // k.shape[2]
  scale = 1.0 / float(d) ** 0.5
  n = t + (0 if prefix is None else prefix.k.shape[1])
  num_chunks = -(-n // chunk_size)
  nb = -(-(window - 1) // chunk_size) if window > 1 else 0
  nb = min(nb, num_chunks - 1)
  gpu = platform in ('gpu', 'gpu_sequential')
  if gpu:  # Triton: the key block (nb + 1) * C must be a power of two.
    nb = next_pow2(nb + 1) - 1
  scalars, gamma32, ops, dims = _layout(
      q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix,
      window=window, chunk=chunk_size, nb=nb, pad_dims=gpu)
  call = SCHEDULES[platform]
  y, s, z = call(scalars, gamma32, ops['q'], ops['k'], ops['v'], ops['phiq'],
                 ops['phik'], ops['s0'], ops['z0'], window=window, nb=nb,
                 chunk=chunk_size, groups=groups, scale=scale,
                 interpret=interpret)
  _, t, h, d, f, p, n = dims
  y = jnp.swapaxes(y, 1, 2)[:, p:n, :, :d]
  return y, LinearState(s[:, :, :f, :d], z[:, :, 0, :f])


def _check_args(q, k, v, phi_q, phi_k, gamma, window, chunk_size):
  if window < 0 or chunk_size < 1:
    raise ValueError(f'window={window} must be >= 0 and chunk_size='
                     f'{chunk_size} >= 1')
  b, t, h, d = q.shape
  if (k.shape != (b, t, k.shape[2], d) or v.shape != k.shape
      or h % k.shape[2]):
    raise ValueError(f'shapes q {q.shape}, k {k.shape}, v {v.shape} do not '
                     'form [B,T,H,D], [B,T,K,D] with H % K == 0')
  if phi_q.shape[:3] != (b, t, h) or phi_k.shape != phi_q.shape:
    raise ValueError(f'phi_q {phi_q.shape} and phi_k {phi_k.shape} must both '
                     'be [B, T, H, F]')
  if gamma.shape != (h,):
    raise ValueError(f'gamma must be [H]={h}; got {gamma.shape}')


_PLATFORMS = {'tpu': 'tpu', 'gpu': 'gpu'}  # jax.default_backend() -> schedule
# platform= -> launch schedule: 'gpu' is the chunk-parallel one (what a GPU
# lowers to), 'gpu_sequential' the one-program-per-(batch, head) loop.
SCHEDULES = {'tpu': _tpu_call, 'gpu': _gpu_chunks_call,
             'gpu_sequential': _gpu_call}


def _no_fallback(what: str):
  def fail(*unused_args, **unused_kwargs):
    raise ValueError(
        f'linear_prefill {what} runs its XLA reference, and none was given: '
        'pass fallback=orthros_jax.attention.orthros_prefill (or call '
        'through orthros_jax.attention.dispatch, which does)')
  return fail


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13))
def _linear_prefill(q, k, v, phi_q, phi_k, gamma, lengths, initial_state,
                    prefix, window, chunk_size, interpret, platform,
                    fallback):
  if platform is not None:  # a forced schedule (tests, interpret mode)
    return _kernel_forward(q, k, v, phi_q, phi_k, gamma, lengths,
                           initial_state, prefix, window=window,
                           chunk_size=chunk_size, interpret=interpret,
                           platform=platform)
  args = (q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix)
  run = lambda plat: (lambda *a: _kernel_forward(
      *a, window=window, chunk_size=chunk_size, interpret=interpret,
      platform=plat))
  if fallback is None:  # the kernel of this backend, or a clear error
    plat = _PLATFORMS.get(jax.default_backend())
    if plat is None:
      _no_fallback(f'on {jax.default_backend()!r} (no kernel)')()
    return run(plat)(*args)
  ref = lambda *a: fallback(*a[:6], window=window, chunk_size=chunk_size,
                            lengths=a[6], initial_state=a[7], prefix=a[8])
  return jax.lax.platform_dependent(*args, tpu=run('tpu'), cuda=run('gpu'),
                                    rocm=run('gpu'), default=ref)


def _fwd(q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix, window,
         chunk_size, interpret, platform, fallback):
  out = _linear_prefill(q, k, v, phi_q, phi_k, gamma, lengths, initial_state,
                        prefix, window, chunk_size, interpret, platform,
                        fallback)
  return out, (q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix)


def _bwd(window, chunk_size, interpret, platform, fallback, residuals,
         cotangents):
  del interpret, platform
  q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix = residuals
  reference = fallback or _no_fallback("'s backward pass (a gradient)")
  f = lambda q, k, v, phi_q, phi_k, gamma, initial_state, prefix: reference(
      q, k, v, phi_q, phi_k, gamma, window=window, chunk_size=chunk_size,
      lengths=lengths, initial_state=initial_state, prefix=prefix)
  _, vjp = jax.vjp(f, q, k, v, phi_q, phi_k, gamma, initial_state, prefix)
  dq, dk, dv, dpq, dpk, dg, dstate, dprefix = vjp(cotangents)
  dlengths = None if lengths is None else jnp.zeros(
      lengths.shape, jax.dtypes.float0)
  return dq, dk, dv, dpq, dpk, dg, dlengths, dstate, dprefix


_linear_prefill.defvjp(_fwd, _bwd)


def linear_prefill(q: Array, k: Array, v: Array, phi_q: Array, phi_k: Array,
                   gamma: Array, *, window: int, chunk_size: int,
                   lengths: Array | None = None,
                   initial_state: LinearState | None = None,
                   prefix: WindowPrefix | None = None, interpret: bool = False,
                   platform: str | None = None,
                   fallback: Callable | None = None
                   ) -> tuple[Array, LinearState]:
  """The Orthros prefill as a Pallas kernel; same arguments and outputs as
  `orthros_jax.attention.orthros_prefill`.

  interpret: run the kernel body in the Pallas interpreter (CPU tests).
  platform: None picks the schedule when lowering ('tpu' on TPU, 'gpu' on
    CUDA/ROCm, `fallback` elsewhere); 'tpu', 'gpu' (chunk-parallel) or
    'gpu_sequential' forces one (with interpret=True each runs on CPU).
  fallback: the XLA reference with orthros_prefill's signature
    (`orthros_jax.attention.orthros_prefill`): what runs on a platform
    without a kernel, and what the backward pass differentiates. Without
    it, an unforced call takes the kernel of `jax.default_backend()` (so
    it lowers for that platform only) and is a ValueError where there is
    none; a gradient is a ValueError.
  chunk_size: a multiple of 8 on TPU and a power of two on GPU.
  """
  _check_args(q, k, v, phi_q, phi_k, gamma, window, chunk_size)
  if platform is not None and platform not in SCHEDULES:
    raise ValueError(f'platform={platform!r}: expected None or one of '
                     f'{tuple(SCHEDULES)}')
  if lengths is not None:
    lengths = jnp.asarray(lengths, jnp.int32)
  return _linear_prefill(q, k, v, phi_q, phi_k, gamma, lengths, initial_state,
                         prefix, window, chunk_size, interpret, platform,
                         fallback)
