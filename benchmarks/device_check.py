"""One prepared accelerator check: compiled kernels vs the XLA references,
the kernel benchmark at SmolLM2-135M's attention shape, then model-level
TTFT / decode. Writes everything under OUT.

  python3 benchmarks/device_check.py OUT        (or benchmarks/device_check.sh OUT)
  python3 benchmarks/device_check.py OUT --dry_run   (tiny sizes; the
                                                    default on a CPU backend)

Sections, each time-boxed and each writing its files as soon as it ends
(OUT/summary.json is rewritten before and after every section):
  1. correctness: the Pallas kernels compiled for the machine's backend (not
     interpreted) at a few shapes (f32 and bf16, GQA, ragged lengths,
     continued prefill, T_q in {1, 5}, gradients) against
     `orthros_jax.attention` -> OUT/check.json;
  2. kernels: benchmarks/kernels.py at SmolLM2-135M's attention shape (9 / 3
     heads of 64, hedgehog P = 64 so F = 128, window 64, chunk 64, bf16),
     prefill 1K..128K (Orthros XLA / Pallas / Pallas + feature map, cuDNN
     flash attention, XLA blocked dense capped at 64K), decode 4K..128K ->
     OUT/bench (kernels_partial.json while it runs);
  3. model: benchmarks/device_model.py, the whole SmolLM2-135M shape with
     random bf16 weights, dense / orthros / none at 4K..32K -> OUT/model.
On a CPU backend (or with --dry_run) every section runs at tiny sizes, in
about two minutes. Meant to finish within 8.5 minutes on one H200 (the
outer `timeout 540` of device_check.sh; --budget_s, default 515 s, is the
internal time box).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

_T0 = time.perf_counter()
# Every section runs in a child process while this one (which only asks
# JAX for the backend) stays alive: without this, JAX would preallocate 75%
# of GPU memory here and the children would get the rest.
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# First: stands in for optional modules that orthros_jax imports at module
# level (safetensors) where they are missing, here and in the children.
from benchmarks import device_model  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from orthros_jax.attention import LinearState  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import WindowPrefix  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import decode_attention  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import orthros_prefill  # pylint: disable=g-import-not-at-top
# The kernels as the model calls them: their XLA reference as the fallback
# and as the function the prefill's backward differentiates.
from orthros_jax.attention.dispatch import pallas_decode as flash_decode  # pylint: disable=g-import-not-at-top
from orthros_jax.attention.dispatch import pallas_prefill as linear_prefill  # pylint: disable=g-import-not-at-top


def _rel_err(a, b, mask=None):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if mask is not None:
    a, b = a[mask], b[mask]
  return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _prefill_case(seed, b, t, h, k, d, f, window, chunk, dtype, continued):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
  pos = lambda *s: jnp.asarray(rng.uniform(0.1, 1.0, size=s), jnp.float32)
  q, kk, v = arr(b, t, h, d), arr(b, t, k, d), arr(b, t, k, d)
  pq, pk = pos(b, t, h, f), pos(b, t, h, f)
  gamma = jnp.asarray(rng.uniform(0.05, 0.9, size=h), jnp.float32)
  lengths = jnp.asarray(rng.integers(t // 2, t + 1, size=b), jnp.int32)
  kw = dict(window=window, chunk_size=chunk, lengths=lengths)
  if continued:
    state = LinearState(pos(b, h, f, d), pos(b, h, f))
    n_valid = rng.integers(0, window + 1, size=b)
    valid = jnp.arange(window)[None, :] >= (window - n_valid)[:, None]
    kw.update(initial_state=state, prefix=WindowPrefix(
        arr(b, window, k, d), arr(b, window, k, d), pos(b, window, h, f),
        valid))
  kernel = jax.jit(lambda *a: linear_prefill(*a, **kw))
  ref = jax.jit(lambda *a: orthros_prefill(*a, **kw))
  args = (q, kk, v, pq, pk, gamma)
  (y, st), (yr, sr) = kernel(*args), ref(*args)
  mask = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
  out = dict(y=_rel_err(y, yr, mask), S=_rel_err(st.S, sr.S),
             z=_rel_err(st.z, sr.z))
  if dtype == jnp.float32 and not continued:
    probe = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
    loss = lambda fn: (lambda *a: jnp.sum(
        fn(*a, **kw)[0].astype(jnp.float32) * probe) + jnp.sum(fn(*a, **kw)[1].S))
    g1 = jax.jit(jax.grad(loss(linear_prefill), argnums=(0, 1, 2, 3, 4, 5)))(*args)
    g2 = jax.jit(jax.grad(loss(orthros_prefill), argnums=(0, 1, 2, 3, 4, 5)))(*args)
    out['grad'] = max(_rel_err(a, b) for a, b in zip(g1, g2))
  return out


def _decode_case(seed, b, s, tq, h, k, d, dtype):
  rng = np.random.default_rng(seed)
  arr = lambda *sh: jnp.asarray(rng.normal(size=sh), dtype)
  q, kc, vc = arr(b, tq, h, d), arr(b, s, k, d), arr(b, s, k, d)
  lengths = jnp.asarray(rng.integers(tq, s + 1, size=b), jnp.int32)
  out = jax.jit(flash_decode)(q, kc, vc, lengths)
  ref = jax.jit(decode_attention)(q, kc, vc, lengths)
  return dict(y=_rel_err(out, ref))


_PREFILL_CASES = [
    dict(b=2, t=1000, h=8, k=2, d=64, f=64, window=64, chunk=64,
         continued=False),
    dict(b=3, t=777, h=4, k=4, d=128, f=128, window=128, chunk=64,
         continued=True),
    dict(b=1, t=4096, h=8, k=1, d=128, f=64, window=0, chunk=128,
         continued=False),
    # SmolLM2-135M's attention: 9 / 3 heads of 64, hedgehog F = 128.
    dict(b=1, t=2048, h=9, k=3, d=64, f=128, window=64, chunk=64,
         continued=False)]
_DECODE_CASES = [dict(b=4, s=4096, tq=1, h=32, k=8, d=128),
                 dict(b=3, s=3000, tq=5, h=8, k=2, d=128),
                 dict(b=2, s=32768, tq=1, h=8, k=8, d=64),
                 dict(b=1, s=8192, tq=1, h=9, k=3, d=64)]
_DRY_PREFILL_CASES = [
    dict(b=2, t=100, h=4, k=2, d=16, f=16, window=16, chunk=16,
         continued=False),
    dict(b=2, t=77, h=3, k=1, d=16, f=32, window=16, chunk=16,
         continued=True)]
_DRY_DECODE_CASES = [dict(b=2, s=256, tq=1, h=4, k=2, d=16),
                     dict(b=2, s=200, tq=5, h=3, k=1, d=16)]

# Kernel benchmark flags: SmolLM2-135M's attention shape. kernels.py's
# --feature_dim is F, the width of phi (hedgehog: F = 2P, P = 64 here).
_KERNEL_SHAPE = ['--batch=1', '--heads=9', '--kv_heads=3', '--head_dim=64',
                 '--feature_dim=128', '--window=64', '--chunk=64',
                 '--with_feature_map']
_KERNEL_FULL = ['--dtype=bfloat16', '--lens=1024,4096,16384,32768,65536,131072',
                '--decode_lens=4096,8192,16384,32768,65536,131072',
                '--dense_xla_max_len=65536', '--rep_budget_s=2',
                '--max_call_s=10']
_KERNEL_DRY = ['--dtype=bfloat16', '--lens=256,512', '--decode_lens=256,512',
               '--check_len=512', '--matmul_size=256', '--copy_mb=8',
               '--rep_budget_s=0.2', '--max_reps=3']
_KERNEL_NOTES = [
    'Shape: SmolLM2-135M attention (H=9, K=3, D=64), hedgehog P=64 so '
    'F=128 (--feature_dim is F), window 64, chunk 64, batch 1, bf16.',
    'orthros_xla / orthros_pallas time the attention only: phi(q), phi(k) '
    'are precomputed random positive [B,N,H,F] arrays in the activation '
    'dtype (the feature map is excluded). orthros_pallas_phi (CPU: '
    'orthros_xla_phi) computes the hedgehog map from q and k inside the '
    'timed function, float32 features as the model feeds them.',
    'dense_cudnn is jax.nn.dot_product_attention(implementation="cudnn", '
    'is_causal=True); dense_xla (XLA blocked online softmax) is capped at '
    'N <= 64K by --dense_xla_max_len to fit the time box.']


def _correctness(out: pathlib.Path, info: dict, dry: bool) -> dict:
  tol = {'float32': 1e-4, 'bfloat16': 2e-2}
  cases = []
  for dtype in (jnp.float32, jnp.bfloat16):
    name = jnp.dtype(dtype).name
    for cfg in _DRY_PREFILL_CASES if dry else _PREFILL_CASES:
      cases.append(('prefill', name, cfg, lambda c=cfg, dt=dtype:
                    _prefill_case(0, **c, dtype=dt)))
    for cfg in _DRY_DECODE_CASES if dry else _DECODE_CASES:
      cases.append(('decode', name, cfg, lambda c=cfg, dt=dtype:
                    _decode_case(0, **c, dtype=dt)))
  results, ok = [], True
  for kind, dtype, cfg, fn in cases:
    t0 = time.perf_counter()
    try:
      errs = fn()
      passed = all(v <= tol[dtype] for v in errs.values())
      rec = dict(kernel=kind, dtype=dtype, **cfg, errors=errs, passed=passed)
    except Exception:  # record the failure and go on with the next case
      rec = dict(kernel=kind, dtype=dtype, **cfg, passed=False,
                 error=traceback.format_exc(limit=4))
    rec['seconds'] = round(time.perf_counter() - t0, 2)
    ok &= rec['passed']
    results.append(rec)
    print(('PASS ' if rec['passed'] else 'FAIL ') + json.dumps(rec)[:400],
          flush=True)
    (out / 'check.json').write_text(json.dumps(
        dict(info=info, dry_run=dry, cases=results), indent=1))
  return dict(passed=ok and bool(results), cases=len(results))


def _run_child(cmd, timeout_s: float) -> dict:
  """Runs a benchmark script (output to this log), killed at timeout_s."""
  print('running', ' '.join(cmd), f'(timeout {timeout_s:.0f} s)', flush=True)
  t0 = time.perf_counter()
  try:
    rc = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, check=False
                        ).returncode
    status = 'ok' if rc == 0 else f'exit code {rc}'
  except subprocess.TimeoutExpired:
    rc, status = None, f'killed at the {timeout_s:.0f} s timeout'
  return dict(status=status, rc=rc,
              seconds=round(time.perf_counter() - t0, 1))


def _kernel_headline(bench: pathlib.Path) -> dict:
  """Per N: prefill time ratios of the dense paths over the Orthros paths
  (> 1: Orthros is faster), from kernels.json or, if the run was cut,
  kernels_partial.json."""
  for name in ('kernels.json', 'kernels_partial.json'):
    path = bench / name
    if path.exists():
      data = json.loads(path.read_text())
      rows = data.get('measurements') or data.get('prefill', [])
      break
  else:
    return {'error': 'no kernels.json or kernels_partial.json'}
  times = {}
  for r in rows:
    if r.get('section') == 'prefill' and r.get('status') == 'ok':
      times.setdefault(r['n'], {})[r['impl']] = r['time_s']
  pairs = [('dense_cudnn', 'orthros_pallas'),
           ('dense_cudnn', 'orthros_pallas_phi'),
           ('dense_xla', 'orthros_pallas'), ('dense_xla', 'orthros_xla'),
           ('dense_xla', 'orthros_xla_phi')]
  out = {'source': path.name, 'ratios': {}}
  for num, den in pairs:
    per_n = {n: t[num] / t[den] for n, t in sorted(times.items())
             if num in t and den in t}
    if per_n:
      out['ratios'][f'{num}/{den}'] = per_n
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('out', help='output folder')
  p.add_argument('--dry_run', action='store_true',
                 help='tiny sizes everywhere (the default on a CPU backend)')
  p.add_argument('--budget_s', type=float, default=515.0,
                 help='time box of the whole check, from process start')
  p.add_argument('--section', choices=['correctness'], default=None,
                 help='run only this section in this process (the check '
                 'runs every section in a child process of its own)')
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  dry = args.dry_run or jax.default_backend() == 'cpu'
  info = device_model.device_info()
  print(json.dumps(info), flush=True)
  if args.section == 'correctness':
    return 0 if _correctness(out, info, dry)['passed'] else 1
  summary = dict(info=info, dry_run=dry, budget_s=args.budget_s,
                 matplotlib=importlib.util.find_spec('matplotlib') is not None,
                 sections={})
  elapsed = lambda: time.perf_counter() - _T0

  def save(section=None, **fields):
    if section:
      summary['sections'][section] = fields
    summary['elapsed_s'] = round(elapsed(), 1)
    (out / 'summary.json').write_text(json.dumps(summary, indent=1,
                                                 default=str))

  # 1. Correctness of the compiled kernels (a child process, so a hang or
  # a crash costs only its time box).
  timeout = 120.0 if dry else 170.0
  cmd = [sys.executable, str(ROOT / 'benchmarks' / 'device_check.py'),
         str(out), '--section=correctness', *(['--dry_run'] if dry else [])]
  save('correctness', status='running', timeout_s=timeout)
  res = _run_child(cmd, timeout)
  check = out / 'check.json'
  cases = json.loads(check.read_text())['cases'] if check.exists() else []
  res.update(cases=len(cases), failed=sum(not c['passed'] for c in cases),
             passed=res['rc'] == 0 and bool(cases), files=['check.json'])
  save('correctness', **res, timeout_s=timeout)

  # 2. Kernel benchmark: at most ~150 s of measurements, leaving the model
  # section at least ~240 s of the budget.
  left = args.budget_s - elapsed()
  deadline = 60.0 if dry else max(30.0, min(150.0, left - 270.0))
  cmd = [sys.executable, str(ROOT / 'benchmarks' / 'kernels.py'),
         f'--out={out / "bench"}', f'--deadline_s={deadline:.0f}',
         *_KERNEL_SHAPE, *(_KERNEL_DRY if dry else _KERNEL_FULL),
         *[f'--note={n}' for n in _KERNEL_NOTES]]
  save('kernels', status='running', deadline_s=deadline)
  res = _run_child(cmd, deadline + 45.0)
  save('kernels', **res, deadline_s=deadline,
       files=[f'bench/{f}' for f in ('kernels.json', 'kernels.csv',
                                     'prefill.png', 'decode.png')],
       headline=_kernel_headline(out / 'bench'))

  # 3. Model level, with what is left.
  left = args.budget_s - elapsed()
  budget = 90.0 if dry else max(30.0, left - 20.0)
  cmd = [sys.executable, str(ROOT / 'benchmarks' / 'device_model.py'),
         f'--out={out / "model"}', f'--budget_s={budget:.0f}',
         *(['--tiny'] if dry else [])]
  save('model', status='running', budget_s=budget)
  res = _run_child(cmd, budget + 15.0)
  model_json = out / 'model' / 'model.json'
  if model_json.exists():
    data = json.loads(model_json.read_text())
    res['rows_ok'] = sum(r['status'] == 'ok' for r in data['rows'])
    res['rows_failed'] = sum(r['status'] != 'ok' for r in data['rows'])
    res['skipped'] = len(data.get('skipped', []))
    res['ratios'] = data.get('ratios')
  save('model', **res, budget_s=budget,
       files=['model/model.json', 'model/model.csv', 'model/model.png'])

  ok = summary['sections']['correctness']['passed']
  print(f'correctness: {"all passed" if ok else "FAILURES"}; kernels: '
        f'{summary["sections"]["kernels"]["status"]}; model: '
        f'{summary["sections"]["model"]["status"]}; '
        f'{elapsed():.0f} s in all', flush=True)
  print(json.dumps(summary['sections'], default=str)[:3000], flush=True)
  rcs = [summary['sections'][s]['rc'] for s in ('kernels', 'model')]
  return 0 if ok and all(rc == 0 for rc in rcs) else 1


if __name__ == '__main__':
  sys.exit(main())
