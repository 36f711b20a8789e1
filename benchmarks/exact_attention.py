"""Exact causal attention on this machine: the one-einsum path vs blocks.

`orthros_jax.attention.softmax_attention` computes small problems with one
einsum over the [T, S] score matrix and large ones with a blocked online
softmax (query blocks one after another, key blocks streamed, masked blocks
skipped); `_auto_block` picks per backend. This script times both, forward
and forward + backward (the gradient w.r.t. q, k, v, as training needs),
for a model's head shape, interleaved, median / min / max of `--reps`.

  python benchmarks/exact_attention.py --lengths 256,512,1024,2048 \
      --blocks 0,128,256,512 --out results/exact_attention

Block 0 is the one-einsum path. Default shape: SmolLM2-135M (9 query heads,
3 kv heads of 64), batch 2. `--base REV` also times softmax.py as it was at
git revision REV (loaded from `git show`, beside today's, in the same
interleaved rounds): before / after a change in one run. Writes
results.json, results.csv, report.md and exact_attention.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from orthros_jax.attention import softmax  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOW = 'now'


def softmax_at(rev: str) -> types.ModuleType:
  """orthros_jax/attention/softmax.py as it was at git revision `rev`."""
  path = 'orthros_jax/attention/softmax.py'
  try:
    src = subprocess.run(['git', 'show', f'{rev}:{path}'], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
  except subprocess.CalledProcessError as e:
    raise SystemExit(f'--base {rev}: git cannot show {path} there: '
                     f'{e.stderr.strip()}') from e
  mod = types.ModuleType(f'softmax_at_{rev}')
  exec(compile(src, f'{rev}:{path}', 'exec'), mod.__dict__)  # pylint: disable=exec-used
  return mod


def _fns(block: int, softmax=softmax):  # pylint: disable=redefined-outer-name
  kw = {'block_size': block} if block else {}
  if not block:
    # Force the one-einsum path whatever the size.
    def fwd(q, k, v):
      b, t = q.shape[:2]
      s = k.shape[1]
      pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (s - t), (b, t))
      return softmax._attend_naive(  # pylint: disable=protected-access
          q, k, v, pos, jnp.full((b,), s, jnp.int32), causal=True)
  else:
    def fwd(q, k, v):
      return softmax.softmax_attention(q, k, v, causal=True, **kw)
  grad = jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v) ** 2),
                  argnums=(0, 1, 2))
  return jax.jit(fwd), jax.jit(grad)


def run(lengths, blocks, *, batch: int, heads: int, kv_heads: int,
        head_dim: int, reps: int, base: str | None = None) -> list[dict]:
  """Rows {length, code, block, what, median/min/max ms}: code is 'now' or
  the --base revision."""
  codes = {NOW: softmax}
  if base:
    codes[base] = softmax_at(base)
  rng = np.random.default_rng(0)
  rows = []
  for t in lengths:
    q = jnp.asarray(rng.standard_normal((batch, t, heads, head_dim)),
                    jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, t, kv_heads, head_dim)),
                        jnp.float32) for _ in range(2))
    fns = {(c, b): _fns(b, mod) for c, mod in codes.items() for b in blocks}
    ref = grad_ref = None
    for (c, b), (f, g) in fns.items():  # compile; every path must agree
      out = np.asarray(jax.block_until_ready(f(q, k, v)))
      grads = [np.asarray(x) for x in jax.block_until_ready(g(q, k, v))]
      ref = out if ref is None else ref
      grad_ref = grads if grad_ref is None else grad_ref
      err = max([float(np.max(np.abs(out - ref)))] + [
          float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
          for x, y in zip(grads, grad_ref)])
      if err > 1e-4:
        raise AssertionError(f'{c} block {b} differs from the first path by '
                             f'{err} at T={t}')
    times = {(key, w): [] for key in fns for w in ('forward', 'grad')}
    for _ in range(reps):  # interleaved
      for key, (f, g) in fns.items():
        for what, fn in (('forward', f), ('grad', g)):
          t0 = time.perf_counter()
          jax.block_until_ready(fn(q, k, v))
          times[(key, what)].append(time.perf_counter() - t0)
    for ((c, b), what), ts in times.items():
      rows.append({'length': t, 'code': c, 'block': b, 'what': what,
                   'median_ms': 1e3 * float(np.median(ts)),
                   'min_ms': 1e3 * min(ts), 'max_ms': 1e3 * max(ts),
                   'reps': reps})
      print(f"T={t} {c} block={b or 'einsum'} {what}: "
            f"{rows[-1]['median_ms']:.1f} ms", flush=True)
  return rows


def _columns(rows) -> list[tuple[str, int]]:
  """(code, block) pairs in the order they ran."""
  return list(dict.fromkeys((r['code'], r['block']) for r in rows))


def _label(code: str, block: int) -> str:
  name = f'block {block}' if block else 'one einsum'
  return name if code == NOW else f'{name} @{code}'


def _plot(rows, path):
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
  for ax, what in zip(axes, ('forward', 'grad')):
    for c, b in _columns(rows):
      rs = sorted((r for r in rows if (r['code'], r['block']) == (c, b)
                   and r['what'] == what), key=lambda r: r['length'])
      ax.errorbar([r['length'] for r in rs], [r['median_ms'] for r in rs],
                  yerr=[[r['median_ms'] - r['min_ms'] for r in rs],
                        [r['max_ms'] - r['median_ms'] for r in rs]],
                  marker='o', label=_label(c, b))
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('T = S (tokens)')
    ax.set_ylabel('ms (median, min-max)')
    ax.set_title(what)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--lengths', default='256,512,1024,2048')
  p.add_argument('--blocks', default='0,128,256,512',
                 help='0 = the one-einsum path')
  p.add_argument('--batch', type=int, default=2)
  p.add_argument('--heads', type=int, default=9)
  p.add_argument('--kv_heads', type=int, default=3)
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--base', default=None,
                 help='also time softmax.py at this git revision')
  p.add_argument('--out', default='results/exact_attention')
  a = p.parse_args(argv)
  if a.reps < 3:
    p.error('--reps must be >= 3 (medians of at least 3 runs)')
  rows = run([int(x) for x in a.lengths.split(',')],
             [int(x) for x in a.blocks.split(',')], batch=a.batch,
             heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
             reps=a.reps, base=a.base)
  os.makedirs(a.out, exist_ok=True)
  meta = {'backend': jax.default_backend(), 'jax': jax.__version__,
          'python': platform.python_version(), 'cpu_count': os.cpu_count(),
          'shape': dict(batch=a.batch, heads=a.heads, kv_heads=a.kv_heads,
                        head_dim=a.head_dim), 'base': a.base}
  with open(os.path.join(a.out, 'results.json'), 'w') as f:
    json.dump({'machine': meta, 'rows': rows}, f, indent=1)
  with open(os.path.join(a.out, 'results.csv'), 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  columns = _columns(rows)
  lines = ['| T | pass | ' + ' | '.join(
      f'{_label(c, b)} ms' for c, b in columns) + ' |',
           '|---|---|' + '---|' * len(columns)]
  for t in sorted({r['length'] for r in rows}):
    for what in ('forward', 'grad'):
      cells = []
      for c, b in columns:
        r = next(r for r in rows if r['length'] == t and r['block'] == b
                 and r['code'] == c and r['what'] == what)
        cells.append(f"{r['median_ms']:.1f} [{r['min_ms']:.1f}, "
                     f"{r['max_ms']:.1f}]")
      lines.append(f'| {t} | {what} | ' + ' | '.join(cells) + ' |')
  plot = _plot(rows, os.path.join(a.out, 'exact_attention.png'))
  with open(os.path.join(a.out, 'report.md'), 'w') as f:
    f.write('# Exact causal attention, one einsum vs blocks\n\n'
            f'{meta}\n\n' + '\n'.join(lines) + '\n'
            + ('\n![plot](exact_attention.png)\n' if plot else ''))
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
