r"""Prefill scaling over devices: context-parallel Orthros prefill of one long
prompt on 1, 2, 4, 8 devices (the 'sequence' mesh axis), plus the dense
model for comparison.

  python benchmarks/scaling.py --out results/scaling              # CPU: fakes 8
  python benchmarks/scaling.py --out results/scaling --length 131072 \
      --layers 16 --embed 2048 --heads 32 --kv_heads 8 --head_dim 64  # 8 chips

On a CPU-only machine the script asks XLA for `max(--devices)` host devices
(--xla_force_host_platform_device_count, set before jax is imported): these
fake devices share the same cores, so their times show the overhead of the
partitioned program, not a speed-up; the per-device memory is real (what
each device's compiled program allocates). On GPU/TPU the devices are the
chips.

For each device count n and model (orthros, dense) it compiles one prefill
of --length tokens (batch 1) into an empty KV cache of the same length,
with the tokens, activations and cache split by position over n devices
(orthros: context-parallel prefill, attention/context_parallel.py; dense:
the same model under XLA's SPMD partitioner), and records the median wall
time, the per-device peak memory from XLA's memory analysis (arguments +
outputs + temporaries of one device's program), and the KV cache bytes one
device holds. Writes <out>/scaling.json, scaling.csv and scaling.png and
prints a table.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import pathlib
import platform
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string('out', 'results/scaling', 'Output folder.')
flags.DEFINE_list('devices', ['1', '2', '4', '8'], 'Device counts to run.')
flags.DEFINE_integer('length', 16384, 'Prompt length in tokens.')
flags.DEFINE_list('models', ['orthros', 'dense'], 'orthros and/or dense.')
flags.DEFINE_integer('layers', 2, 'Model layers.')
flags.DEFINE_integer('embed', 256, 'Embedding width.')
flags.DEFINE_integer('heads', 8, 'Query heads.')
flags.DEFINE_integer('kv_heads', 4, 'KV heads.')
flags.DEFINE_integer('head_dim', 32, 'Head dim.')
flags.DEFINE_integer('mlp', 768, 'MLP width.')
flags.DEFINE_integer('window', 64, 'Orthros window W.')
flags.DEFINE_integer('chunk', 64, 'Orthros chunk size C.')
flags.DEFINE_integer('feature_dim', 16, 'Hedgehog feature projection P.')
flags.DEFINE_string('dtype', 'float32', 'Activation dtype.')
flags.DEFINE_integer('reps', 3, 'Timed repetitions (after one warm-up).')


def _force_host_devices(argv) -> None:
  """Before jax is imported: enough fake CPU devices for --devices."""
  wanted = 8
  for arg in argv:
    if arg.startswith('--devices='):
      wanted = max(int(x) for x in arg.split('=', 1)[1].split(','))
  flags_env = os.environ.get('XLA_FLAGS', '')
  if ('xla_force_host_platform_device_count' not in flags_env and
      os.environ.get('JAX_PLATFORMS', 'cpu') in ('', 'cpu')):
    os.environ['XLA_FLAGS'] = (flags_env + ' --xla_force_host_platform_'
                               f'device_count={wanted}').strip()


def _config(kind: str):
  from orthros_jax import AttentionConfig
  from orthros_jax import ModelConfig
  return ModelConfig(
      vocab_size=256, num_layers=FLAGS.layers, embed_dim=FLAGS.embed,
      num_heads=FLAGS.heads, num_kv_heads=FLAGS.kv_heads,
      head_dim=FLAGS.head_dim, mlp_dim=FLAGS.mlp, dtype=FLAGS.dtype,
      attention=AttentionConfig(kind=kind, window=FLAGS.window,
                                chunk_size=FLAGS.chunk,
                                feature_dim=FLAGS.feature_dim, exact_tail=0))


def measure(kind: str, n: int) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from orthros_jax import init_cache
  from orthros_jax import sharding
  from orthros_jax.evaluation.speed import _memory_bytes

  config = _config(kind)
  t = FLAGS.length
  part = sharding.Partitioner.create({'sequence': n},
                                     devices=jax.devices()[:n])
  params = part.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.device_put(
      jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, t)),
                  jnp.int32), part.sharding((None, 'length'), (1, t)))
  cache = part.shard_cache(init_cache(config, 1, t))
  model = part.model(config)  # its attention backend on this mesh

  def prefill(params, tokens, cache):
    logits, cache = model.apply({'params': params}, tokens, phase='prefill',
                                cache=cache)
    return jnp.argmax(logits, -1), cache

  with part.activate():
    t0 = time.perf_counter()
    compiled = jax.jit(prefill, out_shardings=(
        part.replicated, part.cache_shardings(cache))).lower(
            params, tokens, cache).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(params, tokens, cache))
    times = []
    for _ in range(FLAGS.reps):
      t0 = time.perf_counter()
      out = jax.block_until_ready(compiled(params, tokens, cache))
      times.append(time.perf_counter() - t0)
  cache_mem = sharding.bytes_per_device([out[1][i].k for i in range(
      config.num_layers)] + [out[1][i].v for i in range(config.num_layers)])
  return {
      'model': kind, 'devices': n, 'length': t,
      'median_s': float(np.median(times)), 'min_s': float(min(times)),
      'tokens_per_s': t / float(np.median(times)), 'compile_s': compile_s,
      'peak_device_bytes': _memory_bytes(compiled),
      'kv_cache_device_bytes': cache_mem['max_device_bytes'],
      'kv_cache_total_bytes': cache_mem['total_bytes'],
      'params': config.num_params()}


def _plot(rows, path) -> str | None:
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for kind in sorted({r['model'] for r in rows}):
    rs = sorted((r for r in rows if r['model'] == kind),
                key=lambda r: r['devices'])
    d = [r['devices'] for r in rs]
    axes[0].plot(d, [r['median_s'] for r in rs], 'o-', label=kind)
    if all(r['peak_device_bytes'] for r in rs):
      axes[1].plot(d, [r['peak_device_bytes'] / 2**20 for r in rs], 'o-',
                   label=f'{kind}: peak per device')
    axes[1].plot(d, [r['kv_cache_device_bytes'] / 2**20 for r in rs], 'x--',
                 label=f'{kind}: KV cache per device')
  for ax, title in zip(axes, ('prefill time (s)', 'memory per device (MiB)')):
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('devices (sequence axis)')
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, which='both', alpha=0.3)
  fig.suptitle(f"prefill of {rows[0]['length']} tokens")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv):
  del argv
  import jax
  import tqdm
  counts = sorted({int(x) for x in FLAGS.devices})
  if max(counts) > jax.device_count():
    raise app.UsageError(f'--devices asks for {max(counts)} devices; '
                         f'{jax.device_count()} are available')
  for kind in FLAGS.models:
    if kind not in ('orthros', 'dense'):
      raise app.UsageError(f'--models: unknown model {kind!r}')
  if FLAGS.length % max(counts):
    raise app.UsageError(f'--length={FLAGS.length} must be a multiple of '
                         f'{max(counts)} (the cache is split by position)')
  rows = []
  jobs = [(k, n) for k in FLAGS.models for n in counts]
  for kind, n in tqdm.tqdm(jobs, desc='scaling'):
    rows.append(measure(kind, n))
  os.makedirs(FLAGS.out, exist_ok=True)
  meta = {'date': datetime.datetime.now().isoformat(timespec='seconds'),
          'backend': jax.default_backend(),
          'device_kind': jax.devices()[0].device_kind,
          'jax': jax.__version__, 'host': platform.node(),
          'cpu_count': os.cpu_count(), 'command': ' '.join(sys.argv),
          'fake_cpu_devices': jax.default_backend() == 'cpu'}
  with open(os.path.join(FLAGS.out, 'scaling.json'), 'w') as f:
    json.dump({'meta': meta, 'rows': rows}, f, indent=1)
  with open(os.path.join(FLAGS.out, 'scaling.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  plot = _plot(rows, os.path.join(FLAGS.out, 'scaling.png'))
  mib = lambda b: f'{b / 2**20:.1f}' if b else 'n/a'
  print(f"\nprefill of {FLAGS.length} tokens, {meta['backend']} "
        f"({meta['device_kind']}), jax {meta['jax']}")
  print('| model | devices | time (s) | tokens/s | peak MiB / device | '
        'KV cache MiB / device |')
  print('|---|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['model']} | {r['devices']} | {r['median_s']:.3f} | "
          f"{r['tokens_per_s']:.0f} | {mib(r['peak_device_bytes'])} | "
          f"{mib(r['kv_cache_device_bytes'])} |")
  print(f"\nwrote {FLAGS.out}/scaling.json, scaling.csv"
        + (f', {os.path.basename(plot)}' if plot else ''))


if __name__ == '__main__':
  _force_host_devices(sys.argv)
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  app.run(main)
