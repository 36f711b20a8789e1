"""Data pipeline behaviour: tokenizers, synthetic tasks, packed text, the batch
contract, sharding and iterator state. References are independent rebuilds of
what a batch must hold (token streams, decoded text, regexes), not the
pipeline's own helpers."""

import json
import re

import grain
import numpy as np
import pytest
from etils import epath

from orthros_jax import data
from orthros_jax.data import synthetic

BYTE = data.ByteTokenizer()
KEYS = ('inputs', 'targets', 'weights', 'prompt_lengths')


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == sorted(KEYS)
    for k in KEYS:
      np.testing.assert_array_equal(x[k], y[k])


# ---------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
  text = 'Orthros sees ünïcødé, 漢字 and emoji 🐕.\n'
  ids = BYTE.encode(text)
  assert len(ids) == len(text.encode('utf-8'))
  assert min(ids) >= 3 and max(ids) < BYTE.vocab_size == 259
  assert BYTE.decode(ids) == text
  # specials are skipped
  assert BYTE.decode([BYTE.bos_id] + ids + [BYTE.eos_id, BYTE.pad_id, 0]) == text
  with pytest.raises(ValueError, match='259'):
    BYTE.decode([259])
  assert isinstance(data.get_tokenizer('byte'), data.ByteTokenizer)


@pytest.fixture(scope='module')
def hf_tokenizer_file(tmp_path_factory):
  tokenizers = pytest.importorskip('tokenizers')
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=['<pad>', '<s>', '</s>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = [' '.join(synthetic.PASSKEY_FILLER), synthetic.PASSKEY_INTRO,
            'The pass key is 12345. Remember it.', 'the quick brown fox jumps over the lazy dog'] * 5
  tok.train_from_iterator(corpus, trainer)
  path = tmp_path_factory.mktemp('hf') / 'tokenizer.json'
  tok.save(str(path))
  return path


def test_hf_tokenizer_local_file(hf_tokenizer_file):
  tok = data.HFTokenizer(str(hf_tokenizer_file))
  assert tok.vocab_size == 320
  assert (tok.bos_id, tok.eos_id) == (1, 2)  # '<s>', '</s>'
  text = 'The grass is green. A brand-new 98765 sentence!'
  ids = tok.encode(text)
  assert len(ids) < len(text)  # merges were learned
  assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text
  # a directory holding tokenizer.json, through get_tokenizer
  tok2 = data.get_tokenizer(str(hf_tokenizer_file.parent))
  assert isinstance(tok2, data.HFTokenizer) and tok2.encode(text) == ids


def test_hf_tokenizer_errors(tmp_path, hf_tokenizer_file):
  missing = tmp_path / 'nowhere' / 'tokenizer.json'
  with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
    data.HFTokenizer(str(missing))
  with pytest.raises(FileNotFoundError, match='nowhere'):
    data.get_tokenizer(str(missing))
  with pytest.raises(ValueError, match='eos_token'):
    data.HFTokenizer(str(hf_tokenizer_file), eos_token='<not-a-token>')
  # Corrupt files reach the user as errors naming the file.
  broken = tmp_path / 'broken'
  broken.mkdir()
  (broken / 'tokenizer.json').write_text('{"version": "1.0", "mod')
  with pytest.raises(ValueError, match=re.escape(str(broken / 'tokenizer.json'))
                     + ' is not a readable tokenizer.json'):
    data.HFTokenizer(str(broken / 'tokenizer.json'))
  cfg_dir = tmp_path / 'cfg'
  cfg_dir.mkdir()
  (cfg_dir / 'tokenizer.json').write_bytes(hf_tokenizer_file.read_bytes())
  (cfg_dir / 'tokenizer_config.json').write_text('{"eos_token": ')
  with pytest.raises(ValueError, match=re.escape(
      str(cfg_dir / 'tokenizer_config.json')) + ' is not valid JSON'):
    data.HFTokenizer(str(cfg_dir / 'tokenizer.json'))


def test_hf_tokenizer_in_pipeline(hf_tokenizer_file):
  tok = data.HFTokenizer(str(hf_tokenizer_file))
  batch = next(data.make_iterator(seq_len=200, batch_size=2, seed=3, tasks={'passkey': 1},
                                  tokenizer=str(hf_tokenizer_file)))
  for row in range(2):
    p = int(batch['prompt_lengths'][row])
    prompt = tok.decode(batch['inputs'][row, :p])
    answer = tok.decode(batch['targets'][row][batch['weights'][row] > 0])
    assert prompt.endswith('What is the pass key? The pass key is')
    assert re.fullmatch(r' \d{5}', answer) and f'pass key is{answer}.' in prompt


# ---------------------------------------------------------------- synthetic tasks

def test_mixture_deterministic_by_seed_and_index():
  a = synthetic.TaskMixture({'passkey': 1, 'mqar': 2, 'filler': 1}, BYTE, 300, seed=7)
  b = synthetic.TaskMixture({'passkey': 1, 'mqar': 2, 'filler': 1}, BYTE, 300, seed=7)
  c = synthetic.TaskMixture({'passkey': 1, 'mqar': 2, 'filler': 1}, BYTE, 300, seed=8)
  forward = [a.example(i) for i in range(30)]
  backward = [b.example(i) for i in reversed(range(30))][::-1]
  assert forward == backward
  assert forward != [c.example(i) for i in range(30)]
  assert {e.task for e in forward} == {'passkey', 'mqar', 'filler'}
  only = synthetic.TaskMixture({'passkey': 0, 'mqar': 1}, BYTE, 300, seed=7)
  assert {only.example(i).task for i in range(20)} == {'mqar'}


@pytest.mark.parametrize('target', [260, 333, 1000, 4097])
def test_passkey_answer_in_prompt_and_length(target):
  longest_sentence = max(len(BYTE.encode(s)) for s in synthetic.PASSKEY_FILLER)
  for index in range(5):
    rng = np.random.default_rng((0, index))
    prompt, answer = synthetic.passkey(rng, BYTE, target)
    n = len(prompt) + len(answer)
    assert target - longest_sentence < n <= target
    text, ans = BYTE.decode(prompt), BYTE.decode(answer)
    key = re.fullmatch(r' (\d{5})', ans).group(1)
    assert text.startswith('There is an important info hidden inside a lot of irrelevant text.')
    assert f'The pass key is {key}. Remember it. {key} is the pass key.' in text
    assert text.endswith('What is the pass key? The pass key is')
    assert re.findall(r'\d+', text) == [key, key]  # the only numbers in the prompt


def test_passkey_depth_and_options():
  rng = np.random.default_rng(0)
  shallow = BYTE.decode(synthetic.passkey(rng, BYTE, 2000, depth=0.0)[0])
  deep = BYTE.decode(synthetic.passkey(rng, BYTE, 2000, depth=1.0)[0])
  assert shallow.index('The pass key') == len(synthetic.PASSKEY_INTRO) + 1
  assert deep.index('The pass key') > 1500
  prompt, answer = synthetic.passkey(rng, BYTE, 2000, digits=3, min_tokens=500)
  assert re.fullmatch(r' \d{3}', BYTE.decode(answer)) and 500 - 25 < len(prompt + answer) <= 2000
  with pytest.raises(ValueError, match='seq_len'):
    synthetic.passkey(rng, BYTE, 100)


def test_mqar_answers_consistent_with_pairs():
  for index in range(20):
    rng = np.random.default_rng((1, index))
    prompt, answer = synthetic.mqar(rng, BYTE, 512, num_pairs=11, num_queries=3)
    pairs, queries, answered = synthetic.parse_mqar(BYTE.decode(prompt), BYTE.decode(answer))
    assert len(pairs) == 11  # distinct keys
    assert all(re.fullmatch(r'[a-z]{2}', k) and re.fullmatch(r'\d{2}', v) for k, v in pairs.items())
    assert len(set(queries)) == 3 and set(queries) <= set(pairs)
    assert answered == [(q, pairs[q]) for q in queries]
  with pytest.raises(ValueError, match='num_pairs'):
    synthetic.mqar(np.random.default_rng(0), BYTE, 20, num_pairs=8)
  with pytest.raises(ValueError, match='num_queries'):
    synthetic.mqar(np.random.default_rng(0), BYTE, 200, num_pairs=2, num_queries=3)


def test_filler_length():
  prompt, answer = synthetic.filler(np.random.default_rng(3), BYTE, 257)
  assert prompt == [] and len(answer) == 257
  words = re.findall(r'[a-z]+', BYTE.decode(answer).lower())
  assert set(words[:-1]) <= set(synthetic.FILLER_WORDS)  # the last word may be cut


def test_mixture_errors():
  with pytest.raises(ValueError, match='unknown synthetic task'):
    synthetic.TaskMixture({'needle_in_a_sock': 1}, BYTE, 100)
  with pytest.raises(ValueError, match='non-negative'):
    synthetic.TaskMixture({'mqar': -1, 'filler': 2}, BYTE, 100)
  with pytest.raises(ValueError, match='seq_len'):  # fails at construction
    data.make_dataset(seq_len=64, batch_size=2, tasks={'passkey': 1})


# ---------------------------------------------------------------- batch contract

def test_synthetic_batches_follow_contract():
  seq_len, batch_size = 256, 6
  mixture = synthetic.TaskMixture({'passkey': 1, 'mqar': 1, 'filler': 1}, BYTE, seq_len, seed=5)
  it = data.make_iterator(seq_len=seq_len, batch_size=batch_size, seed=5,
                          shard_options=grain.sharding.NoSharding())
  for step, batch in enumerate(take(it, 3)):
    assert batch['inputs'].shape == batch['targets'].shape == (batch_size, seq_len)
    assert batch['weights'].shape == (batch_size, seq_len)
    assert batch['prompt_lengths'].shape == (batch_size,)
    assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
    assert batch['weights'].dtype == np.float32 and batch['prompt_lengths'].dtype == np.int32
    for row in range(batch_size):
      ex = mixture.example(step * batch_size + row)  # the unbounded stream is read in order
      full = ex.prompt + ex.answer + [BYTE.eos_id]
      n = len(full) - 1
      p = len(ex.prompt)
      inputs, targets = batch['inputs'][row], batch['targets'][row]
      weights = batch['weights'][row]
      assert batch['prompt_lengths'][row] == p
      np.testing.assert_array_equal(inputs[:n], full[:-1])
      np.testing.assert_array_equal(targets[:n], full[1:])
      assert not inputs[n:].any() and not targets[n:].any() and not weights[n:].any()
      # weights mark exactly the positions whose target is an answer token (or the final eos)
      expected = np.zeros(seq_len, np.float32)
      for t in range(n):
        expected[t] = t + 1 >= p
      np.testing.assert_array_equal(weights, expected)
      assert set(np.unique(weights)) <= {0.0, 1.0}
      if ex.task == 'filler':
        assert p == 0 and weights.sum() == n
      else:
        assert list(targets[weights > 0]) == ex.answer + [BYTE.eos_id]


def write_corpus(directory):
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'a.txt').write_text('First document.\nWith two lines.', encoding='utf-8')
  with open(directory / 'b.jsonl', 'w', encoding='utf-8') as f:
    f.write(json.dumps({'text': 'Second doc.', 'id': 1}) + '\n\n')
    f.write(json.dumps({'text': 'Third, ünïcode.', 'id': 2}) + '\n')
  stream = []
  for doc in ['First document.\nWith two lines.', 'Second doc.', 'Third, ünïcode.']:
    stream += BYTE.encode(doc) + [BYTE.eos_id]
  return stream


def test_text_packing_covers_every_next_token(tmp_path):
  stream = write_corpus(tmp_path / 'corpus')
  seq_len = 9
  it = data.make_iterator('text', seq_len=seq_len, batch_size=1, seed=0, num_epochs=1,
                          paths=[str(tmp_path / 'corpus')])
  batches = list(it)
  assert len(batches) == -(-(len(stream) - 1) // seq_len)  # ceil: no row lost at batch 1
  pairs, starts = [], []
  for b in batches:
    assert b['prompt_lengths'].tolist() == [0]
    w = b['weights'][0]
    n = int(w.sum())
    np.testing.assert_array_equal(w, np.arange(seq_len) < n)
    assert not b['inputs'][0, n:].any() and not b['targets'][0, n:].any()
    np.testing.assert_array_equal(b['targets'][0, :n - 1], b['inputs'][0, 1:n])
    pairs += list(zip(b['inputs'][0, :n].tolist(), b['targets'][0, :n].tolist()))
    starts.append(b['inputs'][0, :n].tolist())
  assert sorted(pairs) == sorted(zip(stream[:-1], stream[1:]))
  # shuffled rows: reassembled in stride order they give back the stream
  rows = sorted(starts, key=lambda r: [i for i in range(len(stream)) if stream[i:i + len(r)] == r][0])
  assert sum(rows, []) + [stream[-1]] == stream
  assert len({tuple(r) for r in rows}) == len(rows)


def test_text_jsonl_field_and_errors(tmp_path):
  (tmp_path / 'c.jsonl').write_text(json.dumps({'body': 'abc def'}) + '\n', encoding='utf-8')
  rows, lengths = data.load_packed(str(tmp_path / 'c.jsonl'), BYTE, 4, text_field='body')
  assert rows.shape == (2, 5) and lengths.tolist() == [5, 4]
  assert BYTE.decode(np.concatenate([rows[0, :4], rows[1, :lengths[1]]])) == 'abc def'
  with pytest.raises(ValueError, match="'text'"):
    data.load_packed(str(tmp_path / 'c.jsonl'), BYTE, 4)


def test_empty_text_sources_raise(tmp_path):
  empty_dir = tmp_path / 'empty'
  empty_dir.mkdir()
  with pytest.raises(ValueError, match='empty data source.*empty'):
    data.make_dataset('text', seq_len=8, batch_size=1, paths=[str(empty_dir)])
  (tmp_path / 'blank.txt').write_text('', encoding='utf-8')
  with pytest.raises(ValueError, match='empty data source.*blank.txt'):
    data.make_dataset('text', seq_len=8, batch_size=1, paths=[str(tmp_path / 'blank.txt')])
  (tmp_path / 'blank.jsonl').write_text('{"text": ""}\n', encoding='utf-8')
  with pytest.raises(ValueError, match='blank.jsonl'):
    data.make_dataset('text', seq_len=8, batch_size=1, paths=str(tmp_path / 'blank.jsonl'))
  with pytest.raises(ValueError, match='paths'):
    data.make_dataset('text', seq_len=8, batch_size=1)
  with pytest.raises(FileNotFoundError, match='missing'):
    data.make_dataset('text', seq_len=8, batch_size=1, paths=[str(tmp_path / 'missing*.txt')])


def test_pipeline_argument_errors(tmp_path):
  with pytest.raises(ValueError, match='multiple of the number of processes'):
    data.make_dataset(seq_len=128, batch_size=3,
                      shard_options=grain.sharding.ShardOptions(0, 2))
  with pytest.raises(ValueError, match='num_examples'):
    data.make_dataset(seq_len=300, batch_size=2, num_epochs=1)
  with pytest.raises(ValueError, match='source'):
    data.make_dataset('images', seq_len=300, batch_size=2)
  write_corpus(tmp_path)
  with pytest.raises(ValueError, match='fewer than one batch'):
    data.make_dataset('text', seq_len=64, batch_size=8, num_epochs=1, paths=str(tmp_path))


# ---------------------------------------------------------------- sharding, determinism, state

@pytest.mark.parametrize('num_examples', [None, 40])
def test_shards_are_disjoint_and_deterministic(num_examples):
  kw = dict(seq_len=96, batch_size=4, seed=11, tasks={'mqar': 1, 'filler': 1},
            task_options={'mqar': {'num_pairs': 4}, 'filler': {'min_tokens': 10}},
            num_examples=num_examples, num_epochs=1 if num_examples else None)
  def rows(index):
    it = data.make_iterator(shard_options=grain.sharding.ShardOptions(index, 2), **kw)
    return [tuple(r) for b in take(it, 10) for r in b['inputs']]  # one epoch of 40 / 2
  shard0, shard1 = rows(0), rows(1)
  assert shard0 == rows(0)  # same seed, same data
  assert not set(shard0) & set(shard1)
  single = data.make_iterator(shard_options=grain.sharding.NoSharding(), **kw)
  all_rows = [tuple(r) for b in take(single, 10) for r in b['inputs']]
  if num_examples:  # one epoch: the shards split the 40 examples between them
    assert sorted(shard0 + shard1) == sorted(all_rows)
  other_seed = data.make_iterator(shard_options=grain.sharding.NoSharding(), **{**kw, 'seed': 12})
  assert [tuple(r) for r in next(other_seed)['inputs']] != all_rows[:2]
  # the default shards by JAX process (one process here)
  default = data.make_iterator(**kw)
  assert [tuple(r) for b in take(default, 10) for r in b['inputs']] == all_rows


@pytest.mark.parametrize('source', ['synthetic', 'text'])
def test_iterator_state_round_trip(tmp_path, source):
  if source == 'text':
    write_corpus(tmp_path)
    kw = dict(seq_len=6, batch_size=2, seed=2, paths=str(tmp_path))  # ~10 rows: crosses epochs
  else:
    kw = dict(seq_len=300, batch_size=3, seed=2, num_examples=7)  # reshuffled epochs
  it = data.make_iterator(source, **kw)
  take(it, 5)
  state = it.get_state()
  expected = take(it, 9)
  restored = data.make_iterator(source, **kw)
  restored.set_state(state)
  assert_batches_equal(take(restored, 9), expected)
  # the orbax path the trainer uses: grain's checkpoint handler writes JSON per process
  directory = epath.Path(tmp_path / 'ckpt')
  directory.mkdir()
  grain.checkpoint.CheckpointHandler().save(directory, item=it)
  after = take(it, 3)
  fresh = data.make_iterator(source, **kw)
  grain.checkpoint.CheckpointHandler().restore(directory, item=fresh)
  assert_batches_equal(take(fresh, 3), after)
