"""A conversion config parsed once, into typed values: `check_config`.

convert.py hands its ml_collections config to `check_config`, which checks
every value before anything large loads (the teacher, the data) and returns
a frozen `ConversionPlan`; the pipeline (conversion/pipeline.py) reads only
the plan. The config's fields are documented in configs/convert_tiny.py:

  teacher:   TeacherSpec (conversion/teacher.py)
  attention: the Orthros AttentionConfig
  data:      make_dataset arguments for both stages (tokenizer included)
  stage1, stage2: token budget and TrainConfig fields; stage1.from_adapter;
             stage2's lora_rank (0 = full finetune), lora_alpha,
             lora_targets, kl_weight, hidden_weight, from_adapter
  eval:      EvalPlan (the held-out check after the conversion)
  model:     optional scan_layers / remat for teacher and student (the
             adapter and the report do not depend on them)
  mesh:      optional device mesh (orthros_jax/sharding/)
  seed, progress
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from orthros_jax.config import AttentionConfig
from orthros_jax.config import ModelConfig
from orthros_jax.config import plain
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.conversion.teacher import TeacherSpec
from orthros_jax.conversion.teacher import orthros_attention
from orthros_jax.conversion.transfer import TRANSFER_PARAMS
from orthros_jax.data import make_dataset
from orthros_jax.training import loop
from orthros_jax.training import step as step_lib

_STAGE_KEYS = {'tokens'} | {f for f in loop.TrainConfig.__dataclass_fields__
                            if f not in ('num_steps', 'trainable')}
_STAGE1_KEYS = _STAGE_KEYS | {'from_adapter'}
_STAGE2_KEYS = _STAGE_KEYS | {'lora_rank', 'lora_alpha', 'kl_weight',
                              'hidden_weight', 'lora_targets', 'from_adapter'}
_TOP_KEYS = {'teacher', 'attention', 'data', 'stage1', 'stage2', 'eval',
             'mesh', 'seed', 'progress', 'model'}
# config.model: how the layers run (not the teacher's architecture).
_MODEL_KEYS = ('scan_layers', 'remat')
LORA_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj')


@dataclasses.dataclass(frozen=True)
class EvalPlan:
  """The held-out check after the conversion (config.eval): each named set
  is make_dataset with these defaults and its own overrides, one epoch."""
  seq_len: int
  batch_size: int
  seed: int
  sets: Mapping[str, Mapping[str, Any]]
  num_examples: int = 32  # synthetic sets only
  after_stage1: bool = False  # also score the stage-1 params

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any]) -> EvalPlan:
    cfg = dict(plain(cfg))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - names)
    if unknown:
      raise ValueError(f'eval has unknown keys {unknown}; valid keys: '
                       f'{sorted(names)}')
    if not cfg.get('sets'):
      raise ValueError('eval.sets is empty: name at least one held-out set')
    missing = sorted({'seq_len', 'batch_size', 'seed'} - set(cfg))
    if missing:
      raise ValueError(f'eval needs {missing}')
    return cls(seq_len=int(cfg['seq_len']),
               batch_size=int(cfg['batch_size']), seed=int(cfg['seed']),
               sets={k: dict(v or {}) for k, v in cfg['sets'].items()},
               num_examples=int(cfg.get('num_examples', cls.num_examples)),
               after_stage1=bool(cfg.get('after_stage1', False)))

  def datasets(self, tokenizer) -> dict[str, Callable]:
    """name -> a function making that set's batches."""
    out = {}
    for name, overrides in self.sets.items():
      kwargs = dict(seq_len=self.seq_len, batch_size=self.batch_size,
                    seed=self.seed, num_epochs=1)
      kwargs.update(overrides)
      if kwargs.get('source', 'synthetic') == 'synthetic':
        kwargs.setdefault('num_examples', self.num_examples)
      out[name] = functools.partial(make_dataset, tokenizer=tokenizer,
                                    **kwargs)
    return out


@dataclasses.dataclass(frozen=True)
class ConversionPlan:
  """A conversion config, checked: everything `convert` reads."""
  teacher: TeacherSpec
  attention: AttentionConfig
  data: dict
  tokens_per_step: int
  stage1: loop.TrainConfig
  stage2: loop.TrainConfig
  from_adapter: str  # stage 1's result from this adapter (skips the stage)
  stage2_from_adapter: str  # stage 2 continues this adapter's LoRA factors
  lora_rank: int  # 0 = full finetune
  lora_alpha: float
  lora_targets: tuple[str, ...]
  kl_weight: float
  hidden_weight: float
  frozen_teacher: bool  # a full finetune with distillation keeps a copy
  eval: EvalPlan
  mesh: dict | None
  seed: int = 0
  progress: bool = True
  scan_layers: bool = False  # config.model: ModelConfig.scan_layers
  remat: str = 'none'  # config.model: ModelConfig.remat
  config: dict = dataclasses.field(default_factory=dict)  # as given


def _stage_config(stage: Mapping[str, Any], name: str, allowed: set[str],
                  tokens_per_step: int, trainable) -> tuple[loop.TrainConfig,
                                                            dict]:
  stage = dict(plain(stage))
  unknown = sorted(set(stage) - allowed)
  if unknown:
    raise ValueError(f'{name} has unknown keys {unknown}; valid keys: '
                     f'{sorted(allowed)}')
  tokens = stage.pop('tokens', None)
  if not isinstance(tokens, int) or tokens < tokens_per_step:
    raise ValueError(
        f'{name}.tokens={tokens!r} is invalid: expected an integer token '
        f'budget >= one batch ({tokens_per_step} tokens = batch_size x '
        'seq_len)')
  steps = tokens // tokens_per_step
  warmup = stage.get('warmup_steps', loop.TrainConfig.warmup_steps)
  if warmup >= steps:
    raise ValueError(f'{name}.tokens={tokens} gives {steps} steps of '
                     f'{tokens_per_step} tokens, not more than '
                     f'{name}.warmup_steps={warmup}; raise the budget or lower '
                     'warmup_steps')
  extra = {k: stage.pop(k) for k in list(stage) if k not in
           loop.TrainConfig.__dataclass_fields__}
  return loop.TrainConfig(num_steps=steps, trainable=trainable,
                          **stage), extra


def _adapter_dir(path: str, key: str) -> str:
  if path and not adapter_lib.is_adapter(path):
    raise ValueError(f'{key}={path!r} is not an adapter directory (no '
                     f'{adapter_lib.CONFIG} in it)')
  return path


def check_config(config) -> ConversionPlan:
  """The plan of a conversion config, every value checked before anything
  loads (README commands are tested with it): top-level, teacher, stage
  and eval keys, token budgets, the adapters' directories, stage 2's LoRA
  / distillation values, and a window + sinks that leaves some position to
  the linear part."""
  cfg = dict(plain(config))
  unknown = sorted(set(cfg) - _TOP_KEYS)
  if unknown:
    raise ValueError(f'the conversion config has unknown keys {unknown}; '
                     f'valid keys: {sorted(_TOP_KEYS)}')
  data_cfg = dict(cfg['data'])
  tokens_per_step = int(data_cfg['batch_size']) * int(data_cfg['seq_len'])
  s1_cfg, s1_extra = _stage_config(cfg['stage1'], 'stage1', _STAGE1_KEYS,
                                   tokens_per_step, TRANSFER_PARAMS)
  from_adapter = _adapter_dir(str(s1_extra.get('from_adapter') or ''),
                              'stage1.from_adapter')
  s2_cfg, s2_extra = _stage_config(cfg['stage2'], 'stage2', _STAGE2_KEYS,
                                   tokens_per_step, None)
  from_adapter2 = _adapter_dir(str(s2_extra.get('from_adapter') or ''),
                               'stage2.from_adapter')
  if from_adapter and from_adapter2:
    raise ValueError('stage1.from_adapter and stage2.from_adapter are both '
                     'set: a stage-2 adapter already holds its stage 1; set '
                     'one')
  rank = int(s2_extra.get('lora_rank', 8))
  alpha = float(s2_extra.get('lora_alpha', 16.0))
  kl_weight = float(s2_extra.get('kl_weight', 0.0))
  hidden_weight = float(s2_extra.get('hidden_weight', 0.0))
  if rank < 0 or kl_weight < 0 or hidden_weight < 0:
    raise ValueError(f'stage2.lora_rank={rank}, stage2.kl_weight='
                     f'{kl_weight} and stage2.hidden_weight={hidden_weight} '
                     'must be >= 0 (rank 0 = full finetune)')
  if from_adapter2 and not rank:
    raise ValueError('stage2.from_adapter continues LoRA factors: it needs '
                     'stage2.lora_rank > 0')
  # A full finetune moves the base weights, so the distillation terms read
  # a frozen copy of the teacher (params['teacher'], never trained).
  frozen_teacher = not rank and (kl_weight > 0 or hidden_weight > 0)
  if rank:
    s2_cfg = dataclasses.replace(s2_cfg, trainable=('lora',))
  elif frozen_teacher:
    s2_cfg = dataclasses.replace(s2_cfg, trainable=('base',))
  eval_plan = EvalPlan.from_config(cfg['eval'])
  attention = orthros_attention(cfg['attention'])
  first_linear = step_lib.first_linear_position(attention)
  if first_linear >= int(data_cfg['seq_len']):
    # Query t reads keys through the feature maps only from t = W + sinks
    # on; if no position of a sequence does, the prefill formula is exact
    # softmax everywhere and neither stage trains phi_q / phi_k.
    raise ValueError(
        f'attention.window + attention.sinks = {first_linear} >= '
        f'data.seq_len={data_cfg["seq_len"]}: every query\'s exact set covers '
        'its whole context, so no position uses the linear part and the '
        'conversion would train nothing of the prefill formula; use a '
        'smaller window')
  model = dict(cfg.get('model') or {})
  unknown = sorted(set(model) - set(_MODEL_KEYS))
  if unknown:
    raise ValueError(f'model has unknown keys {unknown}; valid keys: '
                     f'{list(_MODEL_KEYS)}')
  # ModelConfig checks the values themselves.
  layers = ModelConfig(**model)
  return ConversionPlan(
      scan_layers=layers.scan_layers, remat=layers.remat,
      teacher=TeacherSpec.from_config(cfg['teacher']), attention=attention,
      data=data_cfg, tokens_per_step=tokens_per_step,
      stage1=s1_cfg, stage2=s2_cfg, from_adapter=from_adapter,
      stage2_from_adapter=from_adapter2, lora_rank=rank, lora_alpha=alpha,
      lora_targets=tuple(s2_extra.get('lora_targets', LORA_TARGETS)),
      kl_weight=kl_weight, hidden_weight=hidden_weight,
      frozen_teacher=frozen_teacher, eval=eval_plan,
      mesh=cfg.get('mesh'), seed=int(cfg.get('seed', 0)),
      progress=bool(cfg.get('progress', True)), config=cfg)
