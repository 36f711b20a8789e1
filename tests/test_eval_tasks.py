"""Evaluation retrieval tasks (orthros_jax/evaluation/tasks/) and the niah
training task: determinism, lengths, answers recoverable from the prompt
(re-derived with independent parsers: regexes, counters, chain resolution),
depth placement, scoring and the training pipeline."""

import collections
import math
import re

import grain
import numpy as np
import pytest

from orthros_jax import data
from orthros_jax.data import synthetic
from orthros_jax.evaluation import inference
from orthros_jax.evaluation import tasks

BYTE = data.ByteTokenizer()

# Lengths (byte tokens) at which each task's template fits.
LENGTHS = {
    'passkey': (300, 1000, 4000),
    'niah': (300, 1000, 4000),
    'niah_single': (1000, 4000),
    'niah_multikey': (1000, 4000),
    'niah_multivalue': (1000, 4000),
    'niah_multiquery': (1000, 4000),
    'variable_tracking': (1000, 4000),
    'common_words': (1000, 4000),
    'frequent_words': (300, 1000, 4000),
    'mqar': (300, 1000),
}
NEEDLE = re.compile(r'One of the special magic (?:numbers|UUIDs) for '
                    r'([a-z]+-[a-z]+) is: ([0-9a-f-]+)\.')


def test_every_task_is_covered():
  assert sorted(LENGTHS) == sorted(tasks.TASKS)


def total(example):
  return len(example.prompt) + len(example.target)


# ---------------------------------------------------------------- haystack

def test_haystack_text_is_normalized_ascii_prose():
  text = tasks.haystack_text()
  assert tasks.haystack_text() is text  # cached
  assert synthetic.haystack_text() is text
  assert len(text) > 300_000 and text.isascii()
  assert '  ' not in text and text == text.strip()
  assert not re.search(r'\s', text.replace(' ', ''))  # only single spaces
  # the reST heading underline between title and body is dropped
  assert 'The "assert" statement Assert statements are' in text
  sentences = synthetic.haystack_sentences()
  assert len(sentences) > 1000
  for s in sentences:
    assert s.startswith(' ') and s.endswith('.') and s[1:] in text
    assert (synthetic.HAYSTACK_MIN_CHARS <= len(s) - 1
            <= synthetic.HAYSTACK_MAX_CHARS)
  assert len(tasks.word_list()) > 1000


# ---------------------------------------------------------------- generic

@pytest.mark.parametrize('task', sorted(tasks.TASKS))
def test_deterministic_by_seed(task):
  length = LENGTHS[task][1 if len(LENGTHS[task]) > 2 else 0]
  a = tasks.make_examples(task, 0, BYTE, length, 3)
  assert a == tasks.make_examples(task, 0, BYTE, length, 3)
  # example i depends on (seed, i) only
  assert tasks.make_examples(task, 0, BYTE, length, 5)[:3] == a
  assert tasks.TASKS[task]((0, 2), BYTE, length) == a[2]
  b = tasks.make_examples(task, 1, BYTE, length, 3)
  for x, y in zip(a, b):
    assert x.prompt != y.prompt and x.answers != y.answers
  assert len({tuple(x.prompt) for x in a}) == 3
  for x in a:
    assert x.task == task and x.meta['length'] == length
    assert isinstance(x.answers, tuple) and x.answers


@pytest.mark.parametrize('task', sorted(tasks.TASKS))
def test_lengths_as_requested(task):
  for length in LENGTHS[task]:
    for x in tasks.make_examples(task, 3, BYTE, length, 4):
      if task == 'mqar':  # no filler: its length is set by num_pairs
        assert total(x) <= length
      else:
        assert length - tasks.MAX_SLACK < total(x) <= length, (length, x.meta)
      if task != 'mqar':  # mqar's answer follows '|' (training format)
        assert BYTE.decode(x.target).startswith(' ')
      assert min(x.prompt) >= BYTE.num_special  # plain text, no specials
  with pytest.raises(ValueError, match=task):
    tasks.TASKS[task](0, BYTE, 40)


def test_niah_slack_over_many_seeds():
  # The essay fill stops below the shortest haystack sentence (with its
  # leading space: HAYSTACK_MIN_CHARS + 1 tokens).
  for length in (257, 731, 2048):
    for x in tasks.make_examples('niah', 9, BYTE, length, 40):
      assert length - synthetic.HAYSTACK_MIN_CHARS <= total(x) <= length


def random_like(rng, answer):
  """A random string shaped like `answer` (digits, letters, case kept)."""
  pools = {str.isdigit: '0123456789', str.islower: 'abcdefghijklmnopqrstuvwxyz',
           str.isupper: 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'}
  out = []
  for c in answer:
    pool = next((p for test, p in pools.items() if test(c)), c)
    out.append(pool[rng.integers(len(pool))])
  return ''.join(out)


@pytest.mark.parametrize('task', sorted(tasks.TASKS))
def test_oracle_scores_one_and_random_scores_chance(task):
  examples = tasks.make_examples(task, 5, BYTE, LENGTHS[task][0], 20)
  rng = np.random.default_rng(0)
  for x in examples:
    assert tasks.score_output(x, BYTE.decode(x.target)) == 1.0
    assert tasks.score_output(x, BYTE.decode(x.target) + ' and more') == 1.0
  chance = [tasks.score_output(
      x, ' ' + ', '.join(random_like(rng, a) for a in x.answers))
            for x in examples]
  assert np.mean(chance) < 0.05
  assert tasks.score_output(examples[0], '') == 0.0


# ---------------------------------------------------------------- per task

def test_passkey_template_and_depth():
  for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
    x = tasks.passkey(7, BYTE, 4000, depth=depth)
    text = BYTE.decode(x.prompt)
    (key,) = x.answers
    assert re.fullmatch(r'\d{5}', key) and BYTE.decode(x.target) == ' ' + key
    assert text.startswith(synthetic.PASSKEY_INTRO)
    assert text.endswith(synthetic.PASSKEY_QUESTION)
    needle = synthetic.PASSKEY_KEY.format(key=key)
    assert text.count(needle) == 1 and re.findall(r'\d+', text) == [key, key]
    start = len(synthetic.PASSKEY_INTRO)
    filler = len(text) - start - len(needle) - len(synthetic.PASSKEY_QUESTION)
    offset = text.index(needle) - start
    assert abs(offset - depth * filler) <= 22  # one filler sentence
    assert x.meta['depth'] == depth
  x = tasks.passkey(7, BYTE, 1000, digits=3)
  assert re.fullmatch(r'\d{3}', x.answers[0])


def parse_niah(text, keyed=False):
  """(key, value, question key) of a decoded niah prompt ('' keys when
  not keyed)."""
  key_re = r' for ([a-z]+-[a-z]+)' if keyed else r'()'
  needles = re.findall(rf'The special magic number{key_re} is: (\d{{7}})\.',
                       text)
  assert len(needles) == 1
  key, value = needles[0]
  question = re.fullmatch(
      rf'.* What is the special magic number{key_re}\? The special '
      rf'magic number{key_re} is:', text, re.DOTALL)
  assert question and question.group(1) == question.group(2)
  return key, value, question.group(1)


@pytest.mark.parametrize('keyed', [False, True])
def test_niah_template_and_depth(keyed):
  needle_t, question_t = ((synthetic.NIAH_NEEDLE_KEYED,
                           synthetic.NIAH_QUESTION_KEYED) if keyed else
                          (synthetic.NIAH_NEEDLE, synthetic.NIAH_QUESTION))
  for depth in (0.0, 0.1, 0.5, 0.9, 1.0):
    x = tasks.niah(11, BYTE, 4000, depth=depth, keyed=keyed)
    text = BYTE.decode(x.prompt)
    key, value, asked = parse_niah(text, keyed)
    assert asked == key == x.meta['key'] and x.answers == (value,)
    if keyed:
      assert key.split('-')[0] in synthetic.KEY_ADJECTIVES
    else:
      assert key == ''
    assert BYTE.decode(x.target) == ' ' + value
    needle = needle_t.format(key=key, value=value)
    hay = text.index(question_t.format(key=key)) - len(needle)
    offset = text.index(needle)
    # nearest sentence boundary: within half the longest sentence
    assert abs(offset - depth * hay) <= synthetic.HAYSTACK_MAX_CHARS / 2 + 1
    # the haystack is real prose: sentences of haystack_text()
    before, after = text[:offset], text[offset + len(needle):]
    if depth == 0.0:
      assert before == ''
    else:
      assert any(before.endswith(s) for s in synthetic.haystack_sentences())
    if depth < 1.0:
      assert any(after.startswith(s) for s in synthetic.haystack_sentences())
  near = BYTE.decode(tasks.niah(11, BYTE, 4000, depth=0.0, keyed=keyed).prompt)
  assert near.startswith(needle_t[:30])
  far = BYTE.decode(tasks.niah(11, BYTE, 4000, depth=1.0, keyed=keyed).prompt)
  assert far.index(needle_t[:30]) > 3500


@pytest.mark.parametrize('value_type,haystack', [('number', 'essay'),
                                                 ('uuid', 'noise')])
def test_niah_single(value_type, haystack):
  for x in tasks.make_examples('niah_single', 2, BYTE, 1500, 5,
                               value_type=value_type, haystack=haystack):
    text = BYTE.decode(x.prompt)
    ((key, value),) = NEEDLE.findall(text)
    assert x.answers == (value,) and key in text.rsplit('\n', 1)[1]
    shape = r'\d{7}' if value_type == 'number' else (
        r'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}')
    assert re.fullmatch(shape, value)
    if haystack == 'noise':
      assert 'The grass is green.' in text
  with pytest.raises(ValueError, match='value_type'):
    tasks.niah_single(0, BYTE, 2000, value_type='word')
  with pytest.raises(ValueError, match='haystack'):
    tasks.niah_single(0, BYTE, 2000, haystack='essays')


def test_niah_multikey_depth_and_distractors():
  for depth in (0.0, 0.5, 1.0):
    x = tasks.niah_multikey(4, BYTE, 4000, num_keys=6, depth=depth)
    text = BYTE.decode(x.prompt)
    needles = NEEDLE.findall(text)
    assert len(needles) == 6 and len(dict(needles)) == 6  # distinct keys
    asked = re.search(r'What is the special magic number for (\S+) ', text)
    assert dict(needles)[asked.group(1)] == x.answers[0]
    assert len({v for _, v in needles}) == 6
    head = len(tasks.RULER_HEAD.format(kinds='numbers'))
    hay = text.rindex('\n') - head - sum(
        len(m.group(0)) + 1 for m in NEEDLE.finditer(text))
    own = (text.index(f'for {asked.group(1)} is:')
           - len(' One of the special magic numbers '))
    others = sum(len(m.group(0)) + 1 for m in NEEDLE.finditer(text)
                 if m.start() < own)
    offset = own - head - others
    assert abs(offset - depth * hay) <= synthetic.HAYSTACK_MAX_CHARS / 2 + 2


def test_niah_multivalue_in_text_order():
  for x in tasks.make_examples('niah_multivalue', 6, BYTE, 2000, 5,
                               num_values=5):
    needles = NEEDLE.findall(BYTE.decode(x.prompt))
    assert len({k for k, _ in needles}) == 1 and len(needles) == 5
    assert x.answers == tuple(v for _, v in needles)
    assert BYTE.decode(x.target) == ' ' + ', '.join(x.answers)
  x = tasks.niah_multivalue(6, BYTE, 2000)
  assert tasks.score_output(x, ', '.join(x.answers[:2])) == 0.5
  assert tasks.score_output(x, 'none of them') == 0.0


def test_niah_multiquery_in_query_order():
  for x in tasks.make_examples('niah_multiquery', 6, BYTE, 2000, 5,
                               value_type='uuid'):
    text = BYTE.decode(x.prompt)
    pairs = dict(NEEDLE.findall(text))
    asked = re.search(r'What are all the special magic UUIDs for (.*?) '
                      r'mentioned', text).group(1)
    keys = re.split(r', | and ', asked)
    assert len(keys) == 4 and set(keys) == set(pairs)
    assert x.answers == tuple(pairs[k] for k in keys)
    # case-insensitive recall
    upper = ' '.join(x.answers).upper()
    assert tasks.score_output(x, upper) == 1.0


def resolve_chains(text):
  """variable -> value of every 'VAR X = ... .' statement, in text order."""
  values = {}
  for name, var, number in re.findall(
      r'VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+)) \.', text):
    values[name] = number or values[var]  # a reference is defined earlier
  return values


@pytest.mark.parametrize('num_chains,haystack', [(1, 'noise'), (3, 'essay')])
def test_variable_tracking_chains(num_chains, haystack):
  for x in tasks.make_examples('variable_tracking', 8, BYTE, 3000, 5,
                               num_chains=num_chains, num_hops=3,
                               haystack=haystack):
    text = BYTE.decode(x.prompt)
    values = resolve_chains(text)
    assert len(values) == 4 * num_chains
    queried = re.search(r'assigned the value (\d+) in the text', text).group(1)
    assert queried == x.meta['value']
    assert set(x.answers) == {v for v, n in values.items() if n == queried}
    assert x.answers[0] in re.search(rf'VAR (\w+) = {queried} \.',
                                     text).group(0)
    assert BYTE.decode(x.target) == ' ' + ' '.join(x.answers)
    assert len(set(values.values())) == num_chains


def test_common_words_recomputed_from_prompt():
  for length in (1000, 4000, 12000):
    for x in tasks.make_examples('common_words', 1, BYTE, length, 3):
      text = BYTE.decode(x.prompt)
      listing = text.split('\n')[1]
      entries = re.findall(r' (\d+)\. ([a-z]+)', listing)
      assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
      assert ' '.join(f'{i}. {w}' for i, w in entries) == listing.strip()
      counts = collections.Counter(w for _, w in entries).most_common()
      assert {w for w, _ in counts[:10]} == set(x.answers)
      assert counts[9][1] > counts[10][1]  # a strict gap to the rest
      assert counts[9][1] == x.meta['freq_common']
      firsts = [w for _, w in entries]
      assert list(x.answers) == sorted(x.answers, key=firsts.index)
      assert set(x.answers) <= set(tasks.word_list())
  x = tasks.common_words(0, BYTE, 3000, num_words=5, freq_common=6,
                         freq_rare=2)
  assert len(x.answers) == 5 and x.meta['freq_common'] == 6
  with pytest.raises(ValueError, match='freq_rare'):
    tasks.common_words(0, BYTE, 3000, freq_common=3, freq_rare=3)


def test_frequent_words_recomputed_from_prompt():
  for length in (300, 1000, 4000):
    for x in tasks.make_examples('frequent_words', 2, BYTE, length, 4):
      coded = BYTE.decode(x.prompt).split('\n')[1].split()
      counts = collections.Counter(coded).most_common()
      assert {w for w, _ in counts[:3]} == set(x.answers)
      assert counts[2][1] > counts[3][1]
      by_count = [collections.Counter(coded)[w] for w in x.answers]
      assert by_count == sorted(by_count, reverse=True)
  x = tasks.frequent_words(0, BYTE, 2000, num_answers=5)
  assert len(x.answers) == 5


def test_mqar_answers_are_the_queried_pairs():
  for x in tasks.make_examples('mqar', 0, BYTE, 200, 5, num_pairs=10,
                               num_queries=3):
    pairs, queries, _ = synthetic.parse_mqar(BYTE.decode(x.prompt),
                                             BYTE.decode(x.target))
    assert x.answers == tuple(f'{q}:{pairs[q]}' for q in queries)
    assert x.meta['num_pairs'] == 10
  with pytest.raises(ValueError, match='num_pairs'):
    tasks.mqar(0, BYTE, 30, num_pairs=10)


def test_tasks_with_a_subword_tokenizer(tmp_path):
  tokenizers = pytest.importorskip('tokenizers')
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=600, special_tokens=['<pad>', '<s>', '</s>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(list(synthetic.haystack_sentences()[:400]), trainer)
  tok.save(str(tmp_path / 'tokenizer.json'))
  hf = data.HFTokenizer(str(tmp_path / 'tokenizer.json'))
  for task in sorted(tasks.TASKS):
    for x in tasks.make_examples(task, 0, hf, 1500, 2):
      assert total(x) <= 1500
      if task != 'mqar':
        assert total(x) > 1500 - tasks.MAX_SLACK, task
      assert tasks.score_output(x, hf.decode(x.target)) == 1.0, task
      text = hf.decode(x.prompt)
      assert all(a in text for a in x.answers), task


# ---------------------------------------------------------------- scoring

def test_first_number_scoring():
  x = tasks.passkey(0, BYTE, 500)
  (key,) = x.answers
  assert tasks.score_output(x, f' {key}.') == 1.0
  assert tasks.score_output(x, f'The pass key is {key}. 999') == 1.0
  assert tasks.score_output(x, f' {key}1') == 0.0  # "123456" is not "12345"
  assert tasks.score_output(x, f' 7 {key}') == 0.0  # only the first number
  assert tasks.score_output(x, 'I do not know') == 0.0
  y = tasks.niah(0, BYTE, 500)
  assert tasks.score_output(y, f'{y.answers[0]}0') == 0.0
  # RULER tasks use substring recall
  z = tasks.niah_single(0, BYTE, 1000)
  assert tasks.score_output(z, f'{z.answers[0]}0') == 1.0


def test_accuracy():
  acc = tasks.accuracy([1.0, 0.0, 1.0, 1.0])
  assert acc['mean'] == 0.75 and acc['n'] == 4
  assert acc['ci95'] == inference.wilson_interval(3, 4)
  assert acc['all_correct'] == 0.75
  assert acc['all_correct_ci95'] == acc['ci95']
  frac = tasks.accuracy(iter([0.5, 1.0, 0.25]))
  assert frac['mean'] == pytest.approx(1.75 / 3)
  assert frac['ci95'] == inference.wilson_interval(2, 3)
  lo, hi = frac['ci95']
  assert lo <= frac['mean'] <= hi
  assert frac['all_correct'] == pytest.approx(1 / 3)
  assert frac['all_correct_ci95'] == inference.wilson_interval(1, 3)
  empty = tasks.accuracy([])
  assert empty['n'] == 0 and math.isnan(empty['mean'])
  with pytest.raises(ValueError, match=r'\[0, 1\]'):
    tasks.accuracy([1.5])


def test_make_examples_errors():
  with pytest.raises(ValueError, match='unknown task'):
    tasks.make_examples('needle', 0, BYTE, 1000, 1)
  with pytest.raises(ValueError, match='depth'):
    tasks.niah(0, BYTE, 1000, depth=1.5)
  with pytest.raises(ValueError, match='num_keys'):
    tasks.niah_multikey(0, BYTE, 1000, num_keys=0)


# ---------------------------------------------------------------- training

def test_synthetic_niah_task():
  rng = np.random.default_rng(0)
  a = synthetic.niah(np.random.default_rng(5), BYTE, 800)
  assert a == synthetic.niah(np.random.default_rng(5), BYTE, 800)
  assert a != synthetic.niah(np.random.default_rng(6), BYTE, 800)
  for _ in range(10):
    keyed = bool(rng.integers(2))
    prompt, answer = synthetic.niah(rng, BYTE, 1000, min_tokens=400,
                                    keyed=keyed)
    assert 400 - synthetic.HAYSTACK_MIN_CHARS <= len(prompt + answer) <= 1000
    key, value, asked = parse_niah(BYTE.decode(prompt), keyed)
    assert asked == key and BYTE.decode(answer) == f' {value}'
    assert bool(key) == keyed
  shallow, _ = synthetic.niah(rng, BYTE, 2000, depth=0.0)
  assert BYTE.decode(shallow).startswith(' The special magic number is: ')
  shallow, _ = synthetic.niah(rng, BYTE, 2000, depth=0.0, keyed=True)
  assert BYTE.decode(shallow).startswith(' The special magic number for ')
  with pytest.raises(ValueError, match='seq_len'):
    synthetic.niah(rng, BYTE, 100)
  with pytest.raises(ValueError, match="seq_len"):
    synthetic.niah(rng, BYTE, 150, keyed=True)


def test_niah_through_mixture_and_pipeline():
  mixture = synthetic.TaskMixture({'niah': 1.0}, BYTE, 512, seed=4)
  examples = [mixture.example(i) for i in range(4)]
  assert examples == [mixture.example(i) for i in range(4)]
  for ex in examples:
    assert ex.task == 'niah' and len(ex.prompt + ex.answer) <= 512
    _, value, _ = parse_niah(BYTE.decode(ex.prompt))
    assert BYTE.decode(ex.answer) == f' {value}'
  it = data.make_iterator(seq_len=512, batch_size=2, seed=4,
                          tasks={'niah': 1.0},
                          shard_options=grain.sharding.NoSharding())
  batch = next(it)
  assert batch['inputs'].shape == (2, 512)
  for row, ex in enumerate(examples[:2]):
    p = len(ex.prompt)
    assert batch['prompt_lengths'][row] == p
    np.testing.assert_array_equal(batch['inputs'][row, :p], ex.prompt)
    assert (list(batch['targets'][row][batch['weights'][row] > 0])
            == ex.answer + [BYTE.eos_id])
  ds = data.make_dataset(tasks={'niah': 1.0}, seq_len=512, batch_size=2)
  assert next(iter(ds))['inputs'].shape == (2, 512)
