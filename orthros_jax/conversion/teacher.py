"""The teacher of a conversion and the student built on it: loading the
dense model a config names, the converted model's config, and its initial
params (the teacher's plus fresh feature maps and window weights). Shared
by the pipeline (convert.py) and the adapter export."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from orthros_jax.checkpoints.hf import load_hf
from orthros_jax.checkpoints.hf import read_json
from orthros_jax.config import AttentionConfig
from orthros_jax.config import ModelConfig
from orthros_jax.config import model_config_from
from orthros_jax.config import plain as _plain
from orthros_jax.model import init_orthros_params
from orthros_jax.layer_layout import layers_for
from orthros_jax.layer_layout import unstack_layers
from orthros_jax.training import checkpoint as ckpt_lib


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
  """Which dense model a conversion starts from (config.teacher): exactly
  one of checkpoint (a train.py workdir or checkpoints dir) and hf_dir (a
  local Hugging Face Llama/Mistral/Qwen2 directory); step (a checkpoint's
  step, None = the latest); train_tokens (its pretraining tokens for the
  report, None = read from the workdir when it can be)."""
  checkpoint: str = ''
  hf_dir: str = ''
  step: int | None = None
  train_tokens: int | None = None

  def __post_init__(self):
    if bool(self.checkpoint) == bool(self.hf_dir):
      raise ValueError(
          'set exactly one of teacher.checkpoint (a train.py workdir) and '
          'teacher.hf_dir (a Hugging Face directory); got checkpoint='
          f'{self.checkpoint!r}, hf_dir={self.hf_dir!r}')

  @classmethod
  def from_config(cls, cfg: TeacherSpec | Mapping[str, Any]) -> TeacherSpec:
    """From a config dict; step < 0 and train_tokens <= 0 mean unknown."""
    if isinstance(cfg, TeacherSpec):
      return cfg
    cfg = dict(_plain(cfg))
    unknown = sorted(set(cfg) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f'teacher has unknown keys {unknown}; valid keys: '
                       'checkpoint, hf_dir, step, train_tokens')
    step = cfg.get('step')
    tokens = cfg.get('train_tokens')
    return cls(checkpoint=str(cfg.get('checkpoint') or ''),
               hf_dir=str(cfg.get('hf_dir') or ''),
               step=None if step is None or int(step) < 0 else int(step),
               train_tokens=int(tokens) if tokens else None)


def load_teacher(spec: TeacherSpec | Mapping[str, Any]
                 ) -> tuple[ModelConfig, dict, dict]:
  """(dense config, params, info) of the teacher `spec` names (a
  TeacherSpec, or a config dict it is parsed from)."""
  spec = TeacherSpec.from_config(spec)
  if spec.hf_dir:
    config, params = load_hf(spec.hf_dir)
    return config, params, {'source': 'hf',
                            'path': os.path.abspath(spec.hf_dir),
                            'train_tokens': spec.train_tokens}
  ckpt = spec.checkpoint
  params, config_dict, step = ckpt_lib.load_params(ckpt, spec.step)
  config = model_config_from(config_dict)
  if config.is_orthros:
    raise ValueError(
        f'the teacher checkpoint {ckpt} is already an Orthros model '
        f'(attention.kind={config.attention.kind!r}); convert a dense model')
  ckpt_lib.check_params(config, params, f'teacher checkpoint {ckpt}')
  tokens = spec.train_tokens or _train_tokens(ckpt, step)
  return config, params, {'source': 'checkpoint',
                          'path': os.path.abspath(ckpt), 'step': step,
                          'train_tokens': tokens}


def _train_tokens(workdir: str, step: int) -> int | None:
  """Tokens the teacher was trained on (steps x batch x seq_len), from the
  config.json train.py writes in its workdir; None when unknown."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    return None
  cfg = read_json(path)
  try:
    return int(step) * int(cfg['data']['batch_size']) * int(
        cfg['data']['seq_len'])
  except (KeyError, TypeError, ValueError):
    return None


def orthros_attention(attention: AttentionConfig | Mapping[str, Any]
                      ) -> AttentionConfig:
  """The converted model's AttentionConfig; raises unless kind='orthros'."""
  if not isinstance(attention, AttentionConfig):
    attention = AttentionConfig(**_plain(attention))
  if not attention.kind == 'orthros':
    raise ValueError(f"attention.kind={attention.kind!r}: convert.py builds "
                     "an Orthros model, set attention.kind='orthros'")
  return attention


def orthros_config(teacher: ModelConfig,
                   attention: AttentionConfig | Mapping[str, Any]
                   ) -> ModelConfig:
  """The teacher's config with Orthros `attention` (checked)."""
  return teacher.replace(attention=orthros_attention(attention))


def init_student(teacher_params: dict, config: ModelConfig,
                 rng: jax.Array) -> dict:
  """The teacher's params plus fresh feature maps and window weights, in
  the layer layout of `config` (scan_layers: stacked)."""
  params = jax.tree.map(jnp.copy, unstack_layers(teacher_params))
  for layer, extra in init_orthros_params(config, rng).items():
    params[layer] = dict(params[layer], attn=dict(params[layer]['attn'],
                                                  **extra['attn']))
  return layers_for(config, params)
