"""Long-context retrieval tasks for evaluation, generated offline from a seed.

Every task is a function `fn(seed, tokenizer, length, **options)` returning a
`TaskExample`: the prompt token ids, the canonical answer ids (`target`: what
greedy decoding should produce, the teacher-forcing target; it starts with a
space), the answer strings the scorer looks for, and metadata. Nothing is
downloaded: the haystack is Python's own documentation (`haystack_text()`),
the word lists are built in or derived from it.

Determinism: an example is a function of (seed, options, tokenizer) only;
`seed` is anything `np.random.default_rng` accepts (`make_examples` uses
(seed, i) for example i). The haystack comes from the interpreter's
`pydoc_data`, so examples are stable for a given Python version.

Length: for every task but `mqar`, `len(prompt) + len(target)` is at most
`length` and, with the byte tokenizer, more than `length - MAX_SLACK`: the
filler is whole sentences, list entries or words, and the last gap is smaller
than the shortest one (passkey: a filler sentence, < 22 tokens; essay
haystack: <= HAYSTACK_MIN_CHARS = 24; noise haystack: <= 10; common_words:
one list entry; frequent_words: one word). Sub-word tokenizers pack the same
text into fewer tokens, so their gaps are smaller still. A length that cannot hold
the template with no filler raises ValueError. `mqar` has no filler: its
length is set by `num_pairs` (ValueError when that exceeds `length`).

Tasks ('essay' haystack: consecutive prose sentences from a seeded start;
'noise': "The grass is green. The sky is blue. ..." repeated, as in RULER):
  passkey            Landmark-attention passkey (synthetic.passkey) at `depth`.
  niah               "The special magic number is: V." in the essay at
                     `depth`, then "What is the special magic number? ...
                     is:"; target " V", a 7-digit number (synthetic.niah_parts;
                     Kamradt's single needle). keyed=True: "... number for K
                     is: V.", asked for by its adjective-noun key K.
  niah_single        RULER single needle (number or UUID value).
  niah_multikey      `num_keys` needles with different keys, one queried.
  niah_multivalue    `num_values` needles with the same key; all values are
                     answers; target " v1, v2, ..." in text order.
  niah_multiquery    `num_keys` needles, all queried; target in query order.
  variable_tracking  chains "VAR A = 12345 ." "VAR B = VAR A ." in noise;
                     answers: every variable holding the queried value.
  common_words       (RULER cwe) a numbered word list where `num_words` words
                     appear `freq_common` times and the others at most
                     `freq_rare` times; answers: the common words.
  frequent_words     (RULER fwe) coded words drawn from a Zipf distribution;
                     answers: the `num_answers` most frequent ones.
  mqar               multi-query associative recall (synthetic.mqar);
                     answers: the "key:value" pairs.

Scoring (`score_output`): RULER recall, the fraction of `answers` found as
case-insensitive substrings of the generated text; for `passkey` and `niah`
the first number in the text must equal the answer (so "123456" does not
count for "12345").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np

from orthros_jax.data import synthetic
from orthros_jax.data.tokenizers import Tokenizer
from orthros_jax.evaluation.inference import wilson_interval

haystack_text = synthetic.haystack_text  # lives in data/ for the niah task

Seed = Union[int, Sequence[int]]
MAX_SLACK = 32  # byte tokens; see the module docstring
FIRST_NUMBER_TASKS = frozenset({'passkey', 'niah'})
HAYSTACKS = ('essay', 'noise')

_VALUE_KINDS = {'number': ('number', 'numbers'), 'uuid': ('UUID', 'UUIDs')}
RULER_HEAD = ('Special magic {kinds} are hidden in the text below. Memorize '
              'them; I will quiz you about them afterwards.\n')
RULER_NEEDLE = ' One of the special magic {kinds} for {key} is: {value}.'
RULER_QUESTION_ONE = ('\nWhat is the special magic {kind} for {key} mentioned '
                      'in the provided text? The special magic {kind} for '
                      '{key} mentioned in the provided text is')
RULER_QUESTION_ALL = ('\nWhat are all the special magic {kinds} for {keys} '
                      'mentioned in the provided text? The special magic '
                      '{kinds} for {keys} mentioned in the provided text are')
VT_HEAD = ('Memorize and track the chain(s) of variable assignment hidden in '
           'the following text.\n')
VT_FIRST = ' VAR {name} = {value} .'
VT_HOP = ' VAR {name} = VAR {previous} .'
VT_QUESTION = ('\nQuestion: Find all variables that are assigned the value '
               '{value} in the text above. Answer: According to the chain(s) '
               'of variable assignment in the text above, {count} variables '
               'are assigned the value {value}, they are:')
CWE_HEAD = ('Below is a numbered list of words. Some words appear more often '
            'than others.\n')
CWE_QUESTION = ('\nQuestion: What are the {k} most common words in the list '
                'above? Answer: The {k} most common words are:')
FWE_HEAD = ('Read the coded text below and count how often each coded word '
            'appears.\n')
FWE_QUESTION = ('\nQuestion: What are the {k} most frequent coded words in the '
                'text above? Answer: The {k} most frequent coded words are:')


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

def _check_fits(task: str, length: int, fixed: int) -> None:
  if fixed > length:
    raise ValueError(
        f'{task} needs at least {fixed} tokens without filler but '
        f'length={length}; raise the length (or ask for fewer needles, '
        'words or pairs).')


def _check_positive(task: str, **counts: int) -> None:
  for name, value in counts.items():
    if value < 1:
      raise ValueError(f'{task} {name}={value} must be >= 1.')


def _depth(rng: np.random.Generator, depth: float | None) -> float:
  depth = float(rng.uniform()) if depth is None else float(depth)
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f'depth={depth} must be in [0, 1].')
  return depth


def _value_kind(value_type: str) -> tuple[str, str]:
  if value_type not in _VALUE_KINDS:
    raise ValueError(f'value_type={value_type!r}; expected one of '
                     f'{sorted(_VALUE_KINDS)}.')
  return _VALUE_KINDS[value_type]


def _keys(rng: np.random.Generator, n: int) -> list[str]:
  """n distinct adjective-noun keys."""
  adjectives, nouns = synthetic.KEY_ADJECTIVES, synthetic.KEY_NOUNS
  if n > len(adjectives) * len(nouns):
    raise ValueError(f'{n} keys requested; only '
                     f'{len(adjectives) * len(nouns)} distinct keys exist.')
  picks = rng.choice(len(adjectives) * len(nouns), n, replace=False)
  return [f'{adjectives[i // len(nouns)]}-{nouns[i % len(nouns)]}'
          for i in picks]


def _values(rng: np.random.Generator, n: int, value_type: str) -> list[str]:
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


def _join_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[int]:
  """' w1, w2, ...' encoded piece by piece, so its length is order-free."""
  ids: list[int] = []
  for i, word in enumerate(words):
    ids += (tokenizer.encode(',') if i else []) + tokenizer.encode(' ' + word)
  return ids


def _haystack_prompt(task: str, rng: np.random.Generator,
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
  _check_fits(task, length, fixed)
  if haystack == 'essay':
    sentences = synthetic.haystack_sentences()
    start = int(rng.integers(len(sentences)))
  else:
    sentences, start = synthetic.PASSKEY_FILLER, 0
  chunks = synthetic.fill_sentences(tokenizer, length - fixed, sentences,
                                    start)
  return head_ids + synthetic.insert_needles(chunks, needle_ids) + question_ids


# --------------------------------------------------------------------- tasks

def passkey(seed: Seed, tokenizer: Tokenizer, length: int,
            depth: float | None = None, digits: int = 5) -> TaskExample:
  """Landmark passkey retrieval (synthetic.passkey) of `length` tokens.

  depth: where the pass key sentence sits among the filler sentences (0 =
  right after the instruction, 1 = right before the question); None draws it
  uniformly. The key is a random `digits`-digit number.
  """
  rng = np.random.default_rng(seed)
  depth = _depth(rng, depth)
  prompt, target = synthetic.passkey(rng, tokenizer, length, depth=depth,
                                     digits=digits)
  return TaskExample('passkey', prompt, target,
                     (tokenizer.decode(target).strip(),),
                     {'length': length, 'depth': depth, 'digits': digits})


def niah(seed: Seed, tokenizer: Tokenizer, length: int,
         depth: float | None = None, keyed: bool = False) -> TaskExample:
  """Needle in an essay haystack, the template of synthetic.niah.

  "The special magic number is: V." sits at the sentence boundary nearest
  `depth` (fraction of the haystack; None: uniform) of consecutive prose
  sentences from a seeded start; the question follows the haystack. Target
  " V" (7 digits). keyed: "The special magic number for K is: V." with an
  adjective-noun key K, asked for by K.
  """
  parts = synthetic.niah_parts(np.random.default_rng(seed), tokenizer, length,
                               depth, keyed)
  return TaskExample('niah', parts.prompt, parts.answer, (parts.value,),
                     {'length': length, 'depth': parts.depth,
                      'key': parts.key})


def niah_single(seed: Seed, tokenizer: Tokenizer, length: int,
                depth: float | None = None, value_type: str = 'number',
                haystack: str = 'essay') -> TaskExample:
  """RULER niah_single: one needle (7-digit number or UUID) at `depth`.

  haystack 'noise' is RULER's niah_single_1, 'essay' niah_single_2 and, with
  value_type='uuid', niah_single_3.
  """
  rng = np.random.default_rng(seed)
  kind, kinds = _value_kind(value_type)
  key = _keys(rng, 1)[0]
  value = _values(rng, 1, value_type)[0]
  depth = _depth(rng, depth)
  target = tokenizer.encode(f' {value}')
  prompt = _haystack_prompt(
      'niah_single', rng, tokenizer, length, RULER_HEAD.format(kinds=kinds),
      [(depth, RULER_NEEDLE.format(kinds=kinds, key=key, value=value))],
      RULER_QUESTION_ONE.format(kind=kind, key=key), target, haystack)
  return TaskExample('niah_single', prompt, target, (value,),
                     {'length': length, 'depth': depth, 'key': key,
                      'value_type': value_type, 'haystack': haystack})


def niah_multikey(seed: Seed, tokenizer: Tokenizer, length: int,
                  num_keys: int = 4, depth: float | None = None,
                  value_type: str = 'number',
                  haystack: str = 'essay') -> TaskExample:
  """RULER niah_multikey: `num_keys` needles with distinct keys, one queried.

  The queried needle sits at `depth` (None: uniform), the `num_keys - 1`
  distractors at uniform depths.
  """
  _check_positive('niah_multikey', num_keys=num_keys)
  rng = np.random.default_rng(seed)
  kind, kinds = _value_kind(value_type)
  keys = _keys(rng, num_keys)
  values = _values(rng, num_keys, value_type)
  depths = [_depth(rng, depth)] + [float(d) for d in
                                   rng.uniform(size=num_keys - 1)]
  needles = sorted(
      (d, RULER_NEEDLE.format(kinds=kinds, key=k, value=v))
      for d, k, v in zip(depths, keys, values))
  target = tokenizer.encode(f' {values[0]}')
  prompt = _haystack_prompt(
      'niah_multikey', rng, tokenizer, length, RULER_HEAD.format(kinds=kinds),
      needles, RULER_QUESTION_ONE.format(kind=kind, key=keys[0]), target,
      haystack)
  return TaskExample('niah_multikey', prompt, target, (values[0],),
                     {'length': length, 'depth': depths[0],
                      'num_keys': num_keys, 'key': keys[0],
                      'value_type': value_type, 'haystack': haystack})


def niah_multivalue(seed: Seed, tokenizer: Tokenizer, length: int,
                    num_values: int = 4, value_type: str = 'number',
                    haystack: str = 'essay') -> TaskExample:
  """RULER niah_multivalue: one key with `num_values` values at uniform depths.

  Every value is an answer; the target lists them in text order,
  " v1, v2, ...".
  """
  _check_positive('niah_multivalue', num_values=num_values)
  rng = np.random.default_rng(seed)
  _, kinds = _value_kind(value_type)
  key = _keys(rng, 1)[0]
  values = _values(rng, num_values, value_type)
  depths = sorted(float(d) for d in rng.uniform(size=num_values))
  needles = [(d, RULER_NEEDLE.format(kinds=kinds, key=key, value=v))
             for d, v in zip(depths, values)]
  target = tokenizer.encode(' ' + ', '.join(values))
  prompt = _haystack_prompt(
      'niah_multivalue', rng, tokenizer, length,
      RULER_HEAD.format(kinds=kinds), needles,
      RULER_QUESTION_ALL.format(kinds=kinds, keys=key), target, haystack)
  return TaskExample('niah_multivalue', prompt, target, tuple(values),
                     {'length': length, 'depths': depths,
                      'num_values': num_values, 'key': key,
                      'value_type': value_type, 'haystack': haystack})


def niah_multiquery(seed: Seed, tokenizer: Tokenizer, length: int,
                    num_keys: int = 4, value_type: str = 'number',
                    haystack: str = 'essay') -> TaskExample:
  """RULER niah_multiquery: `num_keys` needles at uniform depths, all queried.

  The question names the keys in a random order ("a, b, c and d"); the target
  lists their values in that order.
  """
  _check_positive('niah_multiquery', num_keys=num_keys)
  rng = np.random.default_rng(seed)
  _, kinds = _value_kind(value_type)
  keys = _keys(rng, num_keys)
  values = _values(rng, num_keys, value_type)
  depths = [float(d) for d in rng.uniform(size=num_keys)]
  needles = sorted(
      (d, RULER_NEEDLE.format(kinds=kinds, key=k, value=v))
      for d, k, v in zip(depths, keys, values))
  keys_text = (keys[0] if num_keys == 1
               else ', '.join(keys[:-1]) + ' and ' + keys[-1])
  target = tokenizer.encode(' ' + ', '.join(values))
  prompt = _haystack_prompt(
      'niah_multiquery', rng, tokenizer, length,
      RULER_HEAD.format(kinds=kinds), needles,
      RULER_QUESTION_ALL.format(kinds=kinds, keys=keys_text), target,
      haystack)
  return TaskExample('niah_multiquery', prompt, target, tuple(values),
                     {'length': length, 'depths': depths,
                      'num_keys': num_keys, 'keys': tuple(keys),
                      'value_type': value_type, 'haystack': haystack})


def variable_tracking(seed: Seed, tokenizer: Tokenizer, length: int,
                      num_chains: int = 1, num_hops: int = 4,
                      haystack: str = 'noise') -> TaskExample:
  """RULER variable tracking: find every variable holding a value.

  Each of `num_chains` chains is " VAR A = 12345 ." then `num_hops`
  statements " VAR B = VAR A ." (each naming the previous variable), at
  sorted uniform depths of the haystack, so a chain reads in order. Names
  are distinct 5-letter uppercase strings, values distinct 5-digit numbers.
  The first chain's value is queried; answers are its `num_hops + 1`
  variables, the target lists them in chain order separated by spaces.
  """
  _check_positive('variable_tracking', num_chains=num_chains)
  if num_hops < 0:
    raise ValueError(f'variable_tracking num_hops={num_hops} must be >= 0.')
  rng = np.random.default_rng(seed)
  letters = np.array(list('ABCDEFGHIJKLMNOPQRSTUVWXYZ'))
  names: list[str] = []
  while len(names) < num_chains * (num_hops + 1):
    name = ''.join(rng.choice(letters, 5))
    if name not in names:
      names.append(name)
  values: list[str] = []
  while len(values) < num_chains:
    value = str(int(rng.integers(10**4, 10**5)))
    if value not in values:
      values.append(value)
  chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
            for c in range(num_chains)]
  needles = []
  for chain, value in zip(chains, values):
    depths = np.sort(rng.uniform(size=num_hops + 1))
    texts = [VT_FIRST.format(name=chain[0], value=value)] + [
        VT_HOP.format(name=b, previous=a) for a, b in zip(chain, chain[1:])]
    needles += [(float(d), t) for d, t in zip(depths, texts)]
  needles.sort(key=lambda n: n[0])  # stable: a chain keeps its order
  target = tokenizer.encode(' ' + ' '.join(chains[0]))
  question = VT_QUESTION.format(value=values[0], count=num_hops + 1)
  prompt = _haystack_prompt('variable_tracking', rng, tokenizer, length,
                            VT_HEAD, needles, question, target, haystack)
  return TaskExample('variable_tracking', prompt, target, tuple(chains[0]),
                     {'length': length, 'num_chains': num_chains,
                      'num_hops': num_hops, 'value': values[0],
                      'haystack': haystack})


def common_words(seed: Seed, tokenizer: Tokenizer, length: int,
                 num_words: int = 10, freq_common: int | None = None,
                 freq_rare: int | None = None) -> TaskExample:
  """RULER common words extraction (cwe) over `word_list()`.

  The prompt is a numbered list " 1. w 2. w ..." in which `num_words` common
  words appear `freq_common` times each and every other word at most
  `freq_rare` (< freq_common) times; the list is shuffled. Rare words are
  added with `freq_rare` occurrences while they fit, then with one
  occurrence, so the list fills `length` to within one entry. The target
  lists the common words in order of first appearance, " w1, w2, ...".

  Defaults scale with the length (RULER uses 30 and 3 at long lengths):
  freq_common = clip(entries // (4 * num_words), 2, 30), so the common words
  take about a quarter of the list, and freq_rare = max(1, freq_common //
  10), raised when the word list would run out.
  """
  _check_positive('common_words', num_words=num_words)
  rng = np.random.default_rng(seed)
  vocab = word_list()
  order = rng.permutation(len(vocab))
  common = [vocab[i] for i in order[:num_words]]
  pool = [vocab[i] for i in order[num_words:]]
  head = tokenizer.encode(CWE_HEAD)
  question = tokenizer.encode(CWE_QUESTION.format(k=num_words))
  target_len = len(_join_ids(tokenizer, common))
  budget = length - len(head) - len(question) - target_len
  word_ids = {w: tokenizer.encode(' ' + w) for w in common}
  number_ids: dict[int, list[int]] = {}

  def number(i: int) -> list[int]:
    if i not in number_ids:
      number_ids[i] = tokenizer.encode(f' {i}.')
    return number_ids[i]

  def word(w: str) -> list[int]:
    if w not in word_ids:
      word_ids[w] = tokenizer.encode(' ' + w)
    return word_ids[w]

  entry = (np.mean([len(word(w)) for w in common])
           + len(number(max(1, budget // 8))))
  estimate = max(budget, 0) / entry
  fc = freq_common or int(np.clip(estimate // (4 * num_words), 2, 30))
  fr = freq_rare or max(  # 25% margin on the estimate before running out
      1, fc // 10, math.ceil(1.25 * (estimate - num_words * fc) / len(pool)))
  if not 1 <= fr < fc:
    raise ValueError(
        f'common_words needs 1 <= freq_rare < freq_common, got freq_rare={fr}'
        f', freq_common={fc} (at length={length} the word list of '
        f'{len(vocab)} words may be too short; raise freq_common).')
  counts: dict[str, int] = {}
  n = used = 0

  def cost(w: str, times: int) -> int:
    return times * len(word(w)) + sum(len(number(n + j))
                                      for j in range(1, times + 1))

  for w in common:
    used += cost(w, fc)
    n += fc
    counts[w] = fc
  _check_fits('common_words', length, length - budget + used)
  shortest = min(pool, key=len)

  def full() -> bool:  # not even the shortest word fits any more
    return budget - used < len(number(n + 1)) + len(word(shortest))

  i = 0
  for times in (fr, 1):  # rare words at freq_rare while they fit, then once
    while i < len(pool) and not full():
      c = cost(pool[i], times)
      if used + c <= budget:
        used, n, counts[pool[i]] = used + c, n + times, times
      elif times > 1:
        break
      i += 1
    if i == len(pool) and times > 1 and not full():
      raise ValueError(
          f'common_words at length={length} runs out of the {len(vocab)} '
          f'words; raise freq_rare (now {fr}) or freq_common (now {fc}).')
  entries = [w for w, c in counts.items() for _ in range(c)]
  entries = [entries[j] for j in rng.permutation(len(entries))]
  prompt = list(head)
  for j, w in enumerate(entries, 1):
    prompt += number(j) + word(w)
  prompt += question
  first: dict[str, int] = {}
  for w in entries:
    first.setdefault(w, len(first))
  ordered = sorted(common, key=first.__getitem__)
  target = _join_ids(tokenizer, ordered)
  return TaskExample('common_words', prompt, target, tuple(ordered),
                     {'length': length, 'num_words': num_words,
                      'freq_common': fc, 'freq_rare': fr,
                      'entries': len(entries)})


def frequent_words(seed: Seed, tokenizer: Tokenizer, length: int,
                   num_answers: int = 3, alpha: float = 2.0,
                   vocab_size: int = 200,
                   max_attempts: int = 100) -> TaskExample:
  """RULER frequent words extraction (fwe): the most frequent coded words.

  `vocab_size` random lowercase "coded words" (3-6 letters) get Zipf
  probabilities p_k ~ k**-alpha by rank k; words are drawn i.i.d. until the
  next one does not fit the length. The draw is repeated (up to
  `max_attempts` times, from the same generator) until the `num_answers`
  most probable words are exactly the most frequent ones, with a strict gap
  to the next word. The target lists them by decreasing count (ties: first
  appearance).
  """
  _check_positive('frequent_words', num_answers=num_answers,
                  max_attempts=max_attempts)
  if vocab_size <= num_answers or alpha <= 0:
    raise ValueError(f'frequent_words needs vocab_size > num_answers and '
                     f'alpha > 0, got vocab_size={vocab_size}, num_answers='
                     f'{num_answers}, alpha={alpha}.')
  rng = np.random.default_rng(seed)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  words: list[str] = []
  while len(words) < vocab_size:
    w = ''.join(rng.choice(letters, int(rng.integers(3, 7))))
    if w not in words:
      words.append(w)
  probs = np.arange(1, vocab_size + 1, dtype=np.float64)**-alpha
  probs /= probs.sum()
  head = tokenizer.encode(FWE_HEAD)
  question = tokenizer.encode(FWE_QUESTION.format(k=num_answers))
  target_len = len(_join_ids(tokenizer, words[:num_answers]))
  budget = length - len(head) - len(question) - target_len
  _check_fits('frequent_words', length, length - budget)
  ids = [tokenizer.encode(' ' + w) for w in words]
  costs = np.array([len(x) for x in ids])
  top = set(range(num_answers))
  for _ in range(max_attempts):
    draws = rng.choice(vocab_size, budget // costs.min() + 1, p=probs)
    n = int(np.searchsorted(np.cumsum(costs[draws]), budget, side='right'))
    draws = draws[:n]
    counts = np.bincount(draws, minlength=vocab_size)
    ranked = np.argsort(-counts, kind='stable')
    if (set(ranked[:num_answers].tolist()) == top
        and counts[ranked[num_answers - 1]] > counts[ranked[num_answers]]):
      break
  else:
    raise ValueError(
        f'frequent_words found no draw with a unique top {num_answers} in '
        f'{max_attempts} attempts at length={length}; raise the length.')
  seen, first_index = np.unique(draws, return_index=True)
  first = dict(zip(seen.tolist(), first_index.tolist()))
  ordered = sorted(top, key=lambda k: (-counts[k], first[k]))
  prompt = head + list(itertools.chain.from_iterable(ids[k] for k in draws))
  prompt += question
  answers = tuple(words[k] for k in ordered)
  return TaskExample('frequent_words', prompt,
                     _join_ids(tokenizer, answers), answers,
                     {'length': length, 'num_answers': num_answers,
                      'alpha': alpha, 'vocab_size': vocab_size,
                      'words': n})


def mqar(seed: Seed, tokenizer: Tokenizer, length: int, num_pairs: int = 8,
         num_queries: int = 2, key_len: int = 2,
         value_len: int = 2) -> TaskExample:
  """Multi-query associative recall (synthetic.mqar), no filler.

  Its length is set by `num_pairs` (at most `length`, ValueError otherwise);
  answers are the queried "key:value" pairs.
  """
  rng = np.random.default_rng(seed)
  prompt, target = synthetic.mqar(rng, tokenizer, length, num_pairs=num_pairs,
                                  num_queries=num_queries, key_len=key_len,
                                  value_len=value_len)
  return TaskExample('mqar', prompt, target,
                     tuple(tokenizer.decode(target).split()),
                     {'length': length, 'num_pairs': num_pairs,
                      'num_queries': num_queries})


TASKS: dict[str, Callable[..., TaskExample]] = {
    'passkey': passkey,
    'niah': niah,
    'niah_single': niah_single,
    'niah_multikey': niah_multikey,
    'niah_multivalue': niah_multivalue,
    'niah_multiquery': niah_multiquery,
    'variable_tracking': variable_tracking,
    'common_words': common_words,
    'frequent_words': frequent_words,
    'mqar': mqar,
}


def make_examples(task: str, seed: int, tokenizer: Tokenizer, length: int,
                  num_examples: int, **options) -> list[TaskExample]:
  """`num_examples` examples of `task`; example i is built from seed (seed, i).

  So example i does not depend on `num_examples` or on the other examples.
  """
  if task not in TASKS:
    raise ValueError(f'unknown task {task!r}; known tasks: {sorted(TASKS)}.')
  if seed < 0 or num_examples < 0:
    raise ValueError(f'seed={seed} and num_examples={num_examples} must be '
                     '>= 0.')
  return [TASKS[task]((seed, i), tokenizer, length, **options)
          for i in range(num_examples)]


# ------------------------------------------------------------------- scoring

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
