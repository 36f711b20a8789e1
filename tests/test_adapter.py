"""The conversion's adapter: what a LoRA conversion adds to its teacher,
written alone and applied back (orthros_jax/conversion/adapter.py), against
the merged params convert.py saves and the conversion's own stage-2
checkpoint; continuing from an adapter (stage1/stage2.from_adapter); its
errors. (Split from tests/test_convert.py; the conversion it reads is the
session fixture `converted`, tests/conversion_fixtures.py.)"""

import os

import jax
import numpy as np
import pytest

from orthros_jax.config import model_config_from
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.conversion import pipeline
from orthros_jax.conversion import plan as plan_lib
from orthros_jax.evaluation import loading
from orthros_jax.training import checkpoint as ckpt_lib
from tests.conversion_fixtures import convert_config
from tests.conversion_fixtures import load_teacher

pytestmark = pytest.mark.filterwarnings(
    'ignore:Some donated buffers were not usable')


def test_convert_writes_an_adapter_that_rebuilds_the_model(converted,
                                                           teacher_dir):
  workdir, _ = converted
  adapter = workdir / 'adapter'
  assert adapter_lib.is_adapter(adapter)
  t_config, t_params = load_teacher(teacher_dir)
  config, params = adapter_lib.apply_adapter(adapter, t_config, t_params)
  merged, merged_cfg, _ = ckpt_lib.load_params(workdir / 'orthros')
  assert config == model_config_from(merged_cfg) and config.is_orthros
  flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  want = dict(jax.tree_util.tree_flatten_with_path(merged)[0])
  assert flat.keys() == want.keys()
  for path, x in want.items():
    np.testing.assert_allclose(np.asarray(flat[path]), np.asarray(x),
                               rtol=1e-6, atol=1e-7, err_msg=str(path))
  # Only what the conversion adds is in the file: no MLP, no embeddings.
  meta, tensors = adapter_lib.read_adapter(adapter)
  assert meta['lora_rank'] == 8 and meta['lora_alpha'] == 16.0
  assert not any('mlp' in k or 'embed' in k for k in tensors)
  assert {k.rsplit('.', 1)[-1] for k in tensors} == {
      'proj', 'window_logit', 'lora_a', 'lora_b'}


def test_export_from_conversion_equals_the_pipeline_adapter(converted,
                                                            tmp_path):
  workdir, _ = converted
  out = adapter_lib.export_from_conversion(workdir, tmp_path / 'exported')
  _, a = adapter_lib.read_adapter(out)
  _, b = adapter_lib.read_adapter(workdir / 'adapter')
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  # After stage 1 alone: feature maps and windows, no LoRA.
  out1 = adapter_lib.export_from_conversion(workdir, tmp_path / 's1',
                                            stage='stage1')
  meta, t1 = adapter_lib.read_adapter(out1)
  assert meta['lora_rank'] == 0 and not any('lora' in k for k in t1)
  stage1, _, _ = ckpt_lib.load_params(workdir / 'stage1')
  np.testing.assert_array_equal(
      t1['layers_1.attn.phi_k.proj'],
      np.asarray(stage1['layers_1']['attn']['phi_k']['proj']))


def test_stage1_from_adapter_replaces_stage1(converted, teacher_dir,
                                            tmp_path):
  """stage1.from_adapter: stage 2 starts from the adapter's feature maps
  and windows (no stage-1 step runs), the report counts the adapter's
  stage-1 steps and tokens; a LoRA adapter or another attention config is
  refused naming the file."""
  workdir, report = converted
  s1 = adapter_lib.export_from_conversion(workdir, tmp_path / 's1',
                                          stage='stage1')
  c = convert_config(teacher_dir)
  c.stage1.from_adapter = str(s1)
  out = pipeline.convert(c, tmp_path / 'run')
  assert not (tmp_path / 'run' / 'stage1').exists()
  got = out['conversion']['stage1']
  assert got['steps'] == report['conversion']['stage1']['steps'] == 4
  assert got['tokens'] == report['conversion']['stage1']['tokens']
  assert got['from_adapter'] == str(s1)
  assert out['conversion']['tokens'] == report['conversion']['tokens']
  # The same stage-1 params: the same held-out transfer MSE, and stage 2's
  # frozen base carries the adapter's feature maps.
  assert got['mse_after'] == pytest.approx(
      report['conversion']['stage1']['mse_after'], rel=1e-6)
  stage2, _, _ = ckpt_lib.load_params(tmp_path / 'run' / 'stage2')
  _, t1 = adapter_lib.read_adapter(s1)
  np.testing.assert_array_equal(
      np.asarray(stage2['base']['layers_1']['attn']['phi_q']['proj']),
      t1['layers_1.attn.phi_q.proj'])
  assert 'from the adapter' in (tmp_path / 'run' / 'report.md').read_text()
  c.stage1.from_adapter = str(workdir / 'adapter')
  with pytest.raises(ValueError, match='adapter_config.json.*LoRA'):
    pipeline.convert(c, tmp_path / 'lora')
  c.stage1.from_adapter = str(s1)
  c.attention.window = 6
  with pytest.raises(ValueError, match='adapter_config.json.*window'):
    pipeline.convert(c, tmp_path / 'other')
  c.stage1.from_adapter = str(tmp_path / 'missing')
  with pytest.raises(ValueError, match='not an adapter directory'):
    pipeline.convert(c, tmp_path / 'missing_run')


def test_stage2_from_adapter_continues_its_lora(converted, teacher_dir,
                                                tmp_path):
  """stage2.from_adapter: no stage 1 runs, stage 2 starts from the
  adapter's feature maps, windows and LoRA factors (at a learning rate of
  1e-30 the continued adapter is the same adapter: every tensor within
  1e-20, where a fresh LoRA start would have B = 0), the report
  counts the adapter's stages and this one (also with the layers
  scanned); a stage-1 adapter, both
  from_adapter keys, another rank or full finetuning are refused."""
  workdir, report = converted
  c = convert_config(teacher_dir)
  c.stage2.from_adapter = str(workdir / 'adapter')
  c.stage2.learning_rate = 1e-30
  out = pipeline.convert(c, tmp_path / 'run')
  assert not (tmp_path / 'run' / 'stage1').exists()
  _, old = adapter_lib.read_adapter(workdir / 'adapter')
  meta, new = adapter_lib.read_adapter(tmp_path / 'run' / 'adapter')
  assert old.keys() == new.keys()
  assert any(np.any(old[k] != 0) for k in old if k.endswith('lora_b'))
  for k in old:
    np.testing.assert_allclose(new[k], old[k], rtol=0, atol=1e-20, err_msg=k)
  # The same with the layers scanned (the SmolLM2 recipe's default): the
  # adapter goes into the stacked layout and comes back out unchanged.
  c_scan = convert_config(teacher_dir)
  c_scan.stage2.from_adapter = str(workdir / 'adapter')
  c_scan.stage2.learning_rate = 1e-30
  c_scan.model.scan_layers = True
  pipeline.convert(c_scan, tmp_path / 'scan')
  _, scanned = adapter_lib.read_adapter(tmp_path / 'scan' / 'adapter')
  assert scanned.keys() == old.keys()
  for k in old:
    np.testing.assert_allclose(scanned[k], old[k], rtol=0, atol=1e-20,
                               err_msg=k)
  conv, before = out['conversion'], report['conversion']
  assert conv['stage1']['steps'] == before['stage1']['steps'] == 4
  assert conv['stage1']['tokens'] == before['stage1']['tokens']
  assert conv['stage2']['continued']['steps'] == 4
  assert conv['stage2']['continued']['tokens'] == before['stage2']['tokens']
  assert conv['tokens'] == before['tokens'] + conv['stage2']['tokens']
  # The merged checkpoint counts every step: 4 + 4 of the adapter, 4 here.
  assert out['checkpoint'].endswith(os.path.join('checkpoints', '12'))
  prov = meta['provenance']
  assert prov['stage2_from_adapter']['tokens'] == before['stage2']['tokens']
  assert 'continues the stage 2 of the adapter' in (
      tmp_path / 'run' / 'report.md').read_text()
  # Continuing the continued adapter counts both earlier stage 2 runs.
  c.stage2.from_adapter = str(tmp_path / 'run' / 'adapter')
  again = pipeline.convert(c, tmp_path / 'again')
  assert again['conversion']['stage2']['continued']['tokens'] == (
      2 * before['stage2']['tokens'])
  assert again['conversion']['stage1']['tokens'] == before['stage1']['tokens']
  s1 = adapter_lib.export_from_conversion(workdir, tmp_path / 's1',
                                          stage='stage1')
  c.stage2.from_adapter = str(s1)
  with pytest.raises(ValueError, match='adapter_config.json.*no LoRA'):
    pipeline.convert(c, tmp_path / 'bad1')
  c.stage2.from_adapter = str(workdir / 'adapter')
  c.stage1.from_adapter = str(s1)
  with pytest.raises(ValueError, match='both'):
    plan_lib.check_config(c)
  c.stage1.from_adapter = ''
  c.stage2.lora_rank = 4
  with pytest.raises(ValueError, match='adapter_config.json.*rank'):
    pipeline.convert(c, tmp_path / 'bad2')
  c.stage2.lora_rank = 0
  with pytest.raises(ValueError, match='lora_rank > 0'):
    plan_lib.check_config(c)
  c.stage2.lora_rank = 8
  c.stage2.from_adapter = str(tmp_path / 'missing')
  with pytest.raises(ValueError, match='not an adapter directory'):
    plan_lib.check_config(c)


def test_adapter_refuses_other_base_and_broken_files(converted, teacher_dir,
                                                     tmp_path):
  workdir, _ = converted
  t_config, t_params = load_teacher(teacher_dir)
  other = jax.tree.map(lambda x: x + 1e-3, t_params)
  with pytest.raises(ValueError, match='adapter_config.json.*other base'):
    adapter_lib.apply_adapter(workdir / 'adapter', t_config, other)
  with pytest.raises(ValueError, match='shape'):
    adapter_lib.apply_adapter(workdir / 'adapter',
                              t_config.replace(num_layers=1), t_params)
  broken = tmp_path / 'broken'
  broken.mkdir()
  with pytest.raises(FileNotFoundError, match='adapter_config.json'):
    adapter_lib.read_adapter(broken)
  (broken / 'adapter_config.json').write_text('{"lora_alpha": 1}')
  (broken / 'adapter.safetensors').write_bytes(b'garbage')
  with pytest.raises(ValueError, match='adapter_config.json'):
    adapter_lib.read_adapter(broken)
  with open(workdir / 'adapter' / 'adapter_config.json') as f:
    (broken / 'adapter_config.json').write_text(f.read())
  with pytest.raises(ValueError, match='adapter.safetensors'):
    adapter_lib.read_adapter(broken)


def test_eval_applies_an_adapter_to_its_teacher(converted, teacher_dir):
  workdir, _ = converted
  from configs import eval_tiny
  c = eval_tiny.get_config('smoke')
  c.checkpoint = str(workdir / 'adapter')
  c.teacher = ''
  with pytest.raises(ValueError, match='teacher='):
    loading.load_models(c)
  c.teacher = str(teacher_dir)
  c.models = ('teacher', 'orthros')
  models, desc = loading.load_models(c)
  merged, _, _ = ckpt_lib.load_params(workdir / 'orthros')
  np.testing.assert_allclose(
      np.asarray(models['orthros'][1]['layers_0']['attn']['q_proj']['kernel']),
      np.asarray(merged['layers_0']['attn']['q_proj']['kernel']), rtol=1e-6,
      atol=1e-7)
  assert 'adapter on' in desc['orthros']
