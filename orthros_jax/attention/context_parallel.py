"""Context parallelism: Orthros prefill and exact decode with the sequence
split over a mesh axis.

Prefill. The prompt's T tokens are cut into n contiguous shards, one per
device along `seq_axis` (T is padded to a multiple of n). Shard i needs two
things from the tokens before it, and both are cheap:
  - its window halo: the last W tokens of shard i-1 (K, V, phi(K)), passed
    along the axis with one `ppermute`; shard 0 uses the cache's own window
    prefix (a continued prefill) or nothing;
  - the linear state of every token older than that halo. The state is a
    sum, so each shard computes the sums of its own tokens split as (all but
    its last W, its last W); an `all_gather` of those [B, H, F, D] sums and
    a masked sum give shard i the exclusive prefix
        initial + prefix tokens + sum_{s < i-1} (head_s + tail_s) + head_{i-1}
    which is exact (only the summation order differs from one device).
Each shard then runs the ordinary single-device prefill (orthros_prefill or
the Pallas kernel) on its T/n tokens with that state and halo. The returned
state (tokens older than the last valid token's window) is each shard's
masked sum, `psum`med over the axis. Requires T/n >= W (a shard's halo comes
from one neighbour).

Decode. The KV cache stays split by position. Each shard computes, for its
slice of keys, the running max m, the softmax denominator l and the
unnormalised output o of the new queries; the shards combine them with the
log-sum-exp rule
    M = max_s m_s,  y = sum_s e^{m_s - M} o_s / sum_s e^{m_s - M} l_s
(a `pmax` and two `psum`s), which is exact softmax over the whole cache.

Both run inside `jax.shard_map` over the full mesh: batch over the batch
axes, heads over the head axes, sequence over `seq_axis`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from orthros_jax.attention.orthros import LinearState
from orthros_jax.attention.orthros import WindowPrefix
from orthros_jax.attention.orthros import fold_into_state
from orthros_jax.attention.orthros import orthros_prefill
from orthros_jax.attention.orthros import zero_state
from orthros_jax.attention.placement import check_divisible
from pallas_kernels.common import normalize
from pallas_kernels.common import stable_max
from pallas_kernels.common import zero_unwritten

Array = jax.Array
Axes = str | tuple[str, ...] | None


def prefill(q: Array, k: Array, v: Array, phi_q: Array, phi_k: Array,
            gamma: Array, *, window: int, chunk_size: int, mesh: Mesh,
            seq_axis: str, batch_axes: Axes = None, head_axes: Axes = None,
            lengths: Array | None = None,
            initial_state: LinearState | None = None,
            prefix: WindowPrefix | None = None,
            local_prefill: Callable = orthros_prefill
            ) -> tuple[Array, LinearState]:
  """`orthros_prefill` with the tokens split over `seq_axis` of `mesh`.

  Same arguments and results as `orthros_prefill` (see there), plus the mesh
  and its axes; `local_prefill` is the per-shard implementation (the XLA
  scan or the Pallas kernel, same signature).
  """
  b, t, h, d = q.shape
  kh, f = k.shape[2], phi_q.shape[-1]
  n = mesh.shape[seq_axis]
  check_divisible(mesh, batch_axes, head_axes, b, kh)
  tl = -(-t // n)
  if window > tl:
    raise ValueError(
        f'context-parallel prefill needs at least window={window} tokens per '
        f"shard, but {t} tokens over the '{seq_axis}' axis ({n} shards) give "
        f'{tl}; use fewer sequence shards or a longer prompt')
  tp = tl * n
  pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] *
                          (x.ndim - 2))
  q, k, v, phi_q, phi_k = map(pad, (q, k, v, phi_q, phi_k))
  lengths = (jnp.full((b,), t, jnp.int32) if lengths is None
             else jnp.asarray(lengths, jnp.int32))
  initial_state = initial_state or zero_state(b, h, f, d)
  if prefix is None and window > 0:
    prefix = WindowPrefix(jnp.zeros((b, window, kh, d), k.dtype),
                          jnp.zeros((b, window, kh, d), v.dtype),
                          jnp.zeros((b, window, h, f), phi_k.dtype),
                          jnp.zeros((b, window), bool))
  if prefix is not None and prefix.k.shape[1] != window:
    raise ValueError(f'prefix holds {prefix.k.shape[1]} tokens; '
                     f'context-parallel prefill wants window={window}')

  seq = P(batch_axes, seq_axis, head_axes, None)
  rep = P(batch_axes, None, head_axes, None)
  state_spec = LinearState(P(batch_axes, head_axes, None, None),
                           P(batch_axes, head_axes, None))
  prefix_spec = None if prefix is None else WindowPrefix(
      rep, rep, rep, P(batch_axes, None))
  local = functools.partial(_prefill_shard, window=window,
                            chunk_size=chunk_size, num_shards=n,
                            shard_len=tl, seq_axis=seq_axis,
                            local_prefill=local_prefill)
  y, state = jax.shard_map(
      local, mesh=mesh,
      in_specs=(seq, seq, seq, seq, seq, P(head_axes), P(batch_axes),
                state_spec, prefix_spec),
      out_specs=(seq, state_spec), check_vma=False)(
          q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix)
  return y[:, :t], state


def _masked_state(phi_k, v, mask, like: LinearState) -> LinearState:
  zero = LinearState(jnp.zeros_like(like.S), jnp.zeros_like(like.z))
  return fold_into_state(zero, phi_k, v, mask)


def _prefill_shard(q, k, v, phi_q, phi_k, gamma, lengths, initial_state,
                   prefix, *, window, chunk_size, num_shards, shard_len,
                   seq_axis, local_prefill):
  i = jax.lax.axis_index(seq_axis)
  tl = shard_len
  pos = i * tl + jnp.arange(tl)[None, :]                  # [1, Tl] absolute
  valid = pos < lengths[:, None]                          # [B, Tl]
  local_len = jnp.clip(lengths - i * tl, 0, tl)
  like = initial_state

  if window > 0:
    head = valid & (jnp.arange(tl)[None, :] < tl - window)
    tail = valid & (jnp.arange(tl)[None, :] >= tl - window)
    s_head = _masked_state(phi_k, v, head, like)
    s_tail = _masked_state(phi_k, v, tail, like)
    # Every shard's (head, tail) sums; shard i adds heads of s < i and
    # tails of s < i - 1 (shard i-1's tail is its halo, not yet in a state).
    heads = jax.lax.all_gather(s_head, seq_axis)           # [n, ...]
    tails = jax.lax.all_gather(s_tail, seq_axis)
    s_ids = jnp.arange(num_shards)
    w_head = (s_ids < i).astype(jnp.float32)
    w_tail = (s_ids < i - 1).astype(jnp.float32)
    mix = lambda a, w: jnp.tensordot(w, a, axes=1)
    prefix_state = _masked_state(prefix.phi_k, prefix.v, prefix.valid, like)
    after_first = (i >= 1).astype(jnp.float32)
    state_i = jax.tree.map(
        lambda s0, ps, hs, ts: s0 + after_first * ps + mix(hs, w_head) +
        mix(ts, w_tail), initial_state, prefix_state, heads, tails)
    # The halo: shard i-1's last W tokens, moved one step along the axis.
    perm = [(j, j + 1) for j in range(num_shards - 1)]
    send = (k[:, tl - window:], v[:, tl - window:], phi_k[:, tl - window:],
            valid[:, tl - window:])
    got = tuple(jax.lax.ppermute(x, seq_axis, perm) for x in send)
    first = i == 0
    halo = WindowPrefix(*(jnp.where(first, p, g) for p, g in zip(prefix, got)))
  else:
    sums = jax.lax.all_gather(_masked_state(phi_k, v, valid, like), seq_axis)
    w = (jnp.arange(num_shards) < i).astype(jnp.float32)
    state_i = jax.tree.map(lambda s0, ss: s0 + jnp.tensordot(w, ss, axes=1),
                           initial_state, sums)
    halo = None

  y, _ = local_prefill(q, k, v, phi_q, phi_k, gamma, window=window,
                       chunk_size=chunk_size, lengths=local_len,
                       initial_state=state_i, prefix=halo)
  # Final state: every token older than the last valid token's window.
  old = valid & (pos < (lengths - window)[:, None])
  final = _masked_state(phi_k, v, old, like)
  if window > 0:
    # Shard 0 also owns the prefix tokens (positions -W .. -1).
    p_old = prefix.valid & (jnp.arange(window)[None, :] < lengths[:, None])
    p_state = _masked_state(prefix.phi_k, prefix.v, p_old, like)
    final = jax.tree.map(lambda a, c: a + jnp.where(i == 0, c, 0.0), final,
                         p_state)
  final = jax.tree.map(lambda x: jax.lax.psum(x, seq_axis), final)
  final = jax.tree.map(jnp.add, initial_state, final)
  return y, final


def decode(q: Array, k_cache: Array, v_cache: Array, lengths: Array, *,
           mesh: Mesh, seq_axis: str, batch_axes: Axes = None,
           head_axes: Axes = None) -> Array:
  """`decode_attention` over a cache split by position along `seq_axis`.

  q: [B, Tq, H, D]; k_cache, v_cache: [B, S, K, D] with S divisible by the
  axis size; lengths: [B] valid keys including the Tq new tokens (query t
  sits at lengths - Tq + t). Returns [B, Tq, H, D] in q.dtype.
  """
  b, tq, h, d = q.shape
  s, kh = k_cache.shape[1], k_cache.shape[2]
  n = mesh.shape[seq_axis]
  check_divisible(mesh, batch_axes, head_axes, b, kh)
  if s % n:
    raise ValueError(f'cache length {s} is not divisible by the '
                     f"'{seq_axis}' mesh axis ({n})")
  local = functools.partial(_decode_shard, seq_axis=seq_axis, shard_len=s // n)
  cache_spec = P(batch_axes, seq_axis, head_axes, None)
  q_spec = P(batch_axes, None, head_axes, None)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(q_spec, cache_spec, cache_spec,
                                 P(batch_axes)),
                       out_specs=q_spec, check_vma=False)(
                           q, k_cache, v_cache, lengths)


def _decode_shard(q, k, v, lengths, *, seq_axis, shard_len):
  b, tq, h, d = q.shape
  kh = k.shape[2]
  g = h // kh
  i = jax.lax.axis_index(seq_axis)
  key_pos = i * shard_len + jnp.arange(shard_len)                   # [S]
  q_pos = lengths[:, None] - tq + jnp.arange(tq)[None, :]           # [B, Tq]
  mask = key_pos[None, None, :] <= q_pos[:, :, None]                # [B,Tq,S]
  qf = q.astype(jnp.float32).reshape(b, tq, kh, g, d)
  scores = jnp.einsum('btkgd,bskd->bkgts', qf, k.astype(jnp.float32))
  scores = scores / jnp.sqrt(jnp.float32(d))
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  # One stabiliser for every shard: the max over the whole cache.
  m_all = stable_max(jax.lax.pmax(jnp.max(scores, axis=-1), seq_axis))
  p = jnp.exp(scores - m_all[..., None])                            # 0 if masked
  l = jax.lax.psum(jnp.sum(p, axis=-1), seq_axis)
  # Values past the cache length are zeroed as in every other path.
  v = zero_unwritten(v, key_pos[None, :] < lengths[:, None])
  o = jax.lax.psum(jnp.einsum('bkgts,bskd->btkgd', p, v), seq_axis)
  l = jnp.moveaxis(l, -1, 1)[..., None]                             # [B,Tq,K,G,1]
  return normalize(o, l).reshape(b, tq, h, d).astype(q.dtype)
