"""benchmarks/prefill_ablation.py: the attention-mass and exact-prefill
diagnostics, against float64 numpy and exact identities."""

import importlib.util
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax.training import save_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    'prefill_ablation', os.path.join(ROOT, 'benchmarks', 'prefill_ablation.py'))
ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation)

V = 259


def config(window, kind='orthros'):
  return oj.ModelConfig(
      vocab_size=V, num_layers=3, embed_dim=32, num_heads=4, num_kv_heads=2,
      head_dim=8, mlp_dim=48,
      attention=oj.AttentionConfig(kind=kind, feature_dim=8, window=window,
                                   chunk_size=8, exact_tail=1,
                                   window_init=0.3))


def params_of(cfg, seed=0):
  p = oj.Transformer(cfg).init(jax.random.PRNGKey(seed),
                               jnp.zeros((1, 16), jnp.int32),
                               phase='forward')['params']
  return jax.device_get(nn.meta.unbox(p))


def batch(seed=0, rows=3, width=37):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, V, (rows, width)).astype(np.int32)
  lengths = np.array([width - 4, width - 11, width - 7][:rows], np.int32)
  return tokens, lengths


def zero_queries(params):
  """q_proj kernels 0: every score q.k is 0 (uniform window softmax)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: np.zeros_like(x) if 'q_proj' in jax.tree_util.keystr(p)
      else x, params)


def expected_share(tokens, lengths, window, share_of_query):
  """Mean over valid prompt queries t >= window of share_of_query(t)."""
  total, count = 0.0, 0
  for n in lengths:
    for t in range(window, int(n)):
      total += share_of_query(t)
      count += 1
  return total / count


def test_far_mass_dense_uniform_attention():
  # With q = 0 the dense softmax is uniform over the t + 1 causal keys, so
  # the share beyond the window is exactly (t - W + 1) / (t + 1).
  w = 5
  cfg = config(w, kind='dense')
  params = zero_queries(params_of(cfg))
  tokens, lengths = batch()
  got = ablation.far_mass(cfg, params, tokens, lengths)
  assert got.shape == (3, 4)
  want = expected_share(tokens, lengths, w, lambda t: (t - w + 1) / (t + 1))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # On random weights the shares are proper fractions, and a window as
  # long as the prompt leaves nothing beyond it.
  params = params_of(cfg)
  got = ablation.far_mass(cfg, params, tokens, lengths)
  assert np.all((got > 0) & (got < 1))
  wide = cfg.replace(attention={'window': 64})
  assert np.all(ablation.far_mass(wide, params, tokens, lengths) == 0)
  # An explicit window overrides the config's.
  np.testing.assert_array_equal(
      ablation.far_mass(wide, params, tokens, lengths, window=w), got)


def test_far_mass_orthros_uniform_features():
  # q = 0: hedgehog phi_q = [1/P] * 2P, so phi_q . phi_k = 2/P for every key
  # (each half of phi_k sums to 1), and every window weight is gamma; the
  # linear share of query t is m 2/P / (m 2/P + W gamma), m = t - W + 1.
  w, gamma = 6, 0.3
  cfg = config(w)
  per_key = 2.0 / cfg.attention.feature_dim
  tokens, lengths = batch(1)
  params = zero_queries(params_of(cfg))
  got = ablation.far_mass(cfg, params, tokens, lengths)
  want = expected_share(
      tokens, lengths, w,
      lambda t: (t - w + 1) * per_key / ((t - w + 1) * per_key + w * gamma))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # gamma -> 0: the window weighs nothing, all mass is linear.
  params = params_of(cfg)
  tiny_gamma = jax.tree_util.tree_map_with_path(
      lambda p, x: np.full_like(x, -40.0) if 'window_logit' in
      jax.tree_util.keystr(p) else x, params)
  np.testing.assert_allclose(
      ablation.far_mass(cfg, tiny_gamma, tokens, lengths), 1.0, rtol=1e-6)
  share = ablation.far_mass(cfg, params, tokens, lengths)
  assert np.all((share > 0) & (share < 1))
  assert np.all(ablation.far_mass(cfg.replace(attention={'window': 64}),
                                  params, tokens, lengths) == 0)


def test_exact_prefill_ablation_identities():
  cfg = config(4)
  params = params_of(cfg, seed=3)
  tokens, lengths = batch(2, width=29)
  targets = [list(tokens[i, n:n + 2]) for i, n in enumerate(lengths)]
  tokens = tokens.copy()
  dense = cfg.replace(attention={'kind': 'dense'})

  def forward_pred(c, split):
    logits, _ = oj.Transformer(c).apply({'params': params},
                                        jnp.asarray(tokens), phase='forward',
                                        split=split)
    return np.asarray(jnp.argmax(logits, -1))

  def matches(pred):
    return float(np.mean([all(pred[i, n - 1 + j] == a
                              for j, a in enumerate(t))
                          for i, (n, t) in enumerate(zip(lengths, targets))]))

  # Make the targets the dense model's own greedy tokens so that the dense
  # exact match is 1 and the comparison is informative.
  pred_dense = forward_pred(dense, None)
  for i, n in enumerate(lengths):
    tokens[i, n] = pred_dense[i, n - 1]
  pred_dense = forward_pred(dense, None)
  for i, n in enumerate(lengths):
    tokens[i, n + 1] = pred_dense[i, n]
  targets = [list(tokens[i, n:n + 2]) for i, n in enumerate(lengths)]
  all_layers = frozenset(range(cfg.num_layers))
  assert ablation.exact_match(cfg, params, tokens, lengths, targets,
                              all_layers) == 1.0
  assert ablation.exact_match(dense, params, tokens, lengths, targets,
                              frozenset()) == 1.0
  # No exact layer = the Orthros model's own inference split.
  split = jnp.asarray(lengths - cfg.attention.exact_tail)
  assert ablation.exact_match(cfg, params, tokens, lengths, targets,
                              frozenset()) == matches(forward_pred(cfg, split))
  assert ablation.layer_sets(3) == [(), (0,), (1,), (2,), (0, 1),
                                    (0, 1, 2), (1, 2)]


def test_run_writes_report(tmp_path):
  cfg = config(8).replace(num_layers=2)
  params = params_of(cfg)
  save_params(str(tmp_path / 'ckpt'), params, cfg, step=3)
  result = ablation.run(str(tmp_path / 'ckpt'), '', 'niah', 160, 3, 0,
                        'byte')
  assert result['step'] == 3 and len(result['ablation']) == 4
  assert np.array(result['far_mass']['teacher']).shape == (2, 4)
  # A separate dense teacher checkpoint whose config says window 64 is
  # measured beyond the Orthros model's window, 8.
  dense = cfg.replace(attention={'kind': 'dense', 'window': 64})
  save_params(str(tmp_path / 'teacher'), params, dense, step=1)
  with_teacher = ablation.run(str(tmp_path / 'ckpt'),
                              str(tmp_path / 'teacher'), 'niah', 160, 3, 0,
                              'byte')
  np.testing.assert_allclose(with_teacher['far_mass']['teacher'],
                             result['far_mass']['teacher'], rtol=1e-12)
  text = ablation.report(json.loads(json.dumps(result)))
  assert '| dense teacher |' in text and '| 0, 1 |' in text
  with pytest.raises(ValueError, match='several answers'):
    ablation.run(str(tmp_path / 'ckpt'), '', 'niah_multivalue', 700, 1, 0,
                 'byte')
  dense = cfg.replace(attention={'kind': 'dense'})
  save_params(str(tmp_path / 'dense'), params_of(dense), dense, step=1)
  with pytest.raises(ValueError, match='dense model'):
    ablation.run(str(tmp_path / 'dense'), '', 'niah', 160, 1, 0, 'byte')


def test_window_zero_shot_script(tmp_path):
  """benchmarks/window_zero_shot.py on the committed tiny teacher: the
  three rows, JSON and table; with a window covering the prompt the window
  rows generate exactly what the teacher does (exact softmax)."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, 'benchmarks/window_zero_shot.py',
         '--teacher', 'assets/tiny_teacher', '--tokenizer', 'byte',
         '--tasks', 'passkey', '--lengths', '300', '--num_examples', '2',
         '--batch_size', '2', '--window', '512,400', '--sinks', '2',
         '--exact_tail', '3', '--out', str(tmp_path)]
  proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                        timeout=900, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / 'results.json') as f:
    res = json.load(f)
  assert set(res['models']) == {'teacher', 'window@512', 'window_sinks@512',
                                'window@400', 'window_sinks@400'}
  acc = {r['model']: r['samples'] for r in res['rows']}
  assert all(acc[m] == acc['teacher'] for m in acc)
  assert 'last 3 prompt tokens' in res['models']['window@400']
  assert '| passkey | 300 |' in (tmp_path / 'report.md').read_text()
