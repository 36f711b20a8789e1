"""Export (orthros_jax/checkpoints/export.py): a model written as a
self-describing directory loads back as the identical model (config with its
Orthros settings, parameters bit-identical, generation equal), in float32
and bfloat16; broken directories are errors naming the file; the command
writes the merged model of a teacher plus an adapter."""

import json

import jax
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax.checkpoints import export
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.conversion.lora import init_lora
from orthros_jax.model import init_orthros_params
from orthros_jax.training import checkpoint as ckpt_lib

from test_model import init_params, make_config

PROMPTS = [[5, 17, 3, 40, 22, 9, 61, 2, 33], [8, 1, 50, 23]]


def _same_tree(a, b):
  fa, ta = jax.tree_util.tree_flatten_with_path(a)
  fb, tb = jax.tree_util.tree_flatten_with_path(b)
  assert ta == tb
  for (path, x), (_, y) in zip(fa, fb):
    assert x.dtype == y.dtype, path
    np.testing.assert_array_equal(np.asarray(x, np.float32),
                                  np.asarray(y, np.float32), err_msg=str(path))


@pytest.mark.parametrize('param_dtype', ['float32', 'bfloat16'])
def test_round_trip_is_the_same_model(tmp_path, param_dtype):
  config = make_config(window=4, chunk=4, sinks=1, param_dtype=param_dtype,
                       dtype=param_dtype).replace(
                           attention={'exact_tail': 2, 'length_scale': True})
  params = init_params(config)
  out = export.save_model(tmp_path / 'model', config, params,
                          provenance={'made_by': 'test'})
  assert sorted(p.name for p in (tmp_path / 'model').iterdir()) == [
      export.WEIGHTS, export.CONFIG]
  loaded_config, loaded = export.load_model(out)
  assert loaded_config == config and export.is_model_dir(out)
  _same_tree(loaded, params)
  a = oj.generate(config, params, PROMPTS, max_new_tokens=4)
  b = oj.generate(loaded_config, loaded, PROMPTS, max_new_tokens=4)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  meta = json.loads((tmp_path / 'model' / export.CONFIG).read_text())
  assert meta['model_config']['attention']['window'] == 4
  assert meta['provenance'] == {'made_by': 'test'}


def test_broken_directories_name_the_file(tmp_path):
  config = make_config(window=4, chunk=4)
  params = init_params(config)
  with pytest.raises(ValueError, match='missing'):
    export.save_model(tmp_path / 'x', config,
                      {k: v for k, v in params.items() if k != 'embed'})
  good = export.save_model(tmp_path / 'good', config, params)
  cfg_file = tmp_path / 'good' / export.CONFIG
  weights = tmp_path / 'good' / export.WEIGHTS
  with pytest.raises(FileNotFoundError, match='model'):
    export.load_model(tmp_path / 'nowhere')
  # A config for another shape: the tensors do not fit it.
  meta = json.loads(cfg_file.read_text())
  meta['model_config']['embed_dim'] = 32
  other = tmp_path / 'other'
  other.mkdir()
  (other / export.CONFIG).write_text(json.dumps(meta))
  (other / export.WEIGHTS).write_bytes(weights.read_bytes())
  with pytest.raises(ValueError, match=f'{other / export.WEIGHTS}.*embed'):
    export.load_model(other)
  (other / export.CONFIG).write_text('{"format": "orthros-jax-mo')
  with pytest.raises(ValueError, match=f'{other / export.CONFIG} is not '
                     'valid JSON'):
    export.load_model(other)
  meta['model_config']['embed_dim'] = 24
  meta['format'] = 'something-else'
  (other / export.CONFIG).write_text(json.dumps(meta))
  with pytest.raises(ValueError, match='something-else'):
    export.load_model(other)
  (other / export.CONFIG).write_text(cfg_file.read_text())
  (other / export.WEIGHTS).write_bytes(weights.read_bytes()[:200])
  with pytest.raises(ValueError, match=f'{other / export.WEIGHTS} is not a '
                     'readable safetensors'):
    export.load_model(other)
  export.load_model(good)  # the good one is untouched
  # A foreign, non-empty directory is never replaced; a model is.
  foreign = tmp_path / 'foreign'
  foreign.mkdir()
  (foreign / 'notes.txt').write_text('keep me')
  with pytest.raises(FileExistsError, match='nothing was changed'):
    export.save_model(foreign, config, params)
  assert (foreign / 'notes.txt').read_text() == 'keep me'
  export.save_model(good, config, params)
  assert sorted(p.name for p in (tmp_path / 'good').iterdir()) == [
      export.WEIGHTS, export.CONFIG]


def test_command_merges_teacher_and_adapter(tmp_path):
  """`python -m orthros_jax.checkpoints.export OUT --teacher --adapter`
  writes the model apply_adapter builds (LoRA merged); the adapter is read
  by the same reader."""
  dense = make_config(kind='dense')
  teacher = init_params(dense)
  ckpt_lib.save_params(tmp_path / 'teacher', teacher, dense)
  student = make_config(window=4, chunk=4, sinks=1)
  params = jax.tree.map(lambda x: x, teacher)
  for layer, extra in init_orthros_params(student,
                                          jax.random.PRNGKey(3)).items():
    params[layer]['attn'].update(extra['attn'])
  lora = init_lora(params, jax.random.PRNGKey(4), rank=2)
  lora = jax.tree.map(lambda x: x + 0.01, lora)  # B != 0: a real delta
  adapter_lib.write_adapter(tmp_path / 'adapter', student, teacher, params,
                            lora, alpha=4.0)
  export.main([str(tmp_path / 'model'), f'--teacher={tmp_path / "teacher"}',
               f'--adapter={tmp_path / "adapter"}', '--exact_tail=3'])
  config, loaded = export.load_model(tmp_path / 'model')
  want_config, want = adapter_lib.apply_adapter(tmp_path / 'adapter', dense,
                                                teacher)
  assert config == want_config.replace(attention={'exact_tail': 3})
  _same_tree(loaded, want)
