"""Stored retrieval cells: every finished (task, length, depth, row) cell of
an evaluation is one JSON line of `CELLS_FILE` in its output directory,
keyed by `cell_key`, so a killed evaluation resumes and a rerun computes
only what is missing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np

from orthros_jax.config import ModelConfig
from orthros_jax.evaluation import inference

CELLS_FILE = 'retrieval_cells.jsonl'
_KEY_ROUTE = {'inference': 'generate'}  # see cell_key


def model_fingerprint(config: ModelConfig, params, _cache=None) -> str:
  """sha256 (16 hex digits) of a row's config and every param's bytes: what
  a stored result was computed with. _cache (id -> digest) spares leaves
  that several rows share."""
  digest = hashlib.sha256(json.dumps(dataclasses.asdict(config),
                                     sort_keys=True).encode())
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = id(leaf)
    if _cache is None or key not in _cache:
      arr = np.ascontiguousarray(np.asarray(leaf))
      leaf_digest = hashlib.sha256(arr.tobytes()).hexdigest() + str(
          arr.dtype) + str(arr.shape)
      if _cache is not None:
        _cache[key] = leaf_digest
    else:
      leaf_digest = _cache[key]
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(leaf_digest.encode())
  return digest.hexdigest()[:16]


def read_cells(path: str) -> dict[str, list[dict]]:
  """Stored retrieval cells {key: [rows]} (a key leaves the example count
  out: rows of several counts may share it); a torn last line (a killed
  run) is skipped."""
  cells: dict[str, list[dict]] = {}
  if os.path.isfile(path):
    with open(path) as f:
      for line in f:
        try:
          entry = json.loads(line)
          cells.setdefault(entry['key'], []).append(entry['row'])
        except (ValueError, KeyError, TypeError, AttributeError):
          continue
  return cells


def append_cell(path: str, entry: dict) -> None:
  """Appends one JSON line, on a line of its own even after a torn one (a
  run killed mid-write leaves no newline)."""
  with open(path, 'a+b') as f:
    f.seek(0, os.SEEK_END)
    if f.tell():
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b'\n':
        f.write(b'\n')
    f.write((json.dumps(entry, default=str) + '\n').encode())
    f.flush()
    os.fsync(f.fileno())


def first_examples(row: dict, num: int) -> dict:
  """The row of a cell's first `num` examples, from a stored row of at
  least as many with per-example scores. Example i of a cell is built from
  (seed, i) alone (tasks.make_examples), so these are exactly the examples
  a cell of `num` would hold."""
  scores = row['scores'][:num]
  if len(scores) != num:
    raise ValueError(f'a stored cell of {len(row["scores"])} examples cannot '
                     f'give {num}')
  full = sum(x >= 1.0 for x in scores)
  lo, hi = inference.wilson_interval(round(sum(scores)), num)
  return dict(row, accuracy=float(np.mean(scores)), exact=full / num, n=num,
              ci95=[lo, hi],
              exact_ci95=list(inference.wilson_interval(full, num)),
              scores=list(scores), samples=row['samples'][:num])


def stored_row(rows: list[dict], num: int) -> dict | None:
  """A stored row of exactly `num` examples, else one derived from the
  smallest stored row with more (and per-example scores); None if none."""
  for row in rows:
    if row.get('n') == num:
      return row
  larger = [r for r in rows if r.get('n', 0) > num and 'scores' in r]
  if larger:
    return first_examples(min(larger, key=lambda r: r['n']), num)
  return None


def cell_batch(num: int, most: int = 8) -> int:
  """The batch size for a cell of `num` examples: at most `most` prompts,
  split as evenly as possible (20 -> 7 + 7 + 6, not 8 + 8 + 4 padded to 8),
  so padding rows (repeats of the last prompt) cost at most one per batch."""
  batches = -(-num // most)
  return -(-num // batches)


def cell_key(task: str, length: int, depth, seed: int, options: dict,
             budget, name: str, route: str, fingerprint: str | None) -> str:
  """The key a retrieval cell is stored under: everything that decides its
  examples and answers (task, length, depth, seed, task options, generation
  budget) and the row (name, route, `model_fingerprint`); the example count
  is left out (`stored_row` serves a smaller count from a larger cell).
  The route 'inference' hashes under its earlier name, 'generate', so cells
  stored before the rename stay valid."""
  route = _KEY_ROUTE.get(route, route)
  return hashlib.sha256(json.dumps(
      [task, length, depth, seed, options, budget, name, route, fingerprint],
      sort_keys=True, default=str).encode()).hexdigest()
