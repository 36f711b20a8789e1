r"""Times the attention kernels against the machine's own ceilings.

  python benchmarks/kernels.py --out results/bench_kernels
  python benchmarks/kernels.py --out results/bench_kernels --max_len 32768

One run measures, on the default JAX backend:
  1. ceilings: the achieved matmul rate (float32, bfloat16 when it runs) and
     the copy bandwidth (x -> x + 1, bytes read + written per second);
  2. prefill time vs prompt length N: XLA `orthros_prefill`, the XLA blocked
     dense `softmax_attention(causal=True)`, and on GPU/TPU the Pallas
     `linear_prefill` (on GPU also its sequential schedule, and cuDNN flash
     attention; on TPU JAX's Pallas flash attention);
  3. decode time vs cache length: XLA `decode_attention`, and on GPU/TPU the
     Pallas `flash_decode`;
and writes <out>/kernels.json, kernels.csv, prefill.png, decode.png and a
markdown table on stdout (see benchmarks/README.md). The ratios, slopes,
tables and plots are made by benchmarks/report.py.

Einsum legend: B batch, N tokens, H query heads, K kv heads, D head dim,
F feature dim, W window, C chunk.
"""

from __future__ import annotations

import csv
import datetime
import importlib
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

from absl import app
from absl import flags

# `python benchmarks/kernels.py` puts benchmarks/ on sys.path, not the repo.
_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from orthros_jax.attention import decode_attention
from orthros_jax.attention import orthros_prefill
from orthros_jax.attention import softmax_attention
from orthros_jax.feature_maps import feature_map

from benchmarks import report
from benchmarks.kernel_costs import decode_bytes
from benchmarks.kernel_costs import dense_blocked_executed_flops
from benchmarks.kernel_costs import prefill_bytes
from benchmarks.kernel_costs import prefill_flops
from benchmarks.kernel_costs import prefill_memory

_K = 1024
_CPU_PREFILL_LENS = [1 * _K, 2 * _K, 4 * _K, 8 * _K, 16 * _K, 32 * _K]
_ACCEL_PREFILL_LENS = _CPU_PREFILL_LENS + [64 * _K, 128 * _K]
_CPU_DECODE_LENS = [4 * _K, 8 * _K, 16 * _K, 32 * _K]
_ACCEL_DECODE_LENS = _CPU_DECODE_LENS + [64 * _K, 128 * _K]

FLAGS = flags.FLAGS
flags.DEFINE_string('out', 'results/bench_kernels', 'Output folder.')
flags.DEFINE_integer('max_len', None, 'Drop prefill/decode lengths above this.')
flags.DEFINE_list('lens', None, 'Prefill lengths (default: 1K..32K on CPU, '
                  '1K..128K on GPU/TPU).')
flags.DEFINE_list('decode_lens', None, 'Decode cache lengths (default: '
                  '4K..32K on CPU, 4K..128K on GPU/TPU).')
flags.DEFINE_enum('dtype', 'auto', ['auto', 'float32', 'bfloat16'],
                  'Activation dtype; auto: float32 on CPU, bfloat16 else.')
flags.DEFINE_integer('batch', 1, 'Prefill batch B.')
flags.DEFINE_integer('heads', 8, 'Query heads H.')
flags.DEFINE_integer('kv_heads', 2, 'KV heads K (GQA).')
flags.DEFINE_integer('head_dim', 64, 'Head dim D.')
flags.DEFINE_integer('feature_dim', 64, 'Feature dim F (hedgehog, P=32).')
flags.DEFINE_integer('window', 64, 'Orthros window W.')
flags.DEFINE_integer('chunk', 64, 'Orthros chunk C.')
flags.DEFINE_integer('dense_block', 512, 'Block of the XLA blocked dense path '
                     '(passed as block_size, so 1K is blocked too).')
flags.DEFINE_integer('decode_batch', 4, 'Decode batch (ragged lengths).')
flags.DEFINE_integer('matmul_size', None, 'Square matmul size for the '
                     'ceiling (default 2048 on CPU, 8192 else).')
flags.DEFINE_integer('copy_mb', None, 'Copy-bandwidth array size in MiB '
                     '(default 256 on CPU, 2048 else).')
flags.DEFINE_integer('min_reps', 3, 'Fewest timed repetitions (median).')
flags.DEFINE_integer('max_reps', 10, 'Most timed repetitions.')
flags.DEFINE_float('rep_budget_s', 20.0, 'Timed repetitions per measurement '
                   'stop at about this many seconds (at least min_reps).')
flags.DEFINE_float('max_call_s', 120.0, 'Skip an impl at N when one call is '
                   'predicted (from its previous N) to take longer.')
flags.DEFINE_float('mem_frac', 0.5, 'Skip a measurement whose estimated '
                   'memory exceeds this fraction of free host/device memory.')
flags.DEFINE_integer('check_len', 32 * _K, 'N of the acceptance line.')
flags.DEFINE_float('check_ratio', 10.0, 'Acceptance: dense/orthros time '
                   'ratio at check_len must be at least this.')
flags.DEFINE_float('deadline_s', None, 'Skip (with the reason recorded) every '
                   'measurement that would start this many seconds after '
                   'the start: a time box for one-shot device runs.')
flags.DEFINE_integer('dense_xla_max_len', None, 'Skip dense_xla above this N '
                     '(reason recorded): its blocked loop is the slow one.')
flags.DEFINE_bool('with_feature_map', False, 'Also time orthros_<impl>_phi: '
                  'the fastest Orthros prefill here (Pallas on GPU/TPU) '
                  'with the hedgehog feature map (P = feature_dim / 2) '
                  'computed from q and k inside the timed function.')
flags.DEFINE_multi_string('note', [], 'Free text copied into kernels.json '
                          '(machine.notes).')

_START = time.perf_counter()


# ---------------------------------------------------------------- timing ---

def _bench(fn, args, *, max_reps=None):
  """Compiles fn, runs it once (warm-up), then times the median of reps.

  The number of reps is min_reps..max_reps, as many as fit rep_budget_s
  given the warm-up time. Returns (stats dict, output of the warm-up).
  """
  max_reps = max_reps or FLAGS.max_reps
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = jax.block_until_ready(compiled(*args))
  warmup_s = time.perf_counter() - t0
  reps = int(FLAGS.rep_budget_s / max(warmup_s, 1e-9))
  reps = max(FLAGS.min_reps, min(max_reps, reps))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return dict(time_s=float(np.median(times)), time_min_s=float(min(times)),
              reps=reps, compile_s=compile_s, warmup_s=warmup_s,
              times_s=times), out


def _free_memory_bytes():
  dev = jax.devices()[0]
  if dev.platform != 'cpu':
    stats = dev.memory_stats() or {}
    if 'bytes_limit' in stats:
      return stats['bytes_limit'] - stats.get('bytes_in_use', 0)
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES')


# -------------------------------------------------------------- ceilings ---

def measure_ceilings(backend):
  """Achieved dense matmul FLOP/s per dtype and copy bandwidth (bytes/s)."""
  n = FLAGS.matmul_size or (2048 if backend == 'cpu' else 8192)
  out = {'matmul_size': n, 'matmul_flops_per_s': {}, 'matmul_errors': {}}
  for name in ('float32', 'bfloat16'):
    try:
      a = jax.random.normal(jax.random.key(1), (n, n), name)
      b = jax.random.normal(jax.random.key(2), (n, n), name)
      stats, _ = _bench(jnp.dot, (a, b))
      rate = 2 * n**3 / stats['time_min_s']  # best of the reps
      out['matmul_flops_per_s'][name] = rate
      print(f'[ceiling] matmul {name} {n}^3: best {stats["time_min_s"]*1e3:.1f}'
            f' ms -> {rate/1e9:.1f} GFLOP/s', flush=True)
    except Exception as e:  # pylint: disable=broad-except
      out['matmul_errors'][name] = f'{type(e).__name__}: {e}'[:500]
      print(f'[ceiling] matmul {name}: failed ({type(e).__name__})', flush=True)
  mb = FLAGS.copy_mb or (256 if backend == 'cpu' else 2048)
  # Donated, so each call writes into the buffer it read: no fresh
  # allocation (page faults on CPU) in the timed loop.
  step = jax.jit(lambda x: x + 1, donate_argnums=0)
  x = jax.block_until_ready(step(jnp.zeros((mb * 2**20 // 4,), jnp.float32)))
  nbytes, times = x.nbytes, []
  for _ in range(max(FLAGS.max_reps, 10)):
    t0 = time.perf_counter()
    x = jax.block_until_ready(step(x))
    times.append(time.perf_counter() - t0)
  bw = 2 * nbytes / min(times)  # read x, write x + 1
  read = jax.jit(jnp.sum)
  stats, _ = _bench(read, (x,), max_reps=max(FLAGS.max_reps, 10))
  del x
  out.update(copy_mib=mb, copy_bytes_per_s=bw,
             read_bytes_per_s=nbytes / stats['time_min_s'])
  print(f'[ceiling] copy {mb} MiB (x -> x + 1, donated): best '
        f'{min(times)*1e3:.1f} ms -> {bw/1e9:.1f} GB/s read+written; '
        f'sum(x) reads {out["read_bytes_per_s"]/1e9:.1f} GB/s', flush=True)
  return out


# --------------------------------------------------------------- prefill ---

def _prefill_inputs(n, s, dtype):
  b, h, kh, d, f = (s['batch'], s['heads'], s['kv_heads'], s['head_dim'],
                    s['feature_dim'])
  ks = jax.random.split(jax.random.key(n), 5)
  q = jax.random.normal(ks[0], (b, n, h, d), dtype)
  k = jax.random.normal(ks[1], (b, n, kh, d), dtype)
  v = jax.random.normal(ks[2], (b, n, kh, d), dtype)
  # The feature map runs outside the attention function: any positive
  # [B, N, H, F] arrays of the right scale time the same.
  phi_q = (jax.random.uniform(ks[3], (b, n, h, f)) / f).astype(dtype)
  phi_k = (jax.random.uniform(ks[4], (b, n, h, f)) / f).astype(dtype)
  gamma = jnp.full((h,), 0.1, jnp.float32)
  return q, k, v, phi_q, phi_k, gamma


def _load_kernel(module, name):
  """The Pallas entry point, or an 'unavailable: ...' string."""
  try:
    return getattr(importlib.import_module(module), name)
  except Exception as e:  # pylint: disable=broad-except
    return f'unavailable: {type(e).__name__}: {e}'[:500]


def prefill_impls(backend, s):
  """name -> (fn(q, k, v, phi_q, phi_k, gamma) -> y, exponent, reference)."""
  w, c = s['window'], s['chunk']
  impls = {
      'orthros_xla': (lambda q, k, v, pq, pk, g: orthros_prefill(
          q, k, v, pq, pk, g, window=w, chunk_size=c)[0], 1, None),
      'dense_xla': (lambda q, k, v, pq, pk, g: softmax_attention(
          q, k, v, causal=True, block_size=s['dense_block']), 2, None),
  }
  if backend == 'gpu':
    impls['dense_cudnn'] = (lambda q, k, v, pq, pk, g: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation='cudnn'), 2, 'dense_xla')
  if backend not in ('gpu', 'tpu'):
    impls['orthros_pallas'] = 'skipped: Pallas is timed on GPU/TPU only'
  else:
    kernel = _load_kernel('pallas_kernels.linear_prefill', 'linear_prefill')
    if isinstance(kernel, str):
      impls['orthros_pallas'] = kernel
    else:
      impls['orthros_pallas'] = (lambda q, k, v, pq, pk, g: kernel(
          q, k, v, pq, pk, g, window=w, chunk_size=c)[0], 1, 'orthros_xla')
      if backend == 'gpu':  # the earlier one-program-per-head GPU schedule
        impls['orthros_pallas_seq'] = (lambda q, k, v, pq, pk, g: kernel(
            q, k, v, pq, pk, g, window=w, chunk_size=c,
            platform='gpu_sequential')[0], 1, 'orthros_xla')
  if backend == 'tpu':  # the dense side at its best: JAX's Pallas flash
    flash = _load_kernel('orthros_jax.attention.dispatch',
                         'tpu_flash_attention')
    impls['dense_tpu_flash'] = flash if isinstance(flash, str) else (
        lambda q, k, v, pq, pk, g: flash(q, k, v), 2, 'dense_xla')
  if FLAGS.with_feature_map:
    name, prefill = 'orthros_xla_phi', orthros_prefill
    if isinstance(impls['orthros_pallas'], tuple):
      name, prefill = 'orthros_pallas_phi', kernel
    impls[name] = (_with_feature_map(prefill, s), 1, None)
  return impls


def _with_feature_map(prefill, s):
  """fn(q, k, v, _, _, gamma): `prefill` fed with the hedgehog features of
  q and k (P = F / 2, float32, k repeated per query head), computed inside
  the timed function as the model does, instead of the stand-in arrays."""
  h, d, f, w, c = (s['heads'], s['head_dim'], s['feature_dim'], s['window'],
                   s['chunk'])
  if f % 2:
    raise ValueError(f'--feature_dim={f}: hedgehog needs an even F = 2P')
  groups = h // s['kv_heads']
  kq, kk = jax.random.split(jax.random.key(3))
  eye = jnp.eye(d, f // 2)
  wq = eye + 0.05 * jax.random.normal(kq, (h, d, f // 2))
  wk = eye + 0.05 * jax.random.normal(kk, (h, d, f // 2))

  def fn(q, k, v, unused_pq, unused_pk, g):
    del unused_pq, unused_pk
    phi_q = feature_map('hedgehog', q, wq)
    phi_k = feature_map('hedgehog', jnp.repeat(k, groups, axis=2), wk)
    return prefill(q, k, v, phi_q, phi_k, g, window=w, chunk_size=c)[0]

  return fn


def _past_deadline():
  if FLAGS.deadline_s is None:
    return None
  elapsed = time.perf_counter() - _START
  if elapsed > FLAGS.deadline_s:
    return (f'time box: {elapsed:.0f} s elapsed > --deadline_s '
            f'{FLAGS.deadline_s:.0f} s')
  return None


def _skip_reason(impl, n, last, exponent, mem, free):
  if impl == 'dense_tpu_flash' and n % 128:
    return 'shape: the TPU flash kernel takes lengths that are multiples of 128'
  if impl == 'dense_xla' and FLAGS.dense_xla_max_len and (
      n > FLAGS.dense_xla_max_len):
    return (f'capped: N > --dense_xla_max_len={FLAGS.dense_xla_max_len} '
            '(time budget of the run)')
  late = _past_deadline()
  if late:
    return late
  if mem > FLAGS.mem_frac * free:
    return f'memory: ~{mem/2**30:.1f} GiB > {FLAGS.mem_frac} x free'
  if last is not None:
    predicted = last['time_s'] * (n / last['n']) ** exponent
    if predicted > FLAGS.max_call_s:
      return (f'time: one call predicted {predicted:.0f} s > max_call_s '
              f'{FLAGS.max_call_s:.0f} s')
  return None


def _max_abs_diff(a, b):
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def run_prefill(lens, backend, s, dtype, ceilings):
  impls = prefill_impls(backend, s)
  itemsize = jnp.dtype(dtype).itemsize
  rate = ceilings['matmul_flops_per_s'].get(jnp.dtype(dtype).name)
  rows, last, dead = [], {}, {}
  for name, impl in impls.items():
    if isinstance(impl, str):
      dead[name] = impl
  for n in lens:
    args = _prefill_inputs(n, s, dtype)
    outs = {}
    for name, impl in impls.items():
      row = dict(section='prefill', impl=name, n=n, batch=s['batch'])
      if name in dead:
        rows.append(dict(row, status=dead[name]))
        continue
      fn, exponent, ref = impl
      reason = _skip_reason(name, n, last.get(name), exponent,
                            prefill_memory(name, n, s, itemsize),
                            _free_memory_bytes())
      if reason:
        rows.append(dict(row, status='skipped: ' + reason))
        print(f'[prefill] N={n:>6} {name:<15} skipped ({reason})', flush=True)
        continue
      try:
        stats, y = _bench(fn, args)
      except Exception as e:  # pylint: disable=broad-except
        dead[name] = f'failed at N={n}: {type(e).__name__}: {e}'[:500]
        rows.append(dict(row, status=dead[name]))
        print(f'[prefill] N={n:>6} {name:<15} FAILED ({type(e).__name__}: '
              f'{str(e)[:200]})', flush=True)
        continue
      flops = prefill_flops(name, n, s)
      row.update(stats, status='ok', flops=flops,
                 bytes=prefill_bytes(name, n, s, itemsize),
                 flops_per_s=flops / stats['time_s'])
      if name == 'dense_xla':
        row['flops_executed'] = dense_blocked_executed_flops(n, s)
      if rate:
        row['frac_matmul'] = row['flops_per_s'] / rate
      if ref in outs:
        row['max_abs_diff_vs_' + ref] = _max_abs_diff(y, outs[ref])
      outs[name] = y
      last[name] = dict(n=n, time_s=stats['time_s'])
      rows.append(row)
      frac = f' = {row["frac_matmul"]:.3f} of matmul' if rate else ''
      print(f'[prefill] N={n:>6} {name:<15} {stats["time_s"]*1e3:>10.2f} ms '
            f'(median of {stats["reps"]}, compile {stats["compile_s"]:.1f} s) '
            f'{row["flops_per_s"]/1e9:8.2f} GFLOP/s{frac}', flush=True)
    del args, outs
    _write_partial('prefill', rows)
  return rows


# ---------------------------------------------------------------- decode ---

def decode_impls(backend):
  impls = {'decode_xla': (decode_attention, None)}
  if backend not in ('gpu', 'tpu'):
    impls['decode_pallas'] = 'skipped: Pallas is timed on GPU/TPU only'
  else:
    kernel = _load_kernel('pallas_kernels.flash_decode', 'flash_decode')
    impls['decode_pallas'] = kernel if isinstance(kernel, str) else (
        kernel, 'decode_xla')
  return impls


def run_decode(lens, backend, s, dtype, ceilings):
  impls = decode_impls(backend)
  itemsize = jnp.dtype(dtype).itemsize
  bw = ceilings['copy_bytes_per_s']
  b, h, kh, d = s['decode_batch'], s['heads'], s['kv_heads'], s['head_dim']
  rows, dead = [], {n: i for n, i in impls.items() if isinstance(i, str)}
  for n in lens:
    ks = jax.random.split(jax.random.key(n + 1), 3)
    q = jax.random.normal(ks[0], (b, 1, h, d), dtype)
    k_cache = jax.random.normal(ks[1], (b, n, kh, d), dtype)
    v_cache = jax.random.normal(ks[2], (b, n, kh, d), dtype)
    # Ragged, near full: 100%, 98.4%, 96.9%, ... of the cache.
    lengths = n - (n // 64) * jnp.arange(b, dtype=jnp.int32)
    nbytes = decode_bytes(np.asarray(lengths), s, itemsize)
    flops = 2 * 2 * h * d * int(jnp.sum(lengths))  # QK^T and PV, Tq = 1
    outs = {}
    for name, impl in impls.items():
      row = dict(section='decode', impl=name, n=n, batch=b)
      if name in dead:
        rows.append(dict(row, status=dead[name]))
        continue
      fn, ref = impl
      mem = 3 * k_cache.nbytes + 3 * 4 * b * h * n  # cache, f32 v, scores
      if mem > FLAGS.mem_frac * _free_memory_bytes():
        rows.append(dict(row, status=f'skipped: memory ~{mem/2**30:.1f} GiB'))
        continue
      late = _past_deadline()
      if late:
        rows.append(dict(row, status='skipped: ' + late))
        continue
      try:
        stats, y = _bench(fn, (q, k_cache, v_cache, lengths),
                          max_reps=max(FLAGS.max_reps, 20))
      except Exception as e:  # pylint: disable=broad-except
        dead[name] = f'failed at N={n}: {type(e).__name__}: {e}'[:500]
        rows.append(dict(row, status=dead[name]))
        print(f'[decode]  S={n:>6} {name:<15} FAILED ({type(e).__name__})',
              flush=True)
        continue
      row.update(stats, status='ok', flops=flops, bytes=nbytes,
                 flops_per_s=flops / stats['time_s'],
                 bytes_per_s=nbytes / stats['time_s'],
                 frac_bandwidth=nbytes / stats['time_s'] / bw)
      if ref in outs:
        row['max_abs_diff_vs_' + ref] = _max_abs_diff(y, outs[ref])
      outs[name] = y
      rows.append(row)
      print(f'[decode]  S={n:>6} {name:<15} {stats["time_s"]*1e3:>10.3f} ms '
            f'(median of {stats["reps"]}) {row["bytes_per_s"]/1e9:7.2f} GB/s = '
            f'{row["frac_bandwidth"]:.3f} of copy bandwidth', flush=True)
    _write_partial('decode', rows)
  return rows


_PARTIAL = {}


def _write_partial(section, rows):
  """<out>/kernels_partial.json: the rows so far, rewritten after every
  length, so a run killed from outside keeps what it measured (removed when
  kernels.json is written)."""
  _PARTIAL[section] = rows
  path = pathlib.Path(FLAGS.out) / 'kernels_partial.json'
  path.write_text(json.dumps(_PARTIAL, indent=1, default=str))


# ------------------------------------------------------- machine, output ---

def machine_info(backend, dtype):
  dev = jax.devices()[0]
  try:
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=_ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(['git', 'status', '--porcelain'], cwd=_ROOT,
                                capture_output=True, text=True).stdout.strip())
  except OSError:
    commit, dirty = None, None
  try:
    jaxlib_version = importlib.import_module('jaxlib').__version__
  except Exception:  # pylint: disable=broad-except
    jaxlib_version = None
  return dict(
      jax_version=jax.__version__, jaxlib_version=jaxlib_version,
      backend=backend, device_kind=dev.device_kind,
      device_count=jax.device_count(), cpu_count=os.cpu_count(),
      cpus_usable=len(os.sched_getaffinity(0)),
      platform=platform.platform(), python=platform.python_version(),
      xla_flags=os.environ.get('XLA_FLAGS'),
      matmul_precision=str(jax.config.jax_default_matmul_precision),
      git_commit=commit, git_dirty=dirty, dtype=jnp.dtype(dtype).name,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat())


_CSV_FIELDS = ['section', 'impl', 'n', 'batch', 'status', 'time_s',
               'time_min_s', 'reps', 'compile_s', 'warmup_s', 'flops',
               'flops_executed', 'bytes', 'flops_per_s', 'bytes_per_s',
               'frac_matmul', 'frac_bandwidth', 'max_abs_diff_vs_orthros_xla',
               'max_abs_diff_vs_dense_xla', 'max_abs_diff_vs_decode_xla']


# ------------------------------------------------------------------ main ---

def main(argv):
  del argv
  start = time.perf_counter()
  backend = jax.default_backend()
  accel = backend in ('gpu', 'tpu')
  dtype = {'auto': jnp.bfloat16 if accel else jnp.float32,
           'float32': jnp.float32, 'bfloat16': jnp.bfloat16}[FLAGS.dtype]
  lens = ([int(x) for x in FLAGS.lens] if FLAGS.lens else
          _ACCEL_PREFILL_LENS if accel else _CPU_PREFILL_LENS)
  decode_lens = ([int(x) for x in FLAGS.decode_lens] if FLAGS.decode_lens else
                 _ACCEL_DECODE_LENS if accel else _CPU_DECODE_LENS)
  if FLAGS.max_len:
    lens = [n for n in lens if n <= FLAGS.max_len]
    decode_lens = [n for n in decode_lens if n <= FLAGS.max_len]
  shapes = dict(batch=FLAGS.batch, heads=FLAGS.heads, kv_heads=FLAGS.kv_heads,
                head_dim=FLAGS.head_dim, feature_dim=FLAGS.feature_dim,
                window=FLAGS.window, chunk=FLAGS.chunk,
                dense_block=FLAGS.dense_block, decode_batch=FLAGS.decode_batch)
  if FLAGS.heads % FLAGS.kv_heads:
    raise ValueError(f'--heads={FLAGS.heads} must be a multiple of '
                     f'--kv_heads={FLAGS.kv_heads}')
  out_dir = pathlib.Path(FLAGS.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  info = machine_info(backend, dtype)
  info['shapes'] = shapes
  info['notes'] = list(FLAGS.note)
  info['plots'] = ('prefill.png, decode.png'
                   if importlib.util.find_spec('matplotlib') else
                   'skipped: matplotlib is not installed')
  _PARTIAL['machine'] = info
  print(f'backend {backend} ({info["device_kind"]}), {info["cpus_usable"]} '
        f'CPUs, jax {jax.__version__}, dtype {info["dtype"]}; prefill N '
        f'{lens}, decode S {decode_lens}', flush=True)

  # Ceilings first, then prefill and decode.
  ceilings = measure_ceilings(backend)
  _PARTIAL['ceilings'] = ceilings
  rows = run_prefill(lens, backend, shapes, dtype, ceilings)
  rows += run_decode(decode_lens, backend, shapes, dtype, ceilings)
  analysis = report.analyse(rows)
  info['wall_s'] = time.perf_counter() - start

  # Outputs.
  with open(out_dir / 'kernels.json', 'w') as fh:
    json.dump(dict(machine=info, ceilings=ceilings, measurements=rows,
                   analysis=analysis, flags={
                       f.name: f.value
                       for f in FLAGS.get_key_flags_for_module(sys.argv[0])}),
              fh, indent=1, default=str)
  with open(out_dir / 'kernels.csv', 'w', newline='') as fh:
    writer = csv.DictWriter(fh, _CSV_FIELDS, extrasaction='ignore')
    writer.writeheader()
    writer.writerows(rows)
  report.plot(rows, analysis, ceilings, out_dir, FLAGS.check_ratio)
  (out_dir / 'kernels_partial.json').unlink(missing_ok=True)
  print()
  print(report.markdown(info, ceilings, rows, analysis))
  print()
  print(report.acceptance(analysis, FLAGS.check_len, FLAGS.check_ratio))
  print(f'\nWrote {out_dir}/kernels.json, kernels.csv, prefill.png, decode.png '
        f'in {info["wall_s"]:.0f} s.')


if __name__ == '__main__':
  app.run(main)
