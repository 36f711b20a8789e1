"""Tokenizers for the data pipeline: a built-in byte-level one and local Hugging Face files.

Both expose the same small interface the pipeline and evaluation use:
`vocab_size`, `encode(str) -> list[int]` (no special tokens added),
`decode(list[int]) -> str` (special tokens skipped), `pad_id`, `bos_id`, `eos_id`.

Batches are always right-padded with id 0 (the batch contract); padded
positions carry loss weight 0 and sit after every valid token, so for a Hugging
Face vocabulary where 0 is a real token the padding is still inert.
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

from orthros_jax.checkpoints.hf import read_json


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int | None
  eos_id: int

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int]) -> str:
    ...


class ByteTokenizer:
  """UTF-8 bytes offset by 3: 0 = pad, 1 = bos, 2 = eos, byte b -> b + 3 (vocab 259)."""

  pad_id = 0
  bos_id = 1
  eos_id = 2
  num_special = 3
  vocab_size = 256 + num_special

  def encode(self, text: str) -> list[int]:
    return [b + self.num_special for b in text.encode('utf-8')]

  def decode(self, ids: Sequence[int]) -> str:
    data = bytearray()
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f'token id {i} is outside the byte vocabulary [0, {self.vocab_size}).')
      if i >= self.num_special:
        data.append(i - self.num_special)
    return data.decode('utf-8', errors='replace')

  def __repr__(self) -> str:
    return 'ByteTokenizer()'


# Common spellings of special tokens, tried in order when tokenizer_config.json
# does not name them.
_BOS_CANDIDATES = ('<|begin_of_text|>', '<s>', '<bos>', '[CLS]', '<|startoftext|>')
_EOS_CANDIDATES = ('<|end_of_text|>', '<|endoftext|>', '</s>', '<eos>', '[SEP]', '<|im_end|>')


def _chat_template(directory: str) -> str | None:
  """The Jinja chat template of tokenizer_config.json (or chat_template.jinja)."""
  path = os.path.join(directory, 'tokenizer_config.json')
  if os.path.isfile(path):
    template = read_json(path).get('chat_template')
    if isinstance(template, str):
      return template
  path = os.path.join(directory, 'chat_template.jinja')
  if os.path.isfile(path):
    with open(path, encoding='utf-8') as f:
      return f.read()
  return None


def _special_from_config(directory: str) -> dict[str, str]:
  """bos/eos token strings from tokenizer_config.json or special_tokens_map.json, if present."""
  found = {}
  for name in ('special_tokens_map.json', 'tokenizer_config.json'):  # later files win
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      continue
    cfg = read_json(path)
    for key in ('bos_token', 'eos_token'):
      value = cfg.get(key)
      if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get('content')
      if isinstance(value, str):
        found[key] = value
  return found


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer read from a local tokenizer.json (never downloads).

  `path` is the tokenizer.json file or a directory holding it. bos/eos are
  taken from the arguments, else from tokenizer_config.json /
  special_tokens_map.json beside the file, else from common spellings
  (`</s>`, `<|endoftext|>`, ...). An eos token is required: packed text
  separates documents with it and synthetic answers end with it.
  """

  pad_id = 0

  def __init__(self, path: str, *, bos_token: str | None = None, eos_token: str | None = None):
    import tokenizers  # pylint: disable=g-import-not-at-top

    path = os.fspath(path)
    file = os.path.join(path, 'tokenizer.json') if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise FileNotFoundError(
          f'tokenizer file not found: {file!r}. Pass a local tokenizer.json (or a directory '
          "holding one), or tokenizer='byte' for the built-in byte-level tokenizer.")
    self.path = file
    try:
      self._tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the tokenizers library's own error types
      raise ValueError(f'{file} is not a readable tokenizer.json ({e})'
                       ) from e
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    config = _special_from_config(os.path.dirname(file))
    self.bos_id = self._lookup('bos_token', bos_token or config.get('bos_token'), _BOS_CANDIDATES)
    self.eos_id = self._lookup('eos_token', eos_token or config.get('eos_token'), _EOS_CANDIDATES)
    if self.eos_id is None:
      raise ValueError(
          f'could not find an end-of-sequence token in {file!r}; pass eos_token=<a token of '
          'this vocabulary> (documents are separated and answers terminated by it).')
    self.chat_template = _chat_template(os.path.dirname(file))
    self._special = config
    # The end-of-sequence token's own text (decode drops special tokens).
    self.eos_token = self._tok.id_to_token(self.eos_id)

  def _lookup(self, field: str, token: str | None, candidates: Sequence[str]) -> int | None:
    if token is not None:
      token_id = self._tok.token_to_id(token)
      if token_id is None:
        raise ValueError(f'{field}={token!r} is not in the vocabulary of {self.path!r}.')
      return token_id
    for candidate in candidates:
      token_id = self._tok.token_to_id(candidate)
      if token_id is not None:
        return token_id
    return None

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def apply_chat_template(self, messages: Sequence[dict[str, str]], *,
                          add_generation_prompt: bool = False) -> str:
    """The conversation rendered with the model's own chat template.

    messages: [{'role': 'system' | 'user' | 'assistant', 'content': str}].
    Rendered as transformers does (sandboxed Jinja, trim_blocks and
    lstrip_blocks); `encode` of the result gives the prompt ids, the special
    tokens it spells included.
    """
    if self.chat_template is None:
      raise ValueError(f'{self.path!r} has no chat template (tokenizer_config.json '
                       "'chat_template' or chat_template.jinja beside it).")
    import jinja2  # pylint: disable=g-import-not-at-top
    from jinja2 import sandbox  # pylint: disable=g-import-not-at-top

    def raise_exception(message):
      raise jinja2.TemplateError(message)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals['raise_exception'] = raise_exception
    return env.from_string(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=self._special.get('bos_token', ''),
        eos_token=self._special.get('eos_token', ''))

  def __repr__(self) -> str:
    return f'HFTokenizer({self.path!r})'


def get_tokenizer(name_or_path: str | Tokenizer = 'byte') -> Tokenizer:
  """'byte' -> ByteTokenizer; a path -> HFTokenizer(path); a tokenizer object is returned as is."""
  if not isinstance(name_or_path, (str, os.PathLike)):
    return name_or_path
  if name_or_path == 'byte':
    return ByteTokenizer()
  return HFTokenizer(name_or_path)
