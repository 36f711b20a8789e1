"""Model-level behaviour: cache consistency across phases, multi-turn
prefill, the linear-state invariant, errors. References are exact identities
of the model itself (forward vs prefill+decode) and float64 sums."""

import functools
import zlib

import flax.linen as nn

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax import feature_maps
from orthros_jax.model import Transformer

VOCAB = 71


def make_config(kind='orthros', feature_map='hedgehog', window=5, chunk=4,
                sinks=0, **kw):
  attention = oj.AttentionConfig(kind=kind, feature_map=feature_map,
                                 window=window, chunk_size=chunk, sinks=sinks,
                                 feature_dim=4 if feature_map == 'taylor'
                                 else 6)
  base = dict(vocab_size=VOCAB, num_layers=2, embed_dim=24, num_heads=4,
              num_kv_heads=2, head_dim=6, mlp_dim=40, attention=attention)
  base.update(kw)
  return oj.ModelConfig(**base)


@functools.partial(jax.jit, static_argnames=('config',))
def _init(config, rng):
  tokens = jnp.zeros((1, 8), jnp.int32)
  return nn.unbox(Transformer(config).init(rng, tokens,
                                           phase='forward')['params'])


def init_params(config, seed=0):
  params = _init(config, jax.random.PRNGKey(seed))
  # Random (not identity) feature maps and window weights, so the tests see
  # every term of the formula.
  def perturb(path, x):
    name = jax.tree_util.keystr(path)
    if 'phi_' in name or 'window_logit' in name:
      key = jax.random.PRNGKey(zlib.crc32(name.encode()))
      return x + 0.3 * jax.random.normal(key, x.shape, x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(perturb, params)


@functools.partial(jax.jit, static_argnames=('config', 'phase', 'all_logits'))
def run(config, params, tokens, *, phase, cache=None, lengths=None,
        split=None, all_logits=False):
  return Transformer(config).apply({'params': params}, tokens, phase=phase,
                                   cache=cache, lengths=lengths, split=split,
                                   all_logits=all_logits)


def random_tokens(seed, shape):
  return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, VOCAB)


def test_dense_prefill_then_decode_matches_forward():
  config = make_config(kind='dense')
  params = init_params(config)
  x = random_tokens(1, (2, 19))
  full, _ = run(config, params, x, phase='forward')
  cache = oj.init_cache(config, 2, 24)
  logits, cache = run(config, params, x[:, :7], phase='prefill', cache=cache,
                      all_logits=True)
  np.testing.assert_allclose(logits, full[:, :7], atol=2e-5, rtol=1e-5)
  for t in range(7, 19):
    step, cache = run(config, params, x[:, t:t + 1], phase='decode',
                      cache=cache)
    np.testing.assert_allclose(step[:, 0], full[:, t], atol=2e-5, rtol=1e-5)
  assert np.all(np.asarray(cache[0].lengths) == 19)


@pytest.mark.parametrize('feature_map,window,chunk,sinks', [
    ('hedgehog', 5, 4, 0), ('elu', 5, 4, 0), ('relu', 0, 3, 0),
    ('taylor', 12, 4, 0), ('hedgehog', 0, 3, 0), ('hedgehog', 12, 4, 0),
    ('hedgehog', 5, 4, 3), ('elu', 0, 3, 2)])
def test_orthros_prefill_then_decode_matches_split_forward(feature_map, window,
                                                           chunk, sinks):
  config = make_config(feature_map=feature_map, window=window, chunk=chunk,
                       sinks=sinks)
  params = init_params(config)
  x = random_tokens(2, (2, 21))
  p = 13
  full, _ = run(config, params, x, phase='forward', split=p)
  cache = oj.init_cache(config, 2, 32)
  pre, cache = run(config, params, x[:, :p], phase='prefill', cache=cache,
                   all_logits=True)
  np.testing.assert_allclose(pre, full[:, :p], atol=2e-5, rtol=1e-5)
  dec, cache = run(config, params, x[:, p:p + 5], phase='decode', cache=cache)
  np.testing.assert_allclose(dec, full[:, p:p + 5], atol=2e-5, rtol=1e-5)
  for t in range(p + 5, 21):  # one token at a time
    step, cache = run(config, params, x[:, t:t + 1], phase='decode',
                      cache=cache)
    np.testing.assert_allclose(step[:, 0], full[:, t], atol=2e-5, rtol=1e-5)


def test_split_per_example_and_extremes():
  config = make_config()
  params = init_params(config)
  x = random_tokens(3, (2, 17))
  dense, _ = run(make_config(kind='dense'), params, x, phase='forward')
  # split = 0 is the dense model (same weights; feature maps unused).
  zero, _ = run(config, params, x, phase='forward', split=0)
  np.testing.assert_allclose(zero, dense, atol=2e-5, rtol=1e-5)
  pure, _ = run(config, params, x, phase='forward')
  full_split, _ = run(config, params, x, phase='forward', split=17)
  np.testing.assert_allclose(full_split, pure, atol=2e-5, rtol=1e-5)
  mixed, _ = run(config, params, x, phase='forward', split=jnp.array([4, 11]))
  for b, s in enumerate([4, 11]):
    one, _ = run(config, params, x[b:b + 1], phase='forward', split=s)
    np.testing.assert_allclose(mixed[b], one[0], atol=2e-5, rtol=1e-5)


def test_ragged_prefill_matches_unpadded():
  config = make_config()
  params = init_params(config)
  x = random_tokens(4, (3, 15))
  lengths = jnp.array([15, 6, 11])
  cache = oj.init_cache(config, 3, 20)
  last, cache = run(config, params, x, phase='prefill', cache=cache,
                    lengths=lengths)
  for b, n in enumerate([15, 6, 11]):
    c1 = oj.init_cache(config, 1, 20)
    one, c1 = run(config, params, x[b:b + 1, :n], phase='prefill', cache=c1)
    np.testing.assert_allclose(last[b], one[0], atol=2e-5, rtol=1e-5)
    for layer, layer1 in zip(cache, c1):
      np.testing.assert_allclose(layer.k[b, :n], layer1.k[0, :n], atol=1e-6)
      np.testing.assert_allclose(layer.S[b], layer1.S[0], atol=1e-5,
                                 rtol=1e-5)
      np.testing.assert_allclose(layer.z[b], layer1.z[0], atol=1e-5,
                                 rtol=1e-5)
      assert int(layer.lengths[b]) == n


@pytest.mark.parametrize('kind,sinks', [('dense', 0), ('orthros', 0),
                                        ('orthros', 4)])
def test_prefill_in_two_pieces_equals_one(kind, sinks):
  """Multi-turn: a second prefill continues the first exactly (ragged); with
  sinks, the second turn reads them from the cache (first turn of 3 < 4)."""
  config = make_config(kind=kind, window=6, chunk=4, sinks=sinks)
  params = init_params(config)
  first, second = [9, 3], [7, 10]
  x = random_tokens(5, (2, 20))
  t1 = x[:, :9]
  t2 = x[:, 9:19]
  whole = [np.concatenate([np.asarray(t1[b, :first[b]]),
                           np.asarray(t2[b, :second[b]])]) for b in range(2)]
  cache = oj.init_cache(config, 2, 32)
  _, cache = run(config, params, t1, phase='prefill', cache=cache,
                 lengths=jnp.array(first))
  logits2, cache = run(config, params, t2, phase='prefill', cache=cache,
                       lengths=jnp.array(second), all_logits=True)
  for b in range(2):
    c1 = oj.init_cache(config, 1, 32)
    ref, c1 = run(config, params, jnp.asarray(whole[b])[None], phase='prefill',
                  cache=c1, all_logits=True)
    n1, n = first[b], first[b] + second[b]
    np.testing.assert_allclose(logits2[b, :second[b]], ref[0, n1:n],
                               atol=2e-5, rtol=1e-5)
    for layer, layer1 in zip(cache, c1):
      assert int(layer.lengths[b]) == n
      np.testing.assert_allclose(layer.k[b, :n], layer1.k[0, :n], atol=2e-6)
      np.testing.assert_allclose(layer.v[b, :n], layer1.v[0, :n], atol=2e-6)
      np.testing.assert_allclose(layer.S[b], layer1.S[0], atol=2e-5,
                                 rtol=1e-5)
      np.testing.assert_allclose(layer.z[b], layer1.z[0], atol=2e-5,
                                 rtol=1e-5)


def _assert_state_is_sums(config, params, layer, b, lo, hi):
  """(S, z) of example b are the section 3 sums over its cached keys and
  values lo <= j < hi (float64 reference)."""
  i, layer = layer
  w = params[f'layers_{i}']['attn']['phi_k']['proj']
  g = config.num_groups
  k = np.repeat(np.asarray(layer.k[b, lo:hi]), g, axis=1)  # [N, H, D]
  phi = np.asarray(feature_maps.feature_map(config.attention.feature_map, k,
                                            w), np.float64)
  v = np.repeat(np.asarray(layer.v[b, lo:hi], np.float64), g, axis=1)
  np.testing.assert_allclose(layer.S[b], np.einsum('nhf,nhd->hfd', phi, v),
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(layer.z[b], phi.sum(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('window,sinks', [(0, 0), (3, 0), (8, 0), (3, 2)])
def test_linear_state_matches_sums_over_cached_keys(window, sinks):
  """After a prefill (S, z) are the section 3 sums over the cached keys
  older than the window (sinks excepted); decode steps leave the state and
  `folded` as the prefill left them (each example by its own count), and a
  next-turn prefill folds every token decoded since first, so it continues
  exactly."""
  config = make_config(window=window, sinks=sinks)  # chunk 4
  params = init_params(config)
  x = random_tokens(6, (2, 21))
  cache = oj.init_cache(config, 2, 24)
  _, cache = run(config, params, x[:, :10], phase='prefill', cache=cache,
                 lengths=jnp.array([10, 4]))
  steps = [(10, 12), (12, 13), (13, 14), (14, 15), (15, 16), (16, 17),
           (17, 19)]
  behind = set()
  at_prefill = None
  for lo, hi in [(None, None)] + steps + [('prefill', 19)]:
    if lo == 'prefill':
      _, cache = run(config, params, x[:, hi:hi + 2], phase='prefill',
                     cache=cache)
    elif lo is not None:
      _, cache = run(config, params, x[:, lo:hi], phase='decode', cache=cache)
    for i, layer in enumerate(cache):
      for b in range(2):
        n, folded = int(layer.lengths[b]), int(layer.folded[b])
        old = max(n - window, 0)
        if lo in (None, 'prefill'):
          assert folded == old
        else:
          assert folded == int(at_prefill[i].folded[b])
          np.testing.assert_array_equal(layer.S[b], at_prefill[i].S[b])
          np.testing.assert_array_equal(layer.z[b], at_prefill[i].z[b])
        behind.add(old - folded)
        _assert_state_is_sums(config, params, (i, layer), b,
                              min(sinks, folded), folded)
    if lo in (None, 'prefill'):
      at_prefill = cache
    n = int(cache[0].lengths[0])
  assert n == 21 and int(cache[0].lengths[1]) == 15
  # The decode steps left the state behind by more than a chunk (one and
  # two new tokens a step), and the prefill caught up.
  assert max(behind) > config.attention.chunk_size and 0 in behind


def test_continued_prefill_after_decode_folds_what_decode_left():
  """A prefill after decode steps equals one over the same cache with the
  state rebuilt from every cached key (the whole-cache fold, for a cache
  built by hand), and layer 0 (whose inputs are the embeddings) equals one
  prefill of all the tokens."""
  config = make_config(window=3, sinks=1)  # chunk 4
  params = init_params(config)
  x = random_tokens(8, (2, 24))
  cache = oj.init_cache(config, 2, 28)
  _, cache = run(config, params, x[:, :7], phase='prefill', cache=cache,
                 lengths=jnp.array([7, 5]))
  for t in range(7, 16):
    _, cache = run(config, params, x[:, t:t + 1], phase='decode', cache=cache)
  assert (np.asarray(cache[0].lengths) == [16, 14]).all()
  # Decode folded nothing: the state is the prefill's (7 - 3 and 5 - 3
  # tokens) and every token decoded since is behind.
  np.testing.assert_array_equal(cache[0].folded, [4, 2])
  rebuilt = tuple(c.replace(S=jnp.zeros_like(c.S), z=jnp.zeros_like(c.z),
                            folded=jnp.zeros_like(c.folded)) for c in cache)
  more = x[:, 16:22]
  got, cache = run(config, params, more, phase='prefill', cache=cache,
                   all_logits=True)
  want, rebuilt = run(config, params, more, phase='prefill', cache=rebuilt,
                      all_logits=True)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  for a, b in zip(cache, rebuilt):
    np.testing.assert_array_equal(a.folded, b.folded)
    np.testing.assert_allclose(a.S, b.S, atol=2e-5, rtol=1e-5)
  for b, n0 in enumerate((7, 5)):
    ids = np.concatenate([np.asarray(x[b, :n0]), np.asarray(x[b, 7:22])])
    one = oj.init_cache(config, 1, 28)
    _, one = run(config, params, jnp.asarray(ids)[None], phase='prefill',
                 cache=one)
    n = len(ids)
    assert int(cache[0].lengths[b]) == n and int(cache[0].folded[b]) == n - 3
    np.testing.assert_allclose(cache[0].k[b, :n], one[0].k[0, :n], atol=2e-6)
    np.testing.assert_allclose(cache[0].S[b], one[0].S[0], atol=2e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(cache[0].z[b], one[0].z[0], atol=2e-5,
                               rtol=1e-5)


def test_bfloat16_model_runs_and_keeps_float32_state():
  config = make_config(dtype='bfloat16', param_dtype='float32')
  params = init_params(config)
  x = random_tokens(7, (2, 11))
  cache = oj.init_cache(config, 2, 16)
  assert cache[0].k.dtype == jnp.bfloat16 and cache[0].S.dtype == jnp.float32
  logits, cache = run(config, params, x, phase='prefill', cache=cache)
  ref, _ = run(make_config(), params, x, phase='forward')
  assert logits.dtype == jnp.float32 and cache[0].S.dtype == jnp.float32
  # bfloat16 keeps 8 mantissa bits (eps = 2^-8); two layers of bf16
  # activations stay within 4 eps of the logits' scale of float32 (measured
  # 1.3 eps).
  eps = 2.0 ** -8
  err = np.abs(np.asarray(logits) - np.asarray(ref[:, -1])).max()
  assert err <= 4 * eps * np.abs(np.asarray(ref)).max(), err
  # The linear state is accumulated in float32 from the bf16 cache: it
  # equals the float64 sums over the cached keys to float32 rounding (a
  # bf16 accumulation would be off by ~1e-2 relative).
  a = config.attention
  for i, layer in enumerate(cache):
    w = params[f'layers_{i}']['attn']['phi_k']['proj']
    k = np.repeat(np.asarray(layer.k[:, :11 - a.window], np.float32),
                  config.num_groups, axis=2)
    v = np.repeat(np.asarray(layer.v[:, :11 - a.window], np.float64),
                  config.num_groups, axis=2)
    phi = np.asarray(feature_maps.feature_map(a.feature_map, k, w),
                     np.float64)
    np.testing.assert_allclose(layer.S, np.einsum('bnhf,bnhd->bhfd', phi, v),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.z, phi.sum(1), rtol=1e-5, atol=1e-6)


def test_params_carry_logical_axes():
  config = make_config()
  boxed = jax.eval_shape(
      functools.partial(Transformer(config).init, phase='forward'),
      jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))['params']
  specs = nn.get_partition_spec(boxed)
  attn = specs['layers_0']['attn']
  assert tuple(attn['q_proj']['kernel']) == ('embed', 'heads', 'head_dim')
  assert tuple(attn['k_proj']['kernel']) == ('embed', 'kv_heads', 'head_dim')
  assert tuple(attn['o_proj']['kernel']) == ('heads', 'head_dim', 'embed')
  assert tuple(attn['phi_q']['proj']) == ('heads', 'head_dim', 'features')
  assert tuple(specs['layers_0']['mlp']['down_proj']['kernel']) == ('mlp',
                                                                    'embed')
  assert tuple(specs['embed']['embedding']) == ('vocab', 'embed')


def test_init_cache_shapes():
  config = make_config(feature_map='taylor')
  cache = oj.init_cache(config, 3, 40, jnp.bfloat16)
  assert len(cache) == config.num_layers
  layer = cache[0]
  f = 1 + 4 + 16
  assert layer.k.shape == (3, 40, 2, 6) and layer.k.dtype == jnp.bfloat16
  assert layer.S.shape == (3, 4, f, 6) and layer.S.dtype == jnp.float32
  assert layer.z.shape == (3, 4, f) and layer.lengths.dtype == jnp.int32
  dense = oj.init_cache(make_config(kind='dense'), 1, 8)
  assert dense[0].S.shape == (1, 4, 0, 6)


@pytest.mark.parametrize('kwargs,match', [
    (dict(num_heads=4, num_kv_heads=3), 'num_kv_heads'),
    (dict(head_dim=7), 'head_dim'),
    (dict(vocab_size=0), 'vocab_size'),
    (dict(dtype='int32'), 'dtype'),
])
def test_bad_model_config_names_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_config(**kwargs)


@pytest.mark.parametrize('kwargs,match', [
    (dict(kind='sparse'), 'attention.kind'),
    (dict(feature_map='cosine'), 'attention.feature_map'),
    (dict(window=-1), 'attention.window'),
    (dict(chunk_size=0), 'attention.chunk_size'),
    (dict(impl='cuda'), 'attention.impl'),
    (dict(window_init=1.5), 'attention.window_init'),
    (dict(exact_tail=-2), 'attention.exact_tail'),
    (dict(sinks=-1), 'attention.sinks'),
])
def test_bad_attention_config_names_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    oj.AttentionConfig(**kwargs)


def test_model_call_errors():
  config = make_config()
  params = init_params(config)
  model = Transformer(config)
  apply = lambda x, **kw: model.apply({'params': params}, x, **kw)
  x = random_tokens(8, (2, 6))
  with pytest.raises(ValueError, match='phase'):
    apply(x, phase='train')
  with pytest.raises(ValueError, match='needs a cache'):
    apply(x, phase='prefill')
  with pytest.raises(ValueError, match='max_len'):
    apply(x, phase='prefill', cache=oj.init_cache(config, 2, 4))
  with pytest.raises(ValueError, match='vocab_size'):
    apply(x.at[0, 0].set(VOCAB), phase='forward')
  with pytest.raises(ValueError, match='vocab_size'):
    apply(x.at[1, 2].set(-1), phase='forward')
  with pytest.raises(ValueError, match='batch'):
    apply(x, phase='prefill', cache=oj.init_cache(config, 3, 8))
  with pytest.raises(ValueError, match='state_dim'):
    apply(x, phase='prefill',
          cache=oj.init_cache(make_config(kind='dense'), 2, 8))
  cache = oj.init_cache(config, 2, 8)
  _, cache = apply(x, phase='prefill', cache=cache)
  with pytest.raises(ValueError, match='cache overflow'):
    apply(x[:, :3], phase='decode', cache=cache)
  # Under jit the lengths are traced; the overflow is still an error (it
  # used to write nowhere and return wrong logits), and a step that fits
  # runs.
  jitted = jax.jit(lambda tokens, cache, lengths=None: Transformer(
      config).apply({'params': params}, tokens,
                    phase='prefill' if lengths is not None else 'decode',
                    cache=cache, lengths=lengths))
  with pytest.raises(Exception, match='cache overflow.*reach 9 > max_len=8'):
    jax.block_until_ready(jitted(x[:, :3], cache))
  logits, _ = jitted(x[:, :2], cache)
  assert np.all(np.isfinite(np.asarray(logits)))
  fresh = oj.init_cache(config, 2, 8)
  _, fresh = jitted(x, fresh, jnp.array([6, 2]))
  with pytest.raises(Exception, match='cache overflow.*reach 9 > max_len=8'):
    jax.block_until_ready(jitted(x[:, :3], fresh, jnp.array([3, 1])))
  # check_overflow=False (loops whose caller sized the cache) skips the
  # host round trip: the same overflowing call then returns.
  unchecked = jax.jit(lambda tokens, cache: Transformer(config).apply(
      {'params': params}, tokens, phase='decode', cache=cache,
      check_overflow=False))
  jax.block_until_ready(unchecked(x[:, :3], cache))
  with pytest.raises(ValueError, match='lengths'):
    apply(x, phase='prefill', cache=oj.init_cache(config, 2, 8),
          lengths=jnp.array([7, 2]))
  with pytest.raises(ValueError, match="impl='pallas'"):
    bad = make_config().replace(attention={'impl': 'pallas'})
    Transformer(bad).apply({'params': params}, x, phase='forward')
  with pytest.raises(ValueError, match='batch'):
    oj.init_cache(config, 0, 8)


def test_split_and_empty_tokens_are_checked():
  """split outside [0, T], of the wrong batch size or not integer, and an
  empty token array, are errors naming what is wrong (they were taken as
  0 / T silently, or failed deep inside with a broadcasting or
  zero-size-reduction error)."""
  config = make_config()
  params = init_params(config)
  x = random_tokens(8, (2, 6))
  fwd = lambda split, tokens=x: Transformer(config).apply(
      {'params': params}, tokens, phase='forward', split=split)
  for bad in (jnp.array([-1, 2]), jnp.array([7, 2]), 7):
    with pytest.raises(ValueError, match=r'split must lie in \[0, T=6\]'):
      fwd(bad)
  with pytest.raises(ValueError, match=r'\[B\]=2'):
    fwd(jnp.array([1, 2, 3]))
  with pytest.raises(ValueError, match='integers'):
    fwd(jnp.array([1.0, 2.0]))
  # The bounds themselves are valid: 0 is the dense model, T the prefill.
  dense = Transformer(make_config(kind='dense')).apply(
      {'params': params}, x, phase='forward')[0]
  np.testing.assert_allclose(fwd(0)[0], dense, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(fwd(jnp.array([6, 6]))[0], fwd(None)[0],
                             rtol=1e-6, atol=1e-6)
  for phase in ('forward', 'prefill'):
    with pytest.raises(ValueError, match=r'shape \(2, 0\)'):
      Transformer(config).apply(
          {'params': params}, jnp.zeros((2, 0), jnp.int32), phase=phase,
          cache=None if phase == 'forward' else oj.init_cache(config, 2, 8))
