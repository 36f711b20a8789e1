"""attention.length_scale: each prefill query's linear weights scaled by
(n_old / W) ** -alpha_h (docs/ARCHITECTURE.md section 3), against the
float64 formula, and the identities every Orthros option keeps (alpha = 0
is the plain model, a continued prefill equals one prefill, prefill then
decode equals the split forward, the adapter carries alpha)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax import attention as attn_lib
from orthros_jax.conversion import adapter as adapter_lib
from tests import reference
from tests.test_model import init_params
from tests.test_model import make_config
from tests.test_model import random_tokens
from tests.test_model import run


def _with_exponents(params, seed=3):
  """Random non-zero exponents in every layer (init is 0)."""
  def set_alpha(path, x):
    if 'length_exponent' in jax.tree_util.keystr(path):
      return jax.random.uniform(jax.random.PRNGKey(seed), x.shape, x.dtype,
                                -0.5, 1.5)
    return x
  return jax.tree_util.tree_map_with_path(set_alpha, params)


@pytest.mark.parametrize('window,sinks,lengths', [(5, 0, None), (4, 2, (23, 9)),
                                                  (1, 3, (17, 23))])
def test_prefill_formula_with_length_scale(window, sinks, lengths):
  b, t, h, kh, d, f = 2, 23, 4, 2, 6, 5
  keys = jax.random.split(jax.random.PRNGKey(0), 7)
  q = jax.random.normal(keys[0], (b, t, h, d))
  k = jax.random.normal(keys[1], (b, t, kh, d))
  v = jax.random.normal(keys[2], (b, t, kh, d))
  phi_q = jax.random.uniform(keys[3], (b, t, h, f), minval=0.1)
  phi_k = jax.random.uniform(keys[4], (b, t, h, f), minval=0.1)
  gamma = jax.random.uniform(keys[5], (h,), minval=0.05, maxval=0.9)
  alpha = jax.random.uniform(keys[6], (h,), minval=-0.5, maxval=1.5)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  scale = attn_lib.length_scales(positions, alpha, window=window, sinks=sinks)
  extra = {}
  if sinks:
    extra['sinks'] = attn_lib.Sinks(k[:, :sinks], v[:, :sinks],
                                    jnp.ones((b, sinks), bool),
                                    jnp.zeros((b,), jnp.int32))
  y, state = attn_lib.orthros_prefill(
      q, k, v, phi_q * scale[..., None], phi_k, gamma, window=window,
      chunk_size=4, lengths=None if lengths is None else jnp.array(lengths),
      **extra)
  y_ref, s_ref, z_ref = reference.orthros_prefill(
      q, k, v, phi_q, phi_k, gamma, window=window, lengths=lengths,
      sinks=sinks, length_exponent=alpha)
  for i in range(b):
    n = t if lengths is None else lengths[i]
    np.testing.assert_allclose(y[i, :n], y_ref[i, :n], rtol=2e-5, atol=2e-6)
  # The scale is on the queries: the state a continued prefill folds into is
  # the plain one.
  np.testing.assert_allclose(state.S, s_ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(state.z, z_ref, rtol=2e-5, atol=2e-5)


def test_zero_exponent_is_the_plain_model():
  plain = make_config(window=5, sinks=2)
  scaled = make_config(window=5, sinks=2)
  scaled = scaled.replace(attention={'length_scale': True})
  p_plain = init_params(plain)
  p_scaled = init_params(scaled)
  for i in range(scaled.num_layers):
    attn = p_scaled[f'layers_{i}']['attn']
    np.testing.assert_array_equal(attn['length_exponent'], 0.0)
  x = random_tokens(1, (2, 19))
  a, _ = run(plain, p_plain, x, phase='forward')
  b, _ = run(scaled, p_scaled, x, phase='forward')
  np.testing.assert_array_equal(a, b)
  c, _ = run(scaled, _with_exponents(p_scaled), x, phase='forward')
  assert np.max(np.abs(np.asarray(c) - np.asarray(a))) > 1e-3


def test_continued_prefill_and_decode_with_length_scale():
  """Positions are absolute: a second prefill turn scales its queries as
  one prefill of the whole text would, and prefill + decode equals the
  split forward."""
  config = make_config(window=4, sinks=2).replace(
      attention={'length_scale': True})
  params = _with_exponents(init_params(config))
  x = random_tokens(4, (1, 21))
  cache = oj.init_cache(config, 1, 32)
  _, cache = run(config, params, x[:, :9], phase='prefill', cache=cache)
  second, cache = run(config, params, x[:, 9:18], phase='prefill',
                      cache=cache, all_logits=True)
  whole, _ = run(config, params, x[:, :18], phase='prefill',
                 cache=oj.init_cache(config, 1, 32), all_logits=True)
  np.testing.assert_allclose(second[0], whole[0, 9:], atol=2e-5, rtol=1e-5)
  step, _ = run(config, params, x[:, 18:21], phase='decode', cache=cache)
  split, _ = run(config, params, x[:, :21], phase='forward', split=18)
  np.testing.assert_allclose(step[0], split[0, 18:], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(whole[0], split[0, :18], atol=2e-5, rtol=1e-5)


def test_adapter_carries_the_exponents(tmp_path):
  config = make_config(window=4, sinks=1).replace(
      attention={'length_scale': True})
  params = _with_exponents(init_params(config))
  base = make_config(kind='dense')
  base_params = jax.tree_util.tree_map(lambda x: x, params)
  for i in range(config.num_layers):
    attn = dict(base_params[f'layers_{i}']['attn'])
    for name in ('phi_q', 'phi_k', 'window_logit', 'length_exponent'):
      attn.pop(name)
    base_params[f'layers_{i}'] = dict(base_params[f'layers_{i}'], attn=attn)
  adapter_lib.write_adapter(tmp_path / 'a', config, base_params, params, {},
                            alpha=16.0)
  got_config, got = adapter_lib.apply_adapter(tmp_path / 'a', base,
                                              base_params)
  assert got_config.attention.length_scale
  for i in range(config.num_layers):
    np.testing.assert_array_equal(
        got[f'layers_{i}']['attn']['length_exponent'],
        params[f'layers_{i}']['attn']['length_exponent'])
  x = random_tokens(2, (1, 15))
  np.testing.assert_allclose(run(got_config, got, x, phase='forward')[0],
                             run(config, params, x, phase='forward')[0],
                             rtol=1e-6, atol=1e-6)


def test_length_scale_config_errors():
  with pytest.raises(ValueError, match='length_scale'):
    oj.AttentionConfig(kind='orthros', window=0, sinks=0, length_scale=True)
  with pytest.raises(ValueError, match='length_scale'):
    oj.AttentionConfig(kind='orthros', length_scale=1)


def test_conversion_init_and_stage1_train_the_exponents():
  """A conversion's fresh params hold alpha = 0, and the stage-1 transfer
  loss has a non-zero gradient for it (it is a transfer param)."""
  from orthros_jax.conversion import transfer
  from orthros_jax.model import init_orthros_params
  config = make_config(window=3, sinks=1).replace(
      attention={'length_scale': True})
  fresh = init_orthros_params(config, jax.random.PRNGKey(1))
  params = init_params(config)
  for i in range(config.num_layers):
    attn = fresh[f'layers_{i}']['attn']
    np.testing.assert_array_equal(attn['length_exponent'], 0.0)
    assert set(attn) == set(params[f'layers_{i}']['attn']) & set(
        transfer.TRANSFER_PARAMS)
  dense = config.replace(attention={'kind': 'dense', 'length_scale': False})
  x = random_tokens(3, (2, 17))
  inputs, outputs = transfer.teacher_attention_io(dense, params, x)
  grads = jax.grad(lambda p: transfer.transfer_loss(p, config, inputs,
                                                    outputs)[0])(params)
  assert 'length_exponent' in transfer.TRANSFER_PARAMS  # stage 1 trains it
  for i in range(config.num_layers):
    assert np.abs(grads[f'layers_{i}']['attn']['length_exponent']).sum() > 0



def test_pure_linear_row_of_a_length_scaled_model():
  """The pure-linear floor of a length-scaled conversion (eval.py's
  'linear' row, convert.py's held-out check) drops the scale, which loses
  nothing: with window 0 and no sinks a positive factor per query cancels
  in the normalisation (checked on the formula with random factors)."""
  from orthros_jax.evaluation.inference import pure_linear
  from orthros_jax.evaluation import variants
  config = make_config(window=4, sinks=2).replace(
      attention={'length_scale': True})
  params = _with_exponents(init_params(config))
  floor = pure_linear(config)  # raised before: length_scale with window 0
  assert not floor.attention.length_scale and not floor.attention.window
  rows, _ = variants.converted_rows(config, params, ['linear'], sinks=2,
                                    where='x')
  assert rows['linear'][0] == floor
  x = random_tokens(6, (2, 23))
  logits, _ = run(floor, params, x, phase='prefill',
                  cache=oj.init_cache(floor, 2, 23), all_logits=True)
  assert np.isfinite(np.asarray(logits)).all()
  rng = np.random.default_rng(0)
  b, t, h, kh, d, f = 2, 19, 4, 2, 6, 5
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((b, t, h, d), (b, t, kh, d), (b, t, kh, d)))
  pq, pk = (jnp.asarray(rng.uniform(0.1, 1, size=(b, t, h, f)), jnp.float32)
            for _ in range(2))
  gamma = jnp.full((h,), 0.3, jnp.float32)
  scale = jnp.asarray(rng.uniform(0.2, 5, size=(b, t, h, 1)), jnp.float32)
  y1, _ = attn_lib.orthros_prefill(q, k, v, pq, pk, gamma, window=0,
                                   chunk_size=4)
  y2, _ = attn_lib.orthros_prefill(q, k, v, pq * scale, pk, gamma, window=0,
                                   chunk_size=4)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
