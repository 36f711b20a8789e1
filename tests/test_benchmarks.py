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
from orthros_jax.conversion import teacher as teacher_lib
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.config import model_config_from

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER = os.path.join(ROOT, 'assets', 'tiny_teacher')


def _load(name):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(ROOT, 'benchmarks', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run(cmd):
  """Runs a benchmark script on the CPU; it must exit 0."""
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_exact_tail_script(tmp_path):
  """An adapter of fresh feature maps on the committed tiny teacher: a tail
  covering the whole prompt decodes it exactly, so both rows generate what
  the teacher does; the short tail runs the hybrid prefill."""
  params, cfg, _ = ckpt_lib.load_params(TEACHER)
  teacher = model_config_from(cfg)
  student = teacher_lib.orthros_config(teacher, dict(
      kind='orthros', window=16, chunk_size=8, feature_dim=8, sinks=2))
  orthros = teacher_lib.init_student(params, student, jax.random.PRNGKey(0))
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
         '--kv_heads', '1', '--head_dim', '8', '--reps', '3', '--base',
         'HEAD', '--out', str(tmp_path)]
  _run(cmd)  # raises if a path's output or gradient disagrees
  with open(tmp_path / 'results.json') as f:
    rows = json.load(f)['rows']
  assert {(r['length'], r['code'], r['block'], r['what']) for r in rows} == {
      (t, c, b, w) for t in (40, 130) for c in ('now', 'HEAD')
      for b in (0, 16, 64) for w in ('forward', 'grad')}
  for r in rows:
    assert r['reps'] == 3 and r['min_ms'] <= r['median_ms'] <= r['max_ms']
  assert (tmp_path / 'exact_attention.png').stat().st_size > 0
  report = (tmp_path / 'report.md').read_text()
  assert '| 130 | grad |' in report and 'block 16 @HEAD ms' in report


def test_kernels_script_on_cpu(tmp_path):
  """benchmarks/kernels.py at a tiny shape on CPU: the ceilings, the XLA
  prefill and decode rows, the Pallas rows skipped with their reason (CPU
  runs no kernel), the ratio of dense to Orthros and the outputs."""
  cmd = [sys.executable, 'benchmarks/kernels.py', '--out', str(tmp_path),
         '--lens', '128,256', '--decode_lens', '128', '--heads', '2',
         '--kv_heads', '1', '--head_dim', '16', '--feature_dim', '8',
         '--window', '16', '--chunk', '16', '--dense_block', '64',
         '--matmul_size', '128', '--copy_mb', '1', '--min_reps', '3',
         '--max_reps', '3', '--rep_budget_s', '5']
  _run(cmd)
  with open(tmp_path / 'kernels.json') as f:
    res = json.load(f)
  rows = res['measurements']
  ok = {(r['section'], r['impl'], r['n']) for r in rows
        if r['status'] == 'ok'}
  assert ok >= {('prefill', i, n) for i in ('orthros_xla', 'dense_xla')
                for n in (128, 256)} | {('decode', 'decode_xla', 128)}
  skipped = [r for r in rows if r['impl'] == 'orthros_pallas']
  assert skipped and all('GPU/TPU only' in r['status'] for r in skipped)
  for r in rows:
    if r['status'] == 'ok':
      assert r['reps'] >= 3 and r['time_min_s'] > 0
      # Each row against the machine's measured ceilings: prefill against
      # the matmul rate, decode against the copy bandwidth.
      frac = 'frac_matmul' if r['section'] == 'prefill' else 'frac_bandwidth'
      assert r[frac] > 0
  assert set(res['analysis']['ratios']['dense_xla/orthros_xla']['per_n']) \
      == {'128', '256'}
  assert (tmp_path / 'kernels.csv').stat().st_size > 0


def test_auto_block_follows_the_backend(monkeypatch):
  monkeypatch.setattr(jax, 'default_backend', lambda: 'cpu')
  assert softmax._auto_block(256, 256) is None  # pylint: disable=protected-access
  # The CPU takes blocks of 128 only where they pad at least a quarter less
  # area than blocks of 256.
  for (t, s), block in {(257, 256): 128, (384, 384): 128, (512, 512): 256,
                        (1000, 1000): 256, (64, 4096): 256,
                        (640, 640): 128, (4096, 4128): 256}.items():
    assert softmax._auto_block(t, s) == block, (t, s)  # pylint: disable=protected-access
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


def test_device_model_tiny_writes_rows_for_every_variant(tmp_path):
  """benchmarks/device_model.py at tiny size on CPU (the device check's dry
  run): a row per variant with positive times and the attention functions
  dispatch picked; no speed ordering is asserted."""
  cmd = [sys.executable, 'benchmarks/device_model.py', '--tiny', '--lengths',
         '64', '--reps', '3', '--out', str(tmp_path)]
  _run(cmd)
  with open(tmp_path / 'model.json') as f:
    result = json.load(f)
  assert result['info']['backend'] == 'cpu' and result['info']['jax']
  assert result['info']['device_kind']
  assert result['ceilings']['copy_bytes_per_s'] > 0
  assert result['ceilings']['matmul_flops_per_s']['bfloat16'] > 0
  assert result['model']['state_dim_F'] == 16 and not result['skipped']
  rows = {r['variant']: r for r in result['rows']}
  assert set(rows) == {'dense', 'orthros', 'none', 'orthros_sinks4',
                       'dense_forward'}
  for r in rows.values():
    assert r['status'] == 'ok' and r['length'] == 64 and r['reps'] == 3
    assert 0 < r['ttft_min_s'] <= r['ttft_s']
    assert r['ttft_max_s'] > 0 and len(r['ttft_times_s']) == 3
    assert r['prefill_impl']
  for v in ('dense', 'orthros', 'none', 'orthros_sinks4'):
    assert rows[v]['decode_tokens_per_s'] > 0 and rows[v]['decode_impl']
  # On CPU dispatch takes the XLA functions (Pallas on GPU/TPU).
  assert rows['orthros']['prefill_impl'].endswith('orthros_prefill')
  assert rows['orthros']['sinks'] == 0 and rows['orthros_sinks4']['sinks'] == 4
  assert 'decode_attention' in rows['dense']['prefill_impl']
  assert rows['none']['prefill_impl'].endswith('_no_attention')
  assert rows['dense_forward']['prefill_impl'].endswith('softmax_attention')
  assert [r['length'] for r in result['ratios']] == [64]
  with open(tmp_path / 'model.csv') as f:
    assert len(f.read().strip().splitlines()) == 1 + len(rows)


def test_decode_speed_tiny_writes_both_variants(tmp_path):
  """benchmarks/decode_speed.py at tiny size: a row per variant and length,
  each the median of its reps' per-step times over `steps` decode steps, the
  ratio row per length, the CSV, the report table and the plot; no speed
  ordering is asserted."""
  cmd = [sys.executable, 'benchmarks/decode_speed.py', '--tiny', '--lengths',
         '40,17', '--reps', '3', '--steps', '5', '--out', str(tmp_path)]
  _run(cmd)
  with open(tmp_path / 'decode_speed.json') as f:
    result = json.load(f)
  assert result['machine']['backend'] == 'cpu'
  assert result['machine']['copy_bytes_per_s'] > 0
  assert result['machine']['config']['state_dim'] == 16
  rows = {(r['variant'], r['length']): r for r in result['rows']}
  assert set(rows) == {(v, n) for v in ('dense', 'orthros') for n in (40, 17)}
  for r in rows.values():
    assert r['decode_steps'] == 5 and len(r['decode_times_s']) == 3
    assert 0 < r['decode_step_min_s'] <= r['decode_step_s']
    assert r['decode_step_s'] <= r['decode_step_max_s']
    assert r['decode_tokens_per_s'] == pytest.approx(1 / r['decode_step_s'])
    assert r['bytes_per_step'] > 0 and r['frac_copy_bandwidth'] > 0
  # Orthros' decode reads what dense's does (it never touches (S, z));
  # a longer cache is more bytes.
  assert rows['orthros', 40]['bytes_per_step'] == rows['dense', 40][
      'bytes_per_step'] > rows['dense', 17]['bytes_per_step']
  assert [r['length'] for r in result['ratios']] == [40, 17]
  with open(tmp_path / 'decode_speed.csv') as f:
    assert len(f.read().strip().splitlines()) == 1 + 4
  report = (tmp_path / 'report.md').read_text()
  assert '| 40 |' in report and '| 17 |' in report
  assert (tmp_path / 'decode_speed.png').stat().st_size > 0
  with pytest.raises(SystemExit):
    _load('decode_speed').main(['--lengths', '0'])


def test_scan_layers_benchmark_tiny(tmp_path):
  """benchmarks/scan_layers.py at tiny size: a row per (program, setting)
  with its compile times and XLA's memory; the shapes it names build (the
  real ones are only configured, not compiled, here)."""
  bench = _load('scan_layers')
  assert bench.shape_config('smollm2').num_layers == 30
  llama = bench.shape_config('llama_1b')
  assert llama.num_layers == 16 and llama.is_orthros
  with pytest.raises(ValueError, match='unknown shape'):
    bench.shape_config('gpt5')
  cmd = [sys.executable, 'benchmarks/scan_layers.py', '--tiny', '--shapes',
         'smollm2', '--settings', 'unrolled,scan_remat_full', '--reps', '1',
         '--prefill_len', '24', '--decode_len', '20', '--train_len', '17',
         '--train_batch', '2', '--time_stage2', '--out', str(tmp_path)]
  _run(cmd)
  with open(tmp_path / 'scan_layers.json') as f:
    result = json.load(f)
  rows = {(r['program'], r['setting']): r for r in result['rows']}
  assert set(rows) == {(p, s) for p in ('prefill', 'decode', 'stage2_step')
                       for s in ('unrolled', 'scan_remat_full')}
  for (program, _), r in rows.items():
    assert r['length'] == {'prefill': 24, 'decode': 20,
                           'stage2_step': 17}[program]
    assert len(r['compile_times_s']) == 1
    assert 0 < r['compile_min_s'] <= r['compile_s'] <= r['compile_max_s']
    assert r['memory_bytes'] > 0
    assert r['batch'] == (2 if program == 'stage2_step' else 1)
    if program == 'stage2_step':  # --time_stage2: it ran
      assert len(r['step_times_s']) == 1
      assert 0 < r['step_min_s'] <= r['step_s'] <= r['step_max_s']
      assert r['tokens_per_s'] == pytest.approx(2 * 17 / r['step_s'])
    else:
      assert 'step_s' not in r
  assert result['machine']['settings']['scan_remat_full'] == {
      'scan_layers': True, 'remat': 'full'}
  report = (tmp_path / 'report.md').read_text()
  assert '| stage2_step | 17 | scan_remat_full |' in report
  assert '| smollm2 | 2 x 17 | scan_remat_full |' in report
  assert (tmp_path / 'scan_layers.png').stat().st_size > 0
  with pytest.raises(SystemExit):
    bench.main(['--settings', 'unrolled,bogus'])
  with pytest.raises(SystemExit):
    bench.main(['--programs', 'decode,bogus'])
  with pytest.raises(SystemExit):  # nothing to time
    bench.main(['--programs', 'decode', '--time_stage2'])
  # --programs: only the named ones.
  rows = bench.measure('smollm2', ['scan'], {'prefill': 24, 'decode': 20,
                                            'stage2_step': 17}, 1, True,
                       progress=lambda m: None, which=('decode',))
  assert [(r['program'], r['setting']) for r in rows] == [('decode', 'scan')]


def test_device_model_time_box_and_recipe(tmp_path):
  """Lengths run shortest, longest, then the rest; a measurement that cannot
  fit is skipped with the reason; the attention is configs/convert_smollm2's."""
  bench = _load('device_model')
  result = bench.run(str(tmp_path), tiny=True, lengths=[64, 32], budget_s=0,
                     ceilings=False)
  assert not result['rows'] and len(result['skipped']) == 2 * 5
  assert all('time box' in r['status'] for r in result['skipped'])
  assert [r['length'] for r in result['skipped'][:3]] == [32] * 3
  with open(tmp_path / 'model.json') as f:
    assert json.load(f)['skipped'] == result['skipped']
  assert bench.priority([16384, 4096, 32768, 8192]) == [4096, 32768, 16384,
                                                         8192]
  done = [dict(variant='dense', length=4096, status='ok', ttft_s=0.1,
               decode_step_s=0.01, wall_s=10.0)]
  # compile 10 - 4 * 0.1 - 5 * 0.01 = 9.55 s, then the run scales by 2^2.
  assert bench.predict_s('dense', 8192, done, 3) == pytest.approx(
      9.55 + 4 * (4 * 0.1 + 5 * 0.01))
  assert bench.predict_s('none', 8192, done, 3) is None
  from configs import convert_smollm2  # pylint: disable=g-import-not-at-top
  assert bench.RECIPE_ATTENTION == dict(convert_smollm2.get_config().attention)
  cfg = bench.smollm2_config(sinks=0)
  assert (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.attention.state_dim) == (30, 576, 9, 3, 64, 128)


def test_pallas_fit_cases_match_the_reference_in_interpret_mode():
  """benchmarks/pallas_fit.py's cases (the GPU schedule, interpreted) give
  the XLA reference's outputs, at a setting past the kernel's own split
  cap too."""
  from benchmarks import pallas_fit  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  got = pallas_fit.prefill_case(t=96, h=3, k=1, d=16, f=8, window=32,
                                chunk=16, dtype=jnp.float32, interpret=True)
  assert got['error'] < 1e-5 and 'ms' not in got
  got = pallas_fit.decode_case(s=300, h=4, k=2, d=128, split=256,
                               dtype=jnp.float32, interpret=True)
  assert got['error'] < 1e-5


def test_linear_share_script(tmp_path):
  """The older-token shares of benchmarks/linear_share.py against a float64
  numpy evaluation of the same weights (teacher softmax mass, Orthros'
  linear share of its denominator), and the script end to end on held-out
  text with the committed tiny teacher."""
  params, cfg, _ = ckpt_lib.load_params(TEACHER)
  teacher = model_config_from(cfg)
  window, sinks = 6, 2
  student = teacher_lib.orthros_config(teacher, dict(
      kind='orthros', window=window, chunk_size=8, feature_dim=8,
      sinks=sinks))
  orthros = teacher_lib.init_student(params, student, jax.random.PRNGKey(0))
  bench = _load('linear_share')
  t_len, first = 37, 20
  x = jax.random.normal(jax.random.PRNGKey(1), (1, t_len, student.embed_dim))
  layer = orthros['layers_1']['attn']
  teach, orth = bench.layer_shares(student, layer, x, first)
  positions = np.arange(t_len)[None]
  q, k, phi_q, phi_k, gamma = (np.asarray(a, np.float64) for a in
                               bench.Attention(student).apply(
                                   {'params': layer}, x, positions,
                                   method=bench._qk_features))
  k = np.repeat(k, student.num_groups, axis=2)
  want_t = np.zeros((student.num_heads, t_len))
  want_o = np.zeros((student.num_heads, t_len))
  for h in range(student.num_heads):
    for t in range(t_len):
      s = q[0, t, h] @ k[0, :t + 1, h].T / np.sqrt(student.head_dim)
      j = np.arange(t + 1)
      exact = (j > t - window) | (j < sinks)
      p = np.exp(s - s.max())
      p /= p.sum()
      want_t[h, t] = p[~exact].sum()
      win = gamma[h] * np.exp(s[exact] - s[exact].max()).sum()
      lin = (phi_k[0, :t + 1, h][~exact] @ phi_q[0, t, h]).sum()
      want_o[h, t] = lin / (win + lin)
  np.testing.assert_allclose(teach[0], want_t[:, first:].mean(-1), rtol=1e-5)
  np.testing.assert_allclose(orth[0], want_o[:, first:].mean(-1), rtol=1e-5)
  assert np.all(np.asarray(orth) > 0) and np.all(np.asarray(teach) > 0)

  adapter_lib.write_adapter(tmp_path / 'adapter', student, params, orthros,
                            {}, alpha=16.0)
  heldout = tmp_path / 'heldout.jsonl'
  rng = np.random.default_rng(0)
  words = ['alpha', 'beta', 'gamma', 'delta', 'kappa', 'omega']
  with open(heldout, 'w') as f:
    for _ in range(8):
      f.write(json.dumps({'text': ' '.join(rng.choice(words, 80))}) + '\n')
  out = tmp_path / 'out'
  bench.main(['--checkpoint', str(tmp_path / 'adapter'), '--teacher',
              TEACHER, '--tokenizer', 'byte', '--heldout', str(heldout),
              '--lengths', '48,96', '--rows', '2', '--sinks', str(sinks),
              '--out', str(out)])
  with open(out / 'results.json') as f:
    res = json.load(f)
  assert [r['length'] for r in res['results']] == [48, 96]
  for r in res['results']:
    assert len(r['teacher']) == len(r['orthros']) == student.num_layers
    assert 0 < r['teacher_mean'] < 1 and 0 < r['orthros_mean'] < 1
  assert (out / 'linear_share.png').exists()
  assert '| Orthros / teacher |' in (out / 'report.md').read_text()


def test_conversion_speed_step_times_from_both_metric_formats(tmp_path):
  """A step's seconds are its counted tokens over their rate, for the loop
  before 468b73a (tokens_per_s counts `tokens`) and after (tokens_per_s
  counts input tokens, loss_tokens_per_s counts `tokens`); compile steps
  and eval records are left out."""
  cs = _load('conversion_speed')
  old = {'step': 3, 'tokens': 48.0, 'tokens_per_s': 12.0}
  new = {'step': 3, 'tokens': 48.0, 'input_tokens': 384.0,
         'tokens_per_s': 384.0 / 2.5, 'loss_tokens_per_s': 48.0 / 2.5}
  assert cs.step_seconds(old) == pytest.approx(4.0)
  assert cs.step_seconds(new) == pytest.approx(2.5)
  assert cs.step_seconds({'step': 1, 'tokens': 0.0, 'tokens_per_s': 0.0}) \
      is None
  (tmp_path / 'stage1').mkdir()
  rows = [dict(new, step=s, loss_tokens_per_s=48.0 / s) for s in (1, 2, 3, 4)]
  rows.insert(2, {'step': 2, 'eval/loss': 1.0})
  (tmp_path / 'stage1' / 'metrics.jsonl').write_text(
      '\n'.join(json.dumps(r) for r in rows) + '\n')
  assert cs.stage_times(tmp_path, 'stage1', skip=2) == pytest.approx([3, 4])
  with pytest.raises(ValueError, match='no timed step'):
    cs.stage_times(tmp_path, 'stage1', skip=4)
  with pytest.raises(FileNotFoundError, match='stage2'):
    cs.stage_times(tmp_path, 'stage2', skip=0)


def test_conversion_speed_summary_and_outputs(tmp_path, monkeypatch):
  """Median over rounds of each round's median step; tokens/s and the ratio
  to base follow from the step times; JSON, CSV, report and plot written."""
  cs = _load('conversion_speed')
  times = {'base': iter([{'wall_s': 1.0, 'stage1': [2.0, 4.0, 3.0],
                          'stage2': [8.0, 8.0, 9.0]},
                         {'wall_s': 1.0, 'stage1': [5.0, 5.0, 5.0],
                          'stage2': [6.0, 7.0, 8.0]}]),
           'head': iter([{'wall_s': 1.0, 'stage1': [1.0, 1.0, 2.0],
                          'stage2': [2.0, 2.0, 2.0]},
                         {'wall_s': 1.0, 'stage1': [1.0, 2.0, 2.0],
                          'stage2': [4.0, 4.0, 5.0]}])}
  monkeypatch.setattr(cs, 'worktree', lambda rev, scratch: tmp_path)
  monkeypatch.setattr(cs, 'commit_of', lambda tree: 'abc')
  monkeypatch.setattr(cs, 'run_once', lambda tree, args, workdir: next(
      times['base' if 'base' in workdir.name else 'head']))
  out = tmp_path / 'out'
  assert cs.main(['--config', 'configs/convert_tiny.py:smoke', '--rounds',
                  '2', '--scratch', str(tmp_path / 's'), '--out',
                  str(out)]) == 0
  rows = {(r['stage'], r['commit']): r for r in json.loads(
      (out / 'conversion_speed.json').read_text())['rows']}
  tps = 4 * 96  # convert_tiny.py:smoke, batch 4 x 96 tokens
  assert rows['stage1', 'base']['step_s'] == pytest.approx(4.0)  # (3, 5)
  assert rows['stage1', 'head']['step_s'] == pytest.approx(1.5)  # (1, 2)
  assert rows['stage2', 'base']['step_s'] == pytest.approx(7.5)  # (8, 7)
  assert rows['stage2', 'head']['step_s'] == pytest.approx(3.0)  # (2, 4)
  assert rows['stage2', 'head']['speedup'] == pytest.approx(2.5)
  assert rows['stage1', 'head']['tokens_per_s'] == pytest.approx(tps / 1.5)
  assert rows['stage1', 'base']['tokens_per_s_min'] == pytest.approx(tps / 5)
  assert rows['stage2', 'head']['tokens_per_s_max'] == pytest.approx(tps / 2)
  for name in ('conversion_speed.csv', 'report.md', 'conversion_speed.png'):
    assert (out / name).stat().st_size > 0


@pytest.mark.parametrize('n,window,chunk', [(37, 5, 4), (29, 9, 4), (23, 40, 8),
                                            (19, 0, 8), (33, 16, 16),
                                            (5, 3, 8), (21, 1, 4)])
def test_parallel_prefill_matches_the_float64_formula(n, window, chunk):
  """benchmarks/prefill_schedules.py's chunk-parallel form computes the
  section-3 prefill formula (GQA, odd lengths, W = 0, W > N, W = C)."""
  from tests import reference as ref  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ks = jax.random.split(jax.random.PRNGKey(n + window), 6)
  b, h, kh, d, f = 2, 4, 2, 8, 6
  q = jax.random.normal(ks[0], (b, n, h, d))
  k = jax.random.normal(ks[1], (b, n, kh, d))
  v = jax.random.normal(ks[2], (b, n, kh, d))
  phi_q = jax.random.uniform(ks[3], (b, n, h, f), minval=0.1)
  phi_k = jax.random.uniform(ks[4], (b, n, h, f), minval=0.1)
  gamma = jax.nn.sigmoid(jax.random.normal(ks[5], (h,)))
  y = _load('prefill_schedules').parallel_prefill(
      q, k, v, phi_q, phi_k, gamma, window=window, chunk_size=chunk)
  want, _, _ = ref.orthros_prefill(q, k, v, phi_q, phi_k, gamma,
                                   window=window)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-5,
                             atol=2e-6)
  assert y.dtype == jnp.float32


def test_prefill_schedules_script(tmp_path):
  """The script at tiny size: a row per length, direction and schedule,
  the parallel rows' difference from the scan at float32 rounding, the
  CSV, report and plot; no speed ordering is asserted."""
  _run([sys.executable, 'benchmarks/prefill_schedules.py', '--lengths',
        '45,70', '--heads', '4', '--kv_heads', '2', '--head_dim', '8',
        '--feature_dim', '6', '--window', '9', '--chunk', '8', '--reps', '3',
        '--out', str(tmp_path)])
  result = json.loads((tmp_path / 'results.json').read_text())
  assert result['info']['matmul_flops_per_s'] > 0
  rows = {(r['length'], r['what'], r['schedule']): r for r in result['rows']}
  assert set(rows) == {(n, w, s) for n in (45, 70)
                       for w in ('forward', 'forward+backward')
                       for s in ('scan', 'parallel')}
  for (_, _, s), r in rows.items():
    assert 0 < r['min_ms'] <= r['median_ms'] <= r['max_ms']
    if s == 'parallel':
      assert r['max_abs_diff_vs_scan'] < 1e-4
  assert len((tmp_path / 'results.csv').read_text().splitlines()) == 1 + 8
  assert '| 70 | forward+backward |' in (tmp_path / 'report.md').read_text()
  assert (tmp_path / 'prefill_schedules.png').stat().st_size > 0
  script = _load('prefill_schedules')
  for bad in (['--schedules', 'scan,tree'], ['--schedules', 'parallel'],
              ['--window', '-1'], ['--chunk', '0']):
    with pytest.raises(SystemExit):
      script.main(bad)
  x = jax.numpy.ones((1, 8, 2, 4))
  with pytest.raises(ValueError, match='window=-1'):
    script.parallel_prefill(x, x, x, x, x, jax.numpy.ones(2), window=-1,
                            chunk_size=4)
