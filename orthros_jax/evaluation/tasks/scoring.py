"""Scoring generated text against a task example, and aggregating scores
(RULER recall; first-number match for passkey and niah)."""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import numpy as np

from orthros_jax.evaluation.inference import wilson_interval
from orthros_jax.evaluation.tasks.common import TaskExample

FIRST_NUMBER_TASKS = frozenset({'passkey', 'niah'})


def score_output(example: TaskExample, text: str) -> float:
  """The score in [0, 1] of generated `text` for `example`.

  passkey, niah: 1.0 when the first number (run of digits) in `text` is the
  answer, else 0.0. Other tasks (RULER recall): the fraction of
  `example.answers` that occur in `text`, case-insensitively, as substrings.
  """
  if example.task in FIRST_NUMBER_TASKS:
    match = re.search(r'\d+', text)
    return float(match is not None and match.group() == example.answers[0])
  if not example.answers:
    raise ValueError(f'{example.task} example has no answers to score.')
  text = text.lower()
  return sum(a.lower() in text for a in example.answers) / len(example.answers)


def accuracy(scores: Iterable[float]) -> dict[str, Any]:
  """Aggregate per-example scores in [0, 1].

  Returns:
    mean: the mean score (mean recall for multi-answer tasks).
    n: the number of examples.
    ci95: the Wilson 95% interval of round(sum(scores)) successes in n; for
      0/1 scores the exact binomial interval of the mean, for fractional
      recall an approximation that brackets the mean.
    all_correct: the fraction of examples with score 1 (every answer found).
    all_correct_ci95: its Wilson 95% interval.
  With no scores, mean and all_correct are NaN and the intervals (NaN, NaN).
  """
  s = np.asarray(list(scores), dtype=np.float64)
  if np.any((s < 0) | (s > 1)) or not np.all(np.isfinite(s)):
    raise ValueError('scores must lie in [0, 1].')
  n = len(s)
  full = int(np.sum(s == 1.0))
  return {'mean': float(s.mean()) if n else math.nan, 'n': n,
          'ci95': wilson_interval(int(round(float(s.sum()))), n),
          'all_correct': full / n if n else math.nan,
          'all_correct_ci95': wilson_interval(full, n)}
