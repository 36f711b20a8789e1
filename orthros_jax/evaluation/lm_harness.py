"""lm-evaluation-harness bridge: score any row of a report with lm-eval tasks.

`HarnessLM` is an `lm_eval` model (`lm_eval.api.model.TemplateLM`) over one
row of orthros_jax/evaluation/variants.py, i.e. (config, params, route)
(routes: orthros_jax/evaluation/routes.py):

  loglikelihood          (context, continuation) pairs, scored through the
                         row's route exactly as
                         `inference.score_batch` scores a prompt and its
                         answer: route 'inference' (teacher, dense, window,
                         Orthros rows) puts the context through the prefill
                         (Orthros: all but its exact tail) and the
                         continuation through exact decode; route 'prefill'
                         (pure linear) every token through the prefill
                         formula. is_greedy is the exact-match flag.
  loglikelihood_rolling  a document's log-likelihood over disjoint windows
                         of `max_length` tokens, every token of a window
                         teacher-forced through one prefill (route 'prefill'):
                         how a long document is read at inference, so the
                         Orthros row measures its prefill approximation.
  generate_until         greedy continuations through
                         `evaluation.retrieval.greedy` (route 'inference':
                         `orthros_jax.generate`), cut at the first `until`
                         string or the tokenizer's eos.

`run_tasks` runs named lm-eval tasks on several rows and returns
{row: {task: {metric: value}}}; eval.py's `lm_eval` section writes their
table into the report. lm-eval is an optional dependency (the test extras
install it); its datasets come from wherever `lm_eval` finds them (a local
task directory via `include_path`, or the Hugging Face hub on a machine
that has it: this module fetches nothing itself).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from orthros_jax.config import ModelConfig
from orthros_jax.evaluation import inference
from orthros_jax.evaluation import retrieval
from orthros_jax.evaluation import routes

_BUCKET = 64  # sequence widths are padded to a multiple (fewer compiles)


def _bucket(n: int) -> int:
  return -(-n // _BUCKET) * _BUCKET


class HarnessLM(TemplateLM):
  """An lm-eval model over one report row: (config, params, route).

  tokenizer: the project's tokenizer (orthros_jax/data/tokenizers.py);
  max_length: the longest scored sequence (contexts are cut from the left,
  as lm-eval's Hugging Face model does); batch_size: requests per compiled
  call; max_gen_toks: generation budget when a task sets none.
  """

  def __init__(self, config: ModelConfig, params, tokenizer, *,
               route: str = 'inference', max_length: int = 2048,
               batch_size: int = 1, max_gen_toks: int = 256):
    super().__init__()
    routes.check(route, routes.GENERATION_ROUTES)
    for name, value in (('max_length', max_length),
                        ('batch_size', batch_size),
                        ('max_gen_toks', max_gen_toks)):
      if int(value) < 1:
        raise ValueError(f'{name} must be >= 1, got {value}')
    self.config, self.params, self.route = config, params, route
    self.tok = tokenizer
    self.max_length = int(max_length)
    self.batch_size = int(batch_size)
    self.max_gen_toks = int(max_gen_toks)

  # ------------------------------------------------------------ tokenizer

  @property
  def eot_token_id(self) -> int:
    return int(self.tok.eos_id)

  @property
  def prefix_token_id(self) -> int:
    # As lm-eval's Hugging Face model: bos when the tokenizer has one.
    bos = getattr(self.tok, 'bos_id', None)
    return int(self.eot_token_id if bos is None else bos)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 **kwargs) -> list[int]:
    del add_special_tokens, kwargs  # the project's tokenizers add none
    return [int(i) for i in self.tok.encode(string)]

  def tok_decode(self, ids: Sequence[int]) -> str:
    return self.tok.decode([int(i) for i in ids])

  # ------------------------------------------------------------ scoring

  def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]], *,
                   route: str | None = None) -> list[tuple[float, bool]]:
    """(log-likelihood, exact) of each (context ids, continuation ids),
    through `inference.score_batch` on `route` (default: this row's)."""
    route = route or self.route
    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    cut = []
    for i, (ctx, cont) in enumerate(pairs):
      if not cont:
        raise ValueError(f'request {i}: empty continuation')
      if not ctx:
        raise ValueError(f'request {i}: empty context (lm-eval gives an '
                         'empty-context request the prefix token)')
      if len(cont) > self.max_length:
        raise ValueError(f'request {i}: a continuation of {len(cont)} tokens '
                         f'does not fit max_length={self.max_length} with '
                         'one token of context; raise max_length')
      whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
      cut.append((whole, len(whole) - len(cont)))
    # Longest first, so a batch's rows have similar widths.
    order = sorted(range(len(cut)), key=lambda i: -len(cut[i][0]))
    for s in range(0, len(order), self.batch_size):
      idx = order[s:s + self.batch_size]
      width = _bucket(max(len(cut[i][0]) - 1 for i in idx))
      rows = len(idx) if len(order) <= self.batch_size else self.batch_size
      batch = {k: np.zeros((rows, width), np.int32)
               for k in ('inputs', 'targets')}
      batch['weights'] = np.zeros((rows, width), np.float32)
      batch['prompt_lengths'] = np.zeros((rows,), np.int32)
      for r in range(rows):
        whole, ctx_len = cut[idx[min(r, len(idx) - 1)]]
        n = len(whole) - 1
        batch['inputs'][r, :n] = whole[:-1]
        batch['targets'][r, :n] = whole[1:]
        batch['weights'][r, ctx_len - 1:n] = 1.0
        batch['prompt_lengths'][r] = ctx_len
      out = inference.score_batch(self.config, self.params, batch,
                                 route=route)
      for r, i in enumerate(idx):
        results[i] = (-float(out['nll_sum'][r]), bool(out['exact'][r]))
    return results  # type: ignore[return-value]

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                            **kwargs) -> list[tuple[float, bool]]:
    del disable_tqdm, kwargs
    return self.score_tokens([(ctx, cont) for _, ctx, cont in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False
                            ) -> list[float]:
    del disable_tqdm
    out = []
    for req in requests:
      (text,) = req.args
      windows = [lm_utils.make_disjoint_window(w) for w in
                 lm_utils.get_rolling_token_windows(
                     token_list=self.tok_encode(text),
                     prefix_token=self.prefix_token_id,
                     max_seq_len=self.max_length, context_len=1)]
      scores = self.score_tokens(windows, route='prefill')
      out.append(math.fsum(s for s, _ in scores))
    return out

  # ------------------------------------------------------------ generation

  def generate_until(self, requests, disable_tqdm: bool = False
                     ) -> list[str]:
    del disable_tqdm
    out = []
    for req in requests:
      context, kwargs = req.args
      kwargs = dict(kwargs or {})
      if kwargs.get('do_sample') or float(kwargs.get('temperature') or 0):
        raise ValueError('generate_until: only greedy generation is '
                         f'supported (got {kwargs}): set do_sample=False')
      until = kwargs.get('until') or []
      until = [until] if isinstance(until, str) else list(until)
      budget = int(kwargs.get('max_gen_toks') or self.max_gen_toks)
      ids = self.tok_encode(context)
      keep = max(self.max_length - budget, 1)
      ids = ids[-keep:]
      gen = retrieval.greedy(self.config, self.params, [ids],
                             max_new_tokens=budget, route=self.route,
                             width=_bucket(len(ids)))[0]
      gen = [int(x) for x in gen]
      if self.eot_token_id in gen:
        gen = gen[:gen.index(self.eot_token_id)]
      text = self.tok_decode(gen)
      for stop in until:
        if stop and stop in text:
          text = text[:text.index(stop)]
      out.append(text)
    return out


def _numbers(task_result: Mapping[str, Any]) -> dict[str, float]:
  """The numeric metrics of one task's lm-eval result ('acc,none' -> acc)."""
  out = {}
  for key, value in task_result.items():
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      metric, _, filt = key.partition(',')
      name = metric if filt in ('', 'none') else f'{metric} ({filt})'
      out[name] = float(value)
  return out


def run_tasks(models: Mapping[str, tuple[ModelConfig, dict, str]],
              tasks: Sequence[str], tokenizer, *, include_path: str = '',
              num_fewshot: int | Mapping[str, int] | None = None,
              limit: int | None = None,
              max_length: int = 2048, batch_size: int = 1,
              max_gen_toks: int = 256, seed: int = 1234
              ) -> dict[str, dict[str, dict[str, float]]]:
  """{row: {task: {metric: value}}} of lm-eval `tasks` on every row.

  include_path: a directory of task YAMLs (local tasks); num_fewshot: one
  count for every task, {task: count} (tasks not named: their default),
  or None (each task's default); limit: examples per task (None: all);
  seed: lm-eval's random, numpy and fewshot seeds.
  """
  from lm_eval import evaluator  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  if not tasks:
    raise ValueError('lm_eval: name at least one task')
  shots = (dict(num_fewshot) if isinstance(num_fewshot, Mapping)
           else {t: num_fewshot for t in tasks})
  unknown = sorted(set(shots) - set(tasks))
  if unknown:
    raise ValueError(f'lm_eval: num_fewshot names tasks {unknown} that are '
                     f'not run ({list(tasks)})')
  groups: dict[int | None, list[str]] = {}
  for task in tasks:
    n = shots.get(task)
    groups.setdefault(None if n is None else int(n), []).append(task)
  manager = TaskManager(include_path=include_path or None)
  out: dict[str, dict[str, dict[str, float]]] = {}
  for name, (config, params, route) in models.items():
    lm = HarnessLM(config, params, tokenizer, route=route,
                   max_length=max_length, batch_size=batch_size,
                   max_gen_toks=max_gen_toks)
    out[name] = {}
    for n, group in groups.items():
      res = evaluator.simple_evaluate(
          model=lm, tasks=group, num_fewshot=n, limit=limit,
          task_manager=manager, random_seed=seed, numpy_random_seed=seed,
          torch_random_seed=seed, fewshot_random_seed=seed,
          bootstrap_iters=0, log_samples=False)
      out[name].update({task: _numbers(r)
                        for task, r in res['results'].items()})
  return out


def table(results: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
  """Markdown: one row per (task, metric), one column per report row."""
  rows = list(results)
  keys = []
  for r in rows:
    for task, metrics in results[r].items():
      for metric in metrics:
        if (task, metric) not in keys and not metric.endswith('_stderr'):
          keys.append((task, metric))
  lines = ['| task | metric | ' + ' | '.join(rows) + ' |',
           '|---|---|' + '---|' * len(rows)]
  for task, metric in keys:
    cells = []
    for r in rows:
      v = results[r].get(task, {}).get(metric)
      cells.append('' if v is None else f'{v:.4f}')
    lines.append(f'| {task} | {metric} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)
