"""The Pallas kernels inside `shard_map`: batch over one mesh axis, heads
over another, so a sharded model can call them (with their XLA fallbacks,
as `dispatch.pallas_prefill` / `dispatch.pallas_decode`).

Every argument is split along batch and (query or kv) heads; the kernels are
independent per example and per kv head group, so each device runs the
kernel on its shard with no communication. Query and kv heads are split over
the same axis, which keeps each query head with its kv head: the head axis
size must divide the number of kv heads.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from orthros_jax.attention.dispatch import pallas_decode
from orthros_jax.attention.dispatch import pallas_prefill
from orthros_jax.attention.placement import check_divisible
from pallas_kernels.common import LinearState
from pallas_kernels.common import WindowPrefix

Array = jax.Array
Axis = str | tuple[str, ...] | None


def sharded_linear_prefill(mesh: Mesh, q: Array, k: Array, v: Array,
                           phi_q: Array, phi_k: Array, gamma: Array, *,
                           window: int, chunk_size: int,
                           lengths: Array | None = None,
                           initial_state: LinearState | None = None,
                           prefix: WindowPrefix | None = None,
                           batch_axis: Axis = 'data',
                           head_axis: Axis = 'tensor',
                           interpret: bool = False,
                           platform: str | None = None
                           ) -> tuple[Array, LinearState]:
  """`dispatch.pallas_prefill` with batch split over `batch_axis` and heads over
  `head_axis` of `mesh`."""
  check_divisible(mesh, batch_axis, head_axis, q.shape[0], k.shape[2])
  seq = P(batch_axis, None, head_axis, None)       # [B, T, H|K, X]
  state_spec = LinearState(P(batch_axis, head_axis, None, None),
                           P(batch_axis, head_axis, None))
  kernel = functools.partial(pallas_prefill, window=window,
                             chunk_size=chunk_size, interpret=interpret,
                             platform=platform)

  def local(q, k, v, phi_q, phi_k, gamma, lengths, initial_state, prefix):
    return kernel(q, k, v, phi_q, phi_k, gamma, lengths=lengths,
                  initial_state=initial_state, prefix=prefix)

  in_specs = (seq, seq, seq, seq, seq, P(head_axis),
              None if lengths is None else P(batch_axis),
              None if initial_state is None else state_spec,
              None if prefix is None else WindowPrefix(
                  seq, seq, seq, P(batch_axis, None)))
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                       out_specs=(seq, state_spec), check_vma=False)(
                           q, k, v, phi_q, phi_k, gamma, lengths,
                           initial_state, prefix)


def sharded_flash_decode(mesh: Mesh, q: Array, k_cache: Array, v_cache: Array,
                         lengths: Array, *, batch_axis: Axis = 'data',
                         head_axis: Axis = 'tensor', interpret: bool = False,
                         platform: str | None = None,
                         max_split: int = 512) -> Array:
  """`dispatch.pallas_decode` with batch split over `batch_axis` and heads over
  `head_axis` of `mesh`."""
  check_divisible(mesh, batch_axis, head_axis, q.shape[0], k_cache.shape[2])
  seq = P(batch_axis, None, head_axis, None)
  kernel = functools.partial(pallas_decode, interpret=interpret,
                             platform=platform, max_split=max_split)
  return jax.shard_map(kernel, mesh=mesh,
                       in_specs=(seq, seq, seq, P(batch_axis)),
                       out_specs=seq, check_vma=False)(q, k_cache, v_cache,
                                                       lengths)
