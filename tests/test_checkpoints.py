"""Checkpoints of the training loop: round trip and retention, errors that
name the file, the NaN guard keeping the last good checkpoint, and an exact
resume after SIGKILL (CPU, tiny models). Split from test_training.py."""

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

from orthros_jax import training as tr
from orthros_jax.training import state as state_lib
from tests.training_fixtures import PatternBatches
from tests.training_fixtures import init_params
from tests.training_fixtures import quick_config
from tests.training_fixtures import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    import training_fixtures as tt

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
