"""The grain input pipeline: synthetic task mixtures or packed local text, as fixed-shape batches.

Batch contract (every batch is a dict of numpy arrays; B is the per-process
batch, T = seq_len):
  'inputs'         [B, T] int32    tokens, right-padded with 0
  'targets'        [B, T] int32    inputs shifted by one (targets[t] = token t+1), 0 where none
  'weights'        [B, T] float32  1 where the loss counts: synthetic tasks only where the
                                   target is an answer token (answer + its eos); text every
                                   real next token; 0 on padding
  'prompt_lengths' [B]    int32    prompt tokens (the answer starts at this index of inputs);
                                   0 for text and for the filler task ("no prompt")

A synthetic example is `prompt + answer + [eos]`; no bos is added (packed text
has none either: eos separates documents).

Determinism and resumption: the dataset is a grain MapDataset pipeline read
through `to_iter_dataset`; `iter(ds)` is a `grain.DatasetIterator` whose
`get_state()` / `set_state()` (or orbax through `grain.checkpoint.CheckpointSave`
/ `CheckpointRestore`) resume exactly. Synthetic example i is a function of
(seed, i) only.

Multi-host: the global index space is split across JAX processes
(`grain.sharding.ShardByJaxProcess(drop_remainder=True)` by default), and
`batch_size` is the global batch: each process yields `batch_size //
process_count` rows.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from orthros_jax.data import synthetic, text
from orthros_jax.data.tokenizers import Tokenizer, get_tokenizer

DEFAULT_TASKS = {'passkey': 1.0, 'mqar': 1.0, 'filler': 1.0}
PAD_ID = 0


def example_arrays(tokens: Sequence[int] | np.ndarray, seq_len: int, *, loss_start: int,
                   prompt_length: int) -> dict[str, np.ndarray]:
  """One example of the batch contract from a full token sequence (len <= seq_len + 1).

  The loss counts at positions loss_start .. len(tokens) - 2 (targets that exist).
  """
  tokens = np.asarray(tokens, dtype=np.int32)
  n = len(tokens)
  if n > seq_len + 1:
    raise ValueError(f'example of {n} tokens does not fit seq_len={seq_len} (max seq_len + 1).')
  inputs = np.full([seq_len], PAD_ID, np.int32)
  targets = np.full([seq_len], PAD_ID, np.int32)
  weights = np.zeros([seq_len], np.float32)
  inputs[:n - 1] = tokens[:-1]
  targets[:n - 1] = tokens[1:]
  weights[loss_start:n - 1] = 1.0
  return {'inputs': inputs, 'targets': targets, 'weights': weights,
          'prompt_lengths': np.int32(prompt_length)}


def synthetic_arrays(example: synthetic.Example, seq_len: int, eos_id: int) -> dict[str, np.ndarray]:
  """prompt + answer + eos; the loss is on targets that are answer (or eos) tokens."""
  tokens = example.prompt + example.answer + [eos_id]
  prompt_length = len(example.prompt)
  return example_arrays(tokens, seq_len, loss_start=max(prompt_length - 1, 0),
                        prompt_length=prompt_length)


def _synthetic_row(index: int, mixture: synthetic.TaskMixture, seq_len: int,
                   eos_id: int) -> dict[str, np.ndarray]:
  return synthetic_arrays(mixture.example(index), seq_len, eos_id)


def _text_row(index: int, rows: np.ndarray, lengths: np.ndarray,
              seq_len: int) -> dict[str, np.ndarray]:
  return example_arrays(rows[index, :lengths[index]], seq_len, loss_start=0, prompt_length=0)


def _shard(ds: grain.MapDataset, options: grain.sharding.ShardOptions, finite: bool):
  if options.shard_count == 1:
    return ds
  if not finite:  # interleave an unbounded index space
    return ds[options.shard_index::options.shard_count]
  per_shard, rest = divmod(len(ds), options.shard_count)
  if options.drop_remainder or not rest:
    start, end = per_shard * options.shard_index, per_shard * (options.shard_index + 1)
  else:  # the first `rest` shards get one extra element
    start = per_shard * options.shard_index + min(options.shard_index, rest)
    end = start + per_shard + (options.shard_index < rest)
  if end <= start:
    raise ValueError(f'{len(ds)} sequences cannot be split over {options.shard_count} processes; '
                     'add data or lower the number of processes.')
  return ds[start:end]


def make_dataset(source: str = 'synthetic', *, seq_len: int, batch_size: int, seed: int = 0,
                 tasks: Mapping[str, float] | None = None,
                 task_options: Mapping[str, Mapping[str, Any]] | None = None,
                 paths: str | Sequence[str] = (), text_field: str = 'text',
                 tokenizer: str | Tokenizer = 'byte', num_epochs: int | None = None,
                 num_examples: int | None = None,
                 shard_options: grain.sharding.ShardOptions | None = None,
                 read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
  """A grain IterDataset of batches in the contract above; `iter()` it for a checkpointable iterator.

  Args:
    source: 'synthetic' (a task mixture) or 'text' (packed local files).
    seq_len: T, tokens per row.
    batch_size: global batch size (divisible by the number of processes).
    seed: data seed: synthetic content and the shuffle order.
    tasks: synthetic task -> weight (default passkey, mqar, filler equally). The
      passkey template alone is about 250 byte tokens, so with passkey in the mix
      seq_len must be at least that (a ValueError says so at construction).
    task_options: synthetic task -> generator keyword options (see synthetic.py).
    paths: text files, directories or globs (.txt, .jsonl) for source='text'.
    text_field: the jsonl field holding the text.
    tokenizer: 'byte', a tokenizer.json path, or a tokenizer object.
    num_epochs: passes over the data; None repeats forever. For synthetic data an
      epoch needs `num_examples`.
    num_examples: synthetic epoch size (a fixed, shuffled set of examples 0..n-1);
      None is an unbounded stream of fresh examples.
    shard_options: how to split across processes (default ShardByJaxProcess).
    read_options: grain threads / prefetch (default 2 threads, 8 batches).
  """
  if seq_len < 1:
    raise ValueError(f'seq_len={seq_len} must be >= 1.')
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be >= 1.')
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f'num_epochs={num_epochs} must be >= 1 or None (repeat forever).')
  tok = get_tokenizer(tokenizer)
  shard_options = shard_options or grain.sharding.ShardByJaxProcess(drop_remainder=True)
  local_batch, rest = divmod(batch_size, shard_options.shard_count)
  if rest or not local_batch:
    raise ValueError(f'batch_size={batch_size} must be a positive multiple of the number of '
                     f'processes ({shard_options.shard_count}).')

  if source == 'synthetic':
    mixture = synthetic.TaskMixture(tasks or DEFAULT_TASKS, tok, seq_len, seed=seed,
                                    options=task_options)
    if num_examples is None:
      if num_epochs is not None:
        raise ValueError('num_epochs needs num_examples for synthetic data (the default '
                         'stream of fresh examples is unbounded).')
      ds = _shard(grain.MapDataset.range(sys.maxsize), shard_options, finite=False)
    else:
      if num_examples < 1:
        raise ValueError(f'num_examples={num_examples} must be >= 1 or None.')
      ds = grain.MapDataset.range(num_examples).shuffle(seed=seed)
      ds = _shard(ds, shard_options, finite=True).repeat(num_epochs)
    # module-level functions (not lambdas) so grain's multiprocess prefetch can pickle them
    ds = ds.map(functools.partial(_synthetic_row, mixture=mixture, seq_len=seq_len,
                                  eos_id=tok.eos_id))
  elif source == 'text':
    if num_examples is not None:
      raise ValueError('num_examples applies to source="synthetic" only; text uses every '
                       'packed row of the files in paths.')
    rows, lengths = text.load_packed(paths, tok, seq_len, text_field)
    ds = grain.MapDataset.range(len(rows)).shuffle(seed=seed)
    ds = _shard(ds, shard_options, finite=True).repeat(num_epochs)
    ds = ds.map(functools.partial(_text_row, rows=rows, lengths=lengths, seq_len=seq_len))
  else:
    raise ValueError(f"source={source!r}; expected 'synthetic' or 'text'.")

  if len(ds) < local_batch:
    raise ValueError(f'only {len(ds)} sequences per process over num_epochs={num_epochs}, fewer '
                     f'than one batch of {local_batch}; lower batch_size or add data.')
  ds = ds.batch(local_batch, drop_remainder=True)
  read_options = read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
  return ds.to_iter_dataset(read_options)


def make_iterator(source: str = 'synthetic', **kwargs) -> grain.DatasetIterator:
  """iter(make_dataset(...)): a grain.DatasetIterator with get_state() / set_state()."""
  return iter(make_dataset(source, **kwargs))
