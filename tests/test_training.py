"""Training library: optimizer, loss, steps, metrics and the loop (CPU, tiny
models). Checkpoints, the NaN guard's kept checkpoint and an exact resume
after SIGKILL: test_checkpoints.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax import training as tr
from orthros_jax import treepath
from orthros_jax.training import metrics as metrics_lib
from tests.training_fixtures import B
from tests.training_fixtures import T
from tests.training_fixtures import PatternBatches
from tests.training_fixtures import init_params
from tests.training_fixtures import quick_config
from tests.training_fixtures import tiny_config



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
