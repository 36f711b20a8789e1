"""Chat (orthros_jax/chat.py, chat.py): two turns through continued prefill
leave the cache a full re-prefill of the conversation gives; the first turn
equals `generate`; streaming, TTFT and errors; the command end to end on a
small Hugging Face directory with a ChatML template."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax.chat import ChatSession
from orthros_jax.chat import load_chat_model
from orthros_jax.model import Transformer

from test_model import init_params, make_config

ALPHABET = 'abcdefghijklmnopqrstuvwxyz0123456789 .,?!\n:'
EOS = 1


class TinyChatTokenizer:
  """Characters as ids 2.. and '|' as the end-of-turn special token (id 1):
  encode spells it as its id and decode drops it, as a Hugging Face
  tokenizer does with <|im_end|>. Template: 'role:content|' per turn."""
  eos_id = EOS
  eos_token = '|'

  def encode(self, text):
    return [EOS if c == '|' else 2 + ALPHABET.index(c) for c in text]

  def decode(self, ids):
    return ''.join(ALPHABET[i - 2] if 2 <= i < 2 + len(ALPHABET) else '#'
                   for i in ids if i != EOS)

  def apply_chat_template(self, messages, add_generation_prompt=False):
    text = ''.join(f"{m['role']}:{m['content']}|\n" for m in messages)
    return text + ('assistant:' if add_generation_prompt else '')


def _prefill_all(config, params, ids, max_len):
  cache = oj.init_cache(config, 1, max_len)
  _, cache = Transformer(config).apply(
      {'params': params}, jnp.asarray([ids], jnp.int32), phase='prefill',
      cache=cache)
  return cache


def _assert_caches_equal(config, params, got, ids, layers=None):
  """`got` holds the keys and values of one prefill of `ids`, and a linear
  state equal to that of one prefill of the tokens it has folded (decode
  never folds, so the state is the last prefill's: the tokens of the last
  turn's exact tail and reply are not in it yet)."""
  n, w = len(ids), config.attention.window
  want = _prefill_all(config, params, ids, 128)
  folded = int(got[0].folded[0])
  if config.is_orthros:
    assert folded <= max(n - w, 0)
  state = _prefill_all(config, params, ids[:folded + w], 128)
  for i, (a, b, c) in enumerate(zip(got, want, state)):
    if layers is not None and i not in layers:
      continue
    assert int(a.lengths[0]) == int(b.lengths[0]) == n
    assert int(a.folded[0]) == folded
    np.testing.assert_allclose(a.k[0, :n], b.k[0, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.v[0, :n], b.v[0, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.S, c.S, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a.z, c.z, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('kind,window', [('dense', 4), ('orthros', 200)])
def test_two_turns_cache_equals_full_prefill(kind, window):
  """Dense, and Orthros with a window longer than the conversation (so its
  prefill formula is exact softmax): every layer's cache after two turns
  equals one prefill of the conversation's tokens."""
  config = make_config(kind=kind, window=window).replace(
      attention={'exact_tail': 3})
  params = init_params(config)
  chat = ChatSession(config, params, TinyChatTokenizer(), max_len=128)
  streamed = []
  first = chat.send('hi there', max_new_tokens=6, on_token=streamed.append)
  second = chat.send('and now?', max_new_tokens=6)
  assert ''.join(streamed) == first.text
  assert first.ttft_s > 0 and second.prompt_tokens > 0 and first.compiled
  # A third short turn reuses the compiled prefill, tail and step programs.
  third = chat.send('ok', max_new_tokens=2)
  assert not third.compiled
  assert len(chat.ids) == chat.cached + 1
  assert chat.messages[-1] == {'role': 'assistant', 'content': third.text}
  _assert_caches_equal(config, params, chat.cache, chat.ids[:-1])


def test_orthros_turns_short_window():
  """W = 4 < the conversation: the first turn equals `generate` with the
  same exact tail, and layer 0 (whose inputs are the embeddings) holds the
  keys and values of one prefill of the conversation and the linear state
  of one prefill of the tokens it has folded."""
  config = make_config(window=4, chunk=4).replace(attention={'exact_tail': 2})
  params = init_params(config)
  tok = TinyChatTokenizer()
  chat = ChatSession(config, params, tok, max_len=128, system='be brief')
  first = chat.send('what is 2?', max_new_tokens=5)
  prompt = tok.encode(tok.apply_chat_template(
      [{'role': 'system', 'content': 'be brief'},
       {'role': 'user', 'content': 'what is 2?'}], add_generation_prompt=True))
  ref = oj.generate(config, params, [prompt], max_new_tokens=5, eos_id=EOS)
  n = int(ref.lengths[0])
  assert first.ids == ref.tokens[0, :n].tolist()
  chat.send('more', max_new_tokens=4)
  assert chat.cached == len(chat.ids) - 1
  # The state holds the turns' prefilled tokens (not the last reply's).
  assert 0 < int(chat.cache[0].folded[0]) < len(chat.ids) - 1 - 4
  _assert_caches_equal(config, params, chat.cache, chat.ids[:-1],
                       layers=(0,))


def test_chat_errors_keep_the_conversation():
  config = make_config(window=4, chunk=4)
  params = init_params(config)
  chat = ChatSession(config, params, TinyChatTokenizer(), max_len=60)
  chat.send('hi', max_new_tokens=3)
  ids, cached = list(chat.ids), chat.cached
  with pytest.raises(ValueError, match='max_len=60'):
    chat.send('a much longer message than fits', max_new_tokens=8)
  with pytest.raises(ValueError, match='max_new_tokens'):
    chat.send('x', max_new_tokens=0)
  assert chat.ids == ids and chat.cached == cached
  chat.send('ok', max_new_tokens=2)  # the session still works
  with pytest.raises(ValueError, match='max_len'):
    ChatSession(config, params, TinyChatTokenizer(), max_len=1)
  # A turn that fails after its tokens entered the cache (here the
  # streaming callback) leaves the session refusing further turns.

  def broken_pipe(_):
    raise BrokenPipeError

  chat = ChatSession(config, params, TinyChatTokenizer(), max_len=60)
  with pytest.raises(BrokenPipeError):
    chat.send('hi', max_new_tokens=3, on_token=broken_pipe)
  with pytest.raises(RuntimeError, match='new ChatSession'):
    chat.send('again', max_new_tokens=2)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + "
          "'\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          '{% endif %}')


def test_chat_command_two_turns(tmp_path):
  """chat.py with --prompt twice on a small random Llama saved by
  transformers, with a BPE tokenizer and a ChatML template: both turns
  stream, each prints its TTFT; dense and the same model's cache checks
  above cover the numbers."""
  tokenizers = pytest.importorskip('tokenizers')
  transformers = pytest.importorskip('transformers')
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<|endoftext|>', '<|im_start|>',
                                      '<|im_end|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(['hello how are you today', 'fine thanks'] * 5,
                          trainer)
  tok.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'chat_template': CHATML, 'eos_token': '<|im_end|>'}))
  cfg = transformers.LlamaConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=256, tie_word_embeddings=True)
  transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
  out = subprocess.run(
      [sys.executable, 'chat.py', f'--teacher={tmp_path}', '--attention=dense',
       '--prompt=hello', '--prompt=how are you', '--max_new_tokens=4',
       '--max_len=128'], capture_output=True, text=True, check=False,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines[0].startswith(f'[{tmp_path}') and 'dense attention' in lines[0]
  assert sum(line.startswith('[TTFT ') for line in lines) == 2
  assert '> hello' in lines and '> how are you' in lines
  assert 'INFO' not in out.stderr
  with pytest.raises(ValueError, match='needs an adapter'):
    load_chat_model(str(tmp_path), None, 'orthros')
  # An exported model directory (weights, config, tokenizer files) chats
  # the same: greedy, the same first reply.
  from orthros_jax.checkpoints import export  # pylint: disable=g-import-not-at-top
  export.main([str(tmp_path / 'exported'), f'--teacher={tmp_path}'])
  assert (tmp_path / 'exported' / 'tokenizer_config.json').is_file()
  again = subprocess.run(
      [sys.executable, 'chat.py', f'--model={tmp_path / "exported"}',
       '--prompt=hello', '--max_new_tokens=4', '--max_len=128'],
      capture_output=True, text=True, check=False, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  first_reply = lambda text: text.split('> hello\n')[1].split('\n[TTFT')[0]
  assert first_reply(again.stdout) == first_reply(out.stdout)


def test_bucket_widths():
  from orthros_jax.chat import _bucket  # pylint: disable=g-import-not-at-top
  assert [_bucket(n) for n in (1, 64, 65, 100)] == [64, 64, 128, 128]
