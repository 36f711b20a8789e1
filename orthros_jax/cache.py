"""The explicit KV cache: a tuple with one `LayerCache` per layer, or, for
a model with `scan_layers`, one `LayerCache` whose arrays carry a leading
layer axis [L, ...] (`lengths`, `num_layers`, `layer_meta`
and `map_layers` read either).

Shapes (B batch, S max_len, K kv heads, H query heads, D head dim, F feature
dim; F = 0 for dense attention):
  k, v     [B, S, K, D]  post-RoPE keys and values, valid at j < lengths[b]
  lengths  [B] int32     tokens held per example
  S        [B, H, F, D]  float32 linear state of the tokens j < folded
                         (sinks excepted: they stay exact)
  z        [B, H, F]     float32 normaliser of the same tokens
  folded   [B] int32     tokens accounted for in (S, z); after a prefill
                         max(lengths - window, 0). Decode attends exactly
                         and never reads or writes the state, so after
                         decode steps it lags by the tokens decoded, which
                         the next prefill folds first, a chunk at a time
                         (docs/ARCHITECTURE.md, 3).
The cache is passed into the model and returned updated (no mutable
collections), so prefill and decode are pure functions that can donate it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from orthros_jax.config import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class LayerCache:
  k: Array
  v: Array
  lengths: Array
  S: Array
  z: Array
  folded: Array

  @property
  def max_len(self) -> int:
    return self.k.shape[1]


Cache = tuple[LayerCache, ...] | LayerCache


def is_stacked(cache: Cache) -> bool:
  """True for the scanned layout (one LayerCache of [L, ...] arrays)."""
  return isinstance(cache, LayerCache)


def num_layers(cache: Cache) -> int:
  return cache.k.shape[0] if is_stacked(cache) else len(cache)


def layer_meta(cache: Cache) -> LayerCache:
  """One layer's view for checks (every layer holds the same lengths):
  lengths and folded as values; k, v, S, z as arrays of a tuple cache, as
  one layer's `jax.ShapeDtypeStruct`s of a stacked one (no copy)."""
  if not is_stacked(cache):
    return cache[0]
  shape = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return cache.replace(k=shape(cache.k), v=shape(cache.v), S=shape(cache.S),
                       z=shape(cache.z), lengths=cache.lengths[0],
                       folded=cache.folded[0])


def lengths(cache: Cache) -> Array:
  """[B] tokens held per example."""
  return cache.lengths[0] if is_stacked(cache) else cache[0].lengths


def map_layers(fn, cache: Cache) -> Cache:
  """`fn(LayerCache) -> LayerCache` applied to every layer, the layout
  kept (fn sees the stacked arrays at once for a stacked cache; it must
  then treat the leading axis as the layer)."""
  return fn(cache) if is_stacked(cache) else tuple(fn(c) for c in cache)


def init_cache(config: ModelConfig, batch: int, max_len: int,
               dtype=None) -> Cache:
  """An empty cache for `batch` sequences of up to `max_len` tokens.

  `dtype` is the K/V storage dtype (default: the model's activation dtype);
  the linear state is always float32.
  """
  if not isinstance(batch, int) or batch < 1:
    raise ValueError(f'batch={batch!r} must be an integer >= 1')
  if not isinstance(max_len, int) or max_len < 1:
    raise ValueError(f'max_len={max_len!r} must be an integer >= 1')
  dtype = jnp.dtype(dtype or config.dtype)
  kv_shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  f = config.attention.state_dim
  h, d = config.num_heads, config.head_dim

  def layer():
    return LayerCache(
        k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype),
        lengths=jnp.zeros((batch,), jnp.int32),
        S=jnp.zeros((batch, h, f, d), jnp.float32),
        z=jnp.zeros((batch, h, f), jnp.float32),
        folded=jnp.zeros((batch,), jnp.int32))

  if config.scan_layers:
    return jax.tree.map(
        lambda x: jnp.zeros((config.num_layers,) + x.shape, x.dtype),
        jax.eval_shape(layer))
  return tuple(layer() for _ in range(config.num_layers))


def write_kv(cache: LayerCache, k: Array, v: Array, valid: Array, *,
             flat_heads: bool = False) -> tuple[Array, Array]:
  """Writes new K/V at positions lengths[b] + t where valid[b, t].

  k, v: [B, T, K, D]; valid: [B, T] bool. Entries that are not valid or fall
  beyond max_len are dropped (callers check capacity before any work).
  flat_heads: write through the [B, S * K, D] view of the cache (K rows per
  token), the view the CPU's decode attention reads (`attention.softmax`'s
  cross-head path; the model passes True where that path runs: one CPU
  device). Written as [B, S, K, D], XLA fused the update into that view's
  reshape as a second copy of the update and copied the cache for it, per
  layer and step. False: the [B, S, K, D] layout, whose kv-head axis may
  be sharded on a mesh (merged with S it could not), and which padded
  TPU layouts do not view for free.
  """
  b, t = valid.shape
  s, kh, d = cache.k.shape[1:]
  pos = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if not flat_heads:
    pos = jnp.where(valid, pos, s)  # out of range -> dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return (cache.k.at[rows, pos].set(k.astype(cache.k.dtype), mode='drop'),
            cache.v.at[rows, pos].set(v.astype(cache.v.dtype), mode='drop'))
  rows = (pos[:, :, None] * kh + jnp.arange(kh, dtype=jnp.int32)).reshape(
      b, t * kh)
  rows = jnp.where(jnp.repeat(valid, kh, axis=1), rows, s * kh)  # dropped
  batch = jnp.broadcast_to(jnp.arange(b)[:, None], rows.shape)

  def put(cached, new):
    flat = cached.reshape(b, s * kh, d).at[batch, rows].set(
        new.astype(cached.dtype).reshape(b, t * kh, d), mode='drop')
    return flat.reshape(cached.shape)

  return put(cache.k, k), put(cache.v, v)


def gather_kv(k: Array, v: Array, positions: Array) -> tuple[Array, Array]:
  """k, v [B, S, K, D] at positions [B, N] (clipped into range)."""
  pos = jnp.clip(positions, 0, k.shape[1] - 1)
  take = jax.vmap(lambda x, p: x[p])
  return take(k, pos), take(v, pos)
