"""Conversion building blocks: attention transfer (stage 1) and LoRA."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import orthros_jax as oj
from orthros_jax.conversion.lora import init_lora
from orthros_jax.conversion.lora import merge_lora
from orthros_jax.conversion.transfer import TRANSFER_PARAMS
from orthros_jax.conversion.transfer import teacher_attention_io
from orthros_jax.conversion.transfer import transfer_loss
from orthros_jax.model import Transformer
from orthros_jax.model import init_orthros_params
from orthros_jax.training.optim import trainable_labels

TEACHER = oj.ModelConfig(vocab_size=64, num_layers=2, embed_dim=32,
                         num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


@functools.partial(jax.jit, static_argnums=0)
def _init(config, rng):
  return nn.unbox(Transformer(config).init(rng, jnp.zeros((1, 8), jnp.int32),
                                           phase='forward')['params'])


def orthros_params(teacher_params, config, seed=1):
  params = jax.tree.map(lambda x: x, teacher_params)
  for layer, extra in init_orthros_params(config,
                                          jax.random.PRNGKey(seed)).items():
    params[layer]['attn'] = dict(params[layer]['attn'], **extra['attn'])
  return params


def test_teacher_io_is_the_teachers_attention():
  params = _init(TEACHER, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 64)
  inputs, outputs = teacher_attention_io(TEACHER, params, tokens)
  assert inputs.shape == outputs.shape == (2, 2, 11, 32)
  # Layer 0's input is the RMS-normed embedding.
  x = np.asarray(params['embed']['embedding'])[np.asarray(tokens)]
  scale = np.asarray(params['layers_0']['input_norm']['scale'])
  want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + TEACHER.norm_eps)
  np.testing.assert_allclose(inputs[0], want * scale, rtol=1e-5, atol=1e-6)
  # Layer 1's input is built from layer 0's output: residual, MLP, norm.
  assert not np.allclose(inputs[1], inputs[0])


def test_transfer_loss_is_zero_when_the_window_covers_the_sequence():
  """W >= T: the prefill formula is exact softmax, whatever phi."""
  params = _init(TEACHER, jax.random.PRNGKey(0))
  config = TEACHER.replace(attention={'kind': 'orthros', 'window': 16,
                                      'chunk_size': 4, 'feature_dim': 4})
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 13), 0, 64)
  inputs, outputs = teacher_attention_io(TEACHER, params, tokens)
  loss, per_layer = transfer_loss(orthros_params(params, config), config,
                                  inputs, outputs)
  assert per_layer.shape == (2,)
  assert float(loss) < 1e-10


def _split_batch(seed, b=3, t=13, pad=(0, 4, 2)):
  """A batch with right padding of `pad[i]` tokens in row i (weights 0)."""
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (b, t + 1), 1, 64)
  weights = np.ones((b, t), np.float32)
  inputs = np.asarray(tokens[:, :-1]).copy()
  for i, n in enumerate(pad):
    if n:
      weights[i, t - n:] = 0
      inputs[i, t - n:] = 0
  weights[:, : t // 2] = 0  # prompt positions carry no answer loss
  return {'inputs': jnp.asarray(inputs), 'targets': tokens[:, 1:],
          'weights': jnp.asarray(weights),
          'prompt_lengths': jnp.full((b,), t // 2, jnp.int32)}


def test_hidden_distillation_term():
  from orthros_jax.conversion.stages import finetune_objective
  params = _init(TEACHER, jax.random.PRNGKey(0))
  batch = _split_batch(2)
  rng = jax.random.PRNGKey(3)
  wide = TEACHER.replace(attention={'kind': 'orthros', 'window': 16,
                                    'chunk_size': 4, 'feature_dim': 4})
  base = orthros_params(params, wide)

  compiled = {}

  def metrics(config, p, split_mode='random'):
    if (config, split_mode) not in compiled:
      compiled[config, split_mode] = jax.jit(finetune_objective(
          config, split_mode=split_mode, hidden_weight=1.0, kl_weight=1.0))
    loss, m = compiled[config, split_mode](p, batch, rng)
    return float(loss), {k: float(v) for k, v in m.items()}

  # W >= T: prefill is exact softmax, so the student is the teacher (here
  # an explicit frozen copy of it; the narrow case below reads 'base').
  loss, m = metrics(wide, {'base': base, 'lora': {}, 'teacher': params})
  assert m['hidden_mse'] < 1e-10 and abs(m['kl']) < 1e-6
  np.testing.assert_allclose(loss, m['loss'] + m['kl'] + m['hidden_mse'],
                             rtol=1e-6)
  # A frozen 'teacher' copy is what the terms read: scaling its layer-1
  # input norm by c gives exactly (c - 1)^2 x the mean square of that
  # input over the real (unpadded) tokens.
  c = 1.5
  teacher = jax.tree.map(lambda x: x, params)
  teacher['layers_1']['input_norm'] = {
      'scale': params['layers_1']['input_norm']['scale'] * c}
  _, m = metrics(wide, {'base': base, 'lora': {}, 'teacher': teacher})
  inputs, _ = teacher_attention_io(TEACHER, params, batch['inputs'])
  x1 = np.asarray(inputs[1], np.float64)
  w = np.asarray(batch['weights'])
  valid = np.cumsum(w[:, ::-1], axis=1)[:, ::-1] > 0
  want = (c - 1) ** 2 * np.mean(x1 ** 2, -1)[valid].mean()
  np.testing.assert_allclose(m['hidden_mse'], want, rtol=1e-4)
  # A short window: the prefill differs from the teacher. Split 'none'
  # runs the prefill formula everywhere, so padded positions differ too,
  # yet never count: new padding content leaves the value as it was, while
  # the same content as real tokens (weights extended) changes it.
  narrow = TEACHER.replace(attention={'kind': 'orthros', 'window': 2,
                                      'chunk_size': 4, 'feature_dim': 4})
  p = {'base': orthros_params(params, narrow), 'lora': {}}
  _, m = metrics(narrow, p, split_mode='none')
  assert m['hidden_mse'] > 1e-4
  batch['inputs'] = batch['inputs'].at[1, -2:].set(7)  # padding content
  _, m2 = metrics(narrow, p, split_mode='none')
  np.testing.assert_allclose(m2['hidden_mse'], m['hidden_mse'], rtol=1e-6)
  padded = dict(batch)
  batch = dict(batch, weights=batch['weights'].at[1, -1].set(1.0))
  _, m3 = metrics(narrow, p, split_mode='none')
  assert abs(m3['hidden_mse'] - m2['hidden_mse']) > 1e-6
  batch = padded
  # No gradient reaches the frozen teacher copy.
  obj = finetune_objective(narrow, split_mode='prompt', hidden_weight=1.0)
  grads = jax.grad(lambda q: obj(q, batch, rng)[0])(
      dict(p, teacher=params))
  assert all(float(jnp.abs(g).max()) == 0
             for g in jax.tree.leaves(grads['teacher']))
  assert any(float(jnp.abs(g).max()) > 0
             for g in jax.tree.leaves(grads['base']))


def test_stage1_lowers_mse_and_touches_only_feature_maps():
  teacher_params = _init(TEACHER, jax.random.PRNGKey(0))
  config = TEACHER.replace(attention={'kind': 'orthros', 'window': 8,
                                      'chunk_size': 8, 'feature_dim': 8})
  params = orthros_params(teacher_params, config)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (8, 64), 0, 64)
  inputs, outputs = teacher_attention_io(TEACHER, teacher_params, tokens)
  # The mask stage 1 trains with (TrainConfig.trainable = TRANSFER_PARAMS).
  train = trainable_labels(params, TRANSFER_PARAMS)
  assert sorted(set(jax.tree.leaves(train))) == ['freeze', 'train']
  opt = optax.multi_transform(
      {'train': optax.adam(1e-2), 'freeze': optax.set_to_zero()}, train)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    (loss, _), grads = jax.value_and_grad(transfer_loss, has_aux=True)(
        params, config, inputs, outputs)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  first = None
  for _ in range(200):
    params, opt_state, loss = step(params, opt_state)
    first = float(loss) if first is None else first
  final = float(transfer_loss(params, config, inputs, outputs)[0])
  print(f'stage 1 transfer MSE {first:.4g} -> {final:.4g}: '
        f'{first / final:.1f}x lower')
  assert first / final >= 3.0, (first, final)
  for (path, value), label in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(train)):
    if label == 'freeze':  # every frozen param is the teacher's, unchanged
      before = functools.reduce(lambda t, k: t[k.key], path, teacher_params)
      np.testing.assert_array_equal(value, before)


def test_lora_starts_at_base_and_merges_exactly():
  params = _init(TEACHER, jax.random.PRNGKey(0))
  lora = init_lora(params, jax.random.PRNGKey(3), rank=4)
  assert set(lora['layers_1']) == {'q_proj', 'k_proj', 'v_proj', 'o_proj'}
  assert lora['layers_0']['q_proj']['a'].shape == (32, 4)
  assert lora['layers_0']['q_proj']['b'].shape == (4, 32)
  assert lora['layers_0']['k_proj']['b'].shape == (4, 16)
  assert lora['layers_0']['o_proj']['a'].shape == (32, 4)
  merged = merge_lora(params, lora, alpha=8.0)
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)  # B = 0 at init
  # Non-zero B: the merged kernel is W + (alpha / r) A B, base untouched.
  rng = np.random.default_rng(0)
  lora = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape),
                                            jnp.float32), lora)
  base_q = np.array(params['layers_1']['attn']['q_proj']['kernel'])
  merged = merge_lora(params, lora, alpha=8.0)
  ab = np.asarray(lora['layers_1']['q_proj']['a'] @ lora['layers_1'][
      'q_proj']['b']) * 2.0
  np.testing.assert_allclose(merged['layers_1']['attn']['q_proj']['kernel'],
                             base_q + ab.reshape(32, 4, 8), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(params['layers_1']['attn']['q_proj']['kernel'],
                                base_q)
  o_delta = np.asarray(lora['layers_0']['o_proj']['a'] @ lora['layers_0'][
      'o_proj']['b']) * 2.0
  np.testing.assert_allclose(
      merged['layers_0']['attn']['o_proj']['kernel'],
      np.asarray(params['layers_0']['attn']['o_proj']['kernel']) +
      o_delta.reshape(4, 8, 32), rtol=1e-5, atol=1e-5)
  # Untargeted params are shared, not copied into something else.
  np.testing.assert_array_equal(merged['layers_0']['mlp']['up_proj']['kernel'],
                                params['layers_0']['mlp']['up_proj']['kernel'])


def test_lora_gradients_reach_only_the_adapters_and_merged_model_generates():
  config = TEACHER.replace(attention={'kind': 'orthros', 'window': 4,
                                      'chunk_size': 4, 'feature_dim': 4})
  params = orthros_params(_init(TEACHER, jax.random.PRNGKey(0)), config)
  lora = init_lora(params, jax.random.PRNGKey(3), rank=2)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 12), 0, 64)

  def loss(lora):
    logits, _ = Transformer(config).apply(
        {'params': merge_lora(params, lora, alpha=4.0)}, tokens,
        phase='forward', split=6)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

  grads = jax.grad(loss)(lora)
  # dL/dB is non-zero on every target of every layer (B starts at 0, A
  # does not); dL/dA is exactly 0 at B = 0.
  for layer in grads.values():
    for proj in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):
      assert float(jnp.abs(layer[proj]['b']).max()) > 0, proj
      assert not np.any(np.asarray(layer[proj]['a'])), proj
  # Through the stage-2 objective over {base, lora} with the LoRA mask: the
  # adapters get the gradient of the loss above, the base none at all.
  from orthros_jax.conversion.stages import finetune_objective
  from orthros_jax.training.step import trainable_value_and_grad
  objective = finetune_objective(config, split_mode='none', lora_alpha=4.0)
  batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, axis=1),
           'weights': jnp.ones(tokens.shape, jnp.float32),
           'prompt_lengths': jnp.zeros((2,), jnp.int32)}
  full = {'base': params, 'lora': lora}
  _, g = trainable_value_and_grad(
      lambda p: objective(p, batch, None), full, ('lora',))
  assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(g['base']))
  g_lora = jax.grad(lambda lo: objective({'base': params, 'lora': lo}, batch,
                                         None)[0])(lora)
  for a, b in zip(jax.tree.leaves(g['lora']), jax.tree.leaves(g_lora)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
  lora = jax.tree.map(lambda p, g: p - 0.5 * g, lora, grads)
  merged = merge_lora(params, lora, alpha=4.0)
  out = oj.generate(config, merged, [[1, 2, 3, 4, 5]], max_new_tokens=4)
  assert out.tokens.shape == (1, 4)


def test_lora_errors():
  params = _init(TEACHER, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match='rank'):
    init_lora(params, jax.random.PRNGKey(0), rank=0)
  with pytest.raises(ValueError, match='gate_proj'):
    init_lora(params, jax.random.PRNGKey(0), targets=('gate_proj',))
  with pytest.raises(ValueError, match='layers_'):
    init_lora({'embed': {}}, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match='Orthros'):
    transfer_loss(params, TEACHER, jnp.zeros((2, 1, 4, 32)),
                  jnp.zeros((2, 1, 4, 32)))


def _mqar_batches(seed, n, batch_size=4, seq_len=80):
  from orthros_jax.data import make_dataset
  data = iter(make_dataset('synthetic', seq_len=seq_len, batch_size=batch_size,
                           seed=seed, tasks={'mqar': 1.0}, tokenizer='byte'))
  return [next(data) for _ in range(n)]


def test_stages_train_through_the_shared_loop(tmp_path):
  from orthros_jax.conversion.stages import finetune_objective
  from orthros_jax.conversion.stages import transfer_objective
  from orthros_jax.training import loop
  from orthros_jax.training import make_objective_step
  teacher = TEACHER.replace(vocab_size=259)
  config = teacher.replace(attention={'kind': 'orthros', 'window': 8,
                                      'chunk_size': 8, 'feature_dim': 8})
  base = orthros_params(_init(teacher, jax.random.PRNGKey(0)), config)
  batches = _mqar_batches(0, 40)
  # Stage 1: only the feature maps and window weights move.
  stage1 = loop.TrainConfig(
      num_steps=40, learning_rate=1e-2, warmup_steps=1, weight_decay=0.0,
      trainable=('phi_q', 'phi_k', 'window_logit'), log_every=10,
      checkpoint_every=40, progress=False, async_checkpoint=False)
  state, history = loop.train(
      stage1, tmp_path / 's1', config, base, iter(batches),
      train_step=make_objective_step(transfer_objective(config)))
  losses = [h['loss'] for h in history]
  assert losses[-1] < 0.7 * losses[0], losses
  for (path, value), label in zip(
      jax.tree_util.tree_leaves_with_path(state.params),
      jax.tree.leaves(trainable_labels(state.params, stage1.trainable))):
    if label == 'freeze':
      before = functools.reduce(lambda t, k: t[k.key], path, base)
      np.testing.assert_array_equal(value, before)
  # Stage 2: LoRA on q/k/v/o with the phase-aware split; base frozen.
  params = {'base': state.params,
            'lora': init_lora(state.params, jax.random.PRNGKey(5), rank=4)}
  stage2 = loop.TrainConfig(
      num_steps=40, learning_rate=3e-3, warmup_steps=1, weight_decay=0.0,
      trainable=('lora',), log_every=10, checkpoint_every=40,
      progress=False, async_checkpoint=False)
  objective2 = finetune_objective(config, split_mode='prompt',
                                  lora_alpha=8.0, kl_weight=0.5)
  held_out = _mqar_batches(1, 6)
  score = jax.jit(lambda p: jnp.mean(jnp.stack([
      objective2(p, b, jax.random.PRNGKey(i))[0]
      for i, b in enumerate(held_out)])))
  before = float(score(params))
  state2, history2 = loop.train(
      stage2, tmp_path / 's2', config, params, iter(batches),
      train_step=make_objective_step(objective2, trainable=('lora',)))
  assert all(np.isfinite(h['loss']) for h in history2)
  assert 'kl' in history2[0]
  # The stage-2 objective falls on held-out batches (same splits).
  after = float(score(state2.params))
  assert after < 0.97 * before, (before, after)
  for a, b in zip(jax.tree.leaves(state2.params['base']),
                  jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(state2.params['lora']['layers_0']['q_proj']['b']).max()) > 0
  merged = merge_lora(state2.params['base'], state2.params['lora'], alpha=8.0)
  out = oj.generate(config, merged, [[5, 6, 7, 8]], max_new_tokens=3)
  assert out.tokens.shape == (1, 3)
