"""Both kernels inside shard_map on 8 fake CPU devices (interpret mode) equal
the unsharded XLA references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from orthros_jax.attention import LinearState
from orthros_jax.attention import WindowPrefix
from orthros_jax.attention import decode_attention
from orthros_jax.attention import orthros_prefill
from orthros_jax.attention.sharded import sharded_flash_decode
from orthros_jax.attention.sharded import sharded_linear_prefill


def _mesh(data, tensor):
  devices = np.array(jax.devices()[:data * tensor]).reshape(data, tensor)
  return Mesh(devices, ('data', 'tensor'))


def _arrays(seed, b=4, t=21, h=8, k=4, d=8, f=6):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  pos = lambda *s: jnp.asarray(rng.uniform(0.1, 1.0, size=s), jnp.float32)
  return (arr(b, t, h, d), arr(b, t, k, d), arr(b, t, k, d), pos(b, t, h, f),
          pos(b, t, h, f), jnp.asarray(rng.uniform(0.05, 0.9, size=h),
                                       jnp.float32))


@pytest.mark.parametrize('platform', ['tpu', 'gpu'])
@pytest.mark.parametrize('shape', [(2, 4), (8, 1), (1, 4)])
def test_sharded_linear_prefill_matches_reference(platform, shape):
  assert len(jax.devices()) >= 8, 'tests/conftest.py sets 8 CPU devices'
  mesh = _mesh(*shape)
  q, k, v, pq, pk, g = _arrays(0, b=8)
  lengths = jnp.array([21, 9, 14, 3, 21, 1, 17, 8])
  # Continued prefill: a state and a left-padded prefix of 8 tokens.
  rng = np.random.default_rng(1)
  state = LinearState(jnp.asarray(rng.uniform(size=(8, 8, 6, 8)), jnp.float32),
                      jnp.asarray(rng.uniform(size=(8, 8, 6)), jnp.float32))
  _, pk_, pv_, _, ppk, _ = _arrays(2, b=8, t=8)
  valid = jnp.arange(8)[None, :] >= jnp.array([0, 3, 8, 5, 0, 0, 7, 1])[:, None]
  prefix = WindowPrefix(pk_, pv_, ppk, valid)
  y, st = sharded_linear_prefill(
      mesh, q, k, v, pq, pk, g, window=8, chunk_size=8, lengths=lengths,
      initial_state=state, prefix=prefix, interpret=True, platform=platform)
  y_ref, st_ref = orthros_prefill(q, k, v, pq, pk, g, window=8, chunk_size=8,
                                  lengths=lengths, initial_state=state,
                                  prefix=prefix)
  mask = np.arange(21)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(np.asarray(y)[mask], np.asarray(y_ref)[mask],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(st.S, st_ref.S, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(st.z, st_ref.z, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('platform', ['tpu', 'gpu'])
@pytest.mark.parametrize('tq', [1, 5])
def test_sharded_flash_decode_matches_reference(platform, tq):
  mesh = _mesh(2, 4)
  rng = np.random.default_rng(3)
  b, s, h, k, d = 4, 40, 8, 4, 16
  kc = jnp.asarray(rng.normal(size=(b, s, k, d)), jnp.float32)
  vc = jnp.asarray(rng.normal(size=(b, s, k, d)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, tq, h, d)), jnp.float32)
  lengths = jnp.array([40, 17, 5, 33])
  out = sharded_flash_decode(mesh, q, kc, vc, lengths, interpret=True,
                             platform=platform, max_split=16)
  np.testing.assert_allclose(out, decode_attention(q, kc, vc, lengths),
                             rtol=1e-5, atol=1e-5)


def test_sharded_kernels_reject_indivisible_heads():
  mesh = _mesh(1, 8)
  q, k, v, pq, pk, g = _arrays(0)  # 4 kv heads over 8 devices
  with pytest.raises(ValueError, match='kv heads'):
    sharded_linear_prefill(mesh, q, k, v, pq, pk, g, window=4, chunk_size=8,
                           interpret=True)
  with pytest.raises(ValueError, match='batch'):
    sharded_flash_decode(_mesh(8, 1), q[:3, :1], k[:3], v[:3],
                         jnp.array([3, 3, 3]), interpret=True)
