"""What every evaluation task shares: the example type, the seed, the
haystack and the helpers that build a prompt to a token length (the tasks
themselves: the other modules of orthros_jax/evaluation/tasks/)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from typing import Any, Sequence, Union

import numpy as np

from orthros_jax.data import synthetic
from orthros_jax.data.tokenizers import Tokenizer

haystack_text = synthetic.haystack_text  # lives in data/ for the niah task

Seed = Union[int, Sequence[int]]

MAX_SLACK = 32  # byte tokens; see the package docstring
HAYSTACKS = ('essay', 'noise')

VALUE_KINDS = {'number': ('number', 'numbers'), 'uuid': ('UUID', 'UUIDs')}


@dataclasses.dataclass(frozen=True)
class TaskExample:
  """One evaluation example.

  Attributes:
    task: the task name (a key of TASKS).
    prompt: prompt token ids.
    target: canonical answer token ids: what greedy decoding should produce
      right after the prompt. It starts with a space, except for mqar, whose
      answer follows the prompt's final '|' directly (the training format).
    answers: the strings `score_output` looks for in the generated text.
    meta: task parameters, e.g. {'length': requested tokens, 'depth': ...}.
  """
  task: str
  prompt: list[int]
  target: list[int]
  answers: tuple[str, ...]
  meta: dict[str, Any]



@functools.lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
  """Sorted distinct lowercase words (3-10 letters) seen twice in the haystack.

  About 1,700 English words, the vocabulary of `common_words`.
  """
  found = re.findall(r'(?<![\w.])[a-z]{3,10}(?![\w(])', haystack_text())
  return tuple(sorted(w for w, c in collections.Counter(found).items()
                      if c >= 2))


# ------------------------------------------------------------------- helpers

def check_fits(task: str, length: int, fixed: int) -> None:
  if fixed > length:
    raise ValueError(
        f'{task} needs at least {fixed} tokens without filler but '
        f'length={length}; raise the length (or ask for fewer needles, '
        'words or pairs).')


def check_positive(task: str, **counts: int) -> None:
  for name, value in counts.items():
    if value < 1:
      raise ValueError(f'{task} {name}={value} must be >= 1.')


def draw_depth(rng: np.random.Generator, depth: float | None) -> float:
  depth = float(rng.uniform()) if depth is None else float(depth)
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f'depth={depth} must be in [0, 1].')
  return depth


def value_kind(value_type: str) -> tuple[str, str]:
  if value_type not in VALUE_KINDS:
    raise ValueError(f'value_type={value_type!r}; expected one of '
                     f'{sorted(VALUE_KINDS)}.')
  return VALUE_KINDS[value_type]


def draw_keys(rng: np.random.Generator, n: int) -> list[str]:
  """n distinct adjective-noun keys."""
  adjectives, nouns = synthetic.KEY_ADJECTIVES, synthetic.KEY_NOUNS
  if n > len(adjectives) * len(nouns):
    raise ValueError(f'{n} keys requested; only '
                     f'{len(adjectives) * len(nouns)} distinct keys exist.')
  picks = rng.choice(len(adjectives) * len(nouns), n, replace=False)
  return [f'{adjectives[i // len(nouns)]}-{nouns[i % len(nouns)]}'
          for i in picks]


def draw_values(rng: np.random.Generator, n: int, value_type: str) -> list[str]:
  """n distinct 7-digit numbers or UUID-formatted hex strings."""
  values: list[str] = []
  while len(values) < n:
    if value_type == 'number':
      value = str(int(rng.integers(10**6, 10**7)))
    else:
      h = ''.join('0123456789abcdef'[d] for d in rng.integers(16, size=32))
      value = f'{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}'
    if value not in values:
      values.append(value)
  return values


def join_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[int]:
  """' w1, w2, ...' encoded piece by piece, so its length is order-free."""
  ids: list[int] = []
  for i, word in enumerate(words):
    ids += (tokenizer.encode(',') if i else []) + tokenizer.encode(' ' + word)
  return ids


def haystack_prompt(task: str, rng: np.random.Generator,
                     tokenizer: Tokenizer, length: int, head: str,
                     needles: Sequence[tuple[float, str]], question: str,
                     target: Sequence[int], haystack: str) -> list[int]:
  """head + haystack with needles + question, filling `length - len(target)`.

  Needles are (depth, text) in the order they should appear when they share
  a sentence boundary. The essay start sentence is drawn last from `rng`.
  """
  if haystack not in HAYSTACKS:
    raise ValueError(f'haystack={haystack!r}; expected one of {HAYSTACKS}.')
  head_ids = tokenizer.encode(head)
  question_ids = tokenizer.encode(question)
  needle_ids = [(d, tokenizer.encode(text)) for d, text in needles]
  fixed = (len(head_ids) + sum(len(ids) for _, ids in needle_ids)
           + len(question_ids) + len(target))
  check_fits(task, length, fixed)
  if haystack == 'essay':
    sentences = synthetic.haystack_sentences()
    start = int(rng.integers(len(sentences)))
  else:
    sentences, start = synthetic.PASSKEY_FILLER, 0
  chunks = synthetic.fill_sentences(tokenizer, length - fixed, sentences,
                                    start)
  return head_ids + synthetic.insert_needles(chunks, needle_ids) + question_ids
