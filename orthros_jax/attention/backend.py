"""The attention backend: which function computes each attention call.

An `AttentionBackend` is a value built once from the model's attention
settings and, on a device mesh, a `Placement` (the mesh and its batch, head
and sequence axes; `sharding.Partitioner.attention_backend` builds it). It
owns the three decisions that used to be read from a global at trace time:

  kernel choice      dispatch.py: Pallas on GPU/TPU where the shapes suit
                     it, the XLA functions elsewhere, nothing for impl='none';
  shard_map          on a mesh, the Pallas kernels run per shard of batch and
                     heads (attention/sharded.py); XLA partitions the rest;
  context parallel   with a sequence axis of more than one device, prefill
                     and decode split the prompt and the cache by position
                     (attention/context_parallel.py).

The model (`model.Attention`) holds one as a field and keeps the math:
projections, RoPE, cache writes, state folding. Without a placement the
backend is single-device, whatever mesh is active.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from orthros_jax.attention import context_parallel
from orthros_jax.attention import dispatch
from orthros_jax.attention import softmax
from orthros_jax.attention.placement import Placement
from orthros_jax.attention.sharded import sharded_flash_decode
from orthros_jax.attention.sharded import sharded_linear_prefill
from orthros_jax.attention.softmax import softmax_attention


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
  """Attention functions for one model on one placement.

  impl, chunk_size, sinks, window: the model's `AttentionConfig` values.
  head_dim, num_kv_heads, num_groups: its head shapes.
  placement: the mesh and axes (None: one device, no shard_map).
  """
  impl: str = 'auto'
  chunk_size: int = 64
  sinks: int = 0
  window: int = 0
  head_dim: int = 64
  num_kv_heads: int = 1
  num_groups: int = 1
  placement: Placement | None = None

  @classmethod
  def for_model(cls, config, placement: Placement | None = None
                ) -> 'AttentionBackend':
    """The backend of a `ModelConfig` on `placement` (None: one device)."""
    a = config.attention
    if a.impl not in dispatch.IMPLS:
      raise ValueError(f'attention.impl={a.impl!r} is unknown: expected one '
                       f'of {dispatch.IMPLS}')
    return cls(impl=a.impl, chunk_size=a.chunk_size, sinks=a.sinks,
               window=a.window, head_dim=config.head_dim,
               num_kv_heads=config.num_kv_heads,
               num_groups=config.num_groups, placement=placement)

  def _axes(self, batch: int):
    return self.placement.axes_for(batch, self.num_kv_heads)

  def prefill(self, batch: int, *, local: bool = False) -> Callable:
    """The Orthros prefill (`orthros_prefill`'s signature) for a batch of
    `batch` prompts; local: the per-shard function (no shard_map), as the
    context-parallel prefill runs it."""
    kind = dispatch.prefill_kind(self.impl, chunk_size=self.chunk_size,
                                 sinks=self.sinks)
    fn = dispatch.PREFILL_FNS[kind]
    if self.placement is None or local or kind != 'pallas':
      return fn
    batch_axes, head_axes = self._axes(batch)
    return functools.partial(sharded_linear_prefill, self.placement.mesh,
                             batch_axis=batch_axes, head_axis=head_axes)

  @property
  def reads_flat_cache(self) -> bool:
    """Whether decode reads the cache through its [B, S * K, D] view (the
    CPU's cross-head path, one device), so that `cache.write_kv` should
    write through that view too (`flat_heads`)."""
    return self.placement is None and softmax.cross_head_backend()

  def decode(self, num_tokens: int, batch: int) -> Callable:
    """Exact attention of `num_tokens` new tokens per example over the
    cache (`decode_attention`'s signature)."""
    kind = dispatch.decode_kind(self.impl, head_dim=self.head_dim,
                                query_rows=self.num_groups * num_tokens)
    fn = dispatch.DECODE_FNS[kind]
    if self.placement is None or kind == 'none':
      return fn
    batch_axes, head_axes = self._axes(batch)
    if self.placement.sequence_axis is not None:
      return functools.partial(
          context_parallel.decode, mesh=self.placement.mesh,
          seq_axis=self.placement.sequence_axis, batch_axes=batch_axes,
          head_axes=head_axes)
    if kind == 'xla':
      # On global arrays, kv heads possibly sharded: the cross-head path's
      # [S * K, D] view of the cache would gather it.
      return functools.partial(fn, cross_head=False)
    return functools.partial(sharded_flash_decode, self.placement.mesh,
                             batch_axis=batch_axes, head_axis=head_axes)

  def exact(self) -> Callable:
    """Causal full-sequence attention (phase='forward'): cuDNN flash on
    GPU, Pallas flash on one TPU device, XLA elsewhere
    (`dispatch.exact_attention`)."""
    return dispatch.exact_attention(self.impl,
                                    on_mesh=self.placement is not None)

  def exact_after_split(self) -> Callable:
    """`(q, k, v, split) -> y`: causal attention of the queries at positions
    t >= split[b] (the exact half of an Orthros model's split forward);
    rows before the split are not used (0 on the XLA path, which skips the
    query blocks no example needs, forward and backward; the flash kernels
    compute every row)."""
    fn = self.exact()
    if fn is softmax_attention:
      return lambda q, k, v, split: softmax_attention(
          q, k, v, causal=True, skip_before=split)
    return lambda q, k, v, split: fn(q, k, v, causal=True)

  def fresh_prompt(self) -> Callable | None:
    """Causal attention for a dense prompt written into an empty cache
    (cuDNN flash attention on GPU, Pallas flash on TPU), or None where the
    prompt reads the cache back through `decode` (CPU, and every mesh:
    there the cache may be split by position)."""
    if self.placement is not None:
      return None
    return dispatch.fresh_prompt_attention(self.impl)

  def context_parallel_prefill(self, num_tokens: int,
                               batch: int) -> Callable | None:
    """The position-split Orthros prefill for a prompt of `num_tokens`, or
    None for the ordinary path: no sequence axis, impl='none', or a prompt
    too short to give every shard a window of tokens (a short chat turn)."""
    p = self.placement
    if p is None or p.sequence_axis is None:
      return None
    kind = dispatch.prefill_kind(self.impl, chunk_size=self.chunk_size,
                                 sinks=self.sinks)
    if kind == 'none' or -(-num_tokens // p.sequence_devices()) < self.window:
      return None
    if self.sinks:
      raise ValueError(
          f'attention.sinks={self.sinks}: the context-parallel prefill (mesh '
          "axis 'sequence' > 1) has no sink tokens; set sinks=0 or use a "
          'mesh without a sequence axis.')
    batch_axes, head_axes = self._axes(batch)
    return functools.partial(
        context_parallel.prefill, mesh=p.mesh, seq_axis=p.sequence_axis,
        batch_axes=batch_axes, head_axes=head_axes,
        local_prefill=self.prefill(batch, local=True))
