"""The teacher of a conversion and the student built on it: loading the
dense model a config names, the converted model's config, and its initial
params (the teacher's plus fresh feature maps and window weights). Shared
by the pipeline (convert.py) and the adapter export."""

from __future__ import annotations

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
from orthros_jax.training import checkpoint as ckpt_lib


def load_teacher(teacher_cfg: Mapping[str, Any]
                 ) -> tuple[ModelConfig, dict, dict]:
  """(dense config, params, info) of the teacher named by `teacher_cfg`:
  exactly one of checkpoint (a train.py workdir or checkpoints dir) and
  hf_dir (a local Hugging Face Llama/Mistral/Qwen2 directory)."""
  ckpt = teacher_cfg.get('checkpoint') or ''
  hf_dir = teacher_cfg.get('hf_dir') or ''
  if bool(ckpt) == bool(hf_dir):
    raise ValueError('set exactly one of teacher.checkpoint (a train.py '
                     'workdir) and teacher.hf_dir (a Hugging Face directory); '
                     f'got checkpoint={ckpt!r}, hf_dir={hf_dir!r}')
  if hf_dir:
    config, params = load_hf(hf_dir)
    return config, params, {'source': 'hf', 'path': os.path.abspath(hf_dir),
                            'train_tokens': teacher_cfg.get('train_tokens')}
  step = teacher_cfg.get('step')
  step = None if step is None or step < 0 else step
  params, config_dict, step = ckpt_lib.load_params(ckpt, step)
  config = model_config_from(config_dict)
  if config.is_orthros:
    raise ValueError(
        f'the teacher checkpoint {ckpt} is already an Orthros model '
        f'(attention.kind={config.attention.kind!r}); convert a dense model')
  ckpt_lib.check_params(config, params, f'teacher checkpoint {ckpt}')
  tokens = teacher_cfg.get('train_tokens') or _train_tokens(ckpt, step)
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
  """The teacher's params plus fresh feature maps and window weights."""
  params = jax.tree.map(jnp.copy, teacher_params)
  for layer, extra in init_orthros_params(config, rng).items():
    params[layer] = dict(params[layer], attn=dict(params[layer]['attn'],
                                                  **extra['attn']))
  return params
