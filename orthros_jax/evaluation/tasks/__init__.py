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

from typing import Callable

from orthros_jax.data.tokenizers import Tokenizer
from orthros_jax.evaluation.tasks.aggregation import common_words
from orthros_jax.evaluation.tasks.aggregation import frequent_words
from orthros_jax.evaluation.tasks.aggregation import mqar
from orthros_jax.evaluation.tasks.aggregation import variable_tracking
from orthros_jax.evaluation.tasks.common import HAYSTACKS
from orthros_jax.evaluation.tasks.common import MAX_SLACK
from orthros_jax.evaluation.tasks.common import TaskExample
from orthros_jax.evaluation.tasks.common import haystack_text
from orthros_jax.evaluation.tasks.common import word_list
from orthros_jax.evaluation.tasks.needles import RULER_HEAD
from orthros_jax.evaluation.tasks.needles import RULER_NEEDLE
from orthros_jax.evaluation.tasks.needles import niah
from orthros_jax.evaluation.tasks.needles import niah_multikey
from orthros_jax.evaluation.tasks.needles import niah_multiquery
from orthros_jax.evaluation.tasks.needles import niah_multivalue
from orthros_jax.evaluation.tasks.needles import niah_single
from orthros_jax.evaluation.tasks.needles import passkey
from orthros_jax.evaluation.tasks.scoring import FIRST_NUMBER_TASKS
from orthros_jax.evaluation.tasks.scoring import accuracy
from orthros_jax.evaluation.tasks.scoring import score_output

__all__ = [
    'FIRST_NUMBER_TASKS', 'HAYSTACKS', 'MAX_SLACK', 'RULER_HEAD',
    'RULER_NEEDLE', 'TASKS', 'TaskExample', 'accuracy', 'common_words',
    'frequent_words', 'haystack_text', 'make_examples', 'mqar', 'niah',
    'niah_multikey', 'niah_multiquery', 'niah_multivalue', 'niah_single',
    'passkey', 'score_output', 'variable_tracking', 'word_list',
]

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
