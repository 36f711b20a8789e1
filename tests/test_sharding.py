"""Sharding on 8 fake CPU devices (conftest.py sets the XLA flag): meshes and
rules, sharded training and generation equal to one device, FSDP memory,
context-parallel prefill and decode equal to single-device attention."""

import contextlib
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orthros_jax import AttentionConfig
from orthros_jax import ModelConfig
from orthros_jax import Transformer
from orthros_jax import generate
from orthros_jax import init_cache
from orthros_jax import sharding
from orthros_jax.attention import context_parallel
from orthros_jax.attention import dispatch
from orthros_jax.attention.orthros import LinearState
from orthros_jax.attention.orthros import WindowPrefix
from orthros_jax.attention.orthros import orthros_prefill
from orthros_jax.attention.softmax import decode_attention
from orthros_jax.conversion import stages
from orthros_jax.conversion.lora import init_lora
from orthros_jax.layer_layout import stack_layers
from jax.sharding import PartitionSpec as P

from orthros_jax.sharding import Partitioner
from orthros_jax.training import loop
from orthros_jax.training import state as state_lib
from orthros_jax.training import step as step_lib

CFG = ModelConfig(
    vocab_size=64, num_layers=1, embed_dim=32, num_heads=8, num_kv_heads=4,
    head_dim=8, mlp_dim=48, attention=AttentionConfig(
        kind='orthros', feature_dim=4, window=5, chunk_size=4))
MESHES = [{'data': 8}, {'fsdp': 8}, {'tensor': 4},
          {'data': 2, 'fsdp': 2, 'tensor': 2},
          {'data': 2, 'tensor': 2, 'sequence': 2}]


def _mesh_id(shape):
  return '-'.join(f'{k}{v}' for k, v in shape.items())


def _partitioner(shape):
  n = int(np.prod(list(shape.values())))
  return Partitioner.create(shape, devices=jax.devices()[:n])


def test_eight_devices():
  assert jax.device_count() == 8


def test_make_mesh_shapes_and_errors():
  mesh = sharding.make_mesh({'fsdp': -1, 'tensor': 2})
  assert dict(mesh.shape) == {'data': 1, 'fsdp': 4, 'tensor': 2,
                              'sequence': 1}
  assert dict(sharding.make_mesh((2, 2, 2, 1)).shape)['tensor'] == 2
  assert dict(sharding.make_mesh().shape)['data'] == 8
  with pytest.raises(ValueError, match='needs 4 devices but 8'):
    sharding.make_mesh({'data': 4})
  with pytest.raises(ValueError, match='unknown axes'):
    sharding.make_mesh({'model': 8})
  with pytest.raises(ValueError, match='at most one -1'):
    sharding.make_mesh({'data': -1, 'fsdp': -1})
  with pytest.raises(ValueError, match='cannot fill'):
    sharding.make_mesh({'data': -1, 'fsdp': 3})


def test_from_config():
  ones = {'shape': {'data': 1, 'fsdp': 1, 'tensor': 1, 'sequence': 1}}
  assert Partitioner.from_config(ones) is None
  assert Partitioner.from_config(None) is None
  part = Partitioner.from_config({'shape': {'fsdp': 4}, 'rules': ()})
  assert part.mesh.size == 4 and part.rules == sharding.DEFAULT_RULES
  assert Partitioner.from_config({'shape': {'data': -1}}).mesh.size == 8
  with pytest.raises(ValueError, match='needs 16 devices'):
    Partitioner.from_config({'shape': {'fsdp': 16}})
  with pytest.raises(ValueError, match='unknown keys'):
    Partitioner.from_config({'shape': {'fsdp': 2}, 'axes': ()})
  with pytest.raises(ValueError, match="mesh axis 'model'"):
    Partitioner.create({'fsdp': 8}, rules=[('embed', 'model')])


def test_param_specs_follow_rules():
  part = _partitioner({'fsdp': 2, 'tensor': 4})
  sh = part.model_param_shardings(CFG)
  layer = sh['layers_0']
  assert layer['attn']['q_proj']['kernel'].spec == P('fsdp', 'tensor', None)
  assert layer['attn']['k_proj']['kernel'].spec == P('fsdp', 'tensor', None)
  assert layer['attn']['o_proj']['kernel'].spec == P('tensor', None, 'fsdp')
  assert layer['mlp']['gate_proj']['kernel'].spec == P('fsdp', 'tensor')
  assert sh['embed']['embedding'].spec == P('tensor', 'fsdp')
  assert layer['attn']['phi_q']['proj'].spec == P('tensor', None, 'fsdp')
  assert layer['attn']['window_logit'].spec == P('tensor',)
  # A size the axes do not divide is left whole (vocab 259 over tensor 4).
  odd = CFG.replace(vocab_size=259)
  assert part.model_param_shardings(odd)['embed']['embedding'].spec == P(
      None, 'fsdp')
  # Activations: batch takes data + fsdp, so embed stays whole.
  assert part.spec(('batch', 'length', 'embed')) == P(('data', 'fsdp'),
                                                       'sequence', None)


def _batch(i, b=8, t=24):
  r = np.random.default_rng(i)
  x = r.integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)
  return {'inputs': x[:, :-1], 'targets': x[:, 1:],
          'weights': (r.uniform(size=(b, t)) > 0.2).astype(np.float32),
          'prompt_lengths': r.integers(0, t, (b,)).astype(np.int32)}


def _params_init():
  return nn.unbox(Transformer(CFG).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32),
      phase='forward')['params'])


def _train(part, steps=2):
  tc = loop.TrainConfig(learning_rate=1e-2, warmup_steps=1, num_steps=10)
  tx = tc.optimizer()
  init = state_lib.init_fn(_params_init, tx)
  if part is None:
    state = init()
  else:
    abstract = jax.eval_shape(init)
    shardings = part.state_shardings(abstract,
                                     part.model_param_shardings(CFG))
    with part.activate():
      state = jax.jit(init, out_shardings=shardings)()
  train_step = step_lib.make_train_step(CFG, split_mode='random',
                                        partitioner=part)
  losses = []
  for i in range(steps):
    state, metrics = train_step(state, _batch(i), jax.random.PRNGKey(i))
    losses.append(float(metrics['loss']))
  return state, losses


@pytest.fixture(scope='module')
def single_device_run():
  return _train(None)


@pytest.mark.parametrize('shape', MESHES, ids=_mesh_id)
def test_train_step_equals_single_device(shape, single_device_run):
  ref_state, ref_losses = single_device_run
  part = _partitioner(shape)
  state, losses = _train(part)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for (path, a), b in zip(
      jax.tree_util.tree_flatten_with_path(ref_state.params)[0],
      jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                               atol=1e-5, err_msg=str(path))
  # The state really is sharded as the rules say, and stays so.
  q = state.params['layers_0']['attn']['q_proj']['kernel']
  expect = part.model_param_shardings(CFG)['layers_0']['attn']['q_proj'][
      'kernel']
  assert q.sharding.is_equivalent_to(expect, q.ndim)
  mu = state.opt_state
  mu_leaves = [x for x in jax.tree.leaves(mu) if x.shape == q.shape]
  assert mu_leaves and all(x.sharding.is_equivalent_to(expect, q.ndim)
                           for x in mu_leaves)


@pytest.mark.parametrize('shape', MESHES, ids=_mesh_id)
def test_generation_equals_single_device(shape):
  params = jax.tree.map(
      lambda x: x + 0.2 * jax.random.normal(jax.random.PRNGKey(3), x.shape),
      _params_init())
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(1, CFG.vocab_size, n))
             for n in (30, 17, 25, 40, 33, 12, 28, 36)]
  ref = generate(CFG, params, prompts, max_new_tokens=6)
  part = _partitioner(shape)
  out = generate(CFG, part.shard_params(params, CFG), prompts,
                 max_new_tokens=6, partitioner=part)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  k = out.cache[0].k
  assert k.sharding.is_equivalent_to(
      part.cache_shardings(out.cache)[0].k, k.ndim)


@pytest.mark.parametrize('shape', [{'data': 2, 'fsdp': 2, 'tensor': 2},
                                   {'data': 2, 'tensor': 2, 'sequence': 2}],
                         ids=_mesh_id)
def test_scanned_layers_on_a_mesh_equal_unrolled_single_device(shape):
  """A scan_layers model (3 layers) generates on a mesh what the unrolled
  model generates on one device; its stacked params and cache shard like
  the unrolled ones with the layer axis whole."""
  cfg = CFG.replace(num_layers=3)
  scfg = cfg.replace(scan_layers=True)
  params = Transformer(cfg).init(jax.random.PRNGKey(4), jnp.zeros(
      (1, 8), jnp.int32), phase='forward')['params']
  params = jax.tree.map(
      lambda x: x + 0.2 * jax.random.normal(jax.random.PRNGKey(3), x.shape),
      nn.unbox(params))
  rng = np.random.default_rng(6)
  prompts = [list(rng.integers(1, cfg.vocab_size, n))
             for n in (30, 17, 25, 40, 33, 12, 28, 36)]
  ref = generate(cfg, params, prompts, max_new_tokens=6)
  part = _partitioner(shape)
  stacked = part.shard_params(stack_layers(params), scfg)
  out = generate(scfg, stacked, prompts, max_new_tokens=6, partitioner=part)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  q = stacked['layers']['attn']['q_proj']['kernel']
  one = part.model_param_shardings(cfg)['layers_0']['attn']['q_proj'][
      'kernel']
  assert q.sharding.is_equivalent_to(
      jax.sharding.NamedSharding(part.mesh, P(None, *one.spec)), q.ndim)
  assert any(a is not None for a in one.spec)  # the check is not vacuous
  k = out.cache.k  # one LayerCache [L, B, S, K, D]
  assert k.shape[0] == 3
  assert k.sharding.is_equivalent_to(part.cache_shardings(out.cache).k,
                                     k.ndim)
  assert k.sharding.spec[0] is None


def test_conversion_objectives_run_the_prefill_under_shard_map(monkeypatch):
  """Stage 1 and stage 2 on a mesh put the Orthros prefill under the
  placement's shard_map, traced as on a GPU (where impl='auto' picks the
  Pallas kernel, which XLA cannot partition by itself); without a placement
  neither does. Stage 1's student attention once missed its placement."""
  monkeypatch.setattr(dispatch, '_backend', lambda: 'gpu')
  part = _partitioner({'data': 4})
  params = _params_init()
  batch = {'inputs': jnp.ones((4, 16), jnp.int32),
           'targets': jnp.ones((4, 16), jnp.int32),
           'weights': jnp.ones((4, 16), jnp.float32),
           'prompt_lengths': jnp.full((4,), 8, jnp.int32)}
  rng = jax.random.PRNGKey(0)

  lora = {'base': params, 'lora': init_lora(params, rng, rank=2)}
  for make, p in ((stages.transfer_objective, params),
                  (stages.finetune_objective, lora)):
    for placement, expect in ((part.placement, True), (None, False)):
      jaxpr = str(jax.make_jaxpr(make(CFG, placement=placement))(
          p, batch, rng))
      assert ('shard_map' in jaxpr) == expect, (make.__name__, placement)


def test_a_backend_built_for_another_config_is_refused():
  part = _partitioner({'data': 4})
  other = CFG.replace(attention={'window': 7})
  model = Transformer(CFG, part.attention_backend(other))
  with pytest.raises(ValueError, match='another config'):
    model.init(jax.random.PRNGKey(0), jnp.zeros((4, 8), jnp.int32),
               phase='forward')
  Transformer(CFG, part.attention_backend(CFG)).init(
      jax.random.PRNGKey(0), jnp.zeros((4, 8), jnp.int32), phase='forward')


def test_fsdp_parameter_memory_is_one_eighth():
  cfg = ModelConfig(vocab_size=256, num_layers=2, embed_dim=64, num_heads=8,
                    num_kv_heads=4, head_dim=16, mlp_dim=128,
                    attention=AttentionConfig(kind='orthros', feature_dim=8))
  part = _partitioner({'fsdp': 8})
  params = part.init_params(cfg, jax.random.PRNGKey(0))
  mem = sharding.bytes_per_device(params)
  assert mem['total_bytes'] == 4 * cfg.num_params() + 4 * (
      2 * 2 * 8 * 16 * 8 + 2 * 8)  # + feature maps and window weights
  # Only the per-head window weights (8 floats a layer) stay replicated.
  assert mem['max_device_bytes'] == (mem['total_bytes'] - 2 * 4 * 8) / 8 + (
      2 * 4 * 8)
  assert 0.125 <= mem['fraction'] < 0.126
  # Sharded init gives the same values as the plain init.
  plain = jax.jit(lambda r: nn.unbox(Transformer(cfg).init(
      r, jnp.zeros((1, 8), jnp.int32), phase='forward')['params']))(
          jax.random.PRNGKey(0))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6)


def test_sharded_training_resumes_from_checkpoint(tmp_path):
  """loop.train on an FSDP x tensor mesh, killed after 2 steps (a fresh
  call resumes from the orbax checkpoint into the same shardings), equals an
  uninterrupted single-device run."""
  def data():
    i = 0
    while True:
      yield _batch(i)
      i += 1

  def run(workdir, part, steps):
    cfg = loop.TrainConfig(num_steps=steps, learning_rate=1e-2,
                           warmup_steps=1, split_mode='random',
                           checkpoint_every=2, log_every=1, progress=False,
                           async_checkpoint=False)
    it = data()
    for _ in range(loop.ckpt_lib.CheckpointManager(
        os.path.join(workdir, 'checkpoints')).latest_step() or 0):
      next(it)  # this generator has no saved state; skip what was seen
    return loop.train(cfg, workdir, CFG, _params_init, it,
                      partitioner=part)

  part = _partitioner({'fsdp': 4, 'tensor': 2})
  run(str(tmp_path / 'sharded'), part, 2)
  state, history = run(str(tmp_path / 'sharded'), part, 4)
  assert [h['step'] for h in history] == [3, 4]
  ref, ref_history = run(str(tmp_path / 'plain'), None, 4)
  np.testing.assert_allclose([h['loss'] for h in history],
                             [h['loss'] for h in ref_history[2:]], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                               atol=1e-5)
  q = state.params['layers_0']['attn']['q_proj']['kernel']
  assert q.sharding.spec == P('fsdp', 'tensor', None)


# -- context parallelism ------------------------------------------------------


def _random_prefill_inputs(rng, b, t, h, kh, d, f):
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, k, v = n(b, t, h, d), n(b, t, kh, d), n(b, t, kh, d)
  phi = lambda x: jnp.asarray(np.abs(rng.normal(size=x)) + 0.1, jnp.float32)
  return q, k, v, phi((b, t, h, f)), phi((b, t, h, f)), jnp.asarray(
      rng.uniform(0.2, 0.9, size=h), jnp.float32)


@pytest.mark.parametrize('n,window', [(2, 5), (4, 5), (8, 5), (4, 0)])
def test_context_parallel_prefill_function(n, window):
  """Ragged lengths, T not divisible by n, a continued prefill (initial
  state + window prefix), GQA, heads also split over 'tensor'."""
  rng = np.random.default_rng(n + window)
  b, t, h, kh, d, f = 2, 45, 4, 2, 8, 6
  q, k, v, pq, pk, gamma = _random_prefill_inputs(rng, b, t, h, kh, d, f)
  lengths = jnp.array([45, 29], jnp.int32)
  init = LinearState(jnp.asarray(rng.uniform(size=(b, h, f, d)), jnp.float32),
                     jnp.asarray(rng.uniform(size=(b, h, f)), jnp.float32))
  prefix = None
  if window:
    prefix = WindowPrefix(
        *(jnp.asarray(rng.normal(size=s), jnp.float32)
          for s in ((b, window, kh, d), (b, window, kh, d))),
        jnp.asarray(np.abs(rng.normal(size=(b, window, h, f))), jnp.float32),
        jnp.array([[True] * window, [False] * 2 + [True] * (window - 2)]))
  kwargs = dict(window=window, chunk_size=4, lengths=lengths,
                initial_state=init, prefix=prefix)
  y_ref, s_ref = orthros_prefill(q, k, v, pq, pk, gamma, **kwargs)
  shape = {'sequence': n} if n == 8 else {'sequence': n, 'tensor': 2}
  mesh = _partitioner(shape).mesh
  y, s = jax.jit(lambda *a: context_parallel.prefill(
      *a, mesh=mesh, seq_axis='sequence', head_axes='tensor' if n < 8
      else None, **kwargs))(q, k, v, pq, pk, gamma)
  valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(np.asarray(y)[valid], np.asarray(y_ref)[valid],
                             rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(s.S, s_ref.S, rtol=2e-5, atol=1e-5)
  np.testing.assert_allclose(s.z, s_ref.z, rtol=2e-5, atol=1e-5)


def test_context_parallel_prefill_needs_a_window_per_shard():
  rng = np.random.default_rng(0)
  args = _random_prefill_inputs(rng, 1, 20, 2, 2, 4, 4)
  mesh = _partitioner({'sequence': 8}).mesh
  with pytest.raises(ValueError, match='at least window=5 tokens per shard'):
    context_parallel.prefill(*args, window=5, chunk_size=4, mesh=mesh,
                             seq_axis='sequence')


@pytest.mark.parametrize('n', [2, 4, 8])
def test_context_parallel_decode_function(n):
  rng = np.random.default_rng(n)
  b, tq, h, kh, d, s = 2, 3, 4, 2, 8, 48
  q = jnp.asarray(rng.normal(size=(b, tq, h, d)), jnp.float32)
  kc = jnp.asarray(rng.normal(size=(b, s, kh, d)), jnp.float32)
  vc = jnp.asarray(rng.normal(size=(b, s, kh, d)), jnp.float32)
  lengths = jnp.array([41, 4], jnp.int32)  # one cache mostly in shard 0
  ref = decode_attention(q, kc, vc, lengths)
  mesh = _partitioner({'sequence': n}).mesh
  y = jax.jit(lambda *a: context_parallel.decode(
      *a, mesh=mesh, seq_axis='sequence'))(q, kc, vc, lengths)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
  # NaN in the slots past each cache's length changes nothing.
  past = np.arange(s)[None, :] >= np.asarray(lengths)[:, None]
  vc_nan = jnp.where(past[:, :, None, None], jnp.nan, vc)
  y_nan = jax.jit(lambda *a: context_parallel.decode(
      *a, mesh=mesh, seq_axis='sequence'))(q, kc, vc_nan, lengths)
  np.testing.assert_allclose(y_nan, ref, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='not divisible'):
    context_parallel.decode(q, kc[:, :45], vc[:, :45], lengths, mesh=mesh,
                            seq_axis='sequence')


def _prefill_decode(params, tokens, lengths, part, max_len=64):
  model = Transformer(CFG) if part is None else part.model(CFG)
  prefill = jax.jit(lambda p, t, l, c: model.apply(
      {'params': p}, t, phase='prefill', cache=c, lengths=l,
      all_logits=True))
  decode = jax.jit(lambda p, t, c: model.apply({'params': p}, t,
                                               phase='decode', cache=c))
  outs = []
  cache = init_cache(CFG, tokens.shape[0], max_len)
  ctx = contextlib.nullcontext()
  if part is not None:
    cache = part.shard_cache(cache)
    ctx = part.activate()
  with ctx:
    out, cache = prefill(params, tokens, lengths, cache)
    outs.append(out)
    for s in range(3):
      out, cache = decode(params, tokens[:, s:s + 2], cache)
      outs.append(out)
    # A short continued prefill (a chat turn): the ordinary path on the
    # position-sharded cache.
    out, cache = prefill(params, tokens[:, :13], jnp.array([13, 7]), cache)
    outs.append(out)
  return outs, cache


@pytest.mark.parametrize('n', [2, 4, 8])
def test_context_parallel_model_prefill_and_decode(n):
  """Transformer prefill over a 'sequence' mesh equals one device (outputs,
  KV cache, linear state; 45 tokens, ragged), and so does decoding over the
  position-sharded cache."""
  rng = np.random.default_rng(0)
  params = jax.tree.map(
      lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(1), x.shape),
      _params_init())
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 45)), jnp.int32)
  lengths = jnp.array([45, 29], jnp.int32)
  ref_outs, ref_cache = _prefill_decode(params, tokens, lengths, None)
  part = _partitioner({'sequence': n})
  outs, cache = _prefill_decode(params, tokens, lengths, part)
  masks = {0: np.arange(45)[None, :] < np.asarray(lengths)[:, None],
           4: np.arange(13)[None, :] < np.array([13, 7])[:, None]}
  for i, (a, b) in enumerate(zip(ref_outs, outs)):
    a, b = np.asarray(a), np.asarray(b)
    if i in masks:
      a, b = a[masks[i]], b[masks[i]]
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5, err_msg=str(i))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref_cache)[0],
                          jax.tree.leaves(cache)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                               atol=2e-5, err_msg=str(path))
  assert cache[0].k.sharding.spec[1] == 'sequence'


def test_context_parallel_prefill_refuses_sinks():
  """Sinks are not implemented in the context-parallel prefill: a clear
  error, not a silently different computation."""
  cfg = CFG.replace(attention={'sinks': 2})
  part = _partitioner({'sequence': 2})
  tokens = jnp.zeros((2, 40), jnp.int32)
  cache = part.shard_cache(init_cache(cfg, 2, 64))
  with part.activate(), pytest.raises(ValueError, match='attention.sinks=2'):
    part.model(cfg).apply({'params': _params_init()}, tokens,
                          phase='prefill', cache=cache)


def test_active_mesh_does_not_change_a_model_without_backend():
  """No hidden global: which attention runs is the model's backend field.
  Inside `activate()` a Transformer built without one computes what it
  computes outside (the single-device path: here it takes sink tokens,
  which the context-parallel prefill of `part.model` refuses), and equals
  the mesh's model wherever both run."""
  cfg = CFG.replace(attention={'sinks': 2})
  part = _partitioner({'sequence': 2})
  params = jax.tree.map(
      lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(3), x.shape),
      _params_init())
  tokens = jnp.asarray(np.random.default_rng(5).integers(
      0, cfg.vocab_size, (2, 40)), jnp.int32)
  ref, _ = Transformer(cfg).apply({'params': params}, tokens,
                                  phase='prefill', cache=init_cache(cfg, 2, 64))
  with part.activate():
    got, _ = Transformer(cfg).apply(
        {'params': params}, tokens, phase='prefill',
        cache=part.shard_cache(init_cache(cfg, 2, 64)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5,
                             atol=2e-5)
  assert part.model(cfg).backend.placement == part.placement
  assert Transformer(cfg).backend is None


def test_shard_cache_needs_divisible_length():
  part = _partitioner({'sequence': 4})
  with pytest.raises(ValueError, match='multiple of'):
    part.shard_cache(init_cache(CFG, 2, 30))


def test_initialize_distributed_modes(monkeypatch):
  monkeypatch.delenv('TPU_WORKER_HOSTNAMES', raising=False)
  monkeypatch.delenv('JAX_COORDINATOR_ADDRESS', raising=False)
  assert sharding.initialize_distributed('off') is False
  assert sharding.initialize_distributed('auto') is False
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'host0')  # one host
  assert sharding.initialize_distributed('auto') is False
  with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
    sharding.initialize_distributed('yes')


def test_train_entry_with_mesh_matches_single_device(tmp_path):
  """train_and_evaluate with --config.mesh.shape.fsdp=4 (the smoke config)
  logs the same losses as the single-device run."""
  from configs import tiny
  from orthros_jax.training.train_lm import train_and_evaluate

  losses = {}
  for name, shape in (('plain', {}), ('fsdp', {'fsdp': 4})):
    config = tiny.get_config('smoke')
    config.train.eval_every = 0
    config.mesh.shape.update(shape)
    train_and_evaluate(config, tmp_path / name)
    with open(tmp_path / name / 'metrics.jsonl') as f:
      rows = [json.loads(line) for line in f]
    losses[name] = [r['loss'] for r in rows if 'loss' in r]
  assert len(losses['plain']) == 4
  np.testing.assert_allclose(losses['fsdp'], losses['plain'], rtol=1e-5)
