"""The XLA Orthros prefill: the chunk scan against a chunk-parallel form.

`orthros_jax.attention.orthros_prefill` (the CPU and fallback path) scans
the chunks in order, carrying the linear state (S, z) and a rolling key
block. The chunk-parallel form computes every chunk at once, as
flash-linear-attention's chunked kernels and the Pallas GPU schedule do:
each chunk's window block and in-block linear weights as batched einsums
over all chunks, each chunk's state contribution phi_k^T v, a prefix sum
over chunks (`lax.associative_scan`), then every chunk's read of the state
before its block. Same formula (checked here against the scan on every
run); the question is which runs faster on a backend. This script times
both, forward and forward + backward (the gradient w.r.t. q, k, v,
phi_q, phi_k, as stage 1 trains), interleaved (the order alternates
between reps), median / min / max of `--reps`, with the matmul rate (an
n x n x n float32 matmul, n = 2048) and the copy bandwidth measured in the
same run. GFLOP/s counts the matmul work both schedules execute (q.k and
w.v over each chunk's block of (nb + 1) C keys, phi_q.phi_k over its
(nb + 1) C - W older ones, the state's read and fold: `executed_flops`);
for forward + backward it is a model, 3x the forward's (the backward
runs two matmuls per forward one; any recomputation is not counted), and
frac_matmul_rate divides by the 2048^3 matmul's rate, which small batched
matmuls do not reach.

  python benchmarks/prefill_schedules.py --lengths 2048,8192 \
      --out results/prefill_schedules

Default shape: SmolLM2-135M's attention as converted (9 query / 3 kv heads
of 64, F = 128, W = 64, C = 64), batch 1, float32, fresh prompt (no
history, no sinks: the sink keys are a handful of extra scores either
way). Writes results.json, results.csv, report.md and prefill_schedules.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from benchmarks.decode_speed import copy_bandwidth  # pylint: disable=wrong-import-position
from orthros_jax.attention import orthros_prefill  # pylint: disable=wrong-import-position
from pallas_kernels.common import normalize  # pylint: disable=wrong-import-position
from pallas_kernels.common import stable_max  # pylint: disable=wrong-import-position

SCHEDULES = ('scan', 'parallel')
_FIELDS = ('length', 'schedule', 'what', 'median_ms', 'min_ms', 'max_ms',
           'gflop_per_s', 'frac_matmul_rate', 'max_abs_diff_vs_scan')


def executed_flops(n: int, a) -> float:
  """Matmul FLOPs (2 per multiply-add) of one forward, both schedules:
  per query and head, q.k and w.v over the block's (nb + 1) C keys,
  phi_q.phi_k over its (nb + 1) C - W older ones, phi_q S and phi_k v^T."""
  nc = -(-n // a.chunk)
  nb = min(-(-(a.window - 1) // a.chunk) if a.window > 1 else 0, nc - 1)
  blk = (nb + 1) * a.chunk
  n_lin = min(blk, max(0, blk - a.window))
  per = 2 * blk * 2 * a.head_dim + 2 * n_lin * a.feature_dim + (
      4 * a.feature_dim * a.head_dim)
  return float(a.batch * a.heads * nc * a.chunk * per)


def parallel_prefill(q, k, v, phi_q, phi_k, gamma, *, window: int,
                     chunk_size: int):
  """`orthros_prefill(...)[0]` of a fresh prompt (no lengths, history or
  sinks), every chunk at once. Shapes as orthros_prefill's."""
  if window < 0 or chunk_size < 1:
    raise ValueError(f'window={window} must be >= 0 and chunk_size='
                     f'{chunk_size} >= 1')
  b, n, h, d = q.shape
  kh, f, c = k.shape[2], phi_q.shape[-1], chunk_size
  if (k.shape != (b, n, kh, d) or v.shape != k.shape or h % kh
      or phi_q.shape != (b, n, h, f) or phi_k.shape != phi_q.shape):
    raise ValueError(f'shapes q {q.shape}, k {k.shape}, v {v.shape}, phi_q '
                     f'{phi_q.shape}, phi_k {phi_k.shape} do not form [B,N,H,'
                     'D], [B,N,K,D] x 2, [B,N,H,F] x 2 with H % K == 0')
  g = h // kh
  nc = -(-n // c)
  nb = min(-(-(window - 1) // c) if window > 1 else 0, nc - 1)
  blk = (nb + 1) * c

  def chunks(x):  # [B, N, X, Y] -> [B, X, nc, C, Y] (float32)
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, nc * c - n), (0, 0),
                                        (0, 0)])
    return jnp.transpose(x.reshape(b, nc, c, *x.shape[2:]), (0, 3, 1, 2, 4))

  def block(x, axis):  # chunk i -> chunks i - nb .. i along `axis`
    pad = [(0, 0)] * x.ndim
    pad[axis - 1] = (nb, 0)
    x = jnp.pad(x, pad)
    return jnp.concatenate(
        [jax.lax.slice_in_dim(x, o, o + nc, axis=axis - 1)
         for o in range(nb + 1)], axis=axis)

  qs = chunks(q).reshape(b, kh, g, nc, c, d)
  ks, vs, pq, pk = map(chunks, (k, v, phi_q, phi_k))
  exists = (jnp.arange(nc * c) < n).reshape(nc, c)
  kb, vb, pkb = block(ks, 3), block(vs, 3), block(pk, 3)  # [B, X, nc, S, .]
  eb = block(exists, 1)  # [nc, S]
  dist = (nb * c + jnp.arange(c)[:, None]) - jnp.arange(blk)[None, :]
  n_lin = min(blk, max(0, blk - window))
  gamma_g = gamma.astype(jnp.float32).reshape(kh, g)[None, :, :, None, None,
                                                     None]
  scores = jnp.einsum('bkgncd,bknsd->bkgncs', qs, kb) / jnp.sqrt(
      jnp.float32(d))
  win = ((dist >= 0) & (dist < window))[None] & eb[:, None, :]  # [nc, C, S]
  scores = jnp.where(win, scores, -jnp.inf)
  m = stable_max(jnp.max(scores, axis=-1, keepdims=True))
  weights = gamma_g * jnp.exp(scores - m)
  lin = jnp.einsum('bhncf,bhnsf->bhncs', pq, pkb[:, :, :, :n_lin])
  # (Padded keys are zeros, so the `eb` and `exists` masks below change
  # nothing numerically; they keep every padded key out by construction.)
  older = (dist >= window)[None, :, :n_lin] & eb[:, None, :n_lin]
  lin = jnp.where(older, lin, 0.0).reshape(b, kh, g, nc, c, n_lin)
  weights = jnp.concatenate([weights[..., :n_lin] + lin,
                             weights[..., n_lin:]], axis=-1)
  num = jnp.einsum('bkgncs,bknsd->bkgncd', weights, vb)
  den = jnp.sum(weights, axis=-1)
  # Chunk j's keys are older than every window of chunk i >= j + nb + 1.
  pk_g = jnp.where(exists[None, None, :, :, None], pk, 0.0).reshape(
      b, kh, g, nc, c, f)
  ds = jnp.einsum('bkgncf,bkncd->bkgnfd', pk_g, vs)
  dz = jnp.sum(pk_g, axis=4)
  cs = jax.lax.associative_scan(jnp.add, ds, axis=3)
  cz = jax.lax.associative_scan(jnp.add, dz, axis=3)
  shift = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(nb + 1, 0)] + [(0, 0)] * (
      x.ndim - 4))[:, :, :, :nc]
  pq_g = pq.reshape(b, kh, g, nc, c, f)
  num = num + jnp.einsum('bkgncf,bkgnfd->bkgncd', pq_g, shift(cs))
  den = den + jnp.einsum('bkgncf,bkgnf->bkgnc', pq_g, shift(cz))
  y = normalize(num, den[..., None])  # [B, K, G, nc, C, D]
  y = jnp.transpose(y, (0, 3, 4, 1, 2, 5)).reshape(b, nc * c, h, d)
  return y[:, :n].astype(q.dtype)


def _inputs(n, a):
  ks = jax.random.split(jax.random.PRNGKey(n), 6)
  q = jax.random.normal(ks[0], (a.batch, n, a.heads, a.head_dim))
  k = jax.random.normal(ks[1], (a.batch, n, a.kv_heads, a.head_dim))
  v = jax.random.normal(ks[2], (a.batch, n, a.kv_heads, a.head_dim))
  # Positive features of the hedgehog scale (rows summing to 2).
  phi_q = 2 * jax.nn.softmax(jax.random.normal(
      ks[3], (a.batch, n, a.heads, a.feature_dim)), axis=-1)
  phi_k = 2 * jax.nn.softmax(jax.random.normal(
      ks[4], (a.batch, n, a.heads, a.feature_dim)), axis=-1)
  gamma = jax.nn.sigmoid(jax.random.normal(ks[5], (a.heads,)))
  return q, k, v, phi_q, phi_k, gamma


def _fns(schedule, a):
  if schedule == 'scan':
    fwd = lambda *x: orthros_prefill(*x, window=a.window,
                                     chunk_size=a.chunk)[0]
  else:
    fwd = lambda *x: parallel_prefill(*x, window=a.window,
                                      chunk_size=a.chunk)
  weights = jnp.cos(jnp.arange(a.head_dim, dtype=jnp.float32))
  grad = jax.grad(lambda *x: jnp.sum(fwd(*x) * weights),
                  argnums=(0, 1, 2, 3, 4))
  return {'forward': jax.jit(fwd), 'forward+backward': jax.jit(grad)}


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
  """Best float32 FLOP/s of an n x n x n matmul."""
  x = jax.random.normal(jax.random.PRNGKey(0), (n, n))
  f = jax.jit(jnp.dot)
  jax.block_until_ready(f(x, x))
  best = float('inf')
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x, x))
    best = min(best, time.perf_counter() - t0)
  return 2 * n**3 / best


def run(a) -> tuple[list[dict], dict]:
  rate, bandwidth = matmul_rate(), copy_bandwidth()
  print(f'matmul {rate / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s',
        flush=True)
  fns = {s: _fns(s, a) for s in a.schedules}
  shape = dict(batch=a.batch, heads=a.heads, kv_heads=a.kv_heads,
               head_dim=a.head_dim, feature_dim=a.feature_dim,
               window=a.window, chunk=a.chunk)
  rows = []
  for n in a.lengths:
    args = _inputs(n, a)
    for what in a.what:
      outs, times = {}, {s: [] for s in a.schedules}
      for s in a.schedules:  # compile and keep each output
        outs[s] = jax.block_until_ready(fns[s][what](*args))
      for rep in range(a.reps):
        for s in a.schedules[::-1] if rep % 2 else a.schedules:
          t0 = time.perf_counter()
          jax.block_until_ready(fns[s][what](*args))
          times[s].append(time.perf_counter() - t0)
      flops = executed_flops(n, a)
      if what == 'forward+backward':
        flops *= 3  # a model: the backward's matmuls, twice the forward's
      for s in a.schedules:
        med = float(np.median(times[s]))
        row = dict(length=n, schedule=s, what=what, median_ms=med * 1e3,
                   min_ms=min(times[s]) * 1e3, max_ms=max(times[s]) * 1e3,
                   gflop_per_s=flops / med / 1e9,
                   frac_matmul_rate=flops / med / rate)
        if s != 'scan':
          row['max_abs_diff_vs_scan'] = max(
              float(jnp.max(jnp.abs(x - y))) for x, y in zip(
                  jax.tree.leaves(outs[s]), jax.tree.leaves(outs['scan'])))
        rows.append(row)
        print(f'N={n:>6} {what:<16} {s:<8} {row["median_ms"]:9.1f} ms '
              f'[{row["min_ms"]:.1f}, {row["max_ms"]:.1f}] '
              f'{row["gflop_per_s"]:6.1f} GFLOP/s', flush=True)
  info = dict(jax=jax.__version__, backend=jax.default_backend(),
              machine=platform.processor() or platform.machine(),
              cpus=os.cpu_count(), matmul_flops_per_s=rate,
              copy_bytes_per_s=bandwidth, shape=shape, reps=a.reps)
  return rows, info


def write(rows, info, out: str) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(dict(info=info, rows=rows), f, indent=1)
  with open(os.path.join(out, 'results.csv'), 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=_FIELDS)
    w.writeheader()
    for r in rows:
      w.writerow({k: r.get(k, '') for k in _FIELDS})
  by = {(r['length'], r['what'], r['schedule']): r for r in rows}
  lines = [f'# Orthros XLA prefill: chunk scan vs chunk-parallel '
           f'({info["backend"]}, jax {info["jax"]}, matmul '
           f'{info["matmul_flops_per_s"] / 1e9:.1f} GFLOP/s, copy '
           f'{info["copy_bytes_per_s"] / 1e9:.1f} GB/s)', '',
           f'shape {info["shape"]}, float32, fresh prompt without sinks; '
           f'median [min, max] of {info["reps"]} interleaved reps.', '',
           '| N | what | scan ms | parallel ms | parallel / scan | '
           'max abs diff |', '|---:|---|---:|---:|---:|---:|']
  for (n, what, s), r in by.items():
    if s != 'parallel' or (n, what, 'scan') not in by:
      continue
    scan = by[n, what, 'scan']
    lines.append(
        f'| {n} | {what} | {scan["median_ms"]:.1f} [{scan["min_ms"]:.1f}, '
        f'{scan["max_ms"]:.1f}] | {r["median_ms"]:.1f} [{r["min_ms"]:.1f}, '
        f'{r["max_ms"]:.1f}] | {r["median_ms"] / scan["median_ms"]:.2f}x | '
        f'{r.get("max_abs_diff_vs_scan", float("nan")):.1e} |')
  with open(os.path.join(out, 'report.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  whats = sorted({r['what'] for r in rows})
  fig, axes = plt.subplots(1, len(whats), figsize=(5 * len(whats), 4),
                           squeeze=False)
  for ax, what in zip(axes[0], whats):
    for s in SCHEDULES:
      pts = sorted((r['length'], r['median_ms']) for r in rows
                   if r['what'] == what and r['schedule'] == s)
      if pts:
        ax.plot(*zip(*pts), marker='o', label=s)
    ax.set(xscale='log', yscale='log', xlabel='prompt tokens N',
           ylabel='ms (median)', title=what)
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, 'prefill_schedules.png'), dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ints = lambda s: tuple(int(x) for x in s.split(','))
  p.add_argument('--lengths', type=ints, default=(2048, 8192))
  p.add_argument('--schedules', default='scan,parallel')
  p.add_argument('--what', default='forward,forward+backward')
  p.add_argument('--batch', type=int, default=1)
  p.add_argument('--heads', type=int, default=9)
  p.add_argument('--kv_heads', type=int, default=3)
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument('--feature_dim', type=int, default=128)
  p.add_argument('--window', type=int, default=64)
  p.add_argument('--chunk', type=int, default=64)
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--out', default='results/prefill_schedules')
  a = p.parse_args(argv)
  a.schedules = tuple(a.schedules.split(','))
  a.what = tuple(a.what.split(','))
  if set(a.schedules) - set(SCHEDULES) or 'scan' not in a.schedules:
    p.error(f'--schedules {a.schedules}: choose from {SCHEDULES}, scan '
            'included (the other schedules are checked against it)')
  if set(a.what) - {'forward', 'forward+backward'} or not a.what:
    p.error(f'--what {a.what}: forward and/or forward+backward')
  if (a.reps < 3 or min(a.lengths) < 1 or a.heads % a.kv_heads
      or a.window < 0 or a.chunk < 1):
    p.error('need --reps >= 3, lengths >= 1, heads % kv_heads == 0, '
            '--window >= 0 and --chunk >= 1')
  rows, info = run(a)
  write(rows, info, a.out)
  return 0


if __name__ == '__main__':
  sys.exit(main())
