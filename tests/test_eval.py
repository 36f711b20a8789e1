"""eval.py: the prefill-only floor's generation, retrieval runs, speed rows,
and the suite end to end on small random checkpoints."""

import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from configs import eval_tiny
from orthros_jax.data import get_tokenizer
from orthros_jax.evaluation import cells
from orthros_jax.evaluation import inference
from orthros_jax.evaluation import loading
from orthros_jax.evaluation import plan as plan_lib
from orthros_jax.evaluation import retrieval
from orthros_jax.evaluation import routes
from orthros_jax.evaluation import suite
from orthros_jax.evaluation import tasks as tasks_lib
from orthros_jax.evaluation import variants
from orthros_jax.model import Transformer
from orthros_jax.training import checkpoint as ckpt_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings(
    'ignore:Some donated buffers were not usable')

ORTHROS = oj.ModelConfig(
    vocab_size=259, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=64,
    attention=oj.AttentionConfig(kind='orthros', window=8, chunk_size=8,
                                 feature_dim=4))


@functools.partial(jax.jit, static_argnums=0)
def _init(config, rng):
  return nn.unbox(Transformer(config).init(rng, jnp.zeros((1, 8), jnp.int32),
                                           phase='forward')['params'])


@pytest.mark.parametrize('window', [0, 3])
def test_prefill_only_generation_is_the_prefill_formula(window):
  """Each generated token is the argmax of the prefill formula over the
  prompt and the tokens generated so far (recomputed from scratch)."""
  config = ORTHROS.replace(attention={'window': window, 'exact_tail': 0})
  params = _init(config, jax.random.PRNGKey(0))
  prompts = [[5, 9, 33, 70, 2, 41, 41, 8, 100], [17, 3, 250, 6]]
  out = retrieval.greedy(config, params, prompts, max_new_tokens=6,
                         route='prefill')
  assert out.shape == (2, 6)
  # Causal: position len(seq) - 1 of a right-padded row sees only seq.
  forward = jax.jit(lambda x: Transformer(config).apply(
      {'params': params}, x, phase='forward')[0])
  for prompt, row in zip(prompts, out):
    seq = list(prompt)
    for token in row:
      padded = jnp.asarray([seq + [0] * (16 - len(seq))])
      assert int(jnp.argmax(forward(padded)[0, len(seq) - 1])) == int(token)
      seq.append(int(token))
  # Padding to a fixed width and batch (one compile per task) changes
  # nothing, on either path.
  for route in routes.GENERATION_ROUTES:
    plain = retrieval.greedy(config, params, prompts, max_new_tokens=6,
                             route=route)
    padded = retrieval.greedy(config, params, prompts, max_new_tokens=6,
                              route=route, width=32, batch=5)
    np.testing.assert_array_equal(plain, padded)
  with pytest.raises(ValueError, match='route'):
    retrieval.greedy(config, params, prompts, max_new_tokens=2, route='x')
  with pytest.raises(ValueError, match='route'):  # no cache to decode into
    retrieval.greedy(config, params, prompts, max_new_tokens=2,
                     route='forward')


def test_run_task_scores_generated_text(monkeypatch):
  """An oracle model (its greedy output replaced by the target) scores 100%,
  the real random model ~0; the floor runs the prefill path."""
  params = _init(ORTHROS, jax.random.PRNGKey(1))
  tok = get_tokenizer('byte')
  models = {'orthros': (ORTHROS, params, 'inference'),
            'linear': (inference.pure_linear(ORTHROS), params, 'prefill')}
  result = retrieval.run_task(models, 'passkey', tok, length=300,
                              num_examples=3, seed=0, batch_size=2)
  assert set(result) == {'orthros', 'linear'}
  for r in result.values():
    assert r['n'] == 3 and r['accuracy'] < 0.5 and len(r['samples']) == 3
  from orthros_jax.evaluation import tasks
  examples = tasks.make_examples('passkey', 0, tok, 300, 3)

  def oracle(config, params, prompts, *, max_new_tokens, **unused):
    del config, params, unused
    by_prompt = {tuple(e.prompt): e.target for e in examples}
    return np.array([by_prompt[tuple(p)] + [tok.eos_id] * (
        max_new_tokens - len(by_prompt[tuple(p)])) for p in prompts])

  monkeypatch.setattr(retrieval, 'greedy', oracle)
  result = retrieval.run_task(models, 'passkey', tok, length=300,
                              num_examples=3, seed=0)
  assert result['orthros']['accuracy'] == 1.0
  assert result['orthros']['ci95'][1] == 1.0


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp('ckpts')
  params = _init(ORTHROS, jax.random.PRNGKey(2))
  ckpt_lib.save_params(root / 'orthros', params, ORTHROS, step=3)
  dense = ORTHROS.replace(attention={'kind': 'dense'})
  ckpt_lib.save_params(root / 'teacher', _init(dense, jax.random.PRNGKey(3)),
                       dense, step=5)
  return root


def _smoke_config(checkpoints, teacher=True):
  c = eval_tiny.get_config('smoke')
  c.checkpoint = str(checkpoints / 'orthros')
  c.teacher = str(checkpoints / 'teacher') if teacher else ''
  c.tasks.passkey.num_examples = 2
  c.tasks.niah.num_examples = 2
  c.tasks.mqar.num_examples = 2
  c.speed.lengths = (64,)
  return c


def test_suite_writes_results_report_and_plots(checkpoints, tmp_path):
  results = suite.run(_smoke_config(checkpoints), tmp_path)
  with open(tmp_path / 'results.json') as f:
    saved = json.load(f)
  assert set(saved['models']) == {'teacher', 'orthros', 'linear'}
  assert 'step 5' in saved['models']['teacher']
  cells = {(r['task'], r['model']) for r in saved['retrieval']}
  assert cells == {(t, m) for t in ('passkey', 'niah', 'mqar')
                   for m in ('teacher', 'orthros', 'linear')}
  q = saved['quality']
  assert q['orthros']['inference']['route'] == 'inference'
  assert q['orthros']['teacher_forced']['route'] == 'prefill'
  assert q['linear']['inference']['route'] == 'prefill'
  assert q['teacher']['inference']['loss'] == q['teacher'][
      'teacher_forced']['loss']
  assert len(saved['speed']['rows']) == 3
  report = (tmp_path / 'report.md').read_text()
  assert '## Summary' in report and results['summary_table'] in report
  for name in ('speed.png', 'retrieval.png', 'passkey_heatmap.png',
               'niah_heatmap.png', 'speed.csv', 'quality.png'):
    assert (tmp_path / name).stat().st_size > 0


def test_suite_baseline_rows_say_which_weights(checkpoints, tmp_path):
  """Every row of evaluation/variants.py through the suite (quality
  only): 'same weights' only where true, the teacher row is the teacher
  checkpoint, the dense row the converted weights (no teacher needed), and
  the window rows have exactly no linear term."""
  c = _smoke_config(checkpoints)
  c.tasks = {}
  c.speed = {}
  c.models = variants.ROWS[:-1] + ('orthros',)  # a duplicate is harmless
  c.models = tuple(m for m in c.models if m != 'orthros_nosinks')
  c.linear_checkpoint = ''
  models, desc = loading.load_models(c)
  assert list(models) == [m for m in variants.ROWS if m in c.models]
  assert 'same weights' not in desc['teacher'] and 'step 5' in desc['teacher']
  for name in ('window', 'window_sinks', 'orthros_sinks', 'linear'):
    assert 'same weights' in desc[name]
  assert not models['dense'][0].is_orthros
  assert models['dense'][1] is models['orthros'][1]
  assert models['window_sinks'][0].attention.sinks == 4
  assert models['window'][0].attention.sinks == 0
  # The window rows' feature maps are exactly zero on any input.
  config, params, _ = models['window']
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, config.num_heads,
                                                config.head_dim))
  from orthros_jax import feature_maps
  w = params['layers_0']['attn']['phi_q']['proj']
  assert not np.any(feature_maps.feature_map(
      config.attention.feature_map, x, w))
  # Window row with a window covering the text = dense attention.
  wide = config.replace(attention={'window': 64})
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 40), 0, 259)
  run = lambda cfg, p: Transformer(cfg).apply({'params': p}, tokens,
                                              phase='forward')[0]
  np.testing.assert_allclose(run(wide, params),
                             run(models['dense'][0], models['dense'][1]),
                             atol=2e-5, rtol=1e-5)
  results = suite.run(c, tmp_path)
  assert set(results['quality']) == set(models)


def test_suite_row_errors(checkpoints, tmp_path):
  c = _smoke_config(checkpoints, teacher=False)
  with pytest.raises(ValueError, match="'dense' row"):
    loading.load_models(c)
  c.models = ('orthros_nosinks',)
  with pytest.raises(ValueError, match='no sinks'):
    loading.load_models(c)
  c.models = ('linear_trained',)
  with pytest.raises(ValueError, match='linear_checkpoint'):
    loading.load_models(c)
  c.linear_checkpoint = str(checkpoints / 'orthros')  # window 8: not linear
  with pytest.raises(ValueError, match='pure-linear'):
    loading.load_models(c)
  lin = ORTHROS.replace(attention={'window': 0})
  ckpt_lib.save_params(tmp_path / 'lin', _init(lin, jax.random.PRNGKey(4)),
                       lin, step=2)
  c.linear_checkpoint = str(tmp_path / 'lin')
  models, desc = loading.load_models(c)
  assert models['linear_trained'][2] == 'prefill'
  assert 'its own weights' in desc['linear_trained']


def test_eval_tiny_variants():
  full, retrieval = eval_tiny.get_config(), eval_tiny.get_config('retrieval')
  assert retrieval.tasks.to_dict() == full.tasks.to_dict()
  assert not retrieval.get('quality') and not retrieval.get('speed')
  assert full.quality and full.speed
  speed = eval_tiny.get_config('speed')
  assert not speed.tasks and not speed.quality and speed.speed
  with pytest.raises(ValueError, match='expected one of'):
    eval_tiny.get_config('retreival')


def test_eval_config_parsed_once_into_a_plan():
  """eval.py's config becomes a frozen SuitePlan before anything loads:
  every shipped config parses, unknown keys and bad values raise, and the
  plan carries what the sections read."""
  from configs import eval_smollm2
  shipped = [eval_tiny.get_config(arg)
             for arg in ('', 'smoke', 'speed', 'retrieval')]
  shipped += [eval_smollm2.get_config(arg)
              for arg in ('', 'main', 'baselines', 'quality', 'speed', 'quick',
                          'lm_eval')]
  for c in shipped:
    c.checkpoint = c.checkpoint or '/nonexistent'
    c.teacher = c.teacher or '/nonexistent'
    assert plan_lib.check_config(c).models == tuple(c.models)
  c = eval_tiny.get_config()
  c.checkpoint = c.teacher = '/nonexistent'
  plan = plan_lib.check_config(c)
  assert plan_lib.check_config(plan) is plan
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.sinks = 1
  spec = {s.task: s for s in plan.tasks}['passkey']
  assert spec.lengths == tuple(c.tasks.passkey.lengths)
  assert len(list(spec.cells())) == len(spec.lengths) * len(spec.depths)
  assert plan.quality == c.quality.to_dict()
  assert plan.speed.lengths == tuple(c.speed.lengths)
  # sinks 0 was silently read as 4 before the plan.
  for key, value, match in (
      ('sinks', 0, 'sinks=0'), ('models', ('orthros', 'sparse'), 'sparse'),
      ('checkpoint', '', 'set checkpoint')):
    bad = eval_tiny.get_config()
    bad.checkpoint = bad.teacher = '/nonexistent'
    bad.unlock()[key] = value
    with pytest.raises(ValueError, match=match):
      plan_lib.check_config(bad)
  bad = eval_tiny.get_config().to_dict()
  bad['checkpoint'] = bad['teacher'] = '/nonexistent'
  bad['sink'] = 4
  with pytest.raises(ValueError, match=r"unknown keys \['sink'\]"):
    plan_lib.check_config(bad)
  for section, value, match in (
      ('speed', dict(lengths=(64,), rep=3), r"speed has unknown keys \['rep'"),
      ('speed', dict(lengths=(0,)), 'speed.lengths=0'),
      ('speed', dict(lengths=(64,), decode_steps=-1), 'speed.decode_steps'),
      ('speed', dict(lengths=(64,), variants=('dense', 'none')),
       'orthros among them'),
      ('speed', dict(lengths=(64,), variants=('orthros', 'flash')),
       r"speed.variants=\('orthros', 'flash'\)"),
      ('tasks', dict(passkey=dict(depths=(0.5,))), 'needs lengths'),
      ('tasks', dict(passkey=dict(lengths=(64, 96), num_examples=(2,))),
       'one per length'),
      ('tasks', dict(niah=dict(lengths=(64,), depths=(1.5,))), r'\[0, 1\]'),
      ('lm_eval', dict(tasks=('piqa',), batchsize=2), 'batchsize'),
      ('tasks', dict(passkee=dict(lengths=(64,))), 'not a task'),
      ('quality', dict(source='text', seqlen=64), r"unknown keys \['seqlen'"),
      ('teacher', '', "'teacher' row needs teacher"),
      ('models', ('orthros', 'linear_trained'), 'linear_checkpoint')):
    bad = eval_tiny.get_config().to_dict()
    bad['checkpoint'] = bad['teacher'] = '/nonexistent'
    bad[section] = value
    with pytest.raises(ValueError, match=match):
      plan_lib.check_config(bad)


def test_suite_errors(checkpoints, tmp_path):
  c = _smoke_config(checkpoints)
  c.checkpoint = ''
  with pytest.raises(ValueError, match='set checkpoint'):
    suite.run(c, tmp_path)
  c = _smoke_config(checkpoints)
  c.checkpoint = str(checkpoints / 'teacher')
  with pytest.raises(ValueError, match='dense model'):
    suite.run(c, tmp_path)
  c = _smoke_config(checkpoints)
  c.models = ('orthros', 'sparse')
  with pytest.raises(ValueError, match='sparse'):
    suite.run(c, tmp_path)
  c = _smoke_config(checkpoints)
  c.checkpoint = str(tmp_path / 'missing')
  with pytest.raises(FileNotFoundError):
    suite.run(c, tmp_path)


def test_eval_py_entry_point(checkpoints, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, 'eval.py', '--config=configs/eval_tiny.py:smoke',
       f'--config.checkpoint={checkpoints / "orthros"}',
       '--config.tasks.passkey.num_examples=1',
       '--config.tasks.niah.num_examples=1',
       '--config.tasks.mqar.num_examples=1', '--config.models=("orthros",)',
       '--config.speed.lengths=(64,)', f'--out={tmp_path}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '| metric | orthros |' in proc.stdout
  assert (tmp_path / 'report.md').exists()
  assert not re.search(r'^I\d{4} ', proc.stderr, re.M), proc.stderr[-3000:]


def test_every_retrieval_task_runs_through_the_suite(checkpoints, tmp_path,
                                                     monkeypatch):
  """All ten tasks, one example each on a random model, at one width (one
  prefill compile): the pipeline from generator to scorer is wired for
  each, and the report lists them."""
  from orthros_jax.evaluation import tasks
  c = _smoke_config(checkpoints)
  c.models = ('orthros',)
  c.quality = {}
  c.speed = {}
  c.tasks = {name: {'lengths': [640], 'num_examples': 1}
             for name in tasks.TASKS if name != 'mqar'}
  c.tasks['mqar'] = {'lengths': [96], 'num_examples': 1, 'num_pairs': 4}
  results = suite.run(c, tmp_path)
  assert {r['task'] for r in results['retrieval']} == set(tasks.TASKS)
  for r in results['retrieval']:
    assert r['n'] == 1 and 0.0 <= r['accuracy'] <= 1.0
  report = (tmp_path / 'report.md').read_text()
  assert all(f'| {name} |' in report for name in tasks.TASKS)
  # Wired end to end: a model that answers each prompt with its example's
  # target scores 100% on every task, one that answers nothing 0%.
  tok = get_tokenizer('byte')
  by_prompt = {}
  for name, spec in c.tasks.items():
    spec = dict(spec)
    opts = {k: v for k, v in spec.items()
            if k not in ('lengths', 'num_examples')}
    for length in spec['lengths']:
      ex, = tasks.make_examples(name, c.seed, tok, length, 1, **opts)
      by_prompt[tuple(ex.prompt)] = (ex.target, [])
  for which, expect in ((0, lambda a: a == 1.0), (1, lambda a: a == 0.0)):
    def oracle(config, params, prompts, *, max_new_tokens, which=which,
               **unused):
      del config, params, unused
      rows = [list(by_prompt[tuple(p)][which]) + [tok.eos_id] for p in prompts]
      return np.array([(r + [tok.eos_id] * max_new_tokens)[:max_new_tokens]
                       for r in rows])
    monkeypatch.setattr(retrieval, 'greedy', oracle)
    results = suite.run(c, tmp_path / f'oracle{which}')
    for r in results['retrieval']:
      assert expect(r['accuracy']), (which, r['task'], r['accuracy'])


def test_eval_smollm2_variants():
  from configs import eval_smollm2
  full = eval_smollm2.get_config()
  assert set(full.models) >= {'teacher', 'dense', 'window', 'window_sinks',
                              'orthros', 'orthros_nosinks', 'linear'}
  # 'main': at least 100 examples per cell at 2K and 50 at 4K (5 depths).
  main = eval_smollm2.get_config('main')
  for task in ('passkey', 'niah'):
    spec = main.tasks[task]
    counts = dict(zip(spec.lengths, spec.num_examples))
    assert counts[2048] * len(spec.depths) >= 100
    assert counts[4096] * len(spec.depths) >= 50
  assert all(len(s.num_examples) == len(s.lengths)
             for s in full.tasks.values())
  assert max(eval_smollm2.get_config('quick').tasks.passkey.lengths) <= 2048
  with pytest.raises(ValueError, match='expected'):
    eval_smollm2.get_config('fast')
  # The sections of '' alone, the same settings; baselines = the 2K / 4K
  # passkey and niah cells of '' (so they are reused), every row.
  quality, speed_cfg = (eval_smollm2.get_config('quality'),
                        eval_smollm2.get_config('speed'))
  assert not quality.tasks and not quality.speed
  assert quality.quality.to_dict() == full.quality.to_dict()
  assert not speed_cfg.tasks and not speed_cfg.quality
  assert speed_cfg.speed.to_dict() == full.speed.to_dict()
  base = eval_smollm2.get_config('baselines')
  assert base.models == full.models
  for task in ('passkey', 'niah'):
    b, f = base.tasks[task], full.tasks[task]
    assert set(b.lengths) == {2048, 4096} <= set(f.lengths)
    for n, k in zip(b.lengths, b.num_examples):
      assert k * len(b.depths) >= 30
      assert k == dict(zip(f.lengths, f.num_examples))[n]
  assert full.exact_tail == 64 and full.seed == main.seed
  # lm-eval: off unless tasks are named; ':lm_eval' names the zero-shot
  # suite of LoLCATs' tables on every row it reports.
  assert not full.lm_eval.tasks and not main.lm_eval.tasks
  harness = eval_smollm2.get_config('lm_eval')
  assert set(harness.lm_eval.tasks) == {'piqa', 'arc_easy', 'arc_challenge',
                                        'hellaswag', 'winogrande', 'mmlu'}
  assert {'teacher', 'orthros', 'linear'} <= set(harness.models)
  assert harness.lm_eval.num_fewshot.mmlu == 5
  assert harness.lm_eval.num_fewshot.piqa == 0
  assert not harness.tasks and not harness.quality and not harness.speed


def test_task_counts_per_length_and_generation_budget(checkpoints,
                                                     monkeypatch):
  models = {'orthros': loading.load_models(_smoke_config(checkpoints))[0][
      'orthros']}
  tok = get_tokenizer('byte')
  budgets = []
  greedy = retrieval.greedy

  def spy(*args, max_new_tokens, **kwargs):
    budgets.append(max_new_tokens)
    return greedy(*args, max_new_tokens=max_new_tokens, **kwargs)

  monkeypatch.setattr(retrieval, 'greedy', spy)
  rows = suite.run_tasks(models, {'passkey': dict(
      lengths=(300, 320), num_examples=(1, 2), max_new_tokens=9)}, tok,
                         seed=0, progress=False)
  assert [(r['length'], r['n']) for r in rows] == [(300, 1), (320, 2)]
  # The budget is honoured: 9 new tokens where the answer needs 6; without
  # one, the longest answer plus its eos.
  ex = tasks_lib.make_examples('passkey', 0, tok, 300, 1)[0]
  assert len(ex.target) + 1 < 9 and set(budgets) == {9}
  budgets.clear()
  suite.run_tasks(models, {'passkey': dict(lengths=(300,), num_examples=1)},
                  tok, seed=0, progress=False)
  assert budgets == [len(ex.target) + 1]
  with pytest.raises(ValueError, match='one per length'):
    suite.run_tasks(models, {'passkey': dict(lengths=(300, 320),
                                             num_examples=(1, 2, 3))},
                    tok, seed=0, progress=False)


def test_retrieval_cells_resume_and_follow_the_weights(checkpoints, tmp_path,
                                                       monkeypatch):
  """A rerun in the same out_dir computes no stored cell again (a killed
  evaluation resumes), computes a cell whose model's weights changed, and
  returns rows equal to the first run's."""
  c = _smoke_config(checkpoints)
  models = loading.load_models(c)[0]
  models = {k: models[k] for k in ('teacher', 'orthros')}
  tok = get_tokenizer('byte')
  spec = {'passkey': dict(lengths=(300,), depths=(0.2, 0.8),
                          num_examples=2)}
  calls = []
  run_task = retrieval.run_task

  def spy(todo, *args, **kwargs):
    calls.append(sorted(todo))
    return run_task(todo, *args, **kwargs)

  monkeypatch.setattr(retrieval, 'run_task', spy)
  first = suite.run_tasks(models, spec, tok, seed=0, progress=False,
                          out_dir=str(tmp_path))
  assert calls == [['orthros', 'teacher']] * 2
  lines = (tmp_path / cells.CELLS_FILE).read_text().splitlines()
  assert len(lines) == 4
  calls.clear()
  again = suite.run_tasks(models, spec, tok, seed=0, progress=False,
                          out_dir=str(tmp_path))
  assert not calls and again == json.loads(json.dumps(first))
  # A torn last line (killed mid-write) is ignored, not fatal.
  with open(tmp_path / cells.CELLS_FILE, 'a') as f:
    f.write('{"key": "abc", "ro')
  # Other weights under the same name: recomputed, the teacher reused.
  config, params, path = models['orthros']
  moved = jax.tree.map(lambda x: x + 1e-3, params)
  models['orthros'] = (config, moved, path)
  suite.run_tasks(models, spec, tok, seed=0, progress=False,
                  out_dir=str(tmp_path))
  assert calls == [['orthros']] * 2
  # Fewer examples: the first ones of the stored cell, nothing computed,
  # equal to what a fresh run of that count gives; more: computed.
  calls.clear()
  spec['passkey']['num_examples'] = 1
  fewer = suite.run_tasks(models, spec, tok, seed=0, progress=False,
                          out_dir=str(tmp_path))
  assert not calls
  fresh = suite.run_tasks(models, spec, tok, seed=0, progress=False)
  strip = lambda rows: [{k: v for k, v in r.items() if k != 'samples'}
                        for r in rows]
  assert strip(fewer) == strip(json.loads(json.dumps(fresh)))
  assert [r['n'] for r in fewer] == [1] * 4
  spec['passkey']['num_examples'] = 3
  calls.clear()
  suite.run_tasks(models, spec, tok, seed=0, progress=False,
                  out_dir=str(tmp_path))
  assert calls == [['orthros', 'teacher']] * 2


def test_first_examples_of_a_stored_cell():
  row = {'scores': [1.0, 0.0, 0.5, 1.0], 'n': 4, 'accuracy': 0.625,
         'samples': [1, 2, 3], 'model': 'm'}
  sub = cells.first_examples(row, 3)
  assert sub['n'] == 3 and sub['accuracy'] == pytest.approx(0.5)
  assert sub['exact'] == pytest.approx(1 / 3) and sub['scores'] == [1.0, 0.0,
                                                                    0.5]
  assert sub['ci95'] == list(inference.wilson_interval(2, 3))
  assert sub['model'] == 'm'
  with pytest.raises(ValueError, match='cannot'):
    cells.first_examples(row, 5)


def test_exact_tail_override_applies_to_every_converted_row(checkpoints):
  c = _smoke_config(checkpoints)
  c.models = ('teacher', 'window', 'window_sinks', 'orthros')
  c.exact_tail = 5
  models, desc = loading.load_models(c)
  for name in ('window', 'window_sinks', 'orthros'):
    assert models[name][0].attention.exact_tail == 5
    assert 'last 5 prompt tokens' in desc[name]
  assert not models['teacher'][0].is_orthros
  c.exact_tail = -1
  models, _ = loading.load_models(c)
  assert models['orthros'][0].attention.exact_tail == (
      ORTHROS.attention.exact_tail)


def test_cell_keys_outlive_the_route_rename():
  """Cells stored when the 'inference' route was called 'generate' keep
  their keys (a rerun into the same --out reuses them); other routes and
  rows hash apart."""
  args = ('passkey', 256, 0.5, 0, {'digits': 5}, 24, 'orthros')
  legacy = hashlib.sha256(json.dumps(
      [*args, 'generate', 'f00d'], sort_keys=True,
      default=str).encode()).hexdigest()
  assert cells.cell_key(*args, 'inference', 'f00d') == legacy
  assert cells.cell_key(*args, 'prefill', 'f00d') != legacy
  assert cells.cell_key(*args, 'inference', 'beef') != legacy


def test_cell_batch_pads_at_most_one_row_per_batch():
  for num in range(1, 50):
    b = cells.cell_batch(num)
    batches = -(-num // b)
    assert b <= 8 and batches == -(-num // 8)
    assert batches * b - num < batches
  assert cells.cell_batch(20) == 7 and cells.cell_batch(10) == 5
