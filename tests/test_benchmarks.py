"""benchmarks/exact_tail.py and benchmarks/exact_attention.py: what they
write, and the identities their numbers rest on."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from orthros_jax.attention import softmax
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.conversion import pipeline
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.training.train_lm import model_config_from

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER = os.path.join(ROOT, 'assets', 'tiny_teacher')


def _load(name):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(ROOT, 'benchmarks', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_exact_tail_script(tmp_path):
  """An adapter of fresh feature maps on the committed tiny teacher: a tail
  covering the whole prompt decodes it exactly, so both rows generate what
  the teacher does; the short tail runs the hybrid prefill."""
  params, cfg, _ = ckpt_lib.load_params(TEACHER)
  teacher = model_config_from(cfg)
  student = pipeline.orthros_config(teacher, dict(
      kind='orthros', window=16, chunk_size=8, feature_dim=8, sinks=2))
  orthros = pipeline.init_student(params, student, jax.random.PRNGKey(0))
  adapter_lib.write_adapter(tmp_path / 'adapter', student, params, orthros,
                            {}, alpha=16.0)
  bench = _load('exact_tail')
  res = bench.run(str(tmp_path / 'adapter'), TEACHER, tails=[1, 4096],
                  tasks=['passkey'], lengths=[300], num_examples=2, seed=3,
                  sinks=2, max_new_tokens=8, batch_size=2, tokenizer='byte')
  samples = {r['model']: r['samples'] for r in res['rows']}
  assert set(samples) == {'teacher', 'window_sinks@tail1', 'orthros@tail1',
                          'window_sinks@tail4096', 'orthros@tail4096'}
  assert (samples['orthros@tail4096'] == samples['window_sinks@tail4096']
          == samples['teacher'])
  assert 'last 1 prompt tokens' in res['models']['orthros@tail1']
  assert '| passkey | 300 |' in bench.table(res)


def test_exact_attention_script(tmp_path):
  cmd = [sys.executable, 'benchmarks/exact_attention.py', '--lengths',
         '40,130', '--blocks', '0,16,64', '--batch', '1', '--heads', '2',
         '--kv_heads', '1', '--head_dim', '8', '--reps', '3', '--out',
         str(tmp_path)]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / 'results.json') as f:
    rows = json.load(f)['rows']
  assert {(r['length'], r['block'], r['what']) for r in rows} == {
      (t, b, w) for t in (40, 130) for b in (0, 16, 64)
      for w in ('forward', 'grad')}
  for r in rows:
    assert r['reps'] == 3 and r['min_ms'] <= r['median_ms'] <= r['max_ms']
  assert (tmp_path / 'exact_attention.png').stat().st_size > 0
  assert '| 130 | grad |' in (tmp_path / 'report.md').read_text()


def test_auto_block_follows_the_backend(monkeypatch):
  monkeypatch.setattr(jax, 'default_backend', lambda: 'cpu')
  assert softmax._auto_block(256, 256) is None  # pylint: disable=protected-access
  assert softmax._auto_block(257, 256) == 256  # pylint: disable=protected-access
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert softmax._auto_block(1024, 1024) is None  # pylint: disable=protected-access
  assert softmax._auto_block(1025, 1024) == 512  # pylint: disable=protected-access
  # Either choice computes the same attention.
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 300, 2, 8)).astype(np.float32)
  k = rng.standard_normal((1, 300, 1, 8)).astype(np.float32)
  v = rng.standard_normal((1, 300, 1, 8)).astype(np.float32)
  np.testing.assert_allclose(
      np.asarray(softmax.softmax_attention(q, k, v, block_size=256)),
      np.asarray(softmax.softmax_attention(q, k, v, block_size=300)),
      rtol=2e-5, atol=2e-6)


def _cell(key, model, depth, scores, task='passkey', length=300):
  n = len(scores)
  return {'key': key, 'row': {
      'task': task, 'length': length, 'depth': depth, 'model': model,
      'n': n, 'accuracy': sum(scores) / n, 'scores': scores,
      'samples': []}}


def test_cells_table_takes_the_largest_cell_and_pairs_with_the_teacher(
    tmp_path):
  bench = _load('cells_table')
  lines = [
      _cell('t1', 'teacher', 0.1, [1.0, 1.0, 0.0, 1.0]),
      _cell('t2', 'teacher', 0.9, [1.0, 1.0]),
      _cell('o1', 'orthros', 0.1, [1.0, 0.0]),          # fewer examples
      _cell('o1', 'orthros', 0.1, [1.0, 0.0, 0.0, 1.0]),
      _cell('o2', 'orthros', 0.9, [0.0, 1.0]),
      _cell('w1', 'window', 0.1, [0.0]),
      _cell('w2', 'window', 0.9, [1.0]),
      _cell('d1', 'dense', 0.1, [1.0] * 100),
  ]
  path = tmp_path / 'retrieval_cells.jsonl'
  path.write_text(''.join(json.dumps(x) + '\n' for x in lines))
  entries = {e['model']: e for e in bench.table(bench.load_cells(
      str(tmp_path)))}
  assert entries['teacher']['n'] == 6
  assert entries['teacher']['accuracy'] == 5 / 6
  assert entries['orthros']['n'] == 6           # the 4-example cell, not 2
  assert entries['orthros']['accuracy'] == 3 / 6
  # Paired with the teacher's same examples: (2 - 3) + (1 - 2) of 6.
  assert entries['orthros']['minus_teacher_points'] == 100 * -2 / 6
  # window: its 1 example per depth against the teacher's first one.
  assert entries['window']['paired_n'] == 2
  assert entries['window']['minus_teacher_points'] == 100 * (1 - 2) / 2
  md = bench.markdown(list(entries.values()))
  assert md.splitlines()[0] == ('| task | length | teacher | dense | window | '
                                'orthros |')
  assert 'n=6 (-33.3)' in md
  assert bench.plot(list(entries.values()), str(tmp_path / 'p.png'))
  assert (tmp_path / 'p.png').stat().st_size > 0
  # The same cell under another key: the weights changed under this dir.
  with open(path, 'a') as f:
    f.write(json.dumps(_cell('other', 'window', 0.9, [0.0])) + '\n')
  with pytest.raises(ValueError, match='two fingerprints'):
    bench.load_cells(str(path))
  with pytest.raises(FileNotFoundError, match='run eval.py'):
    bench.load_cells(str(tmp_path / 'nowhere'))
