"""convert.py: inference-path scoring, params checkpoints, the conversion
pipeline end to end (train.py teacher and Hugging Face teacher), errors."""

import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from configs import convert_tiny
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.conversion import pipeline
from orthros_jax.conversion import plan as plan_lib
from orthros_jax.conversion import teacher as teacher_lib
from orthros_jax.data import get_tokenizer
from orthros_jax.data import make_dataset
from orthros_jax.evaluation import inference
from orthros_jax.model import Transformer
from orthros_jax.layer_layout import stack_layers
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.config import model_config_from
from tests.conversion_fixtures import convert_config
from tests.conversion_fixtures import load_teacher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.filterwarnings(
    'ignore:Some donated buffers were not usable')

DENSE = oj.ModelConfig(vocab_size=64, num_layers=2, embed_dim=32, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64)
ORTHROS = DENSE.replace(attention={'kind': 'orthros', 'window': 5,
                                   'chunk_size': 4, 'feature_dim': 4,
                                   'exact_tail': 2})


@functools.partial(jax.jit, static_argnums=0)
def _init(config, rng):
  return nn.unbox(Transformer(config).init(rng, jnp.zeros((1, 8), jnp.int32),
                                           phase='forward')['params'])


def _batch(rng, b=4, t=29, prompts=(11, 17, 0, 6), ends=(20, 29, 23, 9)):
  """A batch in the pipeline's contract: answers after ragged prompts, a
  prompt-less (plain text) row, right padding."""
  inputs = np.zeros((b, t), np.int32)
  targets = np.zeros((b, t), np.int32)
  weights = np.zeros((b, t), np.float32)
  for i, (p, e) in enumerate(zip(prompts, ends)):
    seq = rng.integers(1, 64, size=e + 1)
    inputs[i, :e] = seq[:e]
    targets[i, :e] = seq[1:]
    weights[i, max(p - 1, 0):e] = 1.0
  return {'inputs': inputs, 'targets': targets, 'weights': weights,
          'prompt_lengths': np.array(prompts, np.int32)}


def _reference_scores(config, params, batch, boundary, weights):
  """Per-example NLL from the training forward pass with split = boundary,
  summed in float64 with numpy."""
  logits = Transformer(config).apply(
      {'params': params}, jnp.asarray(batch['inputs']), phase='forward',
      split=jnp.asarray(boundary) if config.is_orthros else None)[0]
  logits = np.asarray(logits, np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
      -1, keepdims=True)) - logits.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, batch['targets'][..., None], -1)[..., 0]
  return (nll * weights).sum(1)


@pytest.mark.parametrize('config', [DENSE, ORTHROS], ids=['dense', 'orthros'])
def test_inference_path_equals_forward_with_the_same_split(config):
  params = _init(config, jax.random.PRNGKey(0))
  if config.is_orthros:  # a window weight away from its init
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.7 if 'window_logit' in str(p) else x, params)
  batch = _batch(np.random.default_rng(0))
  weights, boundary, end = inference.scoring_layout(batch, config,
                                                    'inference')
  # The plain row (prompt 0, 23 tokens) prefills its first 12 tokens.
  tail = 2 if config.is_orthros else 0
  np.testing.assert_array_equal(boundary, [11 - tail, 17 - tail, 12 - tail,
                                           6 - tail])
  np.testing.assert_array_equal(end, [20, 29, 23, 9])
  assert weights[2, :11].sum() == 0 and weights[2, 11:23].sum() == 12
  want = _reference_scores(config, params, batch, boundary, weights)
  for route in ('inference', 'forward'):
    got = inference.score_batch(config, params, batch, route=route)
    np.testing.assert_allclose(got['nll_sum'], want, rtol=2e-5)
    np.testing.assert_array_equal(got['tokens'], weights.sum(1))
  # 'prefill': every position through the prefill formula.
  got = inference.score_batch(config, params, batch, route='prefill')
  t = batch['inputs'].shape[1]
  want = _reference_scores(config, params, batch, np.full(4, t), weights)
  np.testing.assert_allclose(got['nll_sum'], want, rtol=2e-5)


def test_exact_match_equals_greedy_generation():
  """Rows whose answer is the model's own greedy continuation are exact,
  rows with one answer token changed are not."""
  params = _init(ORTHROS, jax.random.PRNGKey(1))
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(1, 64, size=n)) for n in (13, 9, 13, 9)]
  answer_len = 5
  out = oj.generate(ORTHROS, params, prompts, max_new_tokens=answer_len)
  t = 13 + answer_len
  batch = {'inputs': np.zeros((4, t), np.int32),
           'targets': np.zeros((4, t), np.int32),
           'weights': np.zeros((4, t), np.float32),
           'prompt_lengths': np.array([13, 9, 13, 9], np.int32)}
  for i, p in enumerate(prompts):
    answer = list(out.tokens[i])
    if i >= 2:
      answer[3] = (answer[3] + 1) % 64
    seq = np.array(p + answer)
    n = len(seq) - 1
    batch['inputs'][i, :n] = seq[:-1]
    batch['targets'][i, :n] = seq[1:]
    batch['weights'][i, len(p) - 1:n] = 1.0
  got = inference.score_batch(ORTHROS, params, batch)
  np.testing.assert_array_equal(got['exact'], [True, True, False, False])
  # Every scored token but the changed one (and the next, which saw it)
  # can still be right; the counts are per example.
  assert list(got['tokens']) == [answer_len] * 4


def test_wilson_interval_known_values():
  lo, hi = inference.wilson_interval(0, 10)
  assert lo == 0.0 and math.isclose(hi, 0.27753, abs_tol=1e-4)
  lo, hi = inference.wilson_interval(5, 10)
  assert math.isclose(lo, 0.23659, abs_tol=1e-4)
  assert math.isclose(hi, 0.76341, abs_tol=1e-4)
  lo, hi = inference.wilson_interval(50, 50)
  assert hi == 1.0 and math.isclose(lo, 0.92865, abs_tol=1e-4)
  assert all(math.isnan(x) for x in inference.wilson_interval(0, 0))


def test_score_rejects_empty_and_unknown_mode():
  params = _init(DENSE, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match='no scored examples'):
    inference.score(DENSE, params, [])
  with pytest.raises(ValueError, match='route'):
    inference.score_batch(DENSE, params, _batch(np.random.default_rng(0)),
                          route='teacher')


def test_save_and_load_params_roundtrip(tmp_path):
  params = _init(ORTHROS, jax.random.PRNGKey(2))
  ckpt_lib.save_params(tmp_path / 'run', params, ORTHROS, step=7)
  loaded, config, step = ckpt_lib.load_params(tmp_path / 'run')
  assert step == 7 and model_config_from(config) == ORTHROS
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  # The checkpoints directory itself works too, and a missing step is named.
  loaded, _, _ = ckpt_lib.load_params(tmp_path / 'run' / 'checkpoints', 7)
  with pytest.raises(FileNotFoundError, match='available'):
    ckpt_lib.load_params(tmp_path / 'run', 3)
  with pytest.raises(FileNotFoundError, match='does not exist'):
    ckpt_lib.load_params(tmp_path / 'nowhere')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='no checkpoint'):
    ckpt_lib.load_params(tmp_path / 'empty')


# ------------------------------------------------------------ end to end


def _stage_losses(workdir, stage):
  """The training losses a conversion stage logged, step by step."""
  with open(workdir / stage / 'metrics.jsonl') as f:
    return [json.loads(l)['loss'] for l in f if '"loss"' in l]


def test_convert_writes_checkpoint_and_report(converted, teacher_dir):
  workdir, report = converted
  with open(workdir / 'report.json') as f:
    assert json.load(f) == json.loads(json.dumps(report))
  assert (workdir / 'report.md').read_text().count('| teacher |') == 1
  assert set(report['eval']) == {'teacher', 'orthros', 'linear'}
  c = report['conversion']
  batch_tokens = 4 * 96
  assert c['stage1']['steps'] == 4 and c['stage2']['steps'] == 4
  assert c['tokens'] == 8 * batch_tokens
  # The smoke teacher saw 4 batches: the conversion used twice that.
  assert report['teacher']['train_tokens'] == 4 * batch_tokens
  assert c['fraction_of_teacher_tokens'] == 2.0
  for model in report['eval'].values():
    assert model['mqar']['examples'] == 4
    assert np.isfinite(model['all']['loss'])
  # The three models differ (different attention on the same weights).
  losses = [report['eval'][m]['all']['loss'] for m in report['eval']]
  assert len(set(losses)) == 3
  # Only LoRA trained in stage 2: the merged q/k/v/o differ from the
  # stage 1 params, the MLP equals the teacher's.
  params, config, step = ckpt_lib.load_params(workdir / 'orthros')
  config = model_config_from(config)
  assert step == 8 and config.attention.kind == 'orthros'
  teacher, _, _ = ckpt_lib.load_params(teacher_dir)
  np.testing.assert_array_equal(
      params['layers_1']['mlp']['up_proj']['kernel'],
      teacher['layers_1']['mlp']['up_proj']['kernel'])
  assert not np.array_equal(params['layers_1']['attn']['q_proj']['kernel'],
                            teacher['layers_1']['attn']['q_proj']['kernel'])
  # The converted checkpoint generates.
  out = oj.generate(config, params, [[5, 6, 7, 8, 9, 10], [11, 12, 13]],
                    max_new_tokens=4)
  assert out.tokens.shape == (2, 4)
  assert np.all((out.tokens >= 0) & (out.tokens < config.vocab_size))


def test_convert_resumes_without_retraining(converted, teacher_dir):
  workdir, report = converted
  logs = {s: (workdir / s / 'metrics.jsonl').read_text()
          for s in ('stage1', 'stage2')}
  again = pipeline.convert(convert_config(teacher_dir), workdir)
  for stage, text in logs.items():  # no step ran again
    assert (workdir / stage / 'metrics.jsonl').read_text() == text
  assert again['eval'] == report['eval']


def test_convert_on_a_mesh_equals_one_device(converted, teacher_dir,
                                             tmp_path):
  """--config.mesh.shape.fsdp=2 --config.mesh.shape.tensor=2: both stages
  run sharded (teacher placed in shards) and match the one-device run."""
  workdir, report = converted
  c = convert_config(teacher_dir)
  c.mesh.shape.fsdp = 2
  c.mesh.shape.tensor = 2
  sharded = pipeline.convert(c, tmp_path)
  for stage in ('stage1', 'stage2'):
    np.testing.assert_allclose(_stage_losses(tmp_path, stage),
                               _stage_losses(workdir, stage), rtol=1e-5)
  params, _, _ = ckpt_lib.load_params(tmp_path / 'orthros')
  ref, _, _ = ckpt_lib.load_params(workdir / 'orthros')
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                               atol=1e-5)
  np.testing.assert_allclose(sharded['eval']['orthros']['all']['loss'],
                             report['eval']['orthros']['all']['loss'],
                             rtol=1e-5)


def test_convert_with_layers_scanned_equals_unrolled(converted, teacher_dir,
                                                     tmp_path):
  """--config.model.scan_layers=True --config.model.remat=dots_no_batch:
  both stages train the same losses as the unrolled run (their checkpoints
  stacked), and the final checkpoint and the adapter, both unrolled on
  disk, equal the unrolled run's."""
  workdir, report = converted
  c = convert_config(teacher_dir)
  c.model = dict(scan_layers=True, remat='dots_no_batch')
  scanned = pipeline.convert(c, tmp_path)
  for stage in ('stage1', 'stage2'):
    np.testing.assert_allclose(_stage_losses(tmp_path, stage),
                               _stage_losses(workdir, stage), rtol=1e-5)
  stage2, _, _ = ckpt_lib.load_params(tmp_path / 'stage2')
  assert 'layers' in stage2['base'] and 'layers_0' not in stage2['base']
  got, config, _ = ckpt_lib.load_params(tmp_path / 'orthros')
  assert not config['scan_layers'] and config['remat'] == 'none'
  ref, _, _ = ckpt_lib.load_params(workdir / 'orthros')
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0],
                          jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4,
                               atol=1e-5, err_msg=jax.tree_util.keystr(path))
  # The workdir's own stage-2 checkpoint (stacked) exports the same adapter.
  adapter_lib.export_from_conversion(tmp_path, tmp_path / 'exported')
  _, exported = adapter_lib.read_adapter(tmp_path / 'exported')
  assert set(exported) == set(
      adapter_lib.read_adapter(tmp_path / 'adapter')[1])
  # Applied to a scanned base, the adapter gives the stacked layout of the
  # model it gives an unrolled base.
  t_cfg, t_params = load_teacher(teacher_dir)
  cfg_u, merged_u = adapter_lib.apply_adapter(tmp_path / 'adapter', t_cfg,
                                              t_params)
  cfg_s, merged_s = adapter_lib.apply_adapter(
      tmp_path / 'adapter', t_cfg.replace(scan_layers=True),
      stack_layers(t_params))
  assert cfg_s == cfg_u.replace(scan_layers=True)
  for a, b in zip(jax.tree.leaves(stack_layers(merged_u)),
                  jax.tree.leaves(merged_s)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  _, want = adapter_lib.read_adapter(workdir / 'adapter')
  meta, have = adapter_lib.read_adapter(tmp_path / 'adapter')
  assert set(have) == set(want)
  assert not meta['model_config']['scan_layers']
  for name in want:
    np.testing.assert_allclose(have[name], want[name], rtol=1e-4, atol=1e-5,
                               err_msg=name)
  np.testing.assert_allclose(scanned['eval']['orthros']['all']['loss'],
                             report['eval']['orthros']['all']['loss'],
                             rtol=1e-5)
  c.model = dict(scan_layers=True, remat='some')
  with pytest.raises(ValueError, match='remat'):
    pipeline.convert(c, tmp_path / 'bad')
  c.model = dict(scan=True)
  with pytest.raises(ValueError, match=r"model has unknown keys \['scan'\]"):
    pipeline.convert(c, tmp_path / 'bad')


def test_full_finetune_and_kl(teacher_dir, tmp_path):
  c = convert_config(teacher_dir)
  c.stage1.tokens = 2 * 4 * 96
  c.stage2.tokens = 2 * 4 * 96
  c.stage2.lora_rank = 0
  c.stage2.kl_weight = 0.5
  c.stage2.hidden_weight = 1.0
  c.stage2.weight_decay = 0.1
  c.stage2.split_mode = 'random'
  report = pipeline.convert(c, tmp_path)
  assert report['conversion']['stage2']['method'] == 'full finetune'
  params, _, _ = ckpt_lib.load_params(tmp_path / 'orthros')
  teacher, _, _ = ckpt_lib.load_params(teacher_dir)
  # A full finetune moves the MLP too.
  assert not np.array_equal(params['layers_1']['mlp']['up_proj']['kernel'],
                            teacher['layers_1']['mlp']['up_proj']['kernel'])
  assert not (tmp_path / 'adapter').exists()  # a full finetune has none
  with pytest.raises(ValueError, match='full finetune'):
    adapter_lib.export_from_conversion(tmp_path, tmp_path / 'adapter')
  rows = [json.loads(l) for l in open(tmp_path / 'stage2' / 'metrics.jsonl')]
  assert all('kl' in r and 'hidden_mse' in r for r in rows if 'loss' in r)
  assert report['conversion']['stage2']['hidden_weight'] == 1.0
  # The distillation terms read a frozen copy of the teacher, which neither
  # gradients nor weight decay move.
  state2, _, _ = ckpt_lib.load_params(tmp_path / 'stage2')
  for a, b in zip(jax.tree.leaves(state2['teacher']),
                  jax.tree.leaves(teacher)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_convert_errors(teacher_dir, tmp_path):
  def run(**edits):
    c = convert_config(teacher_dir)
    for key, value in edits.items():
      section, field = key.split('__')
      c[section][field] = value
    return pipeline.convert(c, tmp_path / 'out')

  with pytest.raises(ValueError, match='exactly one'):
    run(teacher__hf_dir='/somewhere')
  with pytest.raises(ValueError, match='exactly one'):
    run(teacher__checkpoint='')
  with pytest.raises(FileNotFoundError, match='does not exist'):
    run(teacher__checkpoint=str(tmp_path / 'missing'))
  with pytest.raises(ValueError, match="kind='orthros'"):
    run(attention__kind='dense')
  with pytest.raises(ValueError, match='stage1.tokens'):
    run(stage1__tokens=10)
  # Config errors come before the (possibly large) teacher is read.
  with pytest.raises(ValueError, match='stage1.tokens'):
    run(teacher__checkpoint=str(tmp_path / 'missing'), stage1__tokens=10)
  with pytest.raises(ValueError, match="kind='orthros'"):
    run(teacher__checkpoint=str(tmp_path / 'missing'), attention__kind='dense')
  with pytest.raises(ValueError, match='warmup_steps'):
    run(stage2__warmup_steps=4)
  with pytest.raises(ValueError, match='lora_rank'):
    run(stage2__lora_rank=-1)
  with pytest.raises(ValueError, match='hidden_weight=-1.0'):
    run(stage2__hidden_weight=-1.0)
  c = convert_config(teacher_dir)
  c.stage2.lora_rnak = 4
  with pytest.raises(ValueError, match='lora_rnak'):
    pipeline.convert(c, tmp_path / 'out')
  c = convert_config(teacher_dir)
  c.eval.sets = {}
  with pytest.raises(ValueError, match='eval.sets'):
    pipeline.convert(c, tmp_path / 'out')


def test_convert_rejects_splits_that_skip_the_prefill_formula(tmp_path):
  """Config errors before any teacher is read (the checkpoint is missing):
  the removed 'prompt_or_random' names its replacement, and a window that
  covers the whole sequence (no position reads a linear key) is refused."""
  def run(section, field, value):
    c = convert_tiny.get_config('smoke')
    c.teacher.checkpoint = str(tmp_path / 'missing')
    c[section][field] = value
    return pipeline.convert(c, tmp_path / 'out')

  with pytest.raises(ValueError, match="use 'prompt'"):
    run('stage2', 'split_mode', 'prompt_or_random')
  with pytest.raises(ValueError, match=r'attention.sinks = 96 >= '
                     'data.seq_len=96'):
    run('attention', 'window', 96)
  with pytest.raises(FileNotFoundError, match='does not exist'):
    run('attention', 'window', 95)  # W < T passes the check


def test_convert_config_takes_text_paths():
  c = convert_tiny.get_config()
  c.data.source = 'text'
  c.data.paths = '/data/corpus'
  assert c.data.text_field == 'text'
  # The synthetic default passes an empty paths to make_dataset, which
  # ignores it there.
  data = convert_tiny.get_config('smoke').data.to_dict()
  assert data['paths'] == ''
  batch = next(iter(make_dataset(**dict(
      data, tokenizer=get_tokenizer(data['tokenizer'])))))
  assert batch['inputs'].shape == (data['batch_size'], data['seq_len'])


def test_convert_smollm2_recipe(tmp_path):
  """The real-model recipe: W = 64 with 4 sinks and LoRA r=8 at lr 1e-4
  (LoLCATs); 'linear' the same budget with window 0, no sinks, no tail;
  text data from the corpus; every stage config valid (no teacher needed
  to check: a missing teacher directory is the first error)."""
  from configs import convert_smollm2
  c = convert_smollm2.get_config()
  assert (c.attention.window, c.attention.sinks, c.stage2.lora_rank,
          c.stage2.learning_rate) == (64, 4, 8, 1e-4)
  assert c.data.source == 'text' and c.data.paths.endswith('train.jsonl')
  lin = convert_smollm2.get_config('linear')
  assert (lin.attention.window, lin.attention.sinks,
          lin.attention.exact_tail) == (0, 0, 0)
  assert lin.stage1.tokens == c.stage1.tokens
  assert lin.stage2.tokens == c.stage2.tokens
  # Orthros trains the inference split; the floor has no exact decode, so it
  # trains the prefill formula at every position, as it is evaluated.
  assert (c.stage2.split_mode, lin.stage2.split_mode) == ('prompt', 'none')
  assert {k: v for k, v in lin.stage2.items() if k != 'split_mode'} == {
      k: v for k, v in c.stage2.items() if k != 'split_mode'}
  # Layers scanned; remat where the rows are 4096 tokens long.
  assert (c.model.scan_layers, c.model.remat) == (True, 'none')
  rows4k = convert_smollm2.get_config('rows4k,lscale')
  assert (rows4k.model.scan_layers, rows4k.model.remat) == (
      True, 'dots_no_batch')
  with pytest.raises(ValueError, match='unknown config args'):
    convert_smollm2.get_config('fast')
  smoke = convert_smollm2.get_config('smoke')
  smoke.teacher.hf_dir = str(tmp_path / 'no_such_teacher')
  smoke.data.tokenizer = 'byte'
  with pytest.raises(FileNotFoundError, match='no_such_teacher'):
    pipeline.convert(smoke, tmp_path / 'run')


def test_teacher_checkpoint_mismatch_and_orthros_teacher(tmp_path):
  # A checkpoint whose config says one shape and params another.
  params = _init(DENSE, jax.random.PRNGKey(0))
  ckpt_lib.save_params(tmp_path / 'bad', params,
                       DENSE.replace(mlp_dim=48))
  with pytest.raises(ValueError, match='does not match'):
    teacher_lib.load_teacher({'checkpoint': str(tmp_path / 'bad')})
  ckpt_lib.save_params(tmp_path / 'orthros', _init(ORTHROS,
                                                   jax.random.PRNGKey(0)),
                       ORTHROS)
  with pytest.raises(ValueError, match='already an Orthros'):
    teacher_lib.load_teacher({'checkpoint': str(tmp_path / 'orthros')})


def test_convert_from_hugging_face_teacher(tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  hf_config = transformers.LlamaConfig(
      vocab_size=260, hidden_size=32, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
      intermediate_size=64)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path / 'hf')
  c = convert_config('')
  c.teacher.hf_dir = str(tmp_path / 'hf')
  c.stage1.tokens = c.stage2.tokens = 2 * 4 * 96
  report = pipeline.convert(c, tmp_path / 'out')
  assert report['teacher']['source'] == 'hf'
  assert report['conversion']['fraction_of_teacher_tokens'] is None
  # The teacher row is the HF model itself: its loss through our inference
  # path equals transformers' teacher-forced loss on the same held-out rows.
  model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / 'hf')
  nll = tokens = 0.0
  for batch in plan_lib.EvalPlan.from_config(c.eval).datasets(
      get_tokenizer('byte'))['mqar']():
    with torch.no_grad():
      logits = model(torch.tensor(batch['inputs'], dtype=torch.long)).logits
    logp = torch.log_softmax(logits.double(), -1).numpy()
    picked = np.take_along_axis(logp, batch['targets'][..., None], -1)[..., 0]
    nll -= float((picked * batch['weights']).sum())
    tokens += float(batch['weights'].sum())
  np.testing.assert_allclose(report['eval']['teacher']['mqar']['loss'],
                             nll / tokens, rtol=1e-4)


def test_convert_py_entry_point(converted, teacher_dir, tmp_path):
  """convert.py on a copy of a finished conversion: it resumes (no step
  runs again), re-evaluates and prints the same table."""
  workdir, report = converted
  shutil.copytree(workdir, tmp_path / 'run')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, 'convert.py', '--config=configs/convert_tiny.py:smoke',
       f'--config.teacher.checkpoint={teacher_dir}',
       '--config.eval.num_examples=4', f'--workdir={tmp_path / "run"}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '| orthros |' in proc.stdout
  # No library INFO lines (orbax restoring the checkpoints) by default.
  assert not re.search(r'^I\d{4} ', proc.stderr, re.M), proc.stderr[-3000:]
  with open(tmp_path / 'run' / 'report.json') as f:
    assert json.load(f)['eval'] == json.loads(json.dumps(report['eval']))
