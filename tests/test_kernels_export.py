"""Both kernels lower for TPU (Mosaic) and CUDA (Triton) on this CPU
machine via `jax.export` with platform=None (the schedule is chosen at
lowering time), as the model calls them (`dispatch.pallas_prefill` /
`pallas_decode`: the kernels with their XLA fallbacks); only Triton's
custom-call serialization check is disabled."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from orthros_jax.attention import LinearState
from orthros_jax.attention import WindowPrefix
from orthros_jax.attention.dispatch import pallas_decode
from orthros_jax.attention.dispatch import pallas_prefill

TRITON = '__gpu$xla.gpu.triton'
TPU_CALL = 'tpu_custom_call'
SDS = jax.ShapeDtypeStruct


def _prefill_lowering_args(dtype, continued):
  b, t, h, kh, d, f, p = 1, 256, 4, 2, 64, 64, 64
  args = (SDS((b, t, h, d), dtype), SDS((b, t, kh, d), dtype),
          SDS((b, t, kh, d), dtype), SDS((b, t, h, f), jnp.float32),
          SDS((b, t, h, f), jnp.float32), SDS((h,), jnp.float32))
  fn = functools.partial(pallas_prefill, window=64, chunk_size=64)
  if not continued:
    return fn, args

  def continued_fn(q, k, v, phi_q, phi_k, gamma, lengths, s0, z0, pk, pv,
                   pphi, valid):
    return fn(q, k, v, phi_q, phi_k, gamma, lengths=lengths,
              initial_state=LinearState(s0, z0),
              prefix=WindowPrefix(pk, pv, pphi, valid))

  extra = (SDS((b,), jnp.int32), SDS((b, h, f, d), jnp.float32),
           SDS((b, h, f), jnp.float32), SDS((b, p, kh, d), dtype),
           SDS((b, p, kh, d), dtype), SDS((b, p, h, f), jnp.float32),
           SDS((b, p), jnp.bool_))
  return continued_fn, args + extra


def _decode_lowering_args(dtype):
  b, tq, h, kh, d, s = 2, 1, 8, 2, 128, 4096
  return pallas_decode, (SDS((b, tq, h, d), dtype), SDS((b, s, kh, d), dtype),
                        SDS((b, s, kh, d), dtype), SDS((b,), jnp.int32))


@pytest.mark.parametrize('target', ['tpu', 'cuda'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16],
                         ids=['f32', 'bf16'])
@pytest.mark.parametrize('kernel', ['prefill', 'prefill_continued', 'decode'])
def test_lowers_for_tpu_and_cuda(kernel, dtype, target):
  if kernel == 'decode':
    fn, args = _decode_lowering_args(dtype)
  else:
    fn, args = _prefill_lowering_args(dtype, kernel == 'prefill_continued')
  checks = ([] if target == 'tpu' else
            [jax.export.DisabledSafetyCheck.custom_call(TRITON)])
  exported = jax.export.export(jax.jit(fn), platforms=[target],
                               disabled_checks=checks)(*args)
  text = exported.mlir_module()
  want, other = (TPU_CALL, TRITON) if target == 'tpu' else (TRITON, TPU_CALL)
  assert want in text
  assert other not in text  # the other schedule was pruned at lowering
  assert exported.platforms == (target,)



def test_sequential_gpu_prefill_lowers_for_cuda():
  """platform='gpu_sequential' (the one-program-per-(batch, head) loop,
  timed beside the chunk-parallel default on a GPU) lowers to Triton."""
  fn, args = _prefill_lowering_args(jnp.bfloat16, False)
  exported = jax.export.export(
      jax.jit(functools.partial(fn, platform='gpu_sequential')),
      platforms=['cuda'],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
          *args)
  assert exported.mlir_module().count(TRITON) == 1


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16],
                         ids=['f32', 'bf16'])
def test_dense_flash_attention_lowers_for_tpu(dtype, monkeypatch):
  """The dense exact path on TPU (`dispatch.exact_attention` with the TPU
  backend: JAX's Pallas flash kernel, SmolLM2's heads 9 / 3 of 64) lowers
  for TPU forward and backward, as the training forward differentiates
  it."""
  from orthros_jax.attention import dispatch
  monkeypatch.setattr(dispatch, '_backend', lambda: 'tpu')
  fn = dispatch.exact_attention('auto')
  q = SDS((1, 512, 9, 64), dtype)
  kv = SDS((1, 512, 3, 64), dtype)

  def loss(q, k, v):
    return fn(q, k, v, causal=True).astype(jnp.float32).sum()

  # The forward is one kernel; the gradient program runs the forward (with
  # its residuals) and the backward's dq and dk/dv kernels.
  for program, calls in ((fn, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
    exported = jax.export.export(jax.jit(program), platforms=['tpu'])(q, kv,
                                                                      kv)
    assert exported.mlir_module().count(TPU_CALL) >= calls


# Shapes found in review: wide windows on the GPU schedule (look-back
# rounded to 2^k - 1 chunks) and a cache length that is not a multiple of
# the split.


@pytest.mark.parametrize('target', ['tpu', 'cuda'])
@pytest.mark.parametrize('window,chunk,t', [(64, 16, 200), (17, 8, 77),
                                            (40, 8, 50), (128, 64, 777)])
def test_prefill_lowers_for_wide_windows(target, window, chunk, t):
  args = (SDS((1, t, 4, 64), jnp.bfloat16), SDS((1, t, 2, 64), jnp.bfloat16),
          SDS((1, t, 2, 64), jnp.bfloat16), SDS((1, t, 4, 32), jnp.float32),
          SDS((1, t, 4, 32), jnp.float32), SDS((4,), jnp.float32))
  fn = functools.partial(pallas_prefill, window=window, chunk_size=chunk)
  checks = ([] if target == 'tpu' else
            [jax.export.DisabledSafetyCheck.custom_call(TRITON)])
  text = jax.export.export(jax.jit(fn), platforms=[target],
                           disabled_checks=checks)(*args).mlir_module()
  assert (TPU_CALL if target == 'tpu' else TRITON) in text


@pytest.mark.parametrize('target', ['tpu', 'cuda'])
def test_decode_lowers_for_a_cache_not_a_multiple_of_the_split(target):
  args = (SDS((2, 1, 8, 128), jnp.bfloat16), SDS((2, 57, 2, 128), jnp.bfloat16),
          SDS((2, 57, 2, 128), jnp.bfloat16), SDS((2,), jnp.int32))
  checks = ([] if target == 'tpu' else
            [jax.export.DisabledSafetyCheck.custom_call(TRITON)])
  text = jax.export.export(jax.jit(pallas_decode), platforms=[target],
                           disabled_checks=checks)(*args).mlir_module()
  assert (TPU_CALL if target == 'tpu' else TRITON) in text


def _dot_dtypes(jaxpr) -> set[tuple[str, ...]]:
  """Operand dtypes of every dot_general in a jaxpr, nested ones included
  (the kernel body of a pallas_call, loop bodies)."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      found.add(tuple(v.aval.dtype.name for v in eqn.invars))
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (list, tuple)) else [value]):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          found |= _dot_dtypes(inner)
  return found


@pytest.mark.parametrize('kernel,platform', [
    ('prefill', 'tpu'), ('prefill', 'gpu'), ('prefill', 'gpu_sequential'),
    ('decode', 'tpu'), ('decode', 'gpu')])
def test_bf16_inputs_reach_the_dots_in_bf16(kernel, platform):
  """bf16 q, k, v go into bf16 x bf16 dots (tensor-core / MXU rate, float32
  accumulation) in both schedules: q.k and w.v; the feature-map and state
  products stay float32 (f32 x f32 dots); float32 inputs only f32 dots."""
  for dtype, want in ((jnp.bfloat16, ('bfloat16', 'bfloat16')),
                      (jnp.float32, ('float32', 'float32'))):
    if kernel == 'decode':
      fn, args = _decode_lowering_args(dtype)
    else:
      fn, args = _prefill_lowering_args(dtype, False)
    call = functools.partial(fn, interpret=True, platform=platform)
    zeros = [jnp.zeros(a.shape, a.dtype) for a in args]
    dots = _dot_dtypes(jax.make_jaxpr(call)(*zeros).jaxpr)
    assert want in dots, dots
    if dtype == jnp.bfloat16:
      # every dot is bf16 x bf16 or f32 x f32: no mixed operands
      assert dots <= {('bfloat16', 'bfloat16'), ('float32', 'float32')}, dots
    else:
      assert dots == {('float32', 'float32')}, dots
