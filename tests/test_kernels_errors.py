"""The Pallas kernels' argument errors: every bad shape, size or platform
is a ValueError on every schedule (and on the platform=None fallback); the
kernels without their XLA fallback say so; `pallas_kernels` imports nothing
from `orthros_jax`. (Split from tests/test_kernels.py.)"""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orthros_jax import attention
from orthros_jax.attention import dispatch
from pallas_kernels.flash_decode import flash_decode
from pallas_kernels.linear_prefill import linear_prefill
from tests.test_kernels import PLATFORMS

def _prefill_args(b=1, t=16, h=4, kh=2, d=8, f=4):
  z = lambda *s: jnp.ones(s, jnp.float32)
  return dict(q=z(b, t, h, d), k=z(b, t, kh, d), v=z(b, t, kh, d),
              phi_q=z(b, t, h, f), phi_k=z(b, t, h, f), gamma=z(h))


def _replace(**kw):
  a = _prefill_args()
  a.update(kw)
  return a


_ONES = lambda *s: jnp.ones(s, jnp.float32)
PREFILL_BAD = {
    'negative_window': (_prefill_args(), dict(window=-1, chunk_size=8)),
    'chunk_size_0': (_prefill_args(), dict(window=4, chunk_size=0)),
    'platform_foo': (_prefill_args(), dict(window=4, chunk_size=8,
                                           platform='foo')),
    'k_wrong_length': (_replace(k=_ONES(1, 15, 2, 8)),
                       dict(window=4, chunk_size=8)),
    'v_not_like_k': (_replace(v=_ONES(1, 16, 1, 8)),
                     dict(window=4, chunk_size=8)),
    'heads_not_multiple': (_replace(k=_ONES(1, 16, 3, 8), v=_ONES(1, 16, 3, 8)),
                           dict(window=4, chunk_size=8)),
    'phi_k_not_like_phi_q': (_replace(phi_k=_ONES(1, 16, 4, 6)),
                             dict(window=4, chunk_size=8)),
    'phi_q_wrong_heads': (_replace(phi_q=_ONES(1, 16, 2, 4),
                                   phi_k=_ONES(1, 16, 2, 4)),
                          dict(window=4, chunk_size=8)),
    'gamma_wrong_shape': (_replace(gamma=_ONES(2)),
                          dict(window=4, chunk_size=8)),
}


@pytest.mark.parametrize('platform', (None,) + PLATFORMS)
@pytest.mark.parametrize('case', list(PREFILL_BAD))
def test_prefill_bad_arguments(case, platform):
  args, kw = PREFILL_BAD[case]
  kw = dict(kw)
  kw.setdefault('platform', platform)
  with pytest.raises(ValueError):
    linear_prefill(**args, interpret=True, fallback=attention.orthros_prefill,
                   **kw)


@pytest.mark.parametrize('platform', PLATFORMS)
def test_prefill_head_dim_mismatch_message(platform):
  args = _replace(k=_ONES(1, 16, 2, 10), v=_ONES(1, 16, 2, 10))
  with pytest.raises(ValueError, match='shapes q'):
    linear_prefill(**args, window=4, chunk_size=8, interpret=True,
                   platform=platform)


def test_kernels_without_their_xla_fallback_say_so():
  """pallas_kernels imports nothing from orthros_jax: the XLA reference is
  the caller's `fallback`. Without it, an unforced call on CPU (no kernel)
  and a prefill gradient are clear errors; dispatch supplies it."""
  args = _replace()
  with pytest.raises(ValueError, match="no kernel.*fallback=orthros_jax"):
    linear_prefill(**args, window=4, chunk_size=8)
  q, k = _ONES(1, 1, 4, 8), _ONES(1, 16, 2, 8)
  with pytest.raises(ValueError, match='fallback=orthros_jax.attention.deco'):
    flash_decode(q, k, k, jnp.asarray([5], jnp.int32))

  def loss(fn, q):
    return jnp.sum(fn(**dict(args, q=q), window=4, chunk_size=8,
                      interpret=True, platform='tpu')[0])

  with pytest.raises(ValueError, match='backward pass'):
    jax.grad(functools.partial(loss, linear_prefill))(args['q'])
  g = jax.grad(functools.partial(loss, dispatch.pallas_prefill))(args['q'])
  assert np.isfinite(np.asarray(g)).all()
  # On CPU the dispatch wrappers lower to the XLA reference.
  y, _ = dispatch.pallas_prefill(**args, window=4, chunk_size=8)
  y_ref, _ = attention.orthros_prefill(**args, window=4, chunk_size=8)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


def test_pallas_kernels_import_nothing_from_orthros_jax():
  code = ('import sys, pallas_kernels.linear_prefill, '
          'pallas_kernels.flash_decode, pallas_kernels.common; '
          "bad = [m for m in sys.modules if m.startswith('orthros_jax')]; "
          'assert not bad, bad')
  subprocess.run([sys.executable, '-c', code], check=True,
                 cwd=str(pathlib.Path(__file__).resolve().parent.parent))


DECODE_BAD = {
    'q_not_4d': (_ONES(1, 4, 8), _ONES(1, 16, 2, 8), _ONES(1, 16, 2, 8), {}),
    'v_not_like_k': (_ONES(1, 1, 4, 8), _ONES(1, 16, 2, 8),
                     _ONES(1, 16, 1, 8), {}),
    'heads_not_multiple': (_ONES(1, 1, 4, 8), _ONES(1, 16, 3, 8),
                           _ONES(1, 16, 3, 8), {}),
    'head_dim_mismatch': (_ONES(1, 1, 4, 8), _ONES(1, 16, 2, 16),
                          _ONES(1, 16, 2, 16), {}),
    'platform_foo': (_ONES(1, 1, 4, 8), _ONES(1, 16, 2, 8),
                     _ONES(1, 16, 2, 8), dict(platform='foo')),
}


@pytest.mark.parametrize('case', list(DECODE_BAD))
def test_decode_bad_arguments(case):
  q, k, v, kw = DECODE_BAD[case]
  with pytest.raises(ValueError):
    flash_decode(q, k, v, jnp.asarray([5], jnp.int32), interpret=True,
                 fallback=attention.decode_attention, **kw)
