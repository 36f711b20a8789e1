"""`run(config, out_dir)`: the evaluation suite eval.py runs.

Every number is reported for each row of `config.models` (default teacher,
orthros, linear), each stating its weights and attention (the rows are
defined in evaluation/variants.py: the teacher as loaded; the converted
weights with dense attention, window only, window plus sinks, Orthros with
and without sinks, pure linear; a separately converted pure-linear model).

Sections (each optional in the config):
  tasks       retrieval accuracy from greedy generation (evaluation/tasks.py:
              passkey, niah, RULER's niah_*/variable_tracking/common_words/
              frequent_words, mqar) over lengths (and depths), Wilson 95%
  quality     held-out loss and perplexity through the inference path
              (prefill a prefix, decode the continuation), and teacher-forced
              (the whole text through one prefill) for comparison
  speed       time to first token and decode tokens/s vs prompt length for
              dense / Orthros / no attention on this machine
  lm_eval     named lm-evaluation-harness tasks on every row
              (evaluation/lm_harness.py: loglikelihood through the
              inference path, generate_until through `generate`); needs the
              `lm-eval` package and the tasks' datasets (or a local task
              directory, `include_path`)
Outputs in out_dir: results.json, report.md, retrieval.png, heatmaps
(niah_heatmap.png), speed.png and speed.csv.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tqdm

from orthros_jax.config import ModelConfig
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.data import get_tokenizer
from orthros_jax.data import make_dataset
from orthros_jax.evaluation import inference
from orthros_jax.evaluation import retrieval
from orthros_jax.evaluation import speed as speed_lib
from orthros_jax.evaluation import variants
from orthros_jax.checkpoints import hf as hf_lib
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.config import model_config_from
from orthros_jax.config import plain as _plain

MODELS = variants.ROWS


def load_checkpoint(path: str, step: int | None = None
                    ) -> tuple[ModelConfig, dict, int]:
  """(model config, params, step) of a checkpoint of train.py /
  convert.py: a convert.py workdir (its orthros/ checkpoint), a train.py
  workdir, a params checkpoint (assets/tiny_teacher) or a checkpoints
  directory."""
  converted = os.path.join(os.fspath(path), 'orthros')
  if os.path.isdir(os.path.join(converted, 'checkpoints')):
    path = converted
  params, config, step = ckpt_lib.load_params(path, step)
  return model_config_from(config), params, step


def load_dense(path: str) -> tuple[ModelConfig, dict, str]:
  """(config, params, description) of a dense model: a local Hugging Face
  directory (config.json + safetensors, e.g. `make smollm2`'s export) or a
  train.py checkpoint."""
  path_ = os.fspath(path)
  if any(os.path.isfile(os.path.join(path_, name)) for name in (
      hf_lib.WEIGHTS_FILE, hf_lib.WEIGHTS_INDEX_FILE)):
    config, params = hf_lib.load_hf(path)
    where = f'{path} (Hugging Face directory)'
  else:
    config, params, step = load_checkpoint(path)
    where = f'{path} (step {step})'
  if config.is_orthros:
    raise ValueError(f'teacher {path} is not a dense model')
  return config, params, where


def load_models(config) -> tuple[dict, dict]:
  """({name: (config, params, path)}, descriptions) of config.models, in
  the order of variants.ROWS (evaluation/variants.py says what each is)."""
  if not config.get('checkpoint'):
    raise ValueError('set checkpoint: an Orthros checkpoint (a convert.py '
                     'workdir or its orthros/ directory, or an adapter '
                     'directory applied to teacher=)')
  teacher_model = None
  if adapter_lib.is_adapter(config.checkpoint):
    if not config.get('teacher'):
      raise ValueError(f'checkpoint {config.checkpoint} is an adapter: set '
                       'teacher= to the dense model it applies to')
    teacher_model = load_dense(config.teacher)
    student, params = adapter_lib.apply_adapter(
        config.checkpoint, teacher_model[0], teacher_model[1])
    where = f'{config.checkpoint} (adapter on {config.teacher})'
  else:
    student, params, step = load_checkpoint(config.checkpoint)
    where = f'{config.checkpoint} (step {step})'
  if not student.is_orthros:
    raise ValueError(f'checkpoint {config.checkpoint} is a dense model; '
                     'eval.py needs an Orthros checkpoint (convert.py makes '
                     'one) to report its baselines')
  tail = config.get('exact_tail')
  if tail is not None and int(tail) >= 0:
    # An inference setting (how many prompt tokens decode exactly), the same
    # for every row on the converted weights; -1 / None: as converted.
    student = student.replace(attention={'exact_tail': int(tail)})
  names = tuple(config.get('models') or ('teacher', 'orthros', 'linear'))
  unknown = sorted(set(names) - set(MODELS))
  if unknown:
    raise ValueError(f'models {unknown} are unknown: expected a subset of '
                     f'{MODELS}')
  models, desc = {}, {}
  if 'teacher' in names:
    if not config.get('teacher'):
      raise ValueError("the 'teacher' row needs teacher= (the dense model "
                       'as loaded: a Hugging Face directory or a train.py '
                       "checkpoint); the 'dense' row is the converted "
                       'weights with dense attention')
    teacher, t_params, t_where = teacher_model or load_dense(config.teacher)
    models['teacher'] = (teacher, t_params, 'inference')
    desc['teacher'] = f'{t_where}: the teacher as loaded, dense attention'
  rows, rows_desc = variants.converted_rows(
      student, params, [n for n in names if n not in ('teacher',
                                                       'linear_trained')],
      sinks=int(config.get('sinks') or 4), where=where)
  models.update(rows)
  desc.update(rows_desc)
  if 'linear_trained' in names:
    path = config.get('linear_checkpoint')
    if not path:
      raise ValueError("the 'linear_trained' row needs linear_checkpoint= (a "
                       'convert.py workdir of the pure-linear recipe)')
    lin, lin_params, lin_step = load_checkpoint(path)
    if lin.attention.window or lin.attention.sinks:
      raise ValueError(f'linear_checkpoint {path} has window '
                       f'{lin.attention.window} and sinks '
                       f'{lin.attention.sinks}: expected a pure-linear '
                       'conversion (window 0, no sinks)')
    models['linear_trained'] = (inference.pure_linear(lin), lin_params,
                                'prefill')
    desc['linear_trained'] = (f'{path} (step {lin_step}): its own weights, '
                              'converted with window 0 (the trained floor), '
                              'every token through the linear prefill')
  order = [n for n in MODELS if n in models]
  return ({n: models[n] for n in order}, {n: desc[n] for n in order})


# ------------------------------------------------------------- sections


CELLS_FILE = 'retrieval_cells.jsonl'


def model_fingerprint(config: ModelConfig, params, _cache=None) -> str:
  """sha256 (16 hex digits) of a row's config and every param's bytes: what
  a stored result was computed with. _cache (id -> digest) spares leaves
  that several rows share."""
  digest = hashlib.sha256(json.dumps(dataclasses.asdict(config),
                                     sort_keys=True).encode())
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = id(leaf)
    if _cache is None or key not in _cache:
      arr = np.ascontiguousarray(np.asarray(leaf))
      leaf_digest = hashlib.sha256(arr.tobytes()).hexdigest() + str(
          arr.dtype) + str(arr.shape)
      if _cache is not None:
        _cache[key] = leaf_digest
    else:
      leaf_digest = _cache[key]
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(leaf_digest.encode())
  return digest.hexdigest()[:16]


def _read_cells(path: str) -> dict[str, list[dict]]:
  """Stored retrieval cells {key: [rows]} (a key leaves the example count
  out: rows of several counts may share it); a torn last line (a killed
  run) is skipped."""
  cells: dict[str, list[dict]] = {}
  if os.path.isfile(path):
    with open(path) as f:
      for line in f:
        try:
          entry = json.loads(line)
          cells.setdefault(entry['key'], []).append(entry['row'])
        except (ValueError, KeyError, TypeError, AttributeError):
          continue
  return cells


def _append_cell(path: str, entry: dict) -> None:
  """Appends one JSON line, on a line of its own even after a torn one (a
  run killed mid-write leaves no newline)."""
  with open(path, 'a+b') as f:
    f.seek(0, os.SEEK_END)
    if f.tell():
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b'\n':
        f.write(b'\n')
    f.write((json.dumps(entry, default=str) + '\n').encode())
    f.flush()
    os.fsync(f.fileno())


def first_examples(row: dict, num: int) -> dict:
  """The row of a cell's first `num` examples, from a stored row of at
  least as many with per-example scores. Example i of a cell is built from
  (seed, i) alone (tasks.make_examples), so these are exactly the examples
  a cell of `num` would hold."""
  scores = row['scores'][:num]
  if len(scores) != num:
    raise ValueError(f'a stored cell of {len(row["scores"])} examples cannot '
                     f'give {num}')
  full = sum(x >= 1.0 for x in scores)
  lo, hi = inference.wilson_interval(round(sum(scores)), num)
  return dict(row, accuracy=float(np.mean(scores)), exact=full / num, n=num,
              ci95=[lo, hi],
              exact_ci95=list(inference.wilson_interval(full, num)),
              scores=list(scores), samples=row['samples'][:num])


def _stored_row(rows: list[dict], num: int) -> dict | None:
  """A stored row of exactly `num` examples, else one derived from the
  smallest stored row with more (and per-example scores); None if none."""
  for row in rows:
    if row.get('n') == num:
      return row
  larger = [r for r in rows if r.get('n', 0) > num and 'scores' in r]
  if larger:
    return first_examples(min(larger, key=lambda r: r['n']), num)
  return None


def cell_batch(num: int, most: int = 8) -> int:
  """The batch size for a cell of `num` examples: at most `most` prompts,
  split as evenly as possible (20 -> 7 + 7 + 6, not 8 + 8 + 4 padded to 8),
  so padding rows (repeats of the last prompt) cost at most one per batch."""
  batches = -(-num // most)
  return -(-num // batches)


def run_tasks(models, tasks_cfg: Mapping[str, Any], tokenizer, seed: int,
              progress: bool, out_dir: str | None = None) -> list[dict]:
  """Retrieval rows of every (task, length, depth) cell and model.

  With out_dir, every finished cell is appended to out_dir/CELLS_FILE,
  keyed by the cell (task, length, depth, seed, options, budget) and the
  model's fingerprint (its config and the bytes of its params), with its
  per-example scores; a rerun reuses the stored cells and computes only
  the missing ones, so a killed evaluation resumes and adding a row or a
  length costs only that. A cell of n examples is also read from a stored
  cell of more (its first n examples: `first_examples`), so a 30-example
  run of the baselines reuses the teacher's 100-example cells.
  """
  rows = []
  jobs = []
  for task, spec in tasks_cfg.items():
    spec = dict(spec)
    lengths = list(spec.pop('lengths'))
    depths = list(spec.pop('depths', [None]))
    # num_examples: one count, or one per length (per depth within it).
    num = spec.pop('num_examples', 20)
    nums = ([int(n) for n in num] if isinstance(num, (list, tuple))
            else [int(num)] * len(lengths))
    if len(nums) != len(lengths):
      raise ValueError(f'tasks.{task}.num_examples={num!r}: give one count '
                       f'or one per length ({len(lengths)})')
    for length, n in zip(lengths, nums):
      for depth in depths:
        jobs.append((task, length, depth, n, spec))
  cells_path = os.path.join(out_dir, CELLS_FILE) if out_dir else None
  stored = _read_cells(cells_path) if cells_path else {}
  leaf_cache: dict = {}
  prints = ({name: model_fingerprint(c, p, leaf_cache)
             for name, (c, p, _) in models.items()} if cells_path else {})
  total = sum(j[3] for j in jobs) * len(models)
  with tqdm.tqdm(total=total, desc='retrieval', disable=not progress,
                 dynamic_ncols=True) as bar:
    for task, length, depth, num, spec in jobs:
      options = dict(spec)
      budget = options.pop('max_new_tokens', None)
      if depth is not None:
        options['depth'] = depth
      bar.set_postfix_str(f'{task} L={length}'
                          + ('' if depth is None else f' d={depth}'))
      keys = {name: hashlib.sha256(json.dumps(
          [task, length, depth, seed, options, budget, name,
           models[name][2], prints.get(name)], sort_keys=True,
          default=str).encode()).hexdigest() for name in models}
      done = {}
      for name, k in keys.items():
        row = _stored_row(stored.get(k, []), num)
        if row is not None:
          done[name] = row
      todo = {name: m for name, m in models.items() if name not in done}
      bar.update(num * len(done))
      result = {}
      if todo:
        result = retrieval.run_task(todo, task, tokenizer, length=length,
                                    num_examples=num, seed=seed,
                                    batch_size=cell_batch(num),
                                    options=options,
                                    max_new_tokens=budget,
                                    progress=bar.update)
      for model in models:
        if model in done:
          rows.append(done[model])
          continue
        row = dict(result[model], model=model, task=task, length=length,
                   depth=depth)
        rows.append(row)
        if cells_path:
          _append_cell(cells_path, {'key': keys[model], 'row': row})
  return rows


def run_quality(models, quality_cfg: Mapping[str, Any], tokenizer,
                progress: bool) -> dict:
  """{model: {'inference': scores, 'teacher_forced': scores}}."""
  kwargs = dict(_plain(quality_cfg))
  kwargs.setdefault('num_epochs', 1)
  batches = list(make_dataset(tokenizer=tokenizer, **kwargs))
  out = {}
  with tqdm.tqdm(total=2 * len(models) * len(batches), desc='quality',
                 disable=not progress, dynamic_ncols=True) as bar:
    for name, (config, params, route) in models.items():
      tf_route = 'prefill' if config.is_orthros else 'inference'
      res = {}
      for label, how in (('inference', route), ('teacher_forced', tf_route)):
        s = inference.score(config, params, batches, route=how,
                            progress=bar.update)
        s['perplexity'] = math.exp(s['loss'])
        s['route'] = how
        res[label] = s
      out[name] = res
  return out


def run_speed(models, speed_cfg: Mapping[str, Any], progress: bool) -> dict:
  cfg = dict(_plain(speed_cfg))
  if 'orthros' not in models:
    raise ValueError('the speed section needs the orthros model')
  config, params, _ = models['orthros']
  with tqdm.tqdm(total=3 * len(cfg['lengths']), desc='speed',
                 disable=not progress, dynamic_ncols=True) as bar:
    def tick(what):
      bar.set_postfix_str(what)
      bar.update(1)
    rows = speed_lib.measure(
        config, params, [int(n) for n in cfg['lengths']],
        batch=int(cfg.get('batch', 1)),
        decode_batch=int(cfg.get('decode_batch', 1)),
        reps=int(cfg.get('reps', 3)), progress=tick)
  return {'rows': rows, 'ratios': speed_lib.ratios(rows)}


LM_EVAL_KEYS = ('tasks', 'include_path', 'num_fewshot', 'limit', 'max_length',
                'batch_size', 'max_gen_toks', 'seed')


def check_lm_eval_config(cfg: Mapping[str, Any]) -> dict:
  """The lm_eval section as a plain dict; unknown keys are an error
  (checked before any section runs)."""
  cfg = _plain(cfg)
  unknown = sorted(set(cfg) - set(LM_EVAL_KEYS))
  if unknown:
    raise ValueError(f'lm_eval: unknown keys {unknown}')
  return cfg


def run_lm_eval(models, cfg: Mapping[str, Any], tokenizer) -> dict:
  """{'results': {row: {task: {metric: value}}}, 'table': markdown} of
  lm-eval tasks on every row (cfg: tasks,
  include_path, num_fewshot (< 0: each task's default), limit (0: all),
  max_length, batch_size, max_gen_toks, seed)."""
  # lm-eval is an optional dependency: imported only when the section runs.
  from orthros_jax.evaluation import lm_harness  # pylint: disable=g-import-not-at-top
  cfg = check_lm_eval_config(cfg)
  shots = cfg.get('num_fewshot', -1)
  if isinstance(shots, Mapping):
    shots = {t: int(n) for t, n in shots.items() if int(n) >= 0}
  else:
    shots = None if shots is None or int(shots) < 0 else int(shots)
  res = lm_harness.run_tasks(
      models, tuple(cfg['tasks']), tokenizer,
      include_path=cfg.get('include_path') or '',
      num_fewshot=shots,
      limit=int(cfg.get('limit') or 0) or None,
      max_length=int(cfg.get('max_length', 2048)),
      batch_size=int(cfg.get('batch_size', 1)),
      max_gen_toks=int(cfg.get('max_gen_toks', 256)),
      seed=int(cfg.get('seed', 1234)))
  return {'results': res, 'table': lm_harness.table(res)}


# -------------------------------------------------------------- report


def retrieval_table(rows: list[dict], models: list[str]) -> str:
  """Accuracy % per task and length (averaged over depths), per model."""
  keys = sorted({(r['task'], r['length']) for r in rows})
  lines = ['| task | length | ' + ' | '.join(models) + ' |',
           '|---|---|' + '---|' * len(models)]
  for task, length in keys:
    cells = []
    for m in models:
      rs = [r for r in rows if r['task'] == task and r['length'] == length
            and r['model'] == m]
      if not rs:
        cells.append('-')
        continue
      n = sum(r['n'] for r in rs)
      acc = sum(r['accuracy'] * r['n'] for r in rs) / n
      lo, hi = inference.wilson_interval(round(acc * n), n)
      cells.append(f'{100 * acc:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]')
    lines.append(f'| {task} | {length} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def summary_table(rows: list[dict], quality: dict | None,
                  models: list[str]) -> str:
  """The three-way table: each task at its longest length, and perplexity."""
  lines = ['| metric | ' + ' | '.join(models) + ' |',
           '|---|' + '---|' * len(models)]
  for task in sorted({r['task'] for r in rows}):
    longest = max(r['length'] for r in rows if r['task'] == task)
    cells = []
    for m in models:
      rs = [r for r in rows if r['task'] == task and r['length'] == longest
            and r['model'] == m]
      n = sum(r['n'] for r in rs)
      cells.append(f"{100 * sum(r['accuracy'] * r['n'] for r in rs) / n:.1f}"
                   if n else '-')
    lines.append(f'| {task} @ {longest} tokens (accuracy %) | '
                 + ' | '.join(cells) + ' |')
  if quality:
    lines.append('| perplexity, inference path | ' + ' | '.join(
        f"{quality[m]['inference']['perplexity']:.3f}" if m in quality
        else '-' for m in models) + ' |')
    lines.append('| perplexity, teacher-forced prefill | ' + ' | '.join(
        f"{quality[m]['teacher_forced']['perplexity']:.3f}" if m in quality
        else '-' for m in models) + ' |')
  return '\n'.join(lines)


def speed_table(speed: dict) -> str:
  lines = ['| length | dense TTFT ms | Orthros TTFT ms | no-attention TTFT ms '
           '| dense / Orthros | dense decode tok/s | Orthros decode tok/s |',
           '|---|---|---|---|---|---|---|']
  by = {(r['variant'], r['length']): r for r in speed['rows']}
  for ratio in speed['ratios']:
    n = ratio['length']
    d, o, z = (by.get((v, n)) for v in speed_lib.VARIANTS)
    f = lambda r, k, s=1e3: f'{r[k] * s:.1f}' if r else '-'
    lines.append(
        f"| {n} | {f(d, 'ttft_s')} | {f(o, 'ttft_s')} | {f(z, 'ttft_s')} | "
        + (f"{ratio['dense_over_orthros_ttft']:.2f}x"
           if ratio['dense_over_orthros_ttft'] else '-')
        + f" | {f(d, 'decode_tokens_per_s', 1)} | "
          f"{f(o, 'decode_tokens_per_s', 1)} |")
  return '\n'.join(lines)


def _quality_plot(out_dir: str, quality: dict) -> list[str]:
  """Perplexity per model: inference path and teacher-forced prefill."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []
  names = list(quality)
  x = np.arange(len(names))
  fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2.5, 3.5))
  for i, label in enumerate(('inference', 'teacher_forced')):
    ppl = [quality[m][label]['perplexity'] for m in names]
    ax.bar(x + (i - 0.5) * 0.38, ppl, 0.38, label=label.replace('_', '-'))
  ax.set_xticks(x, names, rotation=20)
  ax.set_ylabel('perplexity (log scale)')
  ax.set_yscale('log')
  ax.legend()
  ax.grid(alpha=0.3, axis='y')
  fig.tight_layout()
  path = os.path.join(out_dir, 'quality.png')
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]


def _plots(out_dir: str, rows: list[dict], models: list[str]) -> list[str]:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []
  written = []
  tasks = sorted({r['task'] for r in rows})
  if tasks:
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.5),
                             squeeze=False)
    for ax, task in zip(axes[0], tasks):
      for m in models:
        lengths = sorted({r['length'] for r in rows if r['task'] == task})
        acc = []
        for n in lengths:
          rs = [r for r in rows if r['task'] == task and r['length'] == n
                and r['model'] == m]
          acc.append(100 * sum(r['accuracy'] * r['n'] for r in rs)
                     / max(sum(r['n'] for r in rs), 1))
        ax.plot(lengths, acc, '-o', label=m)
      ax.set_title(task)
      ax.set_xlabel('length (tokens)')
      ax.set_ylabel('accuracy %')
      ax.set_ylim(-5, 105)
      ax.grid(alpha=0.3)
      ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, 'retrieval.png')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  for task in tasks:
    depth_rows = [r for r in rows if r['task'] == task
                  and r['depth'] is not None]
    if not depth_rows:
      continue
    lengths = sorted({r['length'] for r in depth_rows})
    depths = sorted({r['depth'] for r in depth_rows})
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.2),
                             squeeze=False)
    for ax, m in zip(axes[0], models):
      grid = np.full((len(depths), len(lengths)), np.nan)
      for r in depth_rows:
        if r['model'] == m:
          grid[depths.index(r['depth']), lengths.index(r['length'])] = (
              100 * r['accuracy'])
      im = ax.imshow(grid, vmin=0, vmax=100, cmap='RdYlGn', aspect='auto',
                     origin='upper')
      ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
      ax.set_yticks(range(len(depths)), [f'{100 * d:.0f}%' for d in depths])
      ax.set_xlabel('length (tokens)')
      ax.set_ylabel('depth')
      ax.set_title(f'{task}: {m}')
      for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
          ax.text(j, i, f'{v:.0f}', ha='center', va='center', fontsize=7)
    fig.subplots_adjust(wspace=0.45, bottom=0.2, right=0.85)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    path = os.path.join(out_dir, f'{task}_heatmap.png')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


def run(config, out_dir: str | os.PathLike) -> dict:
  """Runs the sections of `config` and writes the results to out_dir."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  os.makedirs(out_dir, exist_ok=True)
  progress = bool(config.get('progress', True))
  if config.get('lm_eval'):
    check_lm_eval_config(config.lm_eval)  # before any expensive section
  models, descriptions = load_models(config)
  names = list(models)
  tokenizer = get_tokenizer(config.get('tokenizer', 'byte'))
  vocab = min(c.vocab_size for c, _, _ in models.values())
  if tokenizer.vocab_size > vocab:
    raise ValueError(f'the tokenizer has {tokenizer.vocab_size} ids but the '
                     f'model only {vocab}: set tokenizer to the model\'s')
  results: dict[str, Any] = {
      'name': config.get('name', os.path.basename(out_dir)),
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(),
      'machine': {'backend': jax.default_backend(),
                  'devices': [str(d) for d in jax.devices()],
                  'jax': jax.__version__, 'python': platform.python_version(),
                  'cpu_count': os.cpu_count()},
      'models': descriptions,
      'model_config': dataclasses.asdict(models[names[-1]][0]
                                         if 'orthros' not in models
                                         else models['orthros'][0]),
  }
  rows: list[dict] = []
  if config.get('tasks'):
    rows = run_tasks(models, _plain(config.tasks), tokenizer,
                     int(config.get('seed', 0)), progress, out_dir=out_dir)
    results['retrieval'] = rows
  quality = None
  if config.get('quality'):
    quality = run_quality(models, config.quality, tokenizer, progress)
    results['quality'] = quality
  if config.get('speed'):
    results['speed'] = run_speed(models, config.speed, progress)
  harness = None
  if config.get('lm_eval') and config.lm_eval.get('tasks'):
    harness = run_lm_eval(models, config.lm_eval, tokenizer)
    results['lm_eval'] = harness
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1, default=str)

  md = [f"# Evaluation: {results['name']}", '',
        f"{results['date']}; backend {results['machine']['backend']}, jax "
        f"{results['machine']['jax']}", '', '## Models', '']
  md += [f'- **{k}**: {v}' for k, v in descriptions.items()]
  summary = ''
  if rows or quality:
    summary = summary_table(rows, quality, names)
    md += ['', '## Summary (each row\'s weights and attention: Models above)', '', summary]
  if rows:
    md += ['', '## Retrieval accuracy % (greedy; mean over depths; Wilson '
           '95% interval; multi-answer tasks score the fraction of answers '
           'found)', '',
           retrieval_table(rows, names)]
  if quality:
    md += ['', '## Quality', '', '| model | inference-path loss | '
           'inference-path ppl | teacher-forced ppl | tokens |',
           '|---|---|---|---|---|']
    for m, q in quality.items():
      md.append(f"| {m} | {q['inference']['loss']:.4f} | "
                f"{q['inference']['perplexity']:.3f} | "
                f"{q['teacher_forced']['perplexity']:.3f} | "
                f"{int(q['inference']['tokens'])} |")
  if config.get('speed'):
    sp = results['speed']
    md += ['', '## Speed (this machine, same model shape)', '',
           speed_table(sp)]
    with open(os.path.join(out_dir, 'speed.csv'), 'w', newline='') as f:
      w = csv.DictWriter(f, fieldnames=list(sp['rows'][0]))
      w.writeheader()
      w.writerows(sp['rows'])
    plot = speed_lib.plot(sp['rows'], os.path.join(out_dir, 'speed.png'))
    if plot:
      md += ['', '![speed](speed.png)']
  if harness:
    md += ['', '## lm-evaluation-harness (zero-shot unless num_fewshot; '
           'each column a row of Models above)', '', harness['table']]
  plots = _plots(out_dir, rows, names)
  if quality:
    plots += _quality_plot(out_dir, quality)
  md += [''] + [f'![{os.path.basename(p)}]({os.path.basename(p)})'
                for p in plots]
  with open(os.path.join(out_dir, 'report.md'), 'w') as f:
    f.write('\n'.join(md) + '\n')
  results['summary_table'] = summary
  print(summary)
  print(f'report: {os.path.join(out_dir, "report.md")}; results: '
        f'{os.path.join(out_dir, "results.json")}; plots: '
        f'{", ".join(os.path.basename(p) for p in plots) or "none"}')
  return results
