"""Decode tokens/s, Orthros vs dense, on the SmolLM2-135M shape.

Both decode with exact attention over the whole KV cache; Orthros' decode
never touches its linear state (S, z), which only a later prefill reads
and which that prefill catches up first (docs/ARCHITECTURE.md, section 3).
`evaluation/speed.measure_decode` times them interleaved: at each cache
length both variants are compiled, then `reps` rounds of one call each in
turn, every call `steps` decode steps from a cache of that length (default
the chunk size); median, min and max per step.

  python benchmarks/decode_speed.py --out results/decode_speed

The shape is configs/convert_smollm2.py's (30 layers, d = 576, 9 / 3 heads
of 64; window 64, 4 sinks, hedgehog feature_dim 64 so F = 128, chunk 64)
with random weights: decode's time does not depend on their values. Beside
the times: the bytes a step must read (the weights plus the K/V cache of
that length, the same for both) over
the copy bandwidth measured in the same run. Writes decode_speed.json,
decode_speed.csv, report.md and decode_speed.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import flax.linen as nn  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from benchmarks.device_model import smollm2_config  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import speed  # pylint: disable=wrong-import-position
from orthros_jax.model import Transformer  # pylint: disable=wrong-import-position

LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
_FIELDS = ('variant', 'length', 'decode_steps', 'reps', 'decode_step_s',
           'decode_step_min_s', 'decode_step_max_s', 'decode_tokens_per_s',
           'bytes_per_step', 'frac_copy_bandwidth')


def copy_bandwidth(mib: int = 256, reps: int = 10) -> float:
  """Best bytes/s of x -> x + 1 on a donated float32 buffer (read + write)."""
  step = jax.jit(lambda x: x + 1, donate_argnums=0)
  x = jax.block_until_ready(step(jnp.zeros((mib * 2**20 // 4,), jnp.float32)))
  best = float('inf')
  for _ in range(reps):
    t0 = time.perf_counter()
    x = jax.block_until_ready(step(x))
    best = min(best, time.perf_counter() - t0)
  return 2 * x.nbytes / best


def step_bytes(config, params, n: int) -> int:
  """Bytes one decode step must read: every weight once (the tied
  embedding too, as the logits' matrix) and the K/V cache of n tokens (the
  same for dense and Orthros, whose decode leaves (S, z) alone)."""
  itemsize = jnp.dtype(config.dtype).itemsize
  weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  kv = 2 * n * config.num_kv_heads * config.head_dim * itemsize
  return int(weights + config.num_layers * kv)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--lengths', default=','.join(map(str, LENGTHS)),
                 help='cache lengths, comma separated')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--steps', type=int, default=0,
                 help='decode steps per timed call (0: the chunk size)')
  p.add_argument('--dtype', default='float32',
                 choices=('float32', 'bfloat16'))
  p.add_argument('--tiny', action='store_true',
                 help='a 2-layer stand-in (CPU dry runs, tests)')
  p.add_argument('--out', default='results/decode_speed')
  args = p.parse_args(argv)
  lengths = [int(x) for x in args.lengths.split(',') if x]
  if not lengths or min(lengths) < 1:
    p.error(f'--lengths={args.lengths!r}: positive integers expected')
  config = smollm2_config(tiny=args.tiny, sinks=4).replace(
      dtype=args.dtype, param_dtype=args.dtype)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  params = jax.jit(lambda key: Transformer(config).init(
      key, jnp.zeros((1, 8), jnp.int32), phase='forward')['params'])(
          jax.random.PRNGKey(0))
  params = nn.unbox(params)
  bandwidth = copy_bandwidth()
  print(f'copy bandwidth {bandwidth / 1e9:.1f} GB/s', flush=True)
  t0 = time.perf_counter()
  rows = speed.measure_decode(
      config, params, lengths, reps=args.reps, steps=args.steps or None,
      progress=lambda what: print(f'  compiling {what}', flush=True))
  for r in rows:
    r['bytes_per_step'] = step_bytes(config, params, r['length'])
    r['frac_copy_bandwidth'] = (r['bytes_per_step'] / r['decode_step_s']
                                / bandwidth)
  by = {(r['variant'], r['length']): r for r in rows}
  ratios = [{'length': n,
             'orthros_over_dense_tokens_per_s':
                 by['orthros', n]['decode_tokens_per_s']
                 / by['dense', n]['decode_tokens_per_s']} for n in lengths]
  info = dict(jax=jax.__version__, backend=jax.default_backend(),
              device_kind=jax.devices()[0].device_kind,
              cpu_count=os.cpu_count(), python=platform.python_version(),
              dtype=args.dtype, tiny=args.tiny,
              config=dict(num_layers=config.num_layers,
                          embed_dim=config.embed_dim,
                          num_heads=config.num_heads,
                          num_kv_heads=config.num_kv_heads,
                          head_dim=config.head_dim,
                          window=config.attention.window,
                          chunk_size=config.attention.chunk_size,
                          state_dim=config.attention.state_dim),
              copy_bytes_per_s=bandwidth,
              wall_s=time.perf_counter() - t0, command=sys.argv)
  (out / 'decode_speed.json').write_text(json.dumps(
      {'machine': info, 'rows': rows, 'ratios': ratios}, indent=1))
  with open(out / 'decode_speed.csv', 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=_FIELDS, extrasaction='ignore')
    w.writeheader()
    w.writerows(rows)
  lines = ['| cache length | dense tok/s (min-max) | Orthros tok/s (min-max)'
           ' | Orthros / dense | dense / Orthros fraction of copy bandwidth |',
           '|---:|---:|---:|---:|---:|']
  for n, ratio in zip(lengths, ratios):
    d, o = by['dense', n], by['orthros', n]
    rng = lambda r: (f"{r['decode_tokens_per_s']:.1f} "
                     f"({1 / r['decode_step_max_s']:.1f}-"
                     f"{1 / r['decode_step_min_s']:.1f})")
    lines.append(f"| {n} | {rng(d)} | {rng(o)} | "
                 f"{ratio['orthros_over_dense_tokens_per_s']:.3f}x | "
                 f"{d['frac_copy_bandwidth']:.2f} / "
                 f"{o['frac_copy_bandwidth']:.2f} |")
  table = '\n'.join(lines)
  (out / 'report.md').write_text(
      f'# Decode speed ({info["device_kind"]}, {args.dtype})\n\n'
      f'{rows[0]["decode_steps"]} steps per timed call, median of '
      f'{args.reps} interleaved calls; copy bandwidth '
      f'{bandwidth / 1e9:.1f} GB/s.\n\n{table}\n')
  print(table)
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return 0
  fig, ax = plt.subplots(figsize=(6, 4))
  for variant, style in (('dense', '-o'), ('orthros', '-s')):
    rs = [by[variant, n] for n in lengths]
    ax.errorbar(lengths, [r['decode_tokens_per_s'] for r in rs], yerr=np.array(
        [[r['decode_tokens_per_s'] - 1 / r['decode_step_max_s'] for r in rs],
         [1 / r['decode_step_min_s'] - r['decode_tokens_per_s'] for r in rs]]),
                fmt=style, label=variant, capsize=3)
  ax.set_xscale('log', base=2)
  ax.set_yscale('log')
  ax.set_xlabel('cache length (tokens)')
  ax.set_ylabel('decode tokens / s')
  ax.set_title('decode, batch 1')
  ax.grid(True, which='both', alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / 'decode_speed.png', dpi=120)
  plt.close(fig)
  return 0


if __name__ == '__main__':
  sys.exit(main())
