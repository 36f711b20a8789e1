"""Needle tasks: the Landmark passkey, Kamradt's needle in a haystack and
RULER's four needle variants (single, multi-key, multi-value, multi-query);
the package docstring (orthros_jax/evaluation/tasks/__init__.py) describes
each."""

from __future__ import annotations

import numpy as np

from orthros_jax.data import synthetic
from orthros_jax.data.tokenizers import Tokenizer
from orthros_jax.evaluation.tasks.common import check_positive
from orthros_jax.evaluation.tasks.common import draw_depth
from orthros_jax.evaluation.tasks.common import draw_keys
from orthros_jax.evaluation.tasks.common import draw_values
from orthros_jax.evaluation.tasks.common import haystack_prompt
from orthros_jax.evaluation.tasks.common import Seed
from orthros_jax.evaluation.tasks.common import TaskExample
from orthros_jax.evaluation.tasks.common import value_kind

RULER_HEAD = ('Special magic {kinds} are hidden in the text below. Memorize '
              'them; I will quiz you about them afterwards.\n')
RULER_NEEDLE = ' One of the special magic {kinds} for {key} is: {value}.'
RULER_QUESTION_ONE = ('\nWhat is the special magic {kind} for {key} mentioned '
                      'in the provided text? The special magic {kind} for '
                      '{key} mentioned in the provided text is')
RULER_QUESTION_ALL = ('\nWhat are all the special magic {kinds} for {keys} '
                      'mentioned in the provided text? The special magic '
                      '{kinds} for {keys} mentioned in the provided text are')


def passkey(seed: Seed, tokenizer: Tokenizer, length: int,
            depth: float | None = None, digits: int = 5) -> TaskExample:
  """Landmark passkey retrieval (synthetic.passkey) of `length` tokens.

  depth: where the pass key sentence sits among the filler sentences (0 =
  right after the instruction, 1 = right before the question); None draws it
  uniformly. The key is a random `digits`-digit number.
  """
  rng = np.random.default_rng(seed)
  depth = draw_depth(rng, depth)
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
  kind, kinds = value_kind(value_type)
  key = draw_keys(rng, 1)[0]
  value = draw_values(rng, 1, value_type)[0]
  depth = draw_depth(rng, depth)
  target = tokenizer.encode(f' {value}')
  prompt = haystack_prompt(
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
  check_positive('niah_multikey', num_keys=num_keys)
  rng = np.random.default_rng(seed)
  kind, kinds = value_kind(value_type)
  keys = draw_keys(rng, num_keys)
  values = draw_values(rng, num_keys, value_type)
  depths = [draw_depth(rng, depth)] + [float(d) for d in
                                   rng.uniform(size=num_keys - 1)]
  needles = sorted(
      (d, RULER_NEEDLE.format(kinds=kinds, key=k, value=v))
      for d, k, v in zip(depths, keys, values))
  target = tokenizer.encode(f' {values[0]}')
  prompt = haystack_prompt(
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
  check_positive('niah_multivalue', num_values=num_values)
  rng = np.random.default_rng(seed)
  _, kinds = value_kind(value_type)
  key = draw_keys(rng, 1)[0]
  values = draw_values(rng, num_values, value_type)
  depths = sorted(float(d) for d in rng.uniform(size=num_values))
  needles = [(d, RULER_NEEDLE.format(kinds=kinds, key=key, value=v))
             for d, v in zip(depths, values)]
  target = tokenizer.encode(' ' + ', '.join(values))
  prompt = haystack_prompt(
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
  check_positive('niah_multiquery', num_keys=num_keys)
  rng = np.random.default_rng(seed)
  _, kinds = value_kind(value_type)
  keys = draw_keys(rng, num_keys)
  values = draw_values(rng, num_keys, value_type)
  depths = [float(d) for d in rng.uniform(size=num_keys)]
  needles = sorted(
      (d, RULER_NEEDLE.format(kinds=kinds, key=k, value=v))
      for d, k, v in zip(depths, keys, values))
  keys_text = (keys[0] if num_keys == 1
               else ', '.join(keys[:-1]) + ' and ' + keys[-1])
  target = tokenizer.encode(' ' + ', '.join(values))
  prompt = haystack_prompt(
      'niah_multiquery', rng, tokenizer, length,
      RULER_HEAD.format(kinds=kinds), needles,
      RULER_QUESTION_ALL.format(kinds=kinds, keys=keys_text), target,
      haystack)
  return TaskExample('niah_multiquery', prompt, target, tuple(values),
                     {'length': length, 'depths': depths,
                      'num_keys': num_keys, 'keys': tuple(keys),
                      'value_type': value_type, 'haystack': haystack})
