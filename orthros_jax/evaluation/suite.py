"""`run(config, out_dir)`: the evaluation suite eval.py runs.

The config is parsed once into a `SuitePlan` (evaluation/plan.py). Every
number is reported for each row of `plan.models` (default teacher,
orthros, linear), each stating its weights and attention (the rows are
defined in evaluation/variants.py: the teacher as loaded; the converted
weights with dense attention, window only, window plus sinks, Orthros with
and without sinks, pure linear; a separately converted pure-linear model).

Sections (each optional in the config):
  tasks       retrieval accuracy from greedy generation (evaluation/tasks/:
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
(niah_heatmap.png), speed.png and speed.csv (evaluation/report.py writes
them), and the stored retrieval cells (evaluation/cells.py). The rows come
from evaluation/loading.py (`load_models`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import tqdm

from orthros_jax.config import plain
from orthros_jax.data import get_tokenizer
from orthros_jax.data import make_dataset
from orthros_jax.evaluation import cells
from orthros_jax.evaluation import inference
from orthros_jax.evaluation import plan as plan_lib
from orthros_jax.evaluation import report
from orthros_jax.evaluation import retrieval
from orthros_jax.evaluation import speed as speed_lib
from orthros_jax.evaluation.loading import load_models


def run_tasks(models, tasks: Sequence[plan_lib.TaskSpec] | Mapping[str, Any],
              tokenizer, seed: int, progress: bool,
              out_dir: str | None = None) -> list[dict]:
  """Retrieval rows of every (task, length, depth) cell and model; `tasks`
  are TaskSpecs (or the config's tasks section, parsed here).

  With out_dir, every finished cell is appended to out_dir/cells.CELLS_FILE,
  keyed by the cell (task, length, depth, seed, options, budget) and the
  model's fingerprint (its config and the bytes of its params), with its
  per-example scores; a rerun reuses the stored cells and computes only
  the missing ones, so a killed evaluation resumes and adding a row or a
  length costs only that. A cell of n examples is also read from a stored
  cell of more (its first n examples: `cells.first_examples`), so a 30-example
  run of the baselines reuses the teacher's 100-example cells.
  """
  rows = []
  jobs = [(spec, length, depth, n)
          for spec in plan_lib.task_specs(tasks)
          for length, depth, n in spec.cells()]
  cells_path = os.path.join(out_dir, cells.CELLS_FILE) if out_dir else None
  stored = cells.read_cells(cells_path) if cells_path else {}
  leaf_cache: dict = {}
  prints = ({name: cells.model_fingerprint(c, p, leaf_cache)
             for name, (c, p, _) in models.items()} if cells_path else {})
  total = sum(n for *_, n in jobs) * len(models)
  with tqdm.tqdm(total=total, desc='retrieval', disable=not progress,
                 dynamic_ncols=True) as bar:
    for spec, length, depth, num in jobs:
      task, budget = spec.task, spec.max_new_tokens
      options = dict(spec.options)
      if depth is not None:
        options['depth'] = depth
      bar.set_postfix_str(f'{task} L={length}'
                          + ('' if depth is None else f' d={depth}'))
      keys = {name: cells.cell_key(task, length, depth, seed, options,
                                   budget, name, models[name][2],
                                   prints.get(name)) for name in models}
      done = {}
      for name, k in keys.items():
        row = cells.stored_row(stored.get(k, []), num)
        if row is not None:
          done[name] = row
      todo = {name: m for name, m in models.items() if name not in done}
      bar.update(num * len(done))
      result = {}
      if todo:
        result = retrieval.run_task(todo, task, tokenizer, length=length,
                                    num_examples=num, seed=seed,
                                    batch_size=cells.cell_batch(num),
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
          cells.append_cell(cells_path, {'key': keys[model], 'row': row})
  return rows


def run_quality(models, quality_cfg: Mapping[str, Any], tokenizer,
                progress: bool) -> dict:
  """{model: {'inference': scores, 'teacher_forced': scores}} on the
  batches of make_dataset(**quality_cfg) (one epoch unless it says)."""
  kwargs = dict(plain(quality_cfg))
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


def run_speed(models, spec: plan_lib.SpeedSpec | Mapping[str, Any],
              progress: bool) -> dict:
  if not isinstance(spec, plan_lib.SpeedSpec):
    spec = plan_lib.SpeedSpec.from_config(spec)
  if 'orthros' not in models:
    raise ValueError('the speed section needs the orthros model')
  config, params, _ = models['orthros']
  with tqdm.tqdm(total=len(spec.variants) * len(spec.lengths), desc='speed',
                 disable=not progress, dynamic_ncols=True) as bar:
    def tick(what):
      bar.set_postfix_str(what)
      bar.update(1)
    rows = speed_lib.measure(
        config, params, list(spec.lengths), variants=spec.variants,
        batch=spec.batch,
        decode_batch=spec.decode_batch, reps=spec.reps,
        decode_steps=spec.decode_steps or None, progress=tick)
  return {'rows': rows, 'ratios': speed_lib.ratios(rows)}


def run_lm_eval(models, spec: plan_lib.LmEvalSpec | Mapping[str, Any],
                tokenizer) -> dict:
  """{'results': {row: {task: {metric: value}}}, 'table': markdown} of
  lm-eval tasks on every row (plan.LmEvalSpec says what each field is)."""
  # lm-eval is an optional dependency: imported only when the section runs.
  from orthros_jax.evaluation import lm_harness  # pylint: disable=g-import-not-at-top
  if not isinstance(spec, plan_lib.LmEvalSpec):
    spec = plan_lib.LmEvalSpec.from_config(spec)
  res = lm_harness.run_tasks(
      models, spec.tasks, tokenizer, include_path=spec.include_path,
      num_fewshot=spec.fewshot(), limit=spec.limit or None,
      max_length=spec.max_length, batch_size=spec.batch_size,
      max_gen_toks=spec.max_gen_toks, seed=spec.seed)
  return {'results': res, 'table': lm_harness.table(res)}


def run(config, out_dir: str | os.PathLike) -> dict:
  """Runs the sections of `config` (an eval config or its SuitePlan) and
  writes the results to out_dir."""
  plan = plan_lib.check_config(config)  # every key checked before loading
  out_dir = os.path.abspath(os.fspath(out_dir))
  os.makedirs(out_dir, exist_ok=True)
  models, descriptions = load_models(plan)
  names = list(models)
  tokenizer = get_tokenizer(plan.tokenizer)
  vocab = min(c.vocab_size for c, _, _ in models.values())
  if tokenizer.vocab_size > vocab:
    raise ValueError(f'the tokenizer has {tokenizer.vocab_size} ids but the '
                     f'model only {vocab}: set tokenizer to the model\'s')
  results: dict[str, Any] = {
      'name': plan.name or os.path.basename(out_dir),
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
  if plan.tasks:
    rows = run_tasks(models, plan.tasks, tokenizer, plan.seed, plan.progress,
                     out_dir=out_dir)
    results['retrieval'] = rows
  quality = None
  if plan.quality:
    quality = run_quality(models, plan.quality, tokenizer, plan.progress)
    results['quality'] = quality
  if plan.speed:
    results['speed'] = run_speed(models, plan.speed, plan.progress)
  harness = None
  if plan.lm_eval and plan.lm_eval.tasks:
    harness = run_lm_eval(models, plan.lm_eval, tokenizer)
    results['lm_eval'] = harness
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1, default=str)

  summary, plots = report.write_report(out_dir, results, rows, quality,
                                       harness, names)
  results['summary_table'] = summary
  print(summary)
  print(f'report: {os.path.join(out_dir, "report.md")}; results: '
        f'{os.path.join(out_dir, "results.json")}; plots: '
        f'{", ".join(os.path.basename(p) for p in plots) or "none"}')
  return results
