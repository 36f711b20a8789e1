"""Synthetic long-context tasks, generated deterministically from (seed, index).

Every generator has the signature `task(rng, tokenizer, max_tokens, **options)`
and returns `(prompt, answer)`, two lists of token ids with
`len(prompt) + len(answer) <= max_tokens`. The pipeline appends eos to the
answer and puts the loss only on the answer (see pipeline.py).

`TaskMixture.example(index)` draws the task and its content from
`np.random.default_rng((seed, index))`, so example i is the same whatever the
order it is read in, the number of processes, or the tokenizer's thread.

Tasks:
- `passkey`: the Landmark-attention template. An instruction, filler sentences
  ("The grass is green. The sky is blue. ..."), the sentence "The pass key is
  N. Remember it. N is the pass key." at a random depth, then "What is the pass
  key? The pass key is"; the answer is " N" (a random `digits`-digit number).
- `mqar`: multi-query associative recall, compact enough for a tiny byte-level
  model. Prompt: `num_pairs` pairs `key:value` (keys `key_len` distinct
  lowercase letters, values `value_len` digits) separated by spaces, then `|`,
  the queried keys separated by spaces, then `|`. Answer: the queried pairs
  restated in query order, `key:value` separated by spaces. Example (4 pairs,
  2 queries): prompt `ab:12 cd:34 ef:56 gh:78|ef ab|`, answer `ef:56 ab:12`.
  Every answer token is determined by the prompt: a key is copied from the
  query list, a value is found after the same `key:` earlier in the prompt
  (an induction-head lookup, which is what exact decode attention must do).
- `filler`: language-model text, random sentences over a small word list; an
  empty prompt (loss on every token).
- `niah`: needle in a haystack over real English prose (`haystack_text()`,
  the Python documentation bundled with the interpreter, so nothing is
  downloaded). Consecutive haystack sentences from a random start, the
  needle sentence "The special magic number is: V." at a sentence boundary
  at `depth`, then " What is the special magic number? The special magic
  number is:"; the answer is " V", a random 7-digit number. This is the
  single-needle test of Kamradt's needle-in-a-haystack (one needle, one
  question). With `keyed=True` the needle carries a key K, an adjective-
  noun pair ("green-river"): "The special magic number for K is: V." and
  " What is the special magic number for K? The special magic number for K
  is:". In both, like the passkey template (and unlike RULER's, whose
  answer prefix paraphrases the needle: see the niah_* tasks in
  orthros_jax/evaluation/tasks/), the answer prefix repeats the needle's
  own words, so a small model can retrieve by matching them. The evaluation
  task of the same name (orthros_jax/evaluation/tasks/) uses the same
  templates (`niah_parts`).

The haystack helpers (`haystack_text`, `haystack_sentences`, `fill_sentences`,
`insert_needles`) are shared with the evaluation tasks.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import string
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from orthros_jax.data.tokenizers import Tokenizer

PASSKEY_INTRO = ('There is an important info hidden inside a lot of irrelevant text. '
                 'Find it and memorize them. I will quiz you about the important '
                 'information there.')
PASSKEY_FILLER = (' The grass is green.', ' The sky is blue.', ' The sun is yellow.',
                  ' Here we go.', ' There and back again.')
PASSKEY_KEY = ' The pass key is {key}. Remember it. {key} is the pass key.'
PASSKEY_QUESTION = ' What is the pass key? The pass key is'
PASSKEY_ANSWER = ' {key}'

FILLER_WORDS = (
    'the a one every some old new small large quiet bright dark warm cold green blue red '
    'river mountain city garden house road window forest village market bridge field '
    'cat dog bird horse child teacher farmer sailor painter walks runs sings reads waits '
    'builds finds carries watches opens near over under beside across through before after '
    'slowly quickly often never always today tomorrow again together alone').split()


def _target_length(rng: np.random.Generator, max_tokens: int, min_tokens: int | None) -> int:
  if min_tokens is None:
    return max_tokens
  if not 0 <= min_tokens <= max_tokens:
    raise ValueError(f'min_tokens={min_tokens} must be in [0, max_tokens={max_tokens}].')
  return int(rng.integers(min_tokens, max_tokens + 1))


def passkey(rng: np.random.Generator, tokenizer: Tokenizer, max_tokens: int, *,
            min_tokens: int | None = None, digits: int = 5,
            depth: float | None = None) -> tuple[list[int], list[int]]:
  """Passkey retrieval (Landmark template) filled to about the target length.

  The target length is `max_tokens`, or uniform in [min_tokens, max_tokens]
  when `min_tokens` is given. Whole filler sentences are added while they fit,
  so the length is within one sentence of the target and never above it.
  `depth` in [0, 1] places the key (0 = right after the instruction); None
  draws it uniformly.
  """
  if digits < 1:
    raise ValueError(f'passkey digits={digits} must be >= 1.')
  target = _target_length(rng, max_tokens, min_tokens)
  key = str(int(rng.integers(10**(digits - 1), 10**digits)))
  depth = float(rng.uniform()) if depth is None else depth
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f'passkey depth={depth} must be in [0, 1].')
  intro = tokenizer.encode(PASSKEY_INTRO)
  key_sentence = tokenizer.encode(PASSKEY_KEY.format(key=key))
  question = tokenizer.encode(PASSKEY_QUESTION)
  answer = tokenizer.encode(PASSKEY_ANSWER.format(key=key))
  budget = target - len(intro) - len(key_sentence) - len(question) - len(answer)
  if budget < 0:
    raise ValueError(
        f'passkey needs at least {target - budget} tokens without filler but the target length '
        f'is {target}; raise seq_len (or the passkey min_tokens).')
  sentences = [tokenizer.encode(s) for s in PASSKEY_FILLER]
  filler: list[list[int]] = []
  while len(sentences[len(filler) % len(sentences)]) <= budget:
    sentence = sentences[len(filler) % len(sentences)]
    filler.append(sentence)
    budget -= len(sentence)
  cut = round(depth * len(filler))
  prompt = intro + sum(filler[:cut], []) + key_sentence + sum(filler[cut:], []) + question
  return prompt, answer


def mqar(rng: np.random.Generator, tokenizer: Tokenizer, max_tokens: int, *,
         num_pairs: int = 8, num_queries: int = 2, key_len: int = 2,
         value_len: int = 2) -> tuple[list[int], list[int]]:
  """Multi-query associative recall: `k:v` pairs, a query list, answer `k:v` per query."""
  if not 1 <= num_queries <= num_pairs:
    raise ValueError(f'mqar num_queries={num_queries} must be in [1, num_pairs={num_pairs}].')
  if num_pairs > len(string.ascii_lowercase)**key_len:
    raise ValueError(f'mqar num_pairs={num_pairs} exceeds the {26**key_len} distinct keys of '
                     f'key_len={key_len}.')
  letters = np.array(list(string.ascii_lowercase))
  digits = np.array(list(string.digits))
  keys: list[str] = []
  seen = set()
  while len(keys) < num_pairs:  # distinct keys
    k = ''.join(rng.choice(letters, key_len))
    if k not in seen:
      seen.add(k)
      keys.append(k)
  values = [''.join(rng.choice(digits, value_len)) for _ in range(num_pairs)]
  queries = rng.choice(num_pairs, num_queries, replace=False)
  prompt_text = (' '.join(f'{k}:{v}' for k, v in zip(keys, values)) + '|'
                 + ' '.join(keys[q] for q in queries) + '|')
  answer_text = ' '.join(f'{keys[q]}:{values[q]}' for q in queries)
  prompt, answer = tokenizer.encode(prompt_text), tokenizer.encode(answer_text)
  if len(prompt) + len(answer) > max_tokens:
    raise ValueError(
        f'mqar with num_pairs={num_pairs} needs {len(prompt) + len(answer)} tokens but only '
        f'{max_tokens} fit; raise seq_len or lower num_pairs.')
  return prompt, answer


def parse_mqar(prompt: str, answer: str) -> tuple[dict[str, str], list[str], list[tuple[str, str]]]:
  """(pairs, queried keys, answered pairs) from decoded mqar text; for evaluation and tests."""
  pairs_text, queries_text, _ = prompt.split('|')
  pairs = dict(p.split(':') for p in pairs_text.split())
  answered = [tuple(p.split(':')) for p in answer.split()]
  return pairs, queries_text.split(), answered


def filler(rng: np.random.Generator, tokenizer: Tokenizer, max_tokens: int, *,
           min_tokens: int | None = None) -> tuple[list[int], list[int]]:
  """Random sentences over FILLER_WORDS, cut to the target length; empty prompt."""
  target = _target_length(rng, max_tokens, min_tokens)
  tokens: list[int] = []
  while len(tokens) < target:
    words = list(rng.choice(FILLER_WORDS, int(rng.integers(4, 11))))
    sentence = ' '.join(words).capitalize() + '.'
    tokens += tokenizer.encode(sentence if not tokens else ' ' + sentence)
  return [], tokens[:target]


# ------------------------------------------------------- needle in a haystack

NIAH_NEEDLE = ' The special magic number is: {value}.'
NIAH_QUESTION = (' What is the special magic number? The special magic '
                 'number is:')
NIAH_NEEDLE_KEYED = ' The special magic number for {key} is: {value}.'
NIAH_QUESTION_KEYED = (' What is the special magic number for {key}? The '
                       'special magic number for {key} is:')
NIAH_ANSWER = ' {value}'
KEY_ADJECTIVES = (
    'amber bold brave bright calm clever cold crimson dusty eager faint fancy '
    'gentle golden green hidden hollow humble icy jolly lively lucky misty '
    'noble quiet rapid rusty silent silver steady sunny swift tender tiny '
    'velvet wild').split()
KEY_NOUNS = (
    'anchor badger beacon canyon cedar comet compass ember falcon garden '
    'glacier harbor harvest island lantern meadow orchard otter pebble pine '
    'prairie quarry raven river saddle summit thistle tunnel valley violin '
    'walnut willow').split()

# Haystack sentences kept from haystack_text(): plain prose of bounded length.
HAYSTACK_MIN_CHARS = 24
HAYSTACK_MAX_CHARS = 250
_RULE_LINE = re.compile(r'\s*([*=~^-])\1{2,}\s*')  # reST heading underlines
_SENTENCE_END = re.compile(r'(?<=[.!?])\s+(?=[A-Z"(])')
_ASCII = str.maketrans({'\u2018': "'", '\u2019': "'", '\u201c': '"',
                        '\u201d': '"', '\u2026': '...', '\u2014': '--',
                        '\u2013': '-'})


@functools.lru_cache(maxsize=1)
def haystack_text() -> str:
  """Real English prose, built offline: Python's own documentation topics.

  The ~80 topics of `pydoc_data.topics` (~465K characters, bundled with the
  interpreter) in sorted-key order, reST heading underlines dropped, common
  typographic characters mapped to ASCII and any other non-ASCII character
  dropped, whitespace collapsed to single spaces. Deterministic for a given
  Python version (the documentation changes between versions).
  """
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  lines = [line for name in sorted(topics)
           for line in topics[name].splitlines()
           if not _RULE_LINE.fullmatch(line)]
  text = ' '.join(lines).translate(_ASCII)
  text = text.encode('ascii', 'ignore').decode('ascii')
  return ' '.join(text.split())


@functools.lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
  """The haystack's prose sentences, each with a leading space, in order.

  `haystack_text()` split after '.', '!' or '?' before a capital letter,
  quote or parenthesis; kept are sentences ending in '.', of
  HAYSTACK_MIN_CHARS..HAYSTACK_MAX_CHARS characters, without code markers
  ('>>>', '::=') and at least 80% letters and spaces (about 2000 sentences).
  """
  kept = []
  for s in _SENTENCE_END.split(haystack_text()):
    if (HAYSTACK_MIN_CHARS <= len(s) <= HAYSTACK_MAX_CHARS
        and s.endswith('.') and '>>>' not in s and '::=' not in s
        and sum(c.isalpha() or c == ' ' for c in s) >= 0.8 * len(s)):
      kept.append(' ' + s)
  return tuple(kept)


def fill_sentences(tokenizer: Tokenizer, budget: int, sentences: Sequence[str],
                   start: int = 0) -> list[list[int]]:
  """Encoded sentences, from `sentences[start]` on, of at most `budget` tokens.

  Sentences are taken in order, cyclically (a long budget wraps around the
  pool); one that does not fit the remaining budget is skipped and the next
  is tried. Filling stops once the remainder is below the token length of
  the pool's shortest sentence (in characters), so the slack,
  `budget - tokens returned`, is below that length: at most
  HAYSTACK_MIN_CHARS tokens for the haystack (its sentences carry a leading
  space) and 10 for PASSKEY_FILLER with the byte tokenizer.
  """
  if budget < 0:
    raise ValueError(f'budget={budget} must be >= 0.')
  n = len(sentences)
  shortest = min(range(n), key=lambda i: len(sentences[i]))
  stop = len(tokenizer.encode(sentences[shortest]))
  chunks: list[list[int]] = []
  i, misses = start, 0
  while budget >= stop and misses < n:  # a full cycle of misses: none fits
    ids = tokenizer.encode(sentences[i % n])
    if len(ids) <= budget:
      chunks.append(ids)
      budget -= len(ids)
      misses = 0
    else:
      misses += 1
    i += 1
  return chunks


def insert_needles(chunks: Sequence[list[int]],
                   needles: Sequence[tuple[float, list[int]]]) -> list[int]:
  """The concatenated `chunks` with each (depth, ids) needle inserted.

  A needle goes at the chunk boundary nearest `depth * haystack tokens`
  (depth 0: before the first chunk, 1: after the last; the needles' own
  tokens are not counted), so its offset is within half a chunk of the
  requested depth. Needles at the same boundary keep their order in
  `needles`.
  """
  bounds = np.concatenate([[0], np.cumsum([len(c) for c in chunks])])
  slots: list[list[list[int]]] = [[] for _ in bounds]
  for depth, ids in needles:
    if not 0.0 <= depth <= 1.0:
      raise ValueError(f'needle depth={depth} must be in [0, 1].')
    slots[int(np.argmin(np.abs(bounds - depth * bounds[-1])))].append(ids)
  out: list[int] = []
  for j, slot in enumerate(slots):
    for ids in slot:
      out += ids
    if j < len(chunks):
      out += chunks[j]
  return out


def random_key(rng: np.random.Generator) -> str:
  """An adjective-noun key such as 'green-river' (1,152 possible keys)."""
  return (f'{KEY_ADJECTIVES[int(rng.integers(len(KEY_ADJECTIVES)))]}-'
          f'{KEY_NOUNS[int(rng.integers(len(KEY_NOUNS)))]}')


class NiahParts(NamedTuple):
  prompt: list[int]
  answer: list[int]
  key: str
  value: str
  depth: float


def niah_parts(rng: np.random.Generator, tokenizer: Tokenizer, length: int,
               depth: float | None = None, keyed: bool = False) -> NiahParts:
  """One niah example of `length - slack` tokens (prompt + answer).

  Draws, in this order, the key (keyed only; otherwise key is ''), the
  7-digit value, the depth (uniform in
  [0, 1] when None) and the haystack start sentence; the haystack fills the
  length left by the needle, question and answer (slack: see
  `fill_sentences`). Raises ValueError when even an empty haystack does not
  fit.
  """
  key = random_key(rng) if keyed else ''
  value = str(int(rng.integers(10**6, 10**7)))
  depth = float(rng.uniform()) if depth is None else float(depth)
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f'niah depth={depth} must be in [0, 1].')
  needle_t, question_t = ((NIAH_NEEDLE_KEYED, NIAH_QUESTION_KEYED) if keyed
                          else (NIAH_NEEDLE, NIAH_QUESTION))
  needle = tokenizer.encode(needle_t.format(key=key, value=value))
  question = tokenizer.encode(question_t.format(key=key))
  answer = tokenizer.encode(NIAH_ANSWER.format(value=value))
  budget = length - len(needle) - len(question) - len(answer)
  if budget < 0:
    raise ValueError(
        f'niah needs at least {length - budget} tokens without haystack but '
        f'the target length is {length}; raise seq_len (or the length).')
  sentences = haystack_sentences()
  start = int(rng.integers(len(sentences)))
  chunks = fill_sentences(tokenizer, budget, sentences, start)
  prompt = insert_needles(chunks, [(depth, needle)]) + question
  return NiahParts(prompt, answer, key, value, depth)


def niah(rng: np.random.Generator, tokenizer: Tokenizer, max_tokens: int, *,
         min_tokens: int | None = None, depth: float | None = None,
         keyed: bool = False) -> tuple[list[int], list[int]]:
  """Needle in a haystack of real prose, filled to about the target length.

  The target length is `max_tokens`, or uniform in [min_tokens, max_tokens]
  when `min_tokens` is given; the example is at most that long and within
  one (short) haystack sentence of it (see `fill_sentences`). `depth` in
  [0, 1] places the needle (0 = before the first haystack sentence, 1 = right
  before the question); None draws it uniformly. The prompt is
  `niah_parts(...).prompt` (`keyed`: the keyed template); raises ValueError
  when the target length cannot hold the needle, question and answer (about
  110 byte tokens, 160 keyed).
  """
  target = _target_length(rng, max_tokens, min_tokens)
  parts = niah_parts(rng, tokenizer, target, depth, keyed)
  return parts.prompt, parts.answer


TASKS: dict[str, Callable[..., tuple[list[int], list[int]]]] = {
    'passkey': passkey,
    'mqar': mqar,
    'filler': filler,
    'niah': niah,
}


@dataclasses.dataclass(frozen=True)
class Example:
  task: str
  prompt: list[int]
  answer: list[int]


class TaskMixture:
  """Draws example `index` of a weighted task mixture from default_rng((seed, index)).

  Args:
    weights: task name -> non-negative weight (need not sum to 1), names from TASKS.
    tokenizer: the tokenizer the text is encoded with.
    max_tokens: prompt + answer length limit of every example.
    seed: the data seed; a different seed gives a disjoint-in-distribution stream
      (use one seed for training, another for held-out evaluation).
    options: task name -> keyword options of that task's generator.
  """

  def __init__(self, weights: Mapping[str, float], tokenizer: Tokenizer, max_tokens: int, *,
               seed: int = 0, options: Mapping[str, Mapping[str, Any]] | None = None):
    options = dict(options or {})
    unknown = sorted((set(weights) | set(options)) - set(TASKS))
    if unknown:
      raise ValueError(f'unknown synthetic task(s) {unknown}; known tasks: {sorted(TASKS)}.')
    w = np.array([float(weights[n]) for n in weights], dtype=np.float64)
    if not len(w) or np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
      raise ValueError(f'task weights {dict(weights)} must be non-negative with a positive sum.')
    if seed < 0:
      raise ValueError(f'seed={seed} must be >= 0.')
    self.names: Sequence[str] = tuple(weights)
    self.probs = w / w.sum()
    self.tokenizer = tokenizer
    self.max_tokens = int(max_tokens)
    self.seed = int(seed)
    self.options = {n: dict(options.get(n, {})) for n in self.names}
    # Fail at construction, not at step 1000: every task must fit max_tokens.
    for name, p in zip(self.names, self.probs):
      if p > 0:
        TASKS[name](np.random.default_rng(0), tokenizer, self.max_tokens, **self.options[name])

  def example(self, index: int) -> Example:
    rng = np.random.default_rng((self.seed, int(index)))
    name = self.names[int(rng.choice(len(self.names), p=self.probs))]
    prompt, answer = TASKS[name](rng, self.tokenizer, self.max_tokens, **self.options[name])
    return Example(name, prompt, answer)
