"""train.py and its library function on the tiny config's smoke variant."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from orthros_jax.training import train_lm
from orthros_jax.config import model_config_from
from orthros_jax.layer_layout import stack_layers
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


def test_warm_start_from_another_run(tmp_path):
  # init_from: the params of a finished run, a fresh optimizer and schedule.
  config = tiny.get_config('smoke')
  first, _ = train_and_evaluate(config, tmp_path / 'a')
  first = jax.device_get(first.params)
  config.init_from = str(tmp_path / 'a')
  config.train.num_steps = 2
  captured = {}
  original = train_lm.loop.train

  def spy(cfg, workdir, model_config, params_init, *args, **kwargs):
    captured['params'] = jax.device_get(params_init())
    return original(cfg, workdir, model_config, params_init, *args, **kwargs)

  train_lm.loop.train = spy
  try:
    second, history = train_and_evaluate(config, tmp_path / 'b')
  finally:
    train_lm.loop.train = original
  assert int(second.step) == 2 and len(history) == 2
  for a, b in zip(jax.tree.leaves(captured['params']),
                  jax.tree.leaves(first)):
    np.testing.assert_array_equal(a, b)
  # A different architecture is refused before training.
  config.model.num_layers = 3
  with pytest.raises(ValueError, match='init_from'):
    train_and_evaluate(config, tmp_path / 'c')
  config.model.num_layers = 2
  # A run with its layers scanned (and remat) warm-starts from the unrolled
  # run's params, stacked, and trains.
  config.model.scan_layers = True
  config.model.remat = 'full'
  train_lm.loop.train = spy
  try:
    third, history = train_and_evaluate(config, tmp_path / 'e')
  finally:
    train_lm.loop.train = original
  assert int(third.step) == 2 and np.all(np.isfinite(
      [h['loss'] for h in history]))
  assert 'layers' in third.params and 'layers_0' not in third.params
  for a, b in zip(jax.tree.leaves(captured['params']),
                  jax.tree.leaves(stack_layers(first))):
    np.testing.assert_array_equal(a, b)
  config.model.scan_layers = False
  config.model.remat = 'none'
  config.init_from = str(tmp_path / 'missing')
  with pytest.raises(FileNotFoundError):
    train_and_evaluate(config, tmp_path / 'd')


def test_bad_config_keys_are_named(tmp_path):
  with pytest.raises(ValueError, match='num_layer'):
    model_config_from({'num_layer': 2})
  with pytest.raises(ValueError, match='windw'):
    model_config_from({'attention': {'windw': 2}})
  config = tiny.get_config('smoke')
  config.model.vocab_size = 100
  with pytest.raises(ValueError, match='vocab_size'):
    train_and_evaluate(config, tmp_path)
  # The config is parsed once into a frozen plan; every shipped config
  # parses, and an unknown or bad top-level value is refused before
  # anything trains (both were ignored before the plan).
  from configs import llama_1b
  for c in (tiny.get_config(), tiny.get_config('smoke,niah,varlen'),
            llama_1b.get_config()):
    plan = train_lm.check_config(c)
    assert plan.seq_len == c.data.seq_len and plan.model.num_layers == (
        c.model.num_layers)
  assert train_lm.check_config(plan) is plan
  for key, value, match in (('eval_batch', 2, r"unknown keys \['eval_batch'"),
                            ('eval_batches', 0, 'eval_batches=0'),
                            ('train', {'num_step': 2}, 'num_step')):
    bad = tiny.get_config('smoke').to_dict()
    bad[key] = value
    with pytest.raises(ValueError, match=match):
      train_lm.check_config(bad)
    with pytest.raises(ValueError, match=match):
      train_and_evaluate(bad, tmp_path / 'never')
    assert not (tmp_path / 'never').exists()


INFO_LINE = re.compile(r'^I\d{4} ', re.M)  # absl's INFO prefix: I<mmdd>


def test_train_py_entry_point(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  cmd = [sys.executable, 'train.py', '--config=configs/tiny.py:smoke',
         '--config.train.num_steps=2', '--config.model.attention.kind=orthros']
  proc = subprocess.run(
      cmd + [f'--workdir={tmp_path}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Quiet by default (orthros_jax/console.py); --verbosity=0 shows the
  # libraries' INFO lines (orbax's checkpoint manager, the loop's steps).
  assert not INFO_LINE.search(proc.stderr), proc.stderr[-3000:]
  loud = subprocess.run(
      cmd + [f'--workdir={tmp_path / "loud"}', '--verbosity=0'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert loud.returncode == 0, loud.stderr[-3000:]
  assert INFO_LINE.search(loud.stderr) and 'checkpoint' in loud.stderr
  assert [r['step'] for r in _records(tmp_path) if 'loss' in r] == [1, 2]
