"""Layers scanned (`ModelConfig.scan_layers`) compute what the unrolled
layers compute, on the same weights (`stack_layers`), in every phase, and
rematerialization (`ModelConfig.remat`) changes no gradient."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orthros_jax import cache as cache_lib
from orthros_jax import config as config_lib
from orthros_jax import model as model_lib
from orthros_jax.cache import init_cache
from orthros_jax.config import AttentionConfig
from orthros_jax.config import ModelConfig
from orthros_jax.generate import generate
from orthros_jax.model import Transformer
from orthros_jax.layer_layout import layers_for
from orthros_jax.layer_layout import stack_layers
from orthros_jax.layer_layout import unstack_layers

ORTHROS = AttentionConfig(kind='orthros', window=8, chunk_size=8,
                          feature_dim=6, feature_map='hedgehog', sinks=2)


def _config(attention=ORTHROS, **kw):
  return ModelConfig(vocab_size=101, num_layers=3, embed_dim=36, num_heads=6,
                     num_kv_heads=2, head_dim=6, mlp_dim=44,
                     attention=attention, **kw)


def _params(config, seed=0):
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = Transformer(config).init(jax.random.PRNGKey(seed), tokens,
                                    phase='forward')['params']
  # Non-zero everywhere (fresh window logits and norms are constants).
  leaves, tree = jax.tree.flatten(nn.unbox(params))
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [
      x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)])


def _tokens(b, t, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 101, (b, t)),
                     jnp.int32)


def _stack(cache):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *cache)


@pytest.mark.parametrize('attention', [ORTHROS, AttentionConfig(
    kind='dense')], ids=['orthros', 'dense'])
def test_scanned_layers_match_unrolled_in_every_phase(attention):
  """forward (with a ragged split), a ragged prefill, decode steps past a
  chunk and a continued prefill that folds them: logits and every cache field of the
  scanned model equal the unrolled model's on the same weights."""
  cfg = _config(attention)
  scfg = cfg.replace(scan_layers=True)
  params = _params(cfg)
  sparams = stack_layers(params)
  jit = lambda m: jax.jit(m.apply, static_argnames='phase')
  unrolled, scanned = jit(Transformer(cfg)), jit(Transformer(scfg))
  tokens = _tokens(2, 29)
  split = jnp.array([11, 29])
  want, _ = unrolled({'params': params}, tokens, phase='forward',
                     split=split)
  got, none = scanned({'params': sparams}, tokens, phase='forward',
                      split=split)
  assert none is None
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  c1, c2 = init_cache(cfg, 2, 64), init_cache(scfg, 2, 64)
  assert cache_lib.is_stacked(c2) and not cache_lib.is_stacked(c1)
  steps = [('prefill', tokens, jnp.array([29, 17]))]
  steps += [('decode', _tokens(2, 1, seed=s), None) for s in range(10)]
  steps += [('prefill', _tokens(2, 13, seed=5), jnp.array([13, 6]))]
  for phase, toks, lengths in steps:
    want, c1 = unrolled({'params': params}, toks, phase=phase, cache=c1,
                        lengths=lengths)
    got, c2 = scanned({'params': sparams}, toks, phase=phase, cache=c2,
                      lengths=lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for field in ('k', 'v', 'S', 'z', 'lengths', 'folded'):
      np.testing.assert_allclose(getattr(c2, field),
                                 getattr(_stack(c1), field), rtol=1e-5,
                                 atol=1e-5, err_msg=f'{phase} {field}')
  np.testing.assert_array_equal(cache_lib.lengths(c2), [29 + 10 + 13,
                                                        17 + 10 + 6])
  assert cache_lib.num_layers(c2) == cache_lib.num_layers(c1) == 3
  if cfg.is_orthros:  # decode left the state behind; the last prefill caught up
    np.testing.assert_array_equal(c2.folded[0], cache_lib.lengths(c2) - 8)


def test_scanned_generate_matches_unrolled():
  """generate (jitted prefill, exact tail, while_loop decode) gives the same
  tokens with the layers scanned."""
  cfg = _config()
  params = _params(cfg, seed=3)
  prompts = _tokens(2, 23, seed=4)
  kw = dict(lengths=jnp.array([23, 15]), max_new_tokens=12, exact_tail=3)
  want = generate(cfg, params, prompts, **kw)
  got = generate(cfg.replace(scan_layers=True), stack_layers(params),
                 prompts, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_remat_changes_no_gradient():
  """The gradient of a loss through forward(split) with each remat policy,
  unrolled and scanned, equals the plain unrolled gradient."""
  cfg = _config()
  params = _params(cfg, seed=7)
  tokens = _tokens(2, 21, seed=8)
  split = jnp.array([9, 16])

  def grad(config, p):
    def loss(p):
      logits, _ = Transformer(config).apply({'params': p}, tokens,
                                            phase='forward', split=split)
      return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])
    return jax.jit(jax.grad(loss))(layers_for(config, p))

  want = grad(cfg, params)
  for scan, remat in ((False, 'full'), (True, 'dots_no_batch'),
                      (True, 'dots'), (True, 'full')):
    got = unstack_layers(grad(cfg.replace(scan_layers=scan, remat=remat),
                              params))
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want)):
      np.testing.assert_allclose(
          g, w, rtol=2e-4, atol=1e-6,
          err_msg=f'{scan} {remat} {jax.tree_util.keystr(path)}')


def test_layer_layouts_convert_both_ways_and_init_agrees():
  """stack_layers / unstack_layers are inverse, exact; the scanned model's
  own init has the stacked layout's shapes; layers_for picks the layout
  the config asks for; a layout that does not fit is a clear error."""
  cfg = _config()
  params = _params(cfg)
  stacked = stack_layers(params)
  assert set(stacked) == {'embed', 'final_norm', 'layers', 'lm_head'}
  assert stacked['layers']['attn']['q_proj']['kernel'].shape == (3, 36, 6, 6)
  back = unstack_layers(stacked)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(x, y)
  own = nn.unbox(Transformer(cfg.replace(scan_layers=True)).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
      phase='forward')['params'])
  assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, stacked)
  assert 'layers' in layers_for(cfg.replace(scan_layers=True), params)
  assert 'layers_2' in layers_for(cfg, stacked)
  assert stack_layers(stacked) == stacked  # already stacked: unchanged
  gap = {k: v for k, v in params.items() if k != 'layers_1'}
  with pytest.raises(ValueError, match='layers_0 .. layers_'):
    stack_layers(gap)


def test_cache_layout_and_config_errors():
  cfg = _config()
  params = _params(cfg)
  tokens = _tokens(1, 5)
  with pytest.raises(ValueError, match='scan_layers=False, the cache is one '
                     'stacked'):
    Transformer(cfg).apply({'params': params}, tokens, phase='prefill',
                           cache=init_cache(cfg.replace(scan_layers=True),
                                            1, 8))
  scfg = cfg.replace(scan_layers=True)
  with pytest.raises(ValueError, match='scan_layers=True, the cache is a '
                     'tuple'):
    Transformer(scfg).apply({'params': stack_layers(params)}, tokens,
                            phase='prefill', cache=init_cache(cfg, 1, 8))
  with pytest.raises(ValueError, match='cache overflow'):
    Transformer(scfg).apply({'params': stack_layers(params)},
                            _tokens(1, 7), phase='prefill',
                            cache=cache_lib.map_layers(
                                lambda c: c.replace(lengths=c.lengths + 3),
                                init_cache(scfg, 1, 8)))
  with pytest.raises(ValueError, match='remat'):
    cfg.replace(remat='everything')
  with pytest.raises(ValueError, match='scan_layers'):
    cfg.replace(scan_layers=1)
  # The config's names and the model's policies are one list.
  assert set(model_lib.REMAT_POLICIES) == set(config_lib.REMAT_POLICIES)
