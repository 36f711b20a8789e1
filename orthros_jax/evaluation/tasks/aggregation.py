"""RULER's multi-hop tracing (variable_tracking) and aggregation tasks
(common_words, frequent_words), and Zoology's multi-query associative
recall (mqar); the package docstring describes each."""

from __future__ import annotations

import itertools
import math

import numpy as np

from orthros_jax.data import synthetic
from orthros_jax.data.tokenizers import Tokenizer
from orthros_jax.evaluation.tasks.common import check_fits
from orthros_jax.evaluation.tasks.common import check_positive
from orthros_jax.evaluation.tasks.common import haystack_prompt
from orthros_jax.evaluation.tasks.common import join_ids
from orthros_jax.evaluation.tasks.common import Seed
from orthros_jax.evaluation.tasks.common import TaskExample
from orthros_jax.evaluation.tasks.common import word_list

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
  check_positive('variable_tracking', num_chains=num_chains)
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
  prompt = haystack_prompt('variable_tracking', rng, tokenizer, length,
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
  check_positive('common_words', num_words=num_words)
  rng = np.random.default_rng(seed)
  vocab = word_list()
  order = rng.permutation(len(vocab))
  common = [vocab[i] for i in order[:num_words]]
  pool = [vocab[i] for i in order[num_words:]]
  head = tokenizer.encode(CWE_HEAD)
  question = tokenizer.encode(CWE_QUESTION.format(k=num_words))
  target_len = len(join_ids(tokenizer, common))
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
  check_fits('common_words', length, length - budget + used)
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
  target = join_ids(tokenizer, ordered)
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
  check_positive('frequent_words', num_answers=num_answers,
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
  target_len = len(join_ids(tokenizer, words[:num_answers]))
  budget = length - len(head) - len(question) - target_len
  check_fits('frequent_words', length, length - budget)
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
                     join_ids(tokenizer, answers), answers,
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
