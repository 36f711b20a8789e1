"""Chooses the implementation of each attention computation.

`AttentionConfig.impl`:
  'auto'   Pallas kernels on GPU/TPU when the shapes suit them, XLA on CPU
           (and, with a one-time warning, where a kernel cannot take the
           shapes);
  'xla'    the pure-XLA functions of `orthros_jax.attention` (everywhere);
  'pallas' the Pallas kernels; raises a ValueError where they cannot run;
  'none'   no attention at all: every attention call returns its queries
           (y = q, no token mixing, the linear state passed through). Not a
           model: the speed benchmarks' ceiling, the same network with the
           attention cost removed (projections, cache writes, MLPs stay).
The dense exact attention of `phase='forward'` (and a dense prompt written
into an empty cache) uses cuDNN flash attention through
`jax.nn.dot_product_attention` on GPU where it applies (half precision,
head_dim a multiple of 8 up to 128), JAX's Pallas TPU flash attention
(`jax.experimental.pallas.ops.tpu.flash_attention`) on TPU where it applies
(one device, a prompt length that is a multiple of `TPU_FLASH_BLOCK`), and
the blocked XLA path elsewhere.

The choice is made at trace time from `jax.default_backend()`; the kernels
themselves also select their TPU or GPU schedule at lowering time.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

from orthros_jax.attention.orthros import orthros_prefill
from orthros_jax.attention.softmax import decode_attention
from orthros_jax.attention.softmax import softmax_attention
from pallas_kernels.common import zero_state
from pallas_kernels.flash_decode import flash_decode
from pallas_kernels.linear_prefill import linear_prefill

IMPLS = ('auto', 'xla', 'pallas', 'none')
# The TPU flash kernel's block along the sequence (its default BlockSizes):
# prompts whose length is a multiple of it take the kernel.
TPU_FLASH_BLOCK = 128


def _no_prefill(q, k, v, phi_q, phi_k, gamma, *, initial_state=None,
                **unused):
  """impl='none' prefill: y = q; (S, z) unchanged (zeros if none)."""
  del k, v, phi_q, unused
  if initial_state is None:
    b, _, h, d = q.shape
    initial_state = zero_state(b, h, phi_k.shape[-1], d)
  del gamma
  return q, initial_state


def _no_attention(q, *unused_args, **unused_kwargs):
  """impl='none' decode / exact attention: y = q."""
  return q


def pallas_prefill(*args, **kwargs):
  """The Pallas `linear_prefill` with `orthros_prefill` as its fallback
  (platforms without a kernel) and the function its backward
  differentiates."""
  return linear_prefill(*args, fallback=orthros_prefill, **kwargs)


def pallas_decode(*args, **kwargs):
  """The Pallas `flash_decode` with `decode_attention` as its fallback."""
  return flash_decode(*args, fallback=decode_attention, **kwargs)


# Each kind's function (the backend, attention/backend.py, wraps the
# 'pallas' ones in shard_map on a mesh; XLA partitions the rest itself).
PREFILL_FNS = {'xla': orthros_prefill, 'pallas': pallas_prefill,
               'none': _no_prefill}
DECODE_FNS = {'xla': decode_attention, 'pallas': pallas_decode,
              'none': _no_attention}


def _backend() -> str:
  return jax.default_backend()


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
  logging.warning(message)


def _is_pow2(x: int) -> bool:
  return x >= 1 and (x & (x - 1)) == 0


def _choose(impl: str, what: str, problem: str | None) -> str:
  """'xla' or 'pallas' for a kernel; `problem` says why the kernel cannot
  take these shapes on this backend (None if it can)."""
  if impl not in IMPLS:
    raise ValueError(f'attention.impl={impl!r} is unknown: expected one of '
                     f'{IMPLS}')
  backend = _backend()
  if impl == 'xla':
    return 'xla'
  if impl == 'pallas':
    if backend not in ('gpu', 'tpu'):
      raise ValueError(
          f"attention.impl='pallas' needs a GPU or TPU, but the backend is "
          f"{backend!r}; use impl='auto' or 'xla' (tests can run the kernels "
          'with interpret=True)')
    if problem:
      raise ValueError(f"attention.impl='pallas': the {what} kernel cannot "
                       f'run here: {problem}')
    return 'pallas'
  if backend not in ('gpu', 'tpu'):
    return 'xla'
  if problem:
    _warn_once(f'{what}: using the XLA implementation because {problem}')
    return 'xla'
  return 'pallas'


def prefill_kind(impl: str, *, chunk_size: int, sinks: int = 0) -> str:
  """Which prefill runs: 'pallas', 'xla' or 'none'."""
  if impl == 'none':
    return 'none'
  backend = _backend()
  problem = None
  if sinks:
    problem = f'attention.sinks={sinks}: the Pallas kernel has no sink tokens'
  elif backend == 'tpu' and chunk_size % 8:
    problem = f'chunk_size={chunk_size} is not a multiple of 8 (TPU tiling)'
  elif backend == 'gpu' and not _is_pow2(chunk_size):
    problem = f'chunk_size={chunk_size} is not a power of two (Triton)'
  return _choose(impl, 'prefill', problem)


def prefill_impl(impl: str, *, chunk_size: int, sinks: int = 0) -> Callable:
  """`orthros_prefill` or `pallas_prefill` (same signature)."""
  return PREFILL_FNS[prefill_kind(impl, chunk_size=chunk_size, sinks=sinks)]


# flash_decode keeps all query rows of a kv head (G * Tq) in one program:
# meant for decoding a few tokens, not for a whole prompt.
MAX_DECODE_ROWS = 128


def decode_kind(impl: str, *, head_dim: int, query_rows: int = 1) -> str:
  """Which exact attention over the cache runs: 'pallas', 'xla' or 'none'.

  query_rows: G * Tq, the query rows per kv head of the call. Long query
  blocks (above MAX_DECODE_ROWS: a dense prefill, a long exact tail) always
  use the XLA blocked path, whatever the impl.
  """
  if impl == 'none':
    return 'none'
  if query_rows > MAX_DECODE_ROWS:
    if impl not in IMPLS:
      raise ValueError(f'attention.impl={impl!r} is unknown: expected one of '
                       f'{IMPLS}')
    return 'xla'
  problem = None
  if _backend() == 'gpu' and not _is_pow2(head_dim):
    problem = f'head_dim={head_dim} is not a power of two (Triton)'
  return _choose(impl, 'decode', problem)


def decode_impl(impl: str, *, head_dim: int, query_rows: int = 1) -> Callable:
  """`decode_attention` or `pallas_decode` (same signature); see
  `decode_kind`."""
  return DECODE_FNS[decode_kind(impl, head_dim=head_dim,
                                query_rows=query_rows)]


def fresh_prompt_attention(impl: str) -> Callable | None:
  """Causal attention over a prompt written into an empty cache, where a
  flash kernel beats reading the cache back: cuDNN's on GPU, the Pallas
  TPU flash kernel on one TPU device (`exact_attention`, which falls back
  to XLA where the kernel does not apply); None elsewhere (the CPU reads
  the cache through `decode_impl`). One device only: on a mesh the
  backend reads the cache, which may be split by position."""
  if impl not in IMPLS:
    raise ValueError(f'attention.impl={impl!r} is unknown: expected one of '
                     f'{IMPLS}')
  if impl in ('none', 'xla') or _backend() not in ('gpu', 'tpu'):
    return None
  return exact_attention(impl)


def tpu_flash_attention(q, k, v, *, causal: bool = True):
  """Self-attention of a prompt (q [B,T,H,D], k/v [B,T,K,D], T a multiple
  of TPU_FLASH_BLOCK) with JAX's Pallas TPU flash kernel; grouped-query
  attention repeats each kv head over its query group (head h reads kv
  head h // (H / K), as `softmax_attention`). Returns [B,T,H,D] in
  q.dtype; its backward is the kernel's own."""
  h, d = q.shape[2], q.shape[3]
  group = h // k.shape[2]
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  y = tpu_flash.flash_attention(
      heads_first(q), heads_first(jnp.repeat(k, group, axis=2)),
      heads_first(jnp.repeat(v, group, axis=2)), causal=causal,
      sm_scale=d ** -0.5)
  return heads_first(y).astype(q.dtype)


def _tpu_flash_or_xla(q, k, v, *, causal=True):
  t = q.shape[1]
  if t == k.shape[1] and t % TPU_FLASH_BLOCK == 0:
    return tpu_flash_attention(q, k, v, causal=causal)
  return softmax_attention(q, k, v, causal=causal)


def _cudnn_or_xla(q, k, v, *, causal=True):
  d = q.shape[-1]
  if (q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128
      and q.shape[1] == k.shape[1]):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                        implementation='cudnn')
  return softmax_attention(q, k, v, causal=causal)


def exact_attention(impl: str, *, on_mesh: bool = False) -> Callable:
  """Causal full-sequence attention (q [B,T,H,D], k/v [B,T,K,D]): cuDNN
  on GPU, the Pallas flash kernel on TPU (not on a mesh: XLA cannot split
  a Pallas call, the XLA path is partitioned instead), XLA elsewhere; each
  kernel falls back to XLA for shapes it does not take."""
  if impl not in IMPLS:
    raise ValueError(f'attention.impl={impl!r} is unknown: expected one of '
                     f'{IMPLS}')
  if impl == 'none':
    return _no_attention
  backend = _backend()
  if impl == 'xla' or backend not in ('gpu', 'tpu'):
    return softmax_attention
  if backend == 'gpu':
    return _cudnn_or_xla
  return softmax_attention if on_mesh else _tpu_flash_or_xla
