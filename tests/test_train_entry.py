"""train.py and its library function on the tiny config's smoke variant."""

import json
import os
import subprocess
import sys

import pytest

from configs import tiny
from orthros_jax.training.train_lm import model_config_from
from orthros_jax.training.train_lm import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize('kind', ['dense', 'orthros'])
def test_train_and_evaluate_then_resume(tmp_path, kind):
  config = tiny.get_config('smoke')
  config.model.attention.kind = kind
  state, history = train_and_evaluate(config, tmp_path)
  assert int(state.step) == 4 and len(history) == 4
  records = _records(tmp_path)
  assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3, 4]
  assert any('eval/loss' in r for r in records)
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']
  # The same workdir with more steps resumes at step 4.
  config.train.num_steps = 6
  state, history = train_and_evaluate(config, tmp_path)
  assert int(state.step) == 6 and len(history) == 2


def test_bad_config_keys_are_named(tmp_path):
  with pytest.raises(ValueError, match='num_layer'):
    model_config_from({'num_layer': 2})
  with pytest.raises(ValueError, match='windw'):
    model_config_from({'attention': {'windw': 2}})
  config = tiny.get_config('smoke')
  config.model.vocab_size = 100
  with pytest.raises(ValueError, match='vocab_size'):
    train_and_evaluate(config, tmp_path)


def test_train_py_entry_point(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/tiny.py:smoke',
       f'--workdir={tmp_path}', '--config.train.num_steps=2',
       '--config.model.attention.kind=orthros'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert [r['step'] for r in _records(tmp_path) if 'loss' in r] == [1, 2]
