"""The stdlib-docstring conversion corpus: extraction, the eval-text guarantee,
the split rule, determinism and caching. Built over a small fake library in a
tmp dir, except one check on a few real stdlib modules."""

import hashlib
import json
import os
import textwrap

import pytest

from orthros_jax.data import corpus, synthetic
from orthros_jax.data.text import read_documents
from orthros_jax.evaluation import tasks

PROSE = ('This paragraph is ordinary prose about a small helper that reads a '
         'file, parses its contents and returns a list of records to the caller. ')
LONG = (PROSE * 4).strip()  # ~ 350 characters


def module(doc: str, body: str = '') -> str:
  return f'"""{doc}"""\n\n' + textwrap.dedent(body)


def write(root, rel, text):
  path = os.path.join(root, *rel.split('/'))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)


ALPHA = module('Alpha module.\n\n    Indented second paragraph.', f'''
    import os

    def first(a, b=1, *args, key=None, **kw):
        """First function.

        {LONG}
        """

    class Widget(object):
        """A widget."""

        def method(self, x):
            """Method doc."""
            def inner():
                """Inner doc."""

        async def fetch(self):
            """Async doc."""

        def undocumented(self):
            return 1

    def last():
        """Last function."""
    ''')


def read_jsonl(path):
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def fake_root(tmp_path, files):
  root = tmp_path / 'lib'
  for rel, text in files.items():
    write(root, rel, text)
  return str(root)


def all_docs(out):
  return {r['source']: r['text'] for s in corpus.SPLITS
          for r in read_jsonl(os.path.join(out, f'{s}.jsonl'))}


# ---------------------------------------------------------------- extraction

def test_document_in_source_order_with_headings():
  doc = corpus.extract_document(ALPHA)
  expected = '\n\n'.join([
      'Alpha module.\n\nIndented second paragraph.',
      'def first(a, b=1, *args, key=None, **kw):\nFirst function.\n\n' + LONG.strip(),
      'class Widget:\nA widget.',
      'def method(self, x):\nMethod doc.',
      'def inner():\nInner doc.',
      'async def fetch(self):\nAsync doc.',
      'def last():\nLast function.',
  ])
  assert doc == expected


def test_skips_test_dirs_short_and_broken_files(tmp_path):
  long_doc = module(LONG)
  root = fake_root(tmp_path, {
      'alpha.py': ALPHA,
      'pkg/__init__.py': long_doc,
      'pkg/beta.py': long_doc,
      'short.py': module('Too short.'),
      'broken.py': module(LONG, 'def oops(:\n    pass\n'),
      'test/test_x.py': long_doc,
      'pkg/tests/test_y.py': long_doc,
      'idlelib/idle_test/t.py': long_doc,
      'lib2to3/tests/data/z.py': long_doc,
      'site-packages/thing/m.py': long_doc,
      '__pycache__/c.py': long_doc,
      'notes.txt': LONG,
  })
  manifest = corpus.build_corpus(str(tmp_path / 'out'), root=root, min_chars=300)
  assert sorted(all_docs(tmp_path / 'out')) == ['alpha.py', 'pkg/__init__.py', 'pkg/beta.py']
  assert manifest['files'] == 5  # alpha, pkg/__init__, pkg/beta, short, broken
  assert manifest['skipped'] == {'unparsable': 1, 'unparsable_files': ['broken.py'],
                                 'under_min_chars': 1}
  for split in corpus.SPLITS:  # the project's text loader reads the output
    rows = read_jsonl(tmp_path / 'out' / f'{split}.jsonl')
    assert list(read_documents(str(tmp_path / 'out' / f'{split}.jsonl'))) == [
        r['text'] for r in rows]
    assert [r['source'] for r in rows] == sorted(r['source'] for r in rows)
    assert manifest['splits'][split]['documents'] == len(rows)
    assert manifest['splits'][split]['characters'] == sum(len(r['text']) for r in rows)


# ---------------------------------------------------------------- eval text

def test_rejects_documents_with_eval_templates(tmp_path):
  sentence = synthetic.haystack_sentences()[100].strip()
  wrapped = '\n    '.join(textwrap.wrap(sentence.upper(), 30))  # case and line breaks differ
  offending = {
      'needle.py': LONG + synthetic.NIAH_NEEDLE.format(value=1234567),
      'keyed.py': LONG + synthetic.NIAH_QUESTION_KEYED.format(key='green-river'),
      'passkey.py': LONG + synthetic.PASSKEY_KEY.format(key=54321),
      'noise.py': LONG + ''.join(synthetic.PASSKEY_FILLER[:2]),
      'ruler.py': LONG + tasks.RULER_NEEDLE.format(kinds='numbers', key='x', value=7),
      'essay.py': LONG + '\n    ' + wrapped,
      'glued.py': LONG + ' ("' + synthetic.PASSKEY_INTRO + '")',  # no space before
  }
  for text in offending.values():
    assert corpus.contains_eval_text(text)
  assert not corpus.contains_eval_text(LONG + ' The magic number is 42. Pass keyword arguments.')
  root = fake_root(tmp_path, {**{k: module(v) for k, v in offending.items()},
                              'clean.py': module(LONG)})
  manifest = corpus.build_corpus(str(tmp_path / 'out'), root=root, min_chars=300)
  assert sorted(all_docs(tmp_path / 'out')) == ['clean.py']
  rejected = manifest['rejected_eval_text']
  assert rejected['documents'] == len(offending)
  assert rejected['files']['needle.py'] == ['synthetic.NIAH_NEEDLE']
  assert rejected['files']['essay.py'] == ['synthetic.haystack_sentences()']
  assert rejected['files']['ruler.py'] == ['tasks.RULER_NEEDLE']


def test_eval_phrases_cover_every_template():
  origins = set(corpus.eval_phrases().values())
  for name in ('PASSKEY_INTRO', 'PASSKEY_FILLER', 'PASSKEY_KEY', 'PASSKEY_QUESTION',
               'NIAH_NEEDLE', 'NIAH_QUESTION', 'NIAH_NEEDLE_KEYED', 'NIAH_QUESTION_KEYED'):
    assert f'synthetic.{name}' in origins
  for name in ('RULER_HEAD', 'RULER_NEEDLE', 'RULER_QUESTION_ONE', 'RULER_QUESTION_ALL',
               'VT_HEAD', 'VT_QUESTION', 'CWE_HEAD', 'CWE_QUESTION', 'FWE_HEAD', 'FWE_QUESTION'):
    assert f'tasks.{name}' in origins
  assert 'synthetic.haystack_sentences()' in origins


# --------------------------------------------------------------------- split

def test_split_rule_and_fraction():
  rel = 'email/message.py'
  digest = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
  assert corpus.is_heldout(rel, 50) == (digest % 1000 < 50)
  paths = [f'pkg{i // 100}/mod_{i}.py' for i in range(20000)]
  for per_mille in (50, 200):
    frac = sum(corpus.is_heldout(p, per_mille) for p in paths) / len(paths)
    assert abs(frac - per_mille / 1000) < 0.01
  assert not any(corpus.is_heldout(p, 0) for p in paths[:500])
  assert all(corpus.is_heldout(p, 1000) for p in paths[:500])


def test_split_depends_on_path_only(tmp_path):
  doc = module(LONG)
  names = [f'm{i}.py' for i in range(12)]
  roots = [fake_root(tmp_path / 'a', {n: doc for n in names[:8]}),
           fake_root(tmp_path / 'b', {n: doc for n in names[4:] + ['extra.py']})]
  splits = []
  for i, root in enumerate(roots):
    out = str(tmp_path / f'out{i}')
    corpus.build_corpus(out, root=root, min_chars=300, heldout_per_mille=500)
    splits.append({r['source']: s for s in corpus.SPLITS
                   for r in read_jsonl(os.path.join(out, f'{s}.jsonl'))})
  for name in names[4:8]:
    assert splits[0][name] == splits[1][name]
  for found in splits:
    assert {n: s == 'heldout' for n, s in found.items()} == {
        n: corpus.is_heldout(n, 500) for n in found}
  assert set(splits[0].values()) == {'train', 'heldout'}  # both splits used at 50%


# ------------------------------------------------------- determinism, caching

def test_byte_identical_and_cached(tmp_path, monkeypatch):
  root = fake_root(tmp_path, {'alpha.py': ALPHA, 'b/c.py': module(LONG),
                              'u.py': module(LONG + ' Unicode: na\u00efve caf\u00e9 \u2014 ok.')})
  outs = [str(tmp_path / 'x'), str(tmp_path / 'y')]
  manifests = [corpus.build_corpus(o, root=root, min_chars=300) for o in outs]
  assert manifests[0] == manifests[1]
  for name in ('train.jsonl', 'heldout.jsonl', 'manifest.json'):
    with open(os.path.join(outs[0], name), 'rb') as f0, open(os.path.join(outs[1], name), 'rb') as f1:
      assert f0.read() == f1.read()
  assert not [p for p in os.listdir(tmp_path) if p.startswith('.')]  # no temp dirs left

  def no_rebuild(*args, **kwargs):
    raise AssertionError('rebuilt')

  monkeypatch.setattr(corpus, '_documents', no_rebuild)
  assert corpus.build_corpus(outs[0], root=root, min_chars=300) == manifests[0]
  with pytest.raises(AssertionError, match='rebuilt'):  # other parameters: rebuild
    corpus.build_corpus(outs[0], root=root, min_chars=301)
  assert corpus.build_corpus(outs[0], root=root, min_chars=300) == manifests[0]  # left intact
  monkeypatch.undo()
  with open(os.path.join(outs[0], 'train.jsonl'), 'a', encoding='utf-8') as f:
    f.write('{"text": "tampered"}\n')
  assert corpus.build_corpus(outs[0], root=root, min_chars=300) == manifests[0]  # rebuilt
  with open(os.path.join(outs[0], 'train.jsonl'), 'rb') as f0, \
      open(os.path.join(outs[1], 'train.jsonl'), 'rb') as f1:
    assert f0.read() == f1.read()


# -------------------------------------------------------------- real stdlib

def test_real_stdlib_documents_have_no_eval_text(tmp_path):
  include = ('bisect.py', 'textwrap.py', 'heapq.py', 'json/', 'string.py', 'pdb.py')
  manifest = corpus.build_corpus(str(tmp_path / 'out'), include=include)
  docs = all_docs(tmp_path / 'out')
  assert docs and all(any(s.startswith(p) for p in include) for s in docs)
  assert manifest['splits']['train']['documents'] > 0
  for text in docs.values():
    assert not corpus.contains_eval_text(text)


def test_count_tokens_counts_documents_and_eos(tmp_path):
  """With the byte tokenizer a document of n ASCII characters is n tokens,
  plus its eos."""
  root = fake_root(tmp_path, {'alpha.py': ALPHA, 'b/c.py': module(LONG)})
  out = tmp_path / 'out'
  corpus.build_corpus(out, root=root, min_chars=300)
  counts = corpus.count_tokens(out, 'byte')
  for split in ('train', 'heldout'):
    with open(out / f'{split}.jsonl', encoding='utf-8') as f:
      docs = [json.loads(line)['text'] for line in f if line.strip()]
    assert counts[split] == sum(len(d.encode('utf-8')) + 1 for d in docs)
  assert sum(counts.values()) > 0
