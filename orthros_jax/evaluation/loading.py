"""Loading the models an evaluation compares: a train.py / convert.py
checkpoint, a dense teacher (a local Hugging Face directory or a train.py
checkpoint), and the report rows of an eval config (`load_models`; the rows
themselves: evaluation/variants.py)."""

from __future__ import annotations

import os

from orthros_jax.checkpoints import hf as hf_lib
from orthros_jax.config import ModelConfig
from orthros_jax.config import model_config_from
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.evaluation import inference
from orthros_jax.evaluation import plan as plan_lib
from orthros_jax.evaluation import variants
from orthros_jax.training import checkpoint as ckpt_lib


def load_checkpoint(path: str, step: int | None = None
                    ) -> tuple[ModelConfig, dict, int]:
  """(model config, params, step) of a checkpoint of train.py /
  convert.py: a convert.py workdir (its orthros/ checkpoint), a train.py
  workdir, a params checkpoint (assets/tiny_teacher) or a checkpoints
  directory."""
  converted = os.path.join(os.fspath(path), 'orthros')
  if os.path.isdir(os.path.join(converted, 'checkpoints')):
    path = converted
  params, config, step = ckpt_lib.load_params(path, step)
  return model_config_from(config), params, step


def load_dense(path: str) -> tuple[ModelConfig, dict, str]:
  """(config, params, description) of a dense model: a local Hugging Face
  directory (config.json + safetensors, e.g. `make smollm2`'s export) or a
  train.py checkpoint."""
  path_ = os.fspath(path)
  if any(os.path.isfile(os.path.join(path_, name)) for name in (
      hf_lib.WEIGHTS_FILE, hf_lib.WEIGHTS_INDEX_FILE)):
    config, params = hf_lib.load_hf(path)
    where = f'{path} (Hugging Face directory)'
  else:
    config, params, step = load_checkpoint(path)
    where = f'{path} (step {step})'
  if config.is_orthros:
    raise ValueError(f'teacher {path} is not a dense model')
  return config, params, where


def load_models(config) -> tuple[dict, dict]:
  """({name: (config, params, path)}, descriptions) of the plan's models
  (an eval config is parsed first: evaluation/plan.py), in the order of
  variants.ROWS (evaluation/variants.py says what each is)."""
  plan = plan_lib.check_config(config)
  teacher_model = None
  if adapter_lib.is_adapter(plan.checkpoint):
    if not plan.teacher:
      raise ValueError(f'checkpoint {plan.checkpoint} is an adapter: set '
                       'teacher= to the dense model it applies to')
    teacher_model = load_dense(plan.teacher)
    student, params = adapter_lib.apply_adapter(
        plan.checkpoint, teacher_model[0], teacher_model[1])
    where = f'{plan.checkpoint} (adapter on {plan.teacher})'
  else:
    student, params, step = load_checkpoint(plan.checkpoint)
    where = f'{plan.checkpoint} (step {step})'
  if not student.is_orthros:
    raise ValueError(f'checkpoint {plan.checkpoint} is a dense model; '
                     'eval.py needs an Orthros checkpoint (convert.py makes '
                     'one) to report its baselines')
  if plan.exact_tail is not None:
    # An inference setting (how many prompt tokens decode exactly), the same
    # for every row on the converted weights; None: as converted.
    student = student.replace(attention={'exact_tail': plan.exact_tail})
  names = plan.models
  models, desc = {}, {}
  if 'teacher' in names:
    teacher, t_params, t_where = teacher_model or load_dense(plan.teacher)
    models['teacher'] = (teacher, t_params, 'inference')
    desc['teacher'] = f'{t_where}: the teacher as loaded, dense attention'
  rows, rows_desc = variants.converted_rows(
      student, params, [n for n in names if n not in ('teacher',
                                                       'linear_trained')],
      sinks=plan.sinks, where=where)
  models.update(rows)
  desc.update(rows_desc)
  if 'linear_trained' in names:
    path = plan.linear_checkpoint  # checked by plan.check_config
    lin, lin_params, lin_step = load_checkpoint(path)
    if lin.attention.window or lin.attention.sinks:
      raise ValueError(f'linear_checkpoint {path} has window '
                       f'{lin.attention.window} and sinks '
                       f'{lin.attention.sinks}: expected a pure-linear '
                       'conversion (window 0, no sinks)')
    models['linear_trained'] = (inference.pure_linear(lin), lin_params,
                                'prefill')
    desc['linear_trained'] = (f'{path} (step {lin_step}): its own weights, '
                              'converted with window 0 (the trained floor), '
                              'every token through the linear prefill')
  order = [n for n in variants.ROWS if n in models]
  return ({n: models[n] for n in order}, {n: desc[n] for n in order})
