"""The package's import structure (docs/ARCHITECTURE.md, sections 2 and 6):
imports at the top of each module, run one way, no hidden global."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Function-local imports allowed: optional or heavy packages a module needs
# only on some paths (GGUF reading, tokenizers, chat templates, plots,
# lm-evaluation-harness, Python's own pydoc topics).
OPTIONAL = ('gguf', 'tokenizers', 'jinja2', 'matplotlib', 'lm_eval',
            'pydoc_data', 'orthros_jax.evaluation.lm_harness')


def _local_imports(path: pathlib.Path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for inner in ast.walk(node):
        if isinstance(inner, ast.Import):
          yield inner.lineno, [a.name for a in inner.names]
        elif isinstance(inner, ast.ImportFrom):
          yield inner.lineno, [f'{inner.module}.{a.name}'
                               for a in inner.names]


def test_no_function_local_imports_except_optional_packages():
  bad = []
  files = sorted((ROOT / 'orthros_jax').rglob('*.py')) + sorted(
      (ROOT / 'pallas_kernels').rglob('*.py'))
  assert len(files) > 40
  for path in files:
    for line, names in _local_imports(path):
      for name in names:
        if not any(name == m or name.startswith(m + '.') for m in OPTIONAL):
          bad.append(f'{path.relative_to(ROOT)}:{line} imports {name}')
  assert not bad, bad


def test_model_imports_no_sharding_and_sharding_no_global():
  """The model reads no partitioner: importing it loads no
  orthros_jax.sharding, and sharding keeps no current-partitioner state."""
  code = ('import sys, orthros_jax.model; '
          "assert 'orthros_jax.sharding' not in sys.modules; "
          'import orthros_jax.sharding as s; '
          "assert not hasattr(s, 'current'), 'sharding.current is back'")
  subprocess.run([sys.executable, '-c', code], check=True, cwd=str(ROOT))
