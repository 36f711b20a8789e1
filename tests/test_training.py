"""Training library: optimizer, loss, steps, checkpoints, metrics, the loop,
and an exact resume after SIGKILL (CPU, tiny models)."""

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax import training as tr
from orthros_jax import treepath
from orthros_jax.training import metrics as metrics_lib
from orthros_jax.training import state as state_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T, V = 4, 32, 64


def tiny_config(kind='dense'):
  return oj.ModelConfig(
      vocab_size=V, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
      head_dim=8, mlp_dim=64,
      attention=oj.AttentionConfig(kind=kind, feature_dim=8, window=8,
                                   chunk_size=8, exact_tail=1))


def init_params(config, seed=0):
  params = oj.Transformer(config).init(
      jax.random.PRNGKey(seed), jnp.zeros((1, T), jnp.int32),
      phase='forward')['params']
  return jax.tree.map(jnp.asarray, jax.device_get(
      __import__('flax').linen.meta.unbox(params)))


class PatternBatches:
  """Deterministic batch stream: x_{t+1} = perm[x_t] from a random start (a
  learnable bigram). Batch i depends only on (seed, i); get_state/set_state
  hold the index. prompt=True gives random prompt lengths and loss weights
  on the answer only."""

  def __init__(self, seed=0, batch=B, prompt=False, state_bytes=False):
    self.seed, self.batch, self.prompt = seed, batch, prompt
    self.state_bytes = state_bytes
    self.index = 0
    self.perm = np.random.default_rng(1234).permutation(V)

  def __iter__(self):
    return self

  def __next__(self):
    rng = np.random.default_rng((self.seed, self.index))
    self.index += 1
    seq = np.zeros((self.batch, T + 1), np.int32)
    seq[:, 0] = rng.integers(0, V, self.batch)
    for t in range(T):
      seq[:, t + 1] = self.perm[seq[:, t]]
    if self.prompt:
      prompt = rng.integers(4, T // 2, self.batch).astype(np.int32)
      weights = (np.arange(T)[None] >= prompt[:, None] - 1).astype(np.float32)
    else:
      prompt = np.zeros(self.batch, np.int32)
      weights = np.ones((self.batch, T), np.float32)
    return {'inputs': seq[:, :-1], 'targets': seq[:, 1:], 'weights': weights,
            'prompt_lengths': prompt}

  def get_state(self):
    if self.state_bytes:
      return json.dumps({'index': self.index}).encode()
    return {'index': self.index}

  def set_state(self, state):
    if isinstance(state, bytes):
      state = json.loads(state)
    self.index = state['index']


def quick_config(**kw):
  base = dict(num_steps=30, learning_rate=1e-2, warmup_steps=2,
              weight_decay=0.0, log_every=5, checkpoint_every=100,
              progress=False, async_checkpoint=False)
  base.update(kw)
  return tr.TrainConfig(**base)


# ---------------------------------------------------------------- loss / optim


def test_cross_entropy_matches_numpy_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (3, 5)).astype(np.int32)
  weights = (rng.random((3, 5)) > 0.4).astype(np.float32)
  loss, m = tr.cross_entropy(jnp.asarray(logits, jnp.bfloat16).astype(
      jnp.float32), targets, weights)
  lf = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(
      jnp.float32)).astype(np.float64)
  logp = lf - np.log(np.exp(lf).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(loss, (weights * nll).sum() / weights.sum(),
                             rtol=1e-5)
  acc = ((lf.argmax(-1) == targets) * weights).sum() / weights.sum()
  np.testing.assert_allclose(m['accuracy'], acc, rtol=1e-6)
  assert float(m['tokens']) == weights.sum()
  zero, _ = tr.cross_entropy(logits, targets, np.zeros_like(weights))
  assert float(zero) == 0.0


@pytest.mark.parametrize('kwargs, field', [
    (dict(lr=0.0), 'learning_rate'), (dict(warmup_steps=20), 'total_steps'),
    (dict(weight_decay=-1.0), 'weight_decay'), (dict(b2=1.0), 'b2'),
    (dict(clip_norm=-1.0), 'clip_norm'), (dict(grad_accum_steps=0),
                                          'grad_accum_steps'),
    (dict(trainable_mask='lora'), 'trainable_mask'),
    (dict(lr_multipliers=(('window_logit', 0.0),)), 'lr_multipliers'),
    (dict(lr_multipliers=('window_logit',)), 'lr_multipliers')])
def test_make_optimizer_validates(kwargs, field):
  args = dict(lr=1e-3, warmup_steps=2, total_steps=10)
  args.update(kwargs)
  with pytest.raises(ValueError, match=field):
    tr.make_optimizer(**args)


def test_train_config_validates_and_reads_mappings():
  with pytest.raises(ValueError, match='split_mode'):
    tr.TrainConfig(split_mode='middle')
  with pytest.raises(ValueError, match='log_every'):
    tr.TrainConfig(log_every=0)
  c = tr.TrainConfig.from_mapping({'num_steps': 7, 'model': 'ignored',
                                   'trainable': ['lora']})
  assert c.num_steps == 7 and c.trainable == ('lora',)
  c = tr.TrainConfig.from_mapping({'lr_multipliers': {'window_logit': 30,
                                                      'phi': 2.0}})
  assert c.lr_multipliers == (('phi', 2.0), ('window_logit', 30.0))
  for bad in ({'window_logit': -1.0}, {'': 2.0}, 'window_logit'):
    with pytest.raises(ValueError, match='lr_multipliers'):
      tr.TrainConfig(lr_multipliers=bad)


def test_lr_multipliers_scale_updates_exactly():
  # Two steps of AdamW with weight decay: the update of a param matching a
  # multiplier is the plain update times the multiplier (the longest
  # matching substring wins), the others are the plain updates, frozen
  # params stay zero.
  params = {'a': {'window_logit': jnp.array([0.5, -1.0])},
            'b': {'phi_q': jnp.array([[1.0, 2.0], [3.0, -4.0]])},
            'c': {'kernel': jnp.array([2.0, 1.0])}}
  grads = [jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)) + 0.3, params)
           for i in range(2)]
  kw = dict(weight_decay=0.1, trainable_mask=('window_logit', 'phi_q'))
  plain = tr.make_optimizer(1e-2, 0, 10, **kw)
  scaled = tr.make_optimizer(1e-2, 0, 10, lr_multipliers=(
      ('window', 30.0), ('window_logit', 5.0), ('phi', 2.0)), **kw)
  sp, ss = plain.init(params), scaled.init(params)
  for g in grads:
    up, sp = plain.update(g, sp, params)
    us, ss = scaled.update(g, ss, params)
    np.testing.assert_allclose(us['a']['window_logit'],
                               5.0 * up['a']['window_logit'], rtol=1e-6)
    np.testing.assert_allclose(us['b']['phi_q'], 2.0 * up['b']['phi_q'],
                               rtol=1e-6)
    assert np.all(np.asarray(us['c']['kernel']) == 0)
    assert np.all(np.asarray(up['a']['window_logit']) != 0)


# ---------------------------------------------------------------- steps


def test_progress_bar_rates(monkeypatch):
  clock = iter([10.0, 12.0, 13.0])
  monkeypatch.setattr(metrics_lib.time, 'perf_counter', lambda: next(clock))
  bar = tr.ProgressBar(10, enabled=False)
  # 2 s for 400 input positions of which 100 count in the loss.
  assert bar.update(2, 400.0, 1.5, 100.0) == (200.0, 50.0)
  rate, loss_rate = bar.update(1, 50.0, 1.0)
  assert rate == 50.0 and np.isnan(loss_rate)
  bar.close()


@pytest.mark.parametrize('kind, prompt', [('dense', False), ('orthros', True)])
def test_loss_decreases(tmp_path, kind, prompt):
  config = tiny_config(kind)
  eval_step = tr.make_eval_step(config, split_mode='prompt')
  held_out = PatternBatches(seed=99, prompt=prompt)
  eval_batches = [next(held_out) for _ in range(2)]
  evaluated = []

  def eval_fn(state, step):
    evaluated.append(step)
    return tr.evaluate(eval_step, state.params, eval_batches)

  _, history = tr.train(quick_config(split_mode='prompt', eval_every=10),
                        tmp_path, config, lambda: init_params(config),
                        PatternBatches(prompt=prompt), eval_fn=eval_fn)
  losses = [h['loss'] for h in history]
  assert len(losses) == 30
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses
  records = tr.read_metrics(tmp_path)
  assert [r['step'] for r in records] == [5, 10, 10, 15, 20, 20, 25, 30, 30]
  assert 'tokens_per_s' in records[0] and 'eval/loss' not in records[0]
  # tok_s counts every input position, loss_tok_s the loss's own positions
  # (the answers only when the rows have prompts).
  assert all(h['input_tokens'] == B * T for h in history)
  if prompt:
    assert all(h['tokens'] < B * T for h in history)
    assert all(r['loss_tokens_per_s'] < r['tokens_per_s'] for r in records
               if 'loss' in r)
  assert evaluated == [10, 20, 30]
  assert records[-1]['eval/loss'] < records[2]['eval/loss']
  assert any(f.startswith('events.out.tfevents')
             for f in os.listdir(tmp_path / 'tensorboard'))


def test_train_step_compiles_once(tmp_path, caplog):
  """A fresh state mixes committed arrays (weights loaded from a checkpoint
  or computed from loaded ones) with uncommitted ones (the step and
  optimizer counters); the step's outputs are all committed. The loop commits
  the state first, so the train step compiles at the first step only (it
  compiled a second time at the second step before)."""
  config = tiny_config('orthros')
  params = jax.device_put(init_params(config), jax.local_devices()[0])
  assert all(x.committed for x in jax.tree.leaves(params))
  with jax.log_compiles(True), caplog.at_level('WARNING'):
    _, history = tr.train(quick_config(num_steps=4), tmp_path, config,
                          lambda: params, PatternBatches())
  assert len(history) == 4
  compiled = [r.getMessage() for r in caplog.records
              if 'Finished XLA compilation of jit(step) ' in
              r.getMessage()]
  assert len(compiled) == 1, compiled


def test_commit_to_device_commits_only_what_is_not():
  """Uncommitted arrays join the device of the committed ones, which keep
  their buffers (no copy); a tree with nothing committed stays as it is."""
  from orthros_jax.training.loop import commit_to_device
  device = jax.local_devices()[0]
  weights = jax.device_put(jnp.arange(6.0), device)
  tree = {'w': weights, 'count': jnp.zeros((), jnp.int32), 'note': 'x'}
  assert weights.committed and not tree['count'].committed
  out = commit_to_device(tree)
  assert out['w'].committed and out['count'].committed
  assert out['count'].devices() == {device} and out['note'] == 'x'
  assert (out['w'].unsafe_buffer_pointer()
          == weights.unsafe_buffer_pointer())
  loose = {'a': jnp.zeros(3), 'b': jnp.ones((), jnp.int32)}
  assert commit_to_device(loose) is loose
  assert not any(x.committed for x in jax.tree.leaves(loose))


def test_split_modes():
  config = tiny_config('orthros')
  w = config.attention.window
  batch = PatternBatches(prompt=True).__next__()
  assert np.all(batch['prompt_lengths'] > 0)
  split = tr.step.make_split(config, 'prompt', batch, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(split, np.maximum(batch['prompt_lengths'] - 1,
                                                  0))
  # 'random': uniform in [W + 1, T], so the query at t = W always reads a
  # key (j = 0) through the feature maps.
  draws = np.concatenate([np.asarray(tr.step.make_split(
      config, 'random', batch, jax.random.PRNGKey(i))) for i in range(50)])
  assert draws.shape == (50 * B,)
  assert draws.min() == w + 1 and draws.max() == T
  # W >= T: no split reaches a linear key; the split is T.
  wide = config.replace(attention={'window': T})
  np.testing.assert_array_equal(
      tr.step.make_split(wide, 'random', batch, jax.random.PRNGKey(3)),
      np.full(B, T))
  assert tr.step.make_split(config, 'none', batch, None) is None
  assert tr.step.make_split(tiny_config(), 'random', batch, None) is None
  with pytest.raises(ValueError, match='needs an rng'):
    tr.step.make_split(config, 'prompt', batch, None)
  with pytest.raises(ValueError, match='split_mode'):
    tr.make_train_step(config, split_mode='middle')


def test_prompt_split_trains_the_prefill_formula_on_text():
  """'prompt' mode on rows without a prompt (plain text, filler): a random
  split >= W + 1 per row, so the forward differs from the all-exact one on
  every row; rows with a prompt keep the inference boundary exactly."""
  config = tiny_config('orthros')
  w = config.attention.window
  params = init_params(config)
  text = next(PatternBatches(prompt=False))
  assert np.all(text['prompt_lengths'] == 0)
  split = np.asarray(tr.step.make_split(config, 'prompt', text,
                                        jax.random.PRNGKey(3)))
  assert np.all(split >= 1), split  # 0 = all exact, the old behaviour
  assert np.all((split >= w + 1) & (split <= T)), split
  apply = jax.jit(lambda s: oj.Transformer(config).apply(
      {'params': params}, text['inputs'], phase='forward', split=s)[0])
  exact = np.asarray(apply(jnp.zeros(B, jnp.int32)))
  logits = np.asarray(apply(jnp.asarray(split)))
  per_row = np.abs(logits - exact).max(axis=(1, 2))
  assert np.all(per_row > 1e-4), per_row
  # A split of W or less is the all-exact forward: why the range starts at
  # W + 1.
  np.testing.assert_allclose(apply(jnp.full(B, w, jnp.int32)), exact,
                             atol=1e-5)
  # The gradient of the loss reaches the feature maps (phi_q, phi_k).
  loss = lambda p: tr.step._forward_loss(
      config, 'prompt', tr.next_token_loss, p, text, jax.random.PRNGKey(3))[0]
  grads = jax.jit(jax.grad(loss))(params)
  phi = [float(jnp.abs(g).max()) for path, g in
         jax.tree_util.tree_flatten_with_path(grads)[0]
         if 'phi_q' in treepath.path_str(path)]
  assert phi and max(phi) > 0, phi
  # Mixed rows: the prompt rows split at prompt - exact_tail exactly, the
  # others as 'random' with the same rng.
  batch = next(PatternBatches(prompt=True))
  mixed = dict(batch, prompt_lengths=np.where(
      np.arange(B) % 2 == 0, batch['prompt_lengths'], 0).astype(np.int32))
  split = tr.step.make_split(config, 'prompt', mixed, jax.random.PRNGKey(3))
  rand = tr.step.make_split(config, 'random', mixed, jax.random.PRNGKey(3))
  np.testing.assert_array_equal(
      split, np.where(mixed['prompt_lengths'] > 0,
                      np.maximum(mixed['prompt_lengths'] - 1, 0), rand))


@pytest.mark.parametrize('sinks', [0, 3])
def test_random_split_starts_at_the_first_linear_position(sinks):
  """The forward through split P equals the all-exact one for P <= W + S
  (no query reads a linear key) and differs at P = W + S + 1, the lowest
  random split."""
  if sinks and 'sinks' not in oj.AttentionConfig.__dataclass_fields__:
    pytest.skip('no attention sinks in this tree')
  config = tiny_config('orthros')
  if sinks:
    config = config.replace(attention={'sinks': sinks})
  first = tr.step.first_linear_position(config.attention)
  assert first == config.attention.window + sinks
  params = init_params(config)
  text = next(PatternBatches())
  apply = jax.jit(lambda s: oj.Transformer(config).apply(
      {'params': params}, text['inputs'], phase='forward', split=s)[0])
  exact = apply(jnp.zeros(B, jnp.int32))
  np.testing.assert_allclose(apply(jnp.full(B, first, jnp.int32)), exact,
                             atol=1e-5)
  diff = jnp.abs(apply(jnp.full(B, first + 1, jnp.int32)) - exact)
  assert np.all(np.asarray(diff.max(axis=(1, 2))) > 1e-4)
  draws = np.concatenate([np.asarray(tr.step.make_split(
      config, 'prompt', text, jax.random.PRNGKey(i))) for i in range(30)])
  assert draws.min() == first + 1 and draws.max() == T


def test_prompt_or_random_is_rejected():
  config = tiny_config('orthros')
  batch = next(PatternBatches())
  for make in (lambda: tr.step.make_split(config, 'prompt_or_random', batch,
                                          jax.random.PRNGKey(0)),
               lambda: tr.make_train_step(config,
                                          split_mode='prompt_or_random'),
               lambda: tr.make_eval_step(config,
                                         split_mode='prompt_or_random'),
               lambda: tr.TrainConfig(split_mode='prompt_or_random')):
    with pytest.raises(ValueError, match="use 'prompt'"):
      make()


def test_frozen_params_get_zero_updates():
  config = tiny_config('orthros')
  params = init_params(config)
  # A host copy: the step donates (deletes) the state's buffers.
  flat0 = dict(jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0])
  tx = tr.make_optimizer(1e-2, 1, 10, weight_decay=0.1, trainable_mask=(
      'phi_q', 'phi_k', 'window_logit'))
  state = tr.TrainState.create(params, tx)
  step = tr.make_train_step(config, split_mode='random')
  data = PatternBatches(prompt=True)
  for i in range(3):
    state, m = step(state, next(data), jax.random.PRNGKey(i))
    assert bool(m['finite'])
  changed = set()
  for path, new in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    name = treepath.path_str(path)
    if any(s in name for s in ('phi_q', 'phi_k', 'window_logit')):
      if not np.array_equal(new, flat0[path]):
        changed.add(name.split('/')[2])
    else:
      np.testing.assert_array_equal(new, flat0[path], err_msg=name)
  assert changed == {'phi_q', 'phi_k', 'window_logit'}


def test_only_trainable_params_are_differentiated():
  """trainable_value_and_grad: the trainable leaves get the full-model
  gradient, frozen leaves exactly zero, and no cotangent ever reaches a
  frozen leaf (a custom_vjp whose backward raises proves it); the train
  step with trainable= updates exactly what the optimizer's mask trains,
  bit-identical to the step that differentiates everything."""
  from orthros_jax.training import step as step_lib

  @jax.custom_vjp
  def guard(x):
    return x

  def guard_bwd(_, g):
    raise AssertionError('a frozen leaf was differentiated')

  guard.defvjp(lambda x: (x, None), guard_bwd)
  rng = np.random.default_rng(0)
  params = {'lora': {'a': jnp.asarray(rng.standard_normal((3, 2)))},
            'base': {'w': jnp.asarray(rng.standard_normal((2, 4)))}}
  fn = lambda p: (jnp.sum(jnp.tanh(p['lora']['a'] @ guard(p['base']['w']))
                          ** 2), {})
  (value, _), grads = step_lib.trainable_value_and_grad(fn, params,
                                                         ('lora',))
  full_fn = lambda p: jnp.sum(jnp.tanh(p['lora']['a'] @ p['base']['w']) ** 2)
  full = jax.grad(full_fn)(params)
  np.testing.assert_allclose(value, full_fn(params), rtol=1e-6)
  np.testing.assert_allclose(grads['lora']['a'], full['lora']['a'],
                             rtol=1e-6)
  assert not np.any(np.asarray(grads['base']['w']))
  with pytest.raises(AssertionError, match='frozen leaf'):
    jax.grad(lambda p: fn(p)[0])(params)

  config = tiny_config('orthros')
  mask = ('phi_q', 'phi_k', 'window_logit')
  states = []
  for trainable in (None, mask):
    tx = tr.make_optimizer(1e-2, 1, 10, trainable_mask=mask)
    state = tr.TrainState.create(init_params(config), tx)
    step = tr.make_train_step(config, split_mode='random', donate=False,
                              trainable=trainable)
    data = PatternBatches(prompt=True)
    for i in range(2):
      state, _ = step(state, next(data), jax.random.PRNGKey(i))
    states.append(jax.device_get(state.params))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(states[0])[0],
                          jax.tree.leaves(states[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7,
                               err_msg=treepath.path_str(path))


def test_grad_accumulation_equals_large_batch():
  config = tiny_config()
  params = init_params(config)
  kw = dict(weight_decay=0.1, clip_norm=1.0)
  big = tr.TrainState.create(params, tr.make_optimizer(1e-3, 1, 10, **kw))
  small = tr.TrainState.create(params, tr.make_optimizer(
      1e-3, 1, 10, grad_accum_steps=2, **kw))
  step = tr.make_train_step(config, donate=False)
  data = PatternBatches(batch=8)
  rng = jax.random.PRNGKey(0)
  for _ in range(2):
    batch = next(data)
    big, _ = step(big, batch, rng)
    for half in (slice(0, 4), slice(4, 8)):
      small, _ = step(small, {k: v[half] for k, v in batch.items()}, rng)
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), big.params,
                      small.params)
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                       big.params, params)
  assert max(jax.tree.leaves(diff)) < 1e-5, diff
  assert min(jax.tree.leaves(moved)) > 1e-4


def test_eval_step_and_evaluate():
  config = tiny_config('orthros')
  params = init_params(config)
  eval_step = tr.make_eval_step(config, split_mode='prompt')
  data = PatternBatches(prompt=True)
  batches = [next(data) for _ in range(3)]
  out = tr.evaluate(eval_step, params, batches)
  per = [jax.device_get(eval_step(params, b, jax.random.PRNGKey(0)))
         for b in batches]
  tokens = sum(float(m['tokens']) for m in per)
  assert out['tokens'] == tokens
  np.testing.assert_allclose(
      out['loss'], sum(float(m['loss'] * m['tokens']) for m in per) / tokens,
      rtol=1e-6)


# ---------------------------------------------------------------- NaN guard


def test_nan_guard_keeps_last_good_checkpoint(tmp_path):
  config = tiny_config()

  class Poisoned(PatternBatches):
    def __next__(self):
      batch = super().__next__()
      batch['scale'] = np.float32(np.inf if self.index == 5 else 1.0)
      return batch

  def loss_fn(logits, batch):
    loss, m = tr.next_token_loss(logits, batch)
    return loss * batch['scale'], m

  step = tr.make_train_step(config, loss_fn=loss_fn)
  with pytest.raises(FloatingPointError, match=r'non-finite.*step 5.*step 4'):
    tr.train(quick_config(num_steps=8, checkpoint_every=2), tmp_path, config,
             lambda: init_params(config), Poisoned(), train_step=step)
  manager = tr.CheckpointManager(tmp_path / 'checkpoints')
  assert manager.all_steps() == [2, 4]
  it = PatternBatches()
  tx = tr.make_optimizer(1e-2, 2, 30)
  state = manager.restore(jax.eval_shape(state_lib.init_fn(
      lambda: init_params(config), tx)), data_iterator=it)
  manager.close()
  assert int(state.step) == 4 and it.index == 4
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize('state_bytes', [False, True])
def test_checkpoint_round_trip_and_keep_last_n(tmp_path, state_bytes):
  config = tiny_config()
  tx = tr.make_optimizer(1e-2, 1, 10)
  init = state_lib.init_fn(lambda: init_params(config), tx)
  step = tr.make_train_step(config, donate=False)
  data = PatternBatches(state_bytes=state_bytes)
  manager = tr.CheckpointManager(tmp_path, max_to_keep=2,
                                 save_interval_steps=2, model_config=config)
  state, restored = tr.restore_or_init(manager, init, data)
  assert restored is None
  saved = []
  for i in range(1, 7):
    state, _ = step(state, next(data), jax.random.PRNGKey(i))
    saved.append(manager.save(i, state, data))
  manager.wait()
  assert saved == [False, True, False, True, False, True]
  assert manager.all_steps() == [4, 6]
  manager.close()

  # A partially written checkpoint (as after a kill mid-save) is ignored.
  os.makedirs(tmp_path / '8.orbax-checkpoint-tmp-1234567' / 'state')
  manager = tr.CheckpointManager(tmp_path, model_config=config)
  assert manager.latest_step() == 6
  fresh = PatternBatches(state_bytes=state_bytes)
  back, restored = tr.restore_or_init(manager, init, fresh)
  manager.close()
  assert restored == 6 and fresh.index == 6
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    np.testing.assert_array_equal(a, b)
  with open(tmp_path / '6' / 'data' / 'metadata') as f:
    raw = json.load(f)
  if state_bytes:
    assert raw['kind'] == 'bytes'
    assert json.loads(base64.b64decode(raw['value'])) == {'index': 6}
  else:
    assert raw == {'kind': 'json', 'value': {'index': 6}}


def test_checkpoint_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match='does not exist'):
    tr.CheckpointManager(tmp_path / 'missing', create=False)
  config = tiny_config()
  tx = tr.make_optimizer(1e-2, 1, 10)
  manager = tr.CheckpointManager(tmp_path, model_config=config)
  with pytest.raises(FileNotFoundError, match='no checkpoint'):
    manager.restore(jax.eval_shape(state_lib.init_fn(
        lambda: init_params(config), tx)))
  manager.save(1, tr.TrainState.create(init_params(config), tx), force=True)
  manager.wait()
  wider = config.replace(mlp_dim=96)
  with pytest.raises(ValueError, match=r"layers_0/mlp.*shape"):
    tr.restore_or_init(manager, state_lib.init_fn(
        lambda: init_params(wider), tx))
  orthros = tiny_config('orthros')
  with pytest.raises(ValueError, match='phi_k'):
    tr.restore_or_init(manager, state_lib.init_fn(
        lambda: init_params(orthros), tx))
  manager.close()


# ---------------------------------------------------------------- SIGKILL

_SCRIPT = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    import numpy as np
    from orthros_jax import training as tr
    import test_training as tt

    class Slow(tt.PatternBatches):
      def __next__(self):
        time.sleep(float(sys.argv[2]))
        return super().__next__()

    config = tt.tiny_config('orthros')
    tr.train(tt.quick_config(num_steps=8, checkpoint_every=2, log_every=1,
                             keep_checkpoints=2, split_mode='random',
                             async_checkpoint=True),
             sys.argv[1], config, lambda: tt.init_params(config),
             Slow(prompt=True))
''')


def test_resume_after_sigkill_is_exact(tmp_path):
  script = tmp_path / 'run.py'
  script.write_text(_SCRIPT.format(repo=REPO, tests=os.path.join(REPO,
                                                                 'tests')))
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='',
             PYTHONPATH=REPO)
  killed, full = tmp_path / 'killed', tmp_path / 'full'
  run = lambda wd, delay: subprocess.Popen(
      [sys.executable, str(script), str(wd), str(delay)], env=env,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  victim = run(killed, 0.3)
  reference = run(full, 0.0)
  deadline = time.time() + 120
  while not (killed / 'checkpoints' / '4').is_dir():
    assert victim.poll() is None, victim.stderr.read().decode()[-3000:]
    assert time.time() < deadline, 'no checkpoint for step 4 within 120 s'
    time.sleep(0.05)
  time.sleep(0.5)  # let it run (and log) a step or two past the checkpoint
  os.kill(victim.pid, signal.SIGKILL)
  victim.wait()
  logged = tr.read_metrics(killed)
  assert 4 <= max(r['step'] for r in logged) < 8
  resumed = run(killed, 0.0)
  for p in (resumed, reference):
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err.decode()[-3000:]
  losses = lambda wd: [(r['step'], r['loss']) for r in tr.read_metrics(wd)]
  assert [s for s, _ in losses(full)] == list(range(1, 9))
  assert losses(killed) == losses(full)
  # Steps the killed run logged before dying were recomputed identically.
  assert all(dict(losses(full))[r['step']] == r['loss'] for r in logged)
  assert tr.CheckpointManager(killed / 'checkpoints').all_steps() == [6, 8]
