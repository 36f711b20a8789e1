"""Compile time and XLA's peak memory, layers unrolled vs scanned (+ remat).

For each model shape and each layer setting, three programs are lowered
and compiled from abstract shapes (nothing is run, so no weights are
needed): the Orthros prefill of one prompt into an empty cache, one decode
step over a full cache, and the conversion's stage-2 training step (the
gradient of `conversion.stages.finetune_objective` with respect to the LoRA
adapters, r = 8 on q/k/v/o, the base frozen; split_mode 'random'). Compile
time is the wall time of lower + compile, median of `--reps` fresh
compilations (jax's caches cleared between them); memory is XLA's
`memory_analysis()` of the compiled program (arguments + outputs + temps -
aliased), the peak that program's buffers need on this backend.

  python benchmarks/scan_layers.py --out results/scan_layers

Shapes: 'smollm2' (SmolLM2-135M: 30 layers, d = 576, 9 / 3 heads of 64,
the recipe's Orthros attention, float32 as converted on CPU) and
'llama_1b' (configs/llama_1b.py, 16 layers, d = 2048, bfloat16 activations,
float32 params, with the same Orthros attention). Settings: unrolled
(the default), scan, scan + remat 'dots_no_batch', scan + remat 'full'.
--programs picks a subset (e.g. --programs decode). With --time_stage2 the
stage-2 step also runs (random weights and data,
`--train_batch` rows): its step time and tokens/s per setting.
Writes scan_layers.json, scan_layers.csv, report.md and scan_layers.png.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from orthros_jax.cache import init_cache  # pylint: disable=g-import-not-at-top
from orthros_jax.config import model_config_from  # pylint: disable=g-import-not-at-top
from orthros_jax.conversion import stages  # pylint: disable=g-import-not-at-top
from orthros_jax.conversion.lora import init_lora  # pylint: disable=g-import-not-at-top
from orthros_jax.model import Transformer  # pylint: disable=g-import-not-at-top

SETTINGS = {
    'unrolled': dict(scan_layers=False, remat='none'),
    'scan': dict(scan_layers=True, remat='none'),
    'scan_remat_dots': dict(scan_layers=True, remat='dots_no_batch'),
    'scan_remat_full': dict(scan_layers=True, remat='full'),
}
PROGRAMS = ('prefill', 'decode', 'stage2_step')
ATTENTION = dict(kind='orthros', feature_map='hedgehog', feature_dim=64,
                 window=64, chunk_size=64, exact_tail=1, window_init=0.1,
                 sinks=4)
_FIELDS = ('shape', 'setting', 'program', 'length', 'batch', 'compile_s',
           'compile_min_s', 'compile_max_s', 'memory_bytes', 'temp_bytes',
           'step_s', 'step_min_s', 'step_max_s', 'tokens_per_s')


def shape_config(name: str, tiny: bool = False):
  """The ModelConfig of a named shape with the recipe's Orthros attention."""
  if tiny:
    return model_config_from(dict(
        vocab_size=300, num_layers=3, embed_dim=32, num_heads=4,
        num_kv_heads=2, head_dim=8, mlp_dim=48, attention=dict(
            ATTENTION, feature_dim=4, window=8, chunk_size=8)))
  if name == 'smollm2':
    return model_config_from(dict(
        vocab_size=49152, num_layers=30, embed_dim=576, num_heads=9,
        num_kv_heads=3, head_dim=64, mlp_dim=1536, norm_eps=1e-5,
        rope_theta=1e5, tie_embeddings=True, attention=ATTENTION))
  if name == 'llama_1b':
    spec = importlib.util.spec_from_file_location(
        'llama_1b', ROOT / 'configs' / 'llama_1b.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = dict(module.get_config().model)
    model['attention'] = dict(model['attention'], **ATTENTION)
    return model_config_from(model)
  raise ValueError(f'unknown shape {name!r}: smollm2 or llama_1b')


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def programs(config, length: int, batch: int = 1) -> dict:
  """name -> (function, abstract arguments) of the three programs (`batch`
  rows of `length` tokens each)."""
  model = Transformer(config)
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  params = _abstract(nn.unbox(jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32),
                         phase='forward')['params'])))
  cache = _abstract(jax.eval_shape(
      lambda: init_cache(config, batch, length + 1)))

  def prefill(p, t, c):
    return model.apply({'params': p}, t, phase='prefill', cache=c,
                       check_overflow=False)

  def decode(p, t, c):
    return model.apply({'params': p}, t, phase='decode', cache=c,
                       check_overflow=False)

  lora = _abstract(jax.eval_shape(
      lambda p: init_lora(p, jax.random.PRNGKey(1), rank=8), params))
  objective = stages.finetune_objective(config, split_mode='random')
  batch_spec = {k: jax.ShapeDtypeStruct((batch, length), dtype) for k, dtype
                in (('inputs', jnp.int32), ('targets', jnp.int32),
                    ('weights', jnp.float32))}

  def stage2_step(lora_, base, b):
    loss = lambda l: objective({'base': base, 'lora': l}, b,
                               jax.random.PRNGKey(0))[0]
    return jax.value_and_grad(loss)(lora_)

  return {
      'prefill': (prefill, (params, tokens, cache)),
      'decode': (decode, (params, jax.ShapeDtypeStruct((batch, 1),
                                                       jnp.int32), cache)),
      'stage2_step': (stage2_step, (lora, params, batch_spec)),
  }


def compile_once(fn, args) -> tuple[float, object]:
  jax.clear_caches()
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return time.perf_counter() - t0, compiled


def concrete(args, seed: int = 0):
  """Random arrays for abstract arguments: normal floats (scaled small),
  token ids in [0, 256), weights 1 where the name says so."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(args)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = []
  for (path, x), key in zip(leaves, keys):
    if jnp.issubdtype(x.dtype, jnp.integer):
      out.append(jax.random.randint(key, x.shape, 0, 256, x.dtype))
    elif 'weights' in jax.tree_util.keystr(path):
      out.append(jnp.ones(x.shape, x.dtype))
    else:
      out.append(0.02 * jax.random.normal(key, x.shape, x.dtype))
  return jax.tree.unflatten(jax.tree.structure(args), out)


def memory(compiled) -> tuple[int | None, int | None]:
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None, None
  if m is None:
    return None, None
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes
          + m.temp_size_in_bytes - getattr(m, 'alias_size_in_bytes', 0))
  return int(peak), int(m.temp_size_in_bytes)


def measure(shape: str, settings, lengths: dict, reps: int, tiny: bool,
            progress=print, train_batch: int = 1,
            time_stage2: bool = False,
            which: tuple[str, ...] = PROGRAMS) -> list[dict]:
  """One row per (setting, program): compile times (median, min, max over
  `reps` interleaved rounds: each round compiles every setting once) and
  the compiled program's memory. time_stage2: the stage-2 step also runs
  on random weights and data, `reps` interleaved rounds after one warm-up
  call each (step_s median, min, max; tokens_per_s = tokens / step_s).
  which: the programs to measure (a subset of PROGRAMS)."""
  base = shape_config(shape, tiny)
  rows = []
  for program in which:
    length = lengths[program]
    batch = train_batch if program == 'stage2_step' else 1
    fns = {s: programs(base.replace(**SETTINGS[s]), length, batch)[program]
           for s in settings}
    times = {s: [] for s in settings}
    mem, compiled = {}, {}
    for r in range(reps):
      for s in settings:
        progress(f'{shape} {program} N={length} {s} ({r + 1}/{reps})')
        t, compiled[s] = compile_once(*fns[s])
        times[s].append(t)
        mem[s] = memory(compiled[s])
    run = {}
    if time_stage2 and program == 'stage2_step':
      args = {s: concrete(fns[s][1]) for s in settings}
      for s in settings:  # warm-up
        progress(f'{shape} {program} running {s} (warm-up)')
        jax.block_until_ready(compiled[s](*args[s]))
      run = {s: [] for s in settings}
      for r in range(reps):
        for s in settings:
          progress(f'{shape} {program} running {s} ({r + 1}/{reps})')
          t0 = time.perf_counter()
          jax.block_until_ready(compiled[s](*args[s]))
          run[s].append(time.perf_counter() - t0)
      del args
    del compiled
    for s in settings:
      row = dict(shape=shape, setting=s, program=program, length=length,
                 batch=batch, compile_s=float(np.median(times[s])),
                 compile_min_s=min(times[s]), compile_max_s=max(times[s]),
                 compile_times_s=times[s], memory_bytes=mem[s][0],
                 temp_bytes=mem[s][1], reps=reps)
      if s in run:
        step = float(np.median(run[s]))
        row.update(step_s=step, step_min_s=min(run[s]),
                   step_max_s=max(run[s]), step_times_s=run[s],
                   tokens_per_s=batch * length / step)
      rows.append(row)
  return rows


def table(rows) -> str:
  by = {(r['shape'], r['setting'], r['program']): r for r in rows}
  lines = ['| shape | program | tokens | setting | compile s (min-max) | '
           'x faster than unrolled | peak memory MiB | temp MiB |',
           '|---|---|---:|---|---:|---:|---:|---:|']
  timed = [r for r in rows if 'step_s' in r]
  for r in rows:
    ref = by.get((r['shape'], 'unrolled', r['program']))
    speedup = (f"{ref['compile_s'] / r['compile_s']:.1f}x" if ref else '')
    mib = lambda b: '' if b is None else f'{b / 2**20:.1f}'
    lines.append(
        f"| {r['shape']} | {r['program']} | {r['length']} | {r['setting']} "
        f"| {r['compile_s']:.1f} ({r['compile_min_s']:.1f}-"
        f"{r['compile_max_s']:.1f}) | {speedup} | {mib(r['memory_bytes'])} | "
        f"{mib(r['temp_bytes'])} |")
  if timed:
    lines += ['', '| shape | stage-2 step, tokens | setting | step s '
              '(min-max) | tokens/s | x unrolled |', '|---|---|---|---:|'
              '---:|---:|']
    for r in timed:
      ref = by.get((r['shape'], 'unrolled', r['program']))
      ratio = (f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x"
               if ref and 'tokens_per_s' in ref else '')
      lines.append(
          f"| {r['shape']} | {r['batch']} x {r['length']} | {r['setting']} "
          f"| {r['step_s']:.2f} ({r['step_min_s']:.2f}-{r['step_max_s']:.2f})"
          f" | {r['tokens_per_s']:.1f} | {ratio} |")
  return '\n'.join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shapes', default='smollm2,llama_1b')
  p.add_argument('--settings', default=','.join(SETTINGS))
  p.add_argument('--prefill_len', type=int, default=4096)
  p.add_argument('--decode_len', type=int, default=4096,
                 help='cache length of the decode step')
  p.add_argument('--train_len', type=int, default=4096,
                 help='tokens of the stage-2 step (batch 1)')
  p.add_argument('--train_batch', type=int, default=1,
                 help='rows of the stage-2 step')
  p.add_argument('--time_stage2', action='store_true',
                 help='also run the stage-2 step on random data and report '
                 'its time and tokens/s')
  p.add_argument('--programs', default=','.join(PROGRAMS),
                 help=f'a subset of {",".join(PROGRAMS)}')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--tiny', action='store_true',
                 help='a 3-layer stand-in (CPU dry runs, tests)')
  p.add_argument('--out', default='results/scan_layers')
  args = p.parse_args(argv)
  settings = [s for s in args.settings.split(',') if s]
  bad = sorted(set(settings) - set(SETTINGS))
  if bad or not settings:
    p.error(f'--settings: unknown {bad}; choose from {list(SETTINGS)}')
  which = tuple(dict.fromkeys(s for s in args.programs.split(',') if s))
  bad = sorted(set(which) - set(PROGRAMS))
  if bad or not which:
    p.error(f'--programs: unknown {bad}; choose from {list(PROGRAMS)}')
  if args.time_stage2 and 'stage2_step' not in which:
    p.error('--time_stage2 needs stage2_step in --programs')
  shapes = [s for s in args.shapes.split(',') if s]
  for s in shapes:
    shape_config(s)  # unknown names fail before any compilation
  if min(args.prefill_len, args.decode_len, args.train_len, args.reps,
         args.train_batch) < 1:
    p.error('lengths and --reps must be >= 1')
  lengths = {'prefill': args.prefill_len, 'decode': args.decode_len,
             'stage2_step': args.train_len}
  # Every compilation really compiles: no persistent cache (the tests set
  # one through JAX_COMPILATION_CACHE_DIR), and jax's in-memory caches are
  # cleared before each (compile_once).
  jax.config.update('jax_enable_compilation_cache', False)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  rows = []
  for shape in shapes:
    rows += measure(shape, settings, lengths, args.reps, args.tiny,
                    progress=lambda m: print(f'  {m}', flush=True),
                    train_batch=args.train_batch,
                    time_stage2=args.time_stage2, which=which)
  info = dict(jax=jax.__version__, backend=jax.default_backend(),
              device_kind=jax.devices()[0].device_kind,
              cpu_count=os.cpu_count(), python=platform.python_version(),
              tiny=args.tiny, lengths=lengths, programs=list(which),
              settings={
                  s: SETTINGS[s] for s in settings},
              wall_s=time.perf_counter() - t0, command=sys.argv)
  (out / 'scan_layers.json').write_text(json.dumps(
      {'machine': info, 'rows': rows}, indent=1))
  with open(out / 'scan_layers.csv', 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=_FIELDS, extrasaction='ignore')
    w.writeheader()
    w.writerows(rows)
  text = table(rows)
  (out / 'report.md').write_text(
      f'# Compile time and peak memory ({info["device_kind"]})\n\n'
      f'Median of {args.reps} compilations each; memory from XLA\'s '
      f'memory_analysis().\n\n{text}\n')
  print(text)
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return 0
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  labels = [f"{r['shape']}\n{r['program']}" for r in rows
            if r['setting'] == settings[0]]
  x = np.arange(len(labels))
  width = 0.8 / len(settings)
  for i, s in enumerate(settings):
    rs = [r for r in rows if r['setting'] == s]
    axes[0].bar(x + i * width, [r['compile_s'] for r in rs], width, label=s)
    axes[1].bar(x + i * width, [(r['memory_bytes'] or 0) / 2**20 for r in rs],
                width, label=s)
  for ax, title in zip(axes, ('compile time (s)', 'peak memory (MiB)')):
    ax.set_xticks(x + width * (len(settings) - 1) / 2)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale('log')
    ax.set_title(title)
    ax.grid(True, axis='y', alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'scan_layers.png', dpi=120)
  plt.close(fig)
  return 0


if __name__ == '__main__':
  sys.exit(main())
