"""An evaluation config parsed once, into typed values: `check_config`.

eval.py hands its ml_collections config to `check_config`, which checks
every key (and the values it can without loading: counts, lengths, rows,
task names) before any model loads and returns a frozen `SuitePlan`; task
options are checked by each task's generator when its cell runs; the suite (evaluation/suite.py) and the row loader
(evaluation/loading.py) read only the plan. The config's fields
(configs/eval_tiny.py, configs/eval_smollm2.py):

  checkpoint         an Orthros checkpoint (convert.py workdir) or adapter
  teacher            the dense model as loaded (also an adapter's base)
  tokenizer          'byte' or a tokenizer.json / Hugging Face directory
  models             the rows (evaluation/variants.py ROWS)
  sinks              sink tokens of the window_sinks / orthros rows
  exact_tail         prompt tokens decoded exactly; -1: as converted
  linear_checkpoint  the trained pure-linear conversion (linear_trained)
  seed, progress, name
  tasks              {task: TaskSpec fields and the task's own options}
  quality            make_dataset arguments of the held-out text
  speed              SpeedSpec fields
  lm_eval            LmEvalSpec fields (lm-evaluation-harness tasks)

An empty section is skipped.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from orthros_jax.config import plain
from orthros_jax.data import pipeline as data_pipeline
from orthros_jax.evaluation import tasks as tasks_lib
from orthros_jax.evaluation import variants

DEFAULT_ROWS = ('teacher', 'orthros', 'linear')
# The quality section's keys: make_dataset's arguments (the tokenizer is the
# config's own).
_DATASET_KEYS = set(inspect.signature(data_pipeline.make_dataset).parameters
                    ) - {'tokenizer'}
_TOP_KEYS = {'name', 'checkpoint', 'teacher', 'tokenizer', 'models', 'sinks',
             'exact_tail', 'linear_checkpoint', 'seed', 'progress', 'tasks',
             'quality', 'speed', 'lm_eval'}


def _fields(cls) -> set[str]:
  return {f.name for f in dataclasses.fields(cls)}


def _check_keys(cfg: Mapping[str, Any], valid: set[str], where: str) -> None:
  unknown = sorted(set(cfg) - valid)
  if unknown:
    raise ValueError(f'{where} has unknown keys {unknown}; valid keys: '
                     f'{sorted(valid)}')


def _positive(value, where: str) -> int:
  try:
    n = int(value)
  except (TypeError, ValueError):
    n = 0
  if n <= 0 or n != value:
    raise ValueError(f'{where}={value!r} must be a positive integer')
  return n


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One retrieval task's cells: every (length, depth) with its example
  count; `options` go to the task's generator (evaluation/tasks/)."""
  task: str
  lengths: tuple[int, ...]
  depths: tuple[float | None, ...] = (None,)
  num_examples: tuple[int, ...] = ()
  max_new_tokens: int | None = None
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_config(cls, task: str, cfg: Mapping[str, Any]) -> TaskSpec:
    cfg = dict(plain(cfg))
    where = f'tasks.{task}'
    if task not in tasks_lib.TASKS:
      raise ValueError(f'tasks: {task!r} is not a task; the tasks are '
                       f'{sorted(tasks_lib.TASKS)}')
    if 'lengths' not in cfg:
      raise ValueError(f'{where} needs lengths')
    lengths = tuple(_positive(n, f'{where}.lengths')
                    for n in cfg.pop('lengths'))
    if not lengths:
      raise ValueError(f'{where}.lengths is empty')
    depths = cfg.pop('depths', None)
    # As given: a depth is part of a stored cell's key (evaluation/cells.py).
    depths = (None,) if depths is None else tuple(depths)
    bad = [d for d in depths if d is not None and not 0 <= d <= 1]
    if bad:
      raise ValueError(f'{where}.depths {bad} must lie in [0, 1]')
    # num_examples: one count, or one per length (per depth within it).
    num = cfg.pop('num_examples', 20)
    nums = (list(num) if isinstance(num, (list, tuple))
            else [num] * len(lengths))
    if len(nums) != len(lengths):
      raise ValueError(f'{where}.num_examples={num!r}: give one count or one '
                       f'per length ({len(lengths)})')
    nums = tuple(_positive(n, f'{where}.num_examples') for n in nums)
    budget = cfg.pop('max_new_tokens', None)
    budget = None if budget is None else _positive(budget,
                                                   f'{where}.max_new_tokens')
    return cls(task, lengths, depths, nums, budget, cfg)

  def cells(self) -> Iterator[tuple[int, float | None, int]]:
    """(length, depth, num_examples) of every cell, lengths first."""
    for length, n in zip(self.lengths, self.num_examples):
      for depth in self.depths:
        yield length, depth, n


def task_specs(cfg: Mapping[str, Any] | Sequence[TaskSpec] | None
               ) -> tuple[TaskSpec, ...]:
  """The tasks section as TaskSpecs (already parsed specs pass through)."""
  if not cfg:
    return ()
  if not isinstance(cfg, Mapping):
    specs = tuple(cfg)
    if not all(isinstance(s, TaskSpec) for s in specs):
      raise TypeError('tasks: a mapping {task: spec} or TaskSpecs')
    return specs
  return tuple(TaskSpec.from_config(task, spec)
               for task, spec in plain(cfg).items())


# The speed section's rows (orthros_jax/evaluation/speed.py, VARIANTS).
SPEED_VARIANTS = ('dense', 'orthros', 'none')


@dataclasses.dataclass(frozen=True)
class SpeedSpec:
  """Time to first token and decode speed at each prompt length (median of
  `reps`), batch `batch` for prefill and `decode_batch` for decode, each
  timed decode call `decode_steps` steps (0: the Orthros chunk size), for
  `variants` (a subset of SPEED_VARIANTS holding 'orthros': dense, Orthros,
  attention removed)."""
  lengths: tuple[int, ...]
  batch: int = 1
  decode_batch: int = 1
  reps: int = 3
  decode_steps: int = 0
  variants: tuple[str, ...] = ('dense', 'orthros', 'none')

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any]) -> SpeedSpec:
    cfg = dict(plain(cfg))
    _check_keys(cfg, _fields(cls), 'speed')
    if not cfg.get('lengths'):
      raise ValueError('speed.lengths is empty')
    steps = cfg.pop('decode_steps', 0)
    if steps != 0:
      steps = _positive(steps, 'speed.decode_steps')
    variants = cfg.pop('variants', SPEED_VARIANTS)
    variants = (variants,) if isinstance(variants, str) else tuple(variants)
    if (not set(variants) <= set(SPEED_VARIANTS) or 'orthros' not in variants
        or len(set(variants)) != len(variants)):
      raise ValueError(f'speed.variants={variants}: expected distinct names '
                       f'of {SPEED_VARIANTS}, orthros among them')
    return cls(tuple(_positive(n, 'speed.lengths') for n in cfg['lengths']),
               decode_steps=steps, variants=variants,
               **{k: _positive(cfg[k], f'speed.{k}')
                  for k in ('batch', 'decode_batch', 'reps') if k in cfg})


@dataclasses.dataclass(frozen=True)
class LmEvalSpec:
  """lm-evaluation-harness tasks on every row (evaluation/lm_harness.py).
  num_fewshot: one count or {task: count}, < 0: each task's default;
  limit 0: every example."""
  tasks: tuple[str, ...] = ()
  include_path: str = ''
  num_fewshot: int | Mapping[str, int] = -1
  limit: int = 0
  max_length: int = 2048
  batch_size: int = 1
  max_gen_toks: int = 256
  seed: int = 1234

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any]) -> LmEvalSpec:
    cfg = dict(plain(cfg))
    _check_keys(cfg, _fields(cls), 'lm_eval')
    shots = cfg.get('num_fewshot')
    shots = ({str(t): int(n) for t, n in shots.items()}
             if isinstance(shots, Mapping) else
             -1 if shots is None else int(shots))
    return cls(tasks=tuple(str(t) for t in cfg.get('tasks') or ()),
               include_path=str(cfg.get('include_path') or ''),
               num_fewshot=shots, limit=int(cfg.get('limit') or 0),
               **{k: _positive(cfg[k], f'lm_eval.{k}')
                  for k in ('max_length', 'batch_size', 'max_gen_toks')
                  if k in cfg},
               seed=int(cfg.get('seed', cls.seed)))

  def fewshot(self) -> int | dict[str, int] | None:
    """What lm_harness.run_tasks takes: None for each task's default."""
    if isinstance(self.num_fewshot, Mapping):
      return {t: n for t, n in self.num_fewshot.items() if n >= 0}
    return None if self.num_fewshot < 0 else self.num_fewshot


@dataclasses.dataclass(frozen=True)
class SuitePlan:
  """Everything eval.py runs, checked (see the module docstring)."""
  checkpoint: str
  teacher: str = ''
  tokenizer: str = 'byte'
  models: tuple[str, ...] = DEFAULT_ROWS
  sinks: int = 4
  exact_tail: int | None = None
  linear_checkpoint: str = ''
  seed: int = 0
  progress: bool = True
  name: str = ''
  tasks: tuple[TaskSpec, ...] = ()
  quality: Mapping[str, Any] | None = None
  speed: SpeedSpec | None = None
  lm_eval: LmEvalSpec | None = None


def check_config(config: Mapping[str, Any] | SuitePlan) -> SuitePlan:
  """The plan of an eval config; every key and value checked (a plan
  passes through)."""
  if isinstance(config, SuitePlan):
    return config
  cfg = dict(plain(config))
  _check_keys(cfg, _TOP_KEYS, 'the eval config')
  if not cfg.get('checkpoint'):
    raise ValueError('set checkpoint: an Orthros checkpoint (a convert.py '
                     'workdir or its orthros/ directory, or an adapter '
                     'directory applied to teacher=)')
  # A row named twice is evaluated once.
  models = tuple(dict.fromkeys(cfg.get('models') or DEFAULT_ROWS))
  unknown = sorted(set(models) - set(variants.ROWS))
  if unknown:
    raise ValueError(f'models {unknown} are unknown: expected a subset of '
                     f'{variants.ROWS}')
  sinks = cfg.get('sinks', 4)
  sinks = 4 if sinks is None else _positive(sinks, 'sinks')
  tail = cfg.get('exact_tail')
  # An inference setting (how many prompt tokens decode exactly), the same
  # for every row on the converted weights; -1 / None: as converted.
  tail = None if tail is None or int(tail) < 0 else int(tail)
  quality = cfg.get('quality') or None
  if quality is not None:
    quality = dict(quality)
    unknown = sorted(set(quality) - _DATASET_KEYS)
    if unknown:
      raise ValueError(f'quality has unknown keys {unknown}: it takes '
                       f'make_dataset arguments {sorted(_DATASET_KEYS)}')
  teacher = str(cfg.get('teacher') or '')
  if 'teacher' in models and not teacher:
    raise ValueError("the 'teacher' row needs teacher= (the dense model "
                     'as loaded: a Hugging Face directory or a train.py '
                     "checkpoint); the 'dense' row is the converted "
                     'weights with dense attention')
  linear_checkpoint = str(cfg.get('linear_checkpoint') or '')
  if 'linear_trained' in models and not linear_checkpoint:
    raise ValueError("the 'linear_trained' row needs linear_checkpoint= (a "
                     'convert.py workdir of the pure-linear recipe)')
  speed = cfg.get('speed') or None
  lm_eval = cfg.get('lm_eval') or None
  return SuitePlan(
      checkpoint=str(cfg['checkpoint']),
      teacher=teacher,
      tokenizer=str(cfg.get('tokenizer') or 'byte'),
      models=models, sinks=sinks, exact_tail=tail,
      linear_checkpoint=linear_checkpoint,
      seed=int(cfg.get('seed') or 0),
      progress=bool(cfg.get('progress', True)),
      name=str(cfg.get('name') or ''),
      tasks=task_specs(cfg.get('tasks')),
      quality=quality,
      speed=None if speed is None else SpeedSpec.from_config(speed),
      lm_eval=None if lm_eval is None else LmEvalSpec.from_config(lm_eval))
