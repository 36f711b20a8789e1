"""Local text corpora: read `.txt` / `.jsonl` files, tokenize, pack to fixed length.

Packing: every document is tokenized and followed by eos, all documents are
concatenated in file order, and the stream is cut into rows of `seq_len + 1`
tokens with stride `seq_len` (consecutive rows share one token), so every token
after the first is a next-token target exactly once. The last row is
right-padded with 0.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Iterator, Sequence

import numpy as np

from orthros_jax.data.tokenizers import Tokenizer

TEXT_SUFFIXES = ('.txt', '.jsonl')


def find_files(paths: str | Sequence[str]) -> list[str]:
  """Expand files, directories (searched recursively) and glob patterns into sorted text files."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  if not paths:
    raise ValueError('no text paths given; set paths= to .txt/.jsonl files or directories.')
  files: list[str] = []
  for path in map(os.fspath, paths):
    if os.path.isdir(path):
      found = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names
               if name.endswith(TEXT_SUFFIXES)]
      if not found:
        raise ValueError(f'empty data source: no .txt or .jsonl files under {path!r}.')
      files += sorted(found)
    elif os.path.isfile(path):
      if not path.endswith(TEXT_SUFFIXES):
        raise ValueError(f'unsupported text file {path!r}; expected one of {TEXT_SUFFIXES}.')
      files.append(path)
    else:
      found = sorted(p for p in glob.glob(path, recursive=True) if p.endswith(TEXT_SUFFIXES))
      if not found:
        raise FileNotFoundError(f'text path {path!r} matches no .txt or .jsonl file.')
      files += found
  return files


def read_documents(file: str, text_field: str = 'text') -> Iterator[str]:
  """A `.txt` file is one document; a `.jsonl` file has one document per line in `text_field`."""
  if file.endswith('.txt'):
    with open(file, encoding='utf-8') as f:
      yield f.read()
    return
  with open(file, encoding='utf-8') as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{file}:{line_no}: not valid JSON ({e}).') from e
      if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f'{file}:{line_no}: no string field {text_field!r}; set text_field= '
                         'to the name of the text field.')
      yield record[text_field]


def pack_tokens(files: Sequence[str], tokenizer: Tokenizer, seq_len: int,
                text_field: str = 'text') -> tuple[np.ndarray, np.ndarray]:
  """Tokenize and pack documents -> (rows [N, seq_len + 1] int32, lengths [N] int32)."""
  if seq_len < 1:
    raise ValueError(f'seq_len={seq_len} must be >= 1.')
  pieces = []
  for file in files:
    for doc in read_documents(file, text_field):
      if doc:
        pieces.append(np.asarray(tokenizer.encode(doc) + [tokenizer.eos_id], dtype=np.int32))
  stream = np.concatenate(pieces) if pieces else np.zeros([0], np.int32)
  if len(stream) < 2:  # one token (or none) has no next-token target
    raise ValueError(f'empty data source: no text in {list(files)!r}'
                     + (f" (field {text_field!r})" if any(f.endswith('.jsonl') for f in files)
                        else '') + '.')
  num_rows = math.ceil((len(stream) - 1) / seq_len)
  rows = np.zeros([num_rows, seq_len + 1], np.int32)  # [N, T + 1], 0 = pad
  lengths = np.zeros([num_rows], np.int32)
  for r in range(num_rows):
    chunk = stream[r * seq_len:r * seq_len + seq_len + 1]
    rows[r, :len(chunk)] = chunk
    lengths[r] = len(chunk)
  return rows, lengths


def load_packed(paths: str | Sequence[str], tokenizer: Tokenizer, seq_len: int,
                text_field: str = 'text') -> tuple[np.ndarray, np.ndarray]:
  """find_files + pack_tokens."""
  return pack_tokens(find_files(paths), tokenizer, seq_len, text_field)
