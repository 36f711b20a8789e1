"""A conversion corpus of generic English prose: the Python standard library's docstrings.

What: one document per `.py` file of the running interpreter's standard
library (`sysconfig.get_paths()['stdlib']`): the module docstring, then every
class, function and method docstring in source order, each after a short
heading line (`class Foo:`, `def bar(x, y=1):`, `async def baz(self):`),
separated by blank lines. Every docstring goes through `inspect.cleandoc`.
The files are parsed with `ast`, never imported, so reading them has no side
effects. Skipped: test packages (any `test/` or `tests/` directory,
`idlelib/idle_test`), `site-packages`, `__pycache__`, `pydoc_data` (the source
of the evaluation's essay haystack, see below), files that do not parse, and
documents under `min_chars` characters.

Why docstrings: they are written English prose about software (what a function
does, its arguments, caveats, examples), a fair stand-in for generic text when
converting a pretrained LLM's attention, and they ship with every interpreter,
so the corpus is built fully offline, deterministically for a given Python
version. Licence: the Python Software Foundation License (the interpreter's
`LICENSE.txt`).

No evaluation text: conversion data must never contain the evaluation's
templates or haystacks, so that every retrieval number stays zero-shot. A
document is rejected when `contains_eval_text` finds in it, case-insensitively
and after whitespace normalization, any phrase of `eval_phrases()`: the
literal pieces (between `{placeholders}` and newlines, of 3 words or more) of
every upper-case string constant of `orthros_jax.data.synthetic` (passkey and
needle templates, the passkey/noise filler sentences) and
every module of `orthros_jax.evaluation.tasks` (RULER heads, needles and
questions), plus every
sentence of the essay haystack (`synthetic.haystack_sentences()`, Python's
bundled documentation topics). The phrase list is read from those modules, so a
new template constant is covered without editing this file. The manifest
records how many documents were rejected and from which files. Whole-sentence
matching does not catch paraphrases: the essay haystack is Python documentation
too, so the corpus shares its domain and vocabulary, just not its sentences.

Split: a file goes to the held-out split when
`int(sha256(relative_path)[:8], 16) % 1000 < heldout_per_mille` (default 50,
i.e. about 5%), so a file's split depends on its path only, not on which other
files exist or on the Python version.

Output (`build_corpus`): `out_dir/train.jsonl` and `out_dir/heldout.jsonl`,
one `{"text": ..., "source": relative path}` per line sorted by relative path
(the format `orthros_jax.data.text.read_documents` reads), and
`out_dir/manifest.json`. Building twice gives byte-identical files. The
directory is written beside `out_dir` and moved into place with `os.replace`;
an existing `out_dir` whose manifest has the same Python version, parameters
and file hashes is returned as is.

CLI: `python -m orthros_jax.data.corpus OUT_DIR [--min_chars N]
[--heldout_per_mille N]`.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import platform
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from typing import Any, Iterator, Sequence

from tqdm import tqdm

from orthros_jax.data import synthetic
from orthros_jax.data.text import read_documents
from orthros_jax.data.tokenizers import get_tokenizer

CORPUS_FORMAT = 1  # bump when the extraction or the output format changes
SPLITS = ('train', 'heldout')
SKIP_DIRS = frozenset({'test', 'tests', 'idle_test', 'site-packages', '__pycache__',
                       'pydoc_data'})
MIN_PHRASE_WORDS = 3  # template pieces shorter than this are too generic to match on
EVAL_MODULES = ('orthros_jax.data.synthetic', 'orthros_jax.evaluation.tasks')

_PLACEHOLDER = re.compile(r'\{[^{}]*\}|\n')
_WORD = re.compile(r'[A-Za-z]+')


def stdlib_root() -> str:
  """The running interpreter's standard library directory."""
  return sysconfig.get_paths()['stdlib']


# -------------------------------------------------------------- eval phrases

def _normalize(text: str) -> str:
  """The haystack's normalization (ASCII typography, whitespace collapsed), lowercased."""
  text = text.translate(synthetic._ASCII)  # pylint: disable=protected-access
  text = text.encode('ascii', 'ignore').decode('ascii')
  return ' '.join(text.split()).lower()


def _template_pieces(template: str) -> list[str]:
  """Literal pieces of a template between placeholders and newlines, of >= 3 words."""
  pieces = [p.strip() for p in _PLACEHOLDER.split(template)]
  return [p for p in pieces if len(_WORD.findall(p)) >= MIN_PHRASE_WORDS]


def _eval_modules() -> Iterator[tuple[str, Any]]:
  """(label, module) of EVAL_MODULES; a package contributes every module in
  it (the evaluation's task templates live in the modules of
  `orthros_jax.evaluation.tasks`), labelled by the package's short name, so
  a template in a new task module is covered without editing this file."""
  for module_name in EVAL_MODULES:
    module = importlib.import_module(module_name)
    short = module_name.rsplit('.', 1)[-1]
    yield short, module
    for info in pkgutil.walk_packages(getattr(module, '__path__', ()),
                                      module_name + '.'):
      yield short, importlib.import_module(info.name)


@functools.lru_cache(maxsize=1)
def eval_phrases() -> dict[str, str]:
  """{normalized phrase: where it comes from} for every evaluation template and haystack.

  Template pieces come from every module-level upper-case `str` (or tuple of
  `str`) of EVAL_MODULES; the essay haystack adds each of its sentences.
  """
  phrases: dict[str, str] = {}
  for short, module in _eval_modules():
    for name in sorted(vars(module)):
      value = getattr(module, name)
      if not name.isupper():
        continue
      strings = ([value] if isinstance(value, str) else list(value)
                 if isinstance(value, tuple) and all(isinstance(v, str) for v in value)
                 else [])
      for s in strings:
        for piece in _template_pieces(s):
          phrases.setdefault(_normalize(piece), f'{short}.{name}')
  synthetic = importlib.import_module('orthros_jax.data.synthetic')
  for sentence in synthetic.haystack_sentences():
    phrases.setdefault(_normalize(sentence), 'synthetic.haystack_sentences()')
  phrases.pop('', None)
  return phrases


@functools.lru_cache(maxsize=1)
def _phrase_index() -> tuple[dict[tuple[str, str], list[str]], tuple[str, ...]]:
  """Phrases of >= 4 words keyed by their 2nd and 3rd words, and the shorter ones.

  Those two words have a space on both sides inside the phrase, so wherever
  the phrase occurs in a normalized text they are two consecutive whole
  space-separated tokens of that text: a cheap exact prefilter.
  """
  keyed: dict[tuple[str, str], list[str]] = {}
  short = []
  for phrase in eval_phrases():
    tokens = phrase.split(' ')
    if len(tokens) >= 4:
      keyed.setdefault((tokens[1], tokens[2]), []).append(phrase)
    else:
      short.append(phrase)
  return keyed, tuple(short)


def eval_text_hits(text: str) -> list[str]:
  """The eval phrases (normalized) found in `text`, in eval_phrases() order."""
  norm = _normalize(text)
  keyed, short = _phrase_index()
  tokens = norm.split(' ')
  found = {p for pair in set(zip(tokens, tokens[1:])) if pair in keyed
           for p in keyed[pair] if p in norm}
  found.update(p for p in short if p in norm)
  return [p for p in eval_phrases() if p in found]


def contains_eval_text(text: str) -> bool:
  """Whether `text` contains any evaluation template piece or haystack sentence (case-insensitive)."""
  return bool(eval_text_hits(text))


# ---------------------------------------------------------------- extraction

def is_heldout(relpath: str, heldout_per_mille: int = 50) -> bool:
  """The split rule: sha256 of the '/'-separated relative path, first 8 hex digits, mod 1000."""
  digest = hashlib.sha256(relpath.encode('utf-8')).hexdigest()
  return int(digest[:8], 16) % 1000 < heldout_per_mille


def source_files(root: str, include: Sequence[str] | None = None) -> list[str]:
  """Sorted '/'-separated relative paths of the `.py` files under `root`, skipping SKIP_DIRS.

  include: keep only paths equal to or starting with one of these prefixes
  (e.g. 'json/', 'textwrap.py').
  """
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
    rel_dir = os.path.relpath(dirpath, root)
    for name in filenames:
      if name.endswith('.py'):
        rel = name if rel_dir == '.' else f'{rel_dir}/{name}'.replace(os.sep, '/')
        if include is None or any(rel.startswith(p) for p in include):
          found.append(rel)
  return sorted(found)


def _clean(doc: str) -> str:
  doc = inspect.cleandoc(doc)
  return doc.encode('utf-8', 'replace').decode('utf-8')  # lone surrogates -> '?'


def _heading(node: ast.AST) -> str:
  if isinstance(node, ast.ClassDef):
    return f'class {node.name}:'
  prefix = 'async def' if isinstance(node, ast.AsyncFunctionDef) else 'def'
  return f'{prefix} {node.name}({ast.unparse(node.args)}):'


def extract_document(source: bytes | str) -> str:
  """The document of one source file ('' when it has no docstring); raises SyntaxError/ValueError."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # invalid escape sequences in old modules
    tree = ast.parse(source)
  parts = []
  module_doc = ast.get_docstring(tree, clean=False)
  if module_doc and module_doc.strip():
    parts.append(_clean(module_doc))
  defs = [n for n in ast.walk(tree)
          if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
  for node in sorted(defs, key=lambda n: (n.lineno, n.col_offset)):
    doc = ast.get_docstring(node, clean=False)
    if doc and doc.strip():
      parts.append(f'{_heading(node)}\n{_clean(doc)}')
  return '\n\n'.join(parts)


def _documents(root: str, files: Sequence[str], progress: bool) -> Iterator[tuple[str, str | None]]:
  """(relative path, document or None when unparsable) per file, in order."""
  it = tqdm(files, desc='stdlib files', unit='file') if progress else files
  for rel in it:
    with open(os.path.join(root, rel), 'rb') as f:
      source = f.read()
    try:
      yield rel, extract_document(source)
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
      yield rel, None


# ------------------------------------------------------------------- output

def _sha256(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, 'sha256').hexdigest()


def _params(root: str, min_chars: int, heldout_per_mille: int,
            include: Sequence[str] | None) -> dict[str, Any]:
  return {'format': CORPUS_FORMAT, 'python_version': platform.python_version(),
          'python_implementation': sys.implementation.name, 'stdlib': root,
          'min_chars': min_chars, 'heldout_per_mille': heldout_per_mille,
          'include': None if include is None else sorted(include)}


def _existing(out_dir: str, params: dict[str, Any]) -> dict[str, Any] | None:
  """The manifest of `out_dir` when it was built with `params` and its files are intact."""
  try:
    with open(os.path.join(out_dir, 'manifest.json'), encoding='utf-8') as f:
      manifest = json.load(f)
    if any(manifest.get(k) != v for k, v in params.items()):
      return None
    for split in SPLITS:
      if _sha256(os.path.join(out_dir, f'{split}.jsonl')) != manifest['splits'][split]['sha256']:
        return None
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return manifest


def build_corpus(out_dir: str, *, min_chars: int = 500, heldout_per_mille: int = 50,
                 root: str | None = None, include: Sequence[str] | None = None,
                 progress: bool = False) -> dict[str, Any]:
  """Write train.jsonl, heldout.jsonl and manifest.json to `out_dir`; returns the manifest.

  root: the library to read (default: the running interpreter's stdlib).
  include: only files whose relative path starts with one of these prefixes.
  An `out_dir` already built with the same parameters is returned as is.
  """
  if min_chars < 0:
    raise ValueError(f'min_chars={min_chars} must be >= 0.')
  if not 0 <= heldout_per_mille <= 1000:
    raise ValueError(f'heldout_per_mille={heldout_per_mille} must be in [0, 1000].')
  root = os.path.abspath(root if root is not None else stdlib_root())
  if not os.path.isdir(root):
    raise FileNotFoundError(f'library root {root!r} is not a directory.')
  include = None if include is None else list(include)
  params = _params(root, min_chars, heldout_per_mille, include)
  out_dir = os.path.abspath(out_dir)
  manifest = _existing(out_dir, params)
  if manifest is not None:
    return manifest

  files = source_files(root, include)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.tmp-', dir=parent)
  try:
    counts = {s: {'documents': 0, 'characters': 0} for s in SPLITS}
    unparsable, short, rejected = [], 0, {}
    outs = {s: open(os.path.join(tmp, f'{s}.jsonl'), 'w', encoding='utf-8', newline='\n')
            for s in SPLITS}
    try:
      for rel, doc in _documents(root, files, progress):
        if doc is None:
          unparsable.append(rel)
          continue
        if len(doc) < min_chars:
          short += 1
          continue
        hits = eval_text_hits(doc)
        if hits:
          rejected[rel] = sorted({eval_phrases()[h] for h in hits})
          continue
        split = 'heldout' if is_heldout(rel, heldout_per_mille) else 'train'
        outs[split].write(json.dumps({'text': doc, 'source': rel}, ensure_ascii=False) + '\n')
        counts[split]['documents'] += 1
        counts[split]['characters'] += len(doc)
    finally:
      for f in outs.values():
        f.close()
    for split in SPLITS:
      counts[split]['sha256'] = _sha256(os.path.join(tmp, f'{split}.jsonl'))
    manifest = {
        **params,
        'files': len(files),
        'skipped': {'unparsable': len(unparsable), 'unparsable_files': unparsable,
                    'under_min_chars': short},
        'rejected_eval_text': {'documents': len(rejected), 'files': rejected},
        'eval_phrases': len(eval_phrases()),
        'splits': counts,
    }
    with open(os.path.join(tmp, 'manifest.json'), 'w', encoding='utf-8', newline='\n') as f:
      json.dump(manifest, f, indent=2, sort_keys=True)
      f.write('\n')
    os.chmod(tmp, 0o755)
    if os.path.exists(out_dir):  # os.replace cannot overwrite a non-empty directory
      old = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.old-', dir=parent)
      os.replace(out_dir, os.path.join(old, 'corpus'))
      os.replace(tmp, out_dir)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return manifest


def summary(manifest: dict[str, Any]) -> str:
  """A few lines describing a manifest."""
  lines = [f"Python {manifest['python_version']} stdlib {manifest['stdlib']}: "
           f"{manifest['files']} files, {manifest['skipped']['unparsable']} unparsable, "
           f"{manifest['skipped']['under_min_chars']} under {manifest['min_chars']} chars, "
           f"{manifest['rejected_eval_text']['documents']} rejected as eval text"]
  for split in SPLITS:
    s = manifest['splits'][split]
    lines.append(f"  {split:8s} {s['documents']:6d} documents {s['characters']:11,d} characters "
                 f"sha256 {s['sha256'][:16]}")
  return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(
      prog='python -m orthros_jax.data.corpus',
      description='Build the stdlib-docstring conversion corpus (train/heldout jsonl + manifest).')
  parser.add_argument('out_dir')
  parser.add_argument('--min_chars', type=int, default=500)
  parser.add_argument('--heldout_per_mille', type=int, default=50)
  parser.add_argument('--tokenizer', default=None,
                      help='also count tokens per split with this tokenizer '
                      "(a tokenizer.json or a directory holding one, or 'byte')")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  manifest = build_corpus(args.out_dir, min_chars=args.min_chars,
                          heldout_per_mille=args.heldout_per_mille, progress=True)
  print(summary(manifest))
  if args.tokenizer:
    counts = count_tokens(args.out_dir, args.tokenizer)
    print('tokens (documents + eos, ' + args.tokenizer + '): ' + ', '.join(
        f'{split} {n:,}' for split, n in counts.items()))
  print(f'{args.out_dir} ({time.perf_counter() - start:.1f} s)')
  return manifest


def count_tokens(out_dir: str | os.PathLike, tokenizer) -> dict[str, int]:
  """Tokens of each split as the text pipeline packs them (each document
  then its eos)."""
  tok = get_tokenizer(tokenizer)
  return {split: sum(len(tok.encode(doc)) + 1 for doc in read_documents(
      os.path.join(os.fspath(out_dir), f'{split}.jsonl')))
          for split in ('train', 'heldout')}


if __name__ == '__main__':
  main()
