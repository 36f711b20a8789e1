"""`AttentionConfig.impl` dispatch, and the model running its prefill and
decode through the Pallas kernels (interpret mode, backend faked)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax import Transformer
from orthros_jax.attention import decode_attention
from orthros_jax.attention import dispatch
from orthros_jax.attention import orthros_prefill
from orthros_jax.attention import softmax_attention
from test_model import init_params
from test_model import make_config
from test_model import random_tokens


def test_cpu_dispatch():
  assert dispatch.prefill_impl('auto', chunk_size=8) is orthros_prefill
  assert dispatch.decode_impl('xla', head_dim=8) is decode_attention
  assert dispatch.exact_attention('auto') is softmax_attention
  with pytest.raises(ValueError, match="impl='pallas' needs a GPU or TPU"):
    dispatch.prefill_impl('pallas', chunk_size=8)
  with pytest.raises(ValueError, match="impl='pallas' needs a GPU or TPU"):
    dispatch.decode_impl('pallas', head_dim=8)
  with pytest.raises(ValueError, match='unknown'):
    dispatch.decode_impl('triton', head_dim=8)


@pytest.mark.parametrize('backend', ['gpu', 'tpu'])
def test_accelerator_dispatch(monkeypatch, backend):
  monkeypatch.setattr(dispatch, '_backend', lambda: backend)
  kernel = dispatch.pallas_prefill
  assert dispatch.prefill_impl('auto', chunk_size=16) is kernel
  assert dispatch.prefill_impl('pallas', chunk_size=16) is kernel
  assert dispatch.prefill_impl('xla', chunk_size=16) is orthros_prefill
  assert dispatch.decode_impl('auto', head_dim=64) is dispatch.pallas_decode
  # Shapes a kernel cannot take: 'auto' falls back, 'pallas' raises.
  bad_chunk = 12 if backend == 'gpu' else 12 + 1
  assert dispatch.prefill_impl('auto', chunk_size=bad_chunk) is orthros_prefill
  with pytest.raises(ValueError, match='chunk_size'):
    dispatch.prefill_impl('pallas', chunk_size=bad_chunk)
  # The Pallas prefill has no attention sinks: 'auto' takes XLA, 'pallas'
  # raises naming the field.
  assert dispatch.prefill_impl('auto', chunk_size=16, sinks=4) is \
      orthros_prefill
  with pytest.raises(ValueError, match='attention.sinks=4'):
    dispatch.prefill_impl('pallas', chunk_size=16, sinks=4)
  # A long query block (dense prefill) never goes to the decode kernel.
  for impl in ('auto', 'pallas'):
    assert dispatch.decode_impl(impl, head_dim=64,
                                query_rows=4 * 2048) is decode_attention
  if backend == 'gpu':
    assert dispatch.decode_impl('auto', head_dim=96) is decode_attention
    with pytest.raises(ValueError, match='head_dim'):
      dispatch.decode_impl('pallas', head_dim=96)


@pytest.mark.parametrize('backend', ['gpu', 'tpu'])
def test_model_runs_through_kernels(monkeypatch, backend):
  """Prefill + decode of an Orthros model with impl='pallas' (kernels in
  interpret mode) equals the XLA model."""
  config = make_config(window=8, chunk=8, head_dim=8)
  params = init_params(config)
  x = random_tokens(9, (2, 19))
  lengths = jnp.array([13, 6])

  def both_phases(config):
    # A fresh jit each time: the dispatch decision is made while tracing.
    # (a new function object, since jax caches traces per function).
    def apply(config, params, tokens, *, phase, cache, lengths=None,
              all_logits=False):
      return Transformer(config).apply(
          {'params': params}, tokens, phase=phase, cache=cache,
          lengths=lengths, all_logits=all_logits)

    run_fresh = jax.jit(apply, static_argnames=('config', 'phase',
                                                'all_logits'))
    cache = oj.init_cache(config, 2, 24)
    pre, cache = run_fresh(config, params, x[:, :13], phase='prefill',
                           cache=cache, lengths=lengths, all_logits=True)
    dec, cache = run_fresh(config, params, x[:, 13:16], phase='decode',
                           cache=cache)
    return pre, dec, cache

  want = both_phases(config)
  monkeypatch.setattr(dispatch, '_backend', lambda: backend)
  calls = []

  def interpreted(module, name):
    kernel = getattr(module, name)

    def wrapper(*args, **kwargs):
      calls.append(name)
      return kernel(*args, interpret=True, platform=backend, **kwargs)

    monkeypatch.setattr(module, name, wrapper)

  interpreted(dispatch, 'linear_prefill')
  interpreted(dispatch, 'flash_decode')
  got = both_phases(config.replace(attention={'impl': 'pallas'}))
  # Traced once per layer: prefill through linear_prefill, decode through
  # flash_decode.
  assert calls.count('linear_prefill') == config.num_layers
  assert calls.count('flash_decode') == config.num_layers
  mask = np.arange(13)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(np.asarray(got[0])[mask],
                             np.asarray(want[0])[mask], rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=2e-5)
  for layer, ref in zip(got[2], want[2]):
    np.testing.assert_allclose(layer.S, ref.S, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(layer.z, ref.z, rtol=1e-5, atol=2e-5)


def test_dense_prefill_of_a_fresh_prompt_on_gpu(monkeypatch):
  """On GPU a dense prompt written into an empty cache attends to itself
  through `fresh_prompt_attention` (cuDNN there; XLA for these float32
  inputs, so it runs on CPU with the backend faked); a prompt continued
  onto a cache reads the cache. Real positions and caches equal the CPU
  path; padded query rows differ, which shows the fresh branch ran."""
  assert dispatch.fresh_prompt_attention('auto') is None  # CPU
  config = make_config(kind='dense', head_dim=8)
  params = init_params(config)
  x = random_tokens(3, (2, 19))
  lengths = jnp.array([13, 6])

  def run(tag):
    # A new function object per run: the dispatch is decided while tracing.
    def apply(params, tokens, cache, lengths, tag=tag):
      del tag
      return Transformer(config).apply(
          {'params': params}, tokens, phase='prefill', cache=cache,
          lengths=lengths, all_logits=True)
    fn = jax.jit(apply)
    first, cache = fn(params, x[:, :13], oj.init_cache(config, 2, 24),
                      lengths)
    second, cache = fn(params, x[:, 13:17], cache, jnp.array([4, 2]))
    return first, second, cache

  want = run('cpu')
  monkeypatch.setattr(dispatch, '_backend', lambda: 'gpu')
  assert dispatch.fresh_prompt_attention('xla') is None
  with pytest.raises(ValueError, match='unknown'):
    dispatch.fresh_prompt_attention('cudnn')
  traced = []
  real = dispatch.fresh_prompt_attention

  def counting(impl):
    fn = real(impl)
    traced.append(fn.__name__)
    return fn

  monkeypatch.setattr(dispatch, 'fresh_prompt_attention', counting)
  got = run('gpu')
  assert traced == ['_cudnn_or_xla'] * (2 * config.num_layers)
  real_rows = np.arange(13)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(np.asarray(got[0])[real_rows],
                             np.asarray(want[0])[real_rows], rtol=1e-5,
                             atol=2e-5)
  assert not np.allclose(np.asarray(got[0])[~real_rows],
                         np.asarray(want[0])[~real_rows], atol=1e-3)
  rows2 = np.arange(4)[None, :] < np.array([[4], [2]])
  np.testing.assert_allclose(np.asarray(got[1])[rows2],
                             np.asarray(want[1])[rows2], rtol=1e-5,
                             atol=2e-5)
  for layer, ref in zip(got[2], want[2]):
    np.testing.assert_array_equal(layer.lengths, ref.lengths)
    np.testing.assert_allclose(layer.k, ref.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.v, ref.v, rtol=1e-6, atol=1e-6)


def _reference_attention(q, k, v):
  """Causal GQA attention in float64 numpy (head h reads kv head h // G)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  t, h, d = q.shape[1], q.shape[2], q.shape[3]
  group = h // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  s = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(d)
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', p, v)


def test_tpu_flash_attention_matches_the_float64_reference():
  """JAX's Pallas TPU flash kernel as the dense path calls it (GQA by
  repeated kv heads, heads-first layout), run in TPU interpret mode on
  this CPU: equal to the float64 formula; a length that is not a multiple
  of its block goes to XLA."""
  from jax.experimental.pallas import tpu as pltpu
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(2, 256, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 256, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 256, 2, 16)), jnp.float32)
  with pltpu.force_tpu_interpret_mode():
    got = dispatch.tpu_flash_attention(q, k, v)
  np.testing.assert_allclose(got, _reference_attention(q, k, v), rtol=1e-5,
                             atol=1e-5)
  short = (q[:, :200], k[:, :200], v[:, :200])
  np.testing.assert_array_equal(dispatch._tpu_flash_or_xla(*short),
                                softmax_attention(*short))


def test_dense_prompt_on_tpu_runs_the_pallas_flash_kernel(monkeypatch):
  """On one TPU device the dense forward and a dense prompt written into an
  empty cache go through the Pallas flash kernel (backend faked, kernel
  interpreted): logits equal the CPU path's, the kernel is in the traced
  program, and on a mesh the XLA path stays (XLA cannot split a Pallas
  call)."""
  from jax.experimental.pallas import tpu as pltpu
  config = make_config(kind='dense', head_dim=8)
  params = init_params(config)
  x = random_tokens(5, (2, 128))

  def programs():
    # New function objects per backend: the dispatch is decided while
    # tracing, and jax caches traces by function.
    def forward(params, tokens):
      return Transformer(config).apply({'params': params}, tokens,
                                       phase='forward')[0]

    def prefill(params, tokens):
      return Transformer(config).apply(
          {'params': params}, tokens, phase='prefill',
          cache=oj.init_cache(config, 2, 128), lengths=jnp.array([128, 128]),
          all_logits=True)[0]
    return forward, prefill

  want = [jax.jit(fn)(params, x) for fn in programs()]
  monkeypatch.setattr(dispatch, '_backend', lambda: 'tpu')
  assert dispatch.exact_attention('auto') is dispatch._tpu_flash_or_xla
  assert dispatch.exact_attention('auto', on_mesh=True) is softmax_attention
  assert dispatch.exact_attention('xla') is softmax_attention
  assert dispatch.fresh_prompt_attention('auto') is dispatch._tpu_flash_or_xla
  # The model's backend: one device takes the kernel, a mesh keeps XLA.
  from orthros_jax.attention.backend import AttentionBackend
  from orthros_jax.attention.placement import Placement
  one = AttentionBackend.for_model(config)
  assert one.exact() is one.fresh_prompt() is dispatch._tpu_flash_or_xla
  mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
  sharded = AttentionBackend.for_model(config, Placement(mesh, 'data'))
  assert sharded.exact() is softmax_attention
  assert sharded.fresh_prompt() is None
  for fn, ref in zip(programs(), want):
    jaxpr = str(jax.make_jaxpr(fn)(params, x))
    assert 'pallas_call' in jaxpr
    with pltpu.force_tpu_interpret_mode():
      got = jax.jit(fn)(params, x)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('kind', ['dense', 'orthros'])
def test_impl_none_removes_attention_only(kind):
  """impl='none' (the speed ceiling): attention returns its queries, so a
  token's logits no longer depend on the tokens before it; everything else
  (cache lengths, generation) still runs."""
  config = make_config(kind).replace(attention={'impl': 'none'})
  params = init_params(config)
  q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 4, 8)),
                  jnp.float32)
  assert dispatch.exact_attention('none')(q, q, q) is q
  assert dispatch.decode_impl('none', head_dim=8)(q, None, None, None) is q
  y, state = dispatch.prefill_impl('none', chunk_size=4)(
      q, q, q, q, jnp.zeros((2, 5, 4, 6)), None)
  assert y is q and state.S.shape == (2, 4, 6, 8) and not state.S.any()
  a = jnp.array([[5, 6, 7, 8]], jnp.int32)
  b = jnp.array([[9, 10, 11, 8]], jnp.int32)
  la = Transformer(config).apply({'params': params}, a, phase='forward')[0]
  lb = Transformer(config).apply({'params': params}, b, phase='forward')[0]
  np.testing.assert_allclose(la[0, -1], lb[0, -1], rtol=1e-6)
  out = oj.generate(config, params, [[5, 6, 7, 8], [9, 10]],
                    max_new_tokens=3)
  assert out.tokens.shape == (2, 3)
  assert int(out.cache[0].lengths[0]) == 4 + 2
