"""`convert(config, workdir)`: a trained dense Transformer -> an Orthros model.

    teacher (train.py checkpoint or HF dir)
      -> Orthros params: the teacher's weights + fresh feature maps / windows
      -> stage 1, attention transfer (workdir/stage1): per-layer MSE to the
         teacher's attention outputs; only phi_q, phi_k, window_logit train
      -> stage 2, phase-aware finetune (workdir/stage2): next-token loss on the
         answer positions with a per-example prefill/decode split, through
         LoRA on q/k/v/o (or a full finetune), optional KL to the teacher
         and hidden-state distillation (every layer's attention input)
      -> merged params saved to workdir/orthros/checkpoints (load_params)
         and, for LoRA, the adapter alone in workdir/adapter
         (conversion/adapter.py: feature maps, windows, LoRA factors)
      -> held-out evaluation through the inference path of the dense teacher,
         the Orthros model and the pure-linear floor (same weights, W = 0,
         no exact tail): workdir/report.json and report.md.

Each stage runs the shared loop (orthros_jax.training.loop) in its own
directory, so a killed conversion resumes where it stopped. Token budgets
are config values (stage*.tokens); a stage runs tokens // (batch * seq_len)
steps and the report states the tokens used, also as a fraction of the
teacher's training tokens when they are known.

The config is parsed and checked once, before anything loads, into a
ConversionPlan (conversion/plan.py; configs/convert_tiny.py documents every
field); the stages, the adapter and the report read only the plan.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import tqdm

from orthros_jax import sharding
from orthros_jax.config import ModelConfig
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.conversion import stages
from orthros_jax.conversion.adapter import stage1_from_adapter
from orthros_jax.conversion.adapter import stage2_from_adapter
from orthros_jax.conversion.lora import init_lora
from orthros_jax.conversion.lora import merge_lora
from orthros_jax.conversion.plan import ConversionPlan
from orthros_jax.conversion.plan import EvalPlan
from orthros_jax.conversion.plan import check_config
from orthros_jax.conversion.report import stage_summary
from orthros_jax.conversion.report import write_report
from orthros_jax.conversion.teacher import init_student
from orthros_jax.conversion.teacher import load_teacher
from orthros_jax.conversion.teacher import orthros_config
from orthros_jax.data import get_tokenizer
from orthros_jax.evaluation import inference
from orthros_jax.layer_layout import layers_for
from orthros_jax.layer_layout import unstack_layers
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.training import loop
from orthros_jax.training import step as step_lib
from orthros_jax.training.train_lm import make_data


def evaluate_models(models: Mapping[str, tuple[ModelConfig, dict, str]],
                    eval_plan: EvalPlan, tokenizer,
                    progress: bool = True) -> dict:
  """{model: {set: scores, 'all': token-weighted loss}} for models given as
  name -> (config, params, route), every set scored on its route
  (orthros_jax/evaluation/routes.py, evaluation/inference.py)."""
  sets = eval_plan.datasets(tokenizer)
  batches = {name: list(make()) for name, make in sets.items()}
  total = len(models) * sum(len(b) for b in batches.values())
  results: dict[str, dict] = {}
  with tqdm.tqdm(total=total, desc='eval', disable=not progress,
                 dynamic_ncols=True) as bar:
    for model, (config, params, route) in models.items():
      per = {}
      for name, bs in batches.items():
        bar.set_postfix_str(f'{model}/{name}')
        per[name] = inference.score(config, params, bs, route=route,
                                    progress=bar.update)
      tokens = sum(s['tokens'] for s in per.values())
      per['all'] = {'loss': sum(s['loss'] * s['tokens'] for s in per.values())
                    / tokens, 'tokens': tokens}
      results[model] = per
  return results


# -------------------------------------------------------------------- main


def unrolled(config: ModelConfig) -> ModelConfig:
  """`config` with its layers unrolled and no remat: the layout of the
  final checkpoint and of the adapter, whatever trained them."""
  return config.replace(scan_layers=False, remat='none')


def convert(config, workdir: str | os.PathLike) -> dict:
  """Runs the conversion `config` describes (a ConversionPlan, or a config
  that check_config parses) in `workdir`, resuming what a previous run
  there finished; returns the report dict."""
  # Every config value is checked before the (possibly large) teacher loads.
  plan = config if isinstance(config, ConversionPlan) else check_config(
      config)
  workdir = os.path.abspath(os.fspath(workdir))
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(plan.config, f, indent=1, default=str)
  progress, seed = plan.progress, plan.seed
  data_cfg, tokens_per_step = plan.data, plan.tokens_per_step
  s1_cfg, s2_cfg, attention = plan.stage1, plan.stage2, plan.attention
  from_adapter, rank, alpha = plan.from_adapter, plan.lora_rank, plan.lora_alpha
  from_adapter2 = plan.stage2_from_adapter
  lora_targets = plan.lora_targets
  kl_weight, hidden_weight = plan.kl_weight, plan.hidden_weight
  frozen_teacher = plan.frozen_teacher
  tokenizer = get_tokenizer(data_cfg.get('tokenizer', 'byte'))

  partitioner = sharding.Partitioner.from_config(plan.mesh)
  teacher, teacher_params, teacher_info = load_teacher(plan.teacher)
  teacher = teacher.replace(scan_layers=plan.scan_layers, remat=plan.remat)
  teacher_params = layers_for(teacher, teacher_params)
  student = orthros_config(teacher, attention)
  if partitioner is not None:
    teacher_params = partitioner.shard_params(teacher_params, teacher)
  if tokenizer.vocab_size > teacher.vocab_size:
    raise ValueError(f'the tokenizer has {tokenizer.vocab_size} ids but the '
                     f'teacher only {teacher.vocab_size}: use the teacher\'s '
                     'tokenizer (data.tokenizer)')

  # Committed like the trained params the held-out probe below also reads
  # (else it compiles twice; loop.commit_to_device).
  student_init = loop.commit_to_device(init_student(
      teacher_params, student, jax.random.PRNGKey(seed)))
  placement = None if partitioner is None else partitioner.placement
  objective1 = stages.transfer_objective(student, placement)
  probe = next(iter(make_data(dict(data_cfg, seed=int(data_cfg['seed']) + 7),
                              teacher.vocab_size)))
  mse = jax.jit(lambda p: objective1(p, probe, None)[0])
  mse_before = float(mse(student_init))
  stage1_dir = os.path.join(workdir, 'stage1')
  lora_start = None
  if from_adapter2:
    params1, lora_start, stage2_source = stage2_from_adapter(
        from_adapter2, student, teacher, teacher_params, rank=rank,
        alpha=alpha, targets=lora_targets)
    stage1_source = dict(stage2_source['stage1'],
                         from_adapter=stage2_source['from_adapter'],
                         workdir=stage2_source['workdir'])
    hist1 = []
  elif from_adapter:
    params1, stage1_source = stage1_from_adapter(
        from_adapter, student, teacher, teacher_params)
    hist1 = []
  else:
    state1, hist1 = loop.train(
        s1_cfg, stage1_dir, student, student_init,
        make_data(data_cfg, teacher.vocab_size),
        train_step=step_lib.make_objective_step(
            objective1, partitioner=partitioner, trainable=s1_cfg.trainable),
        partitioner=partitioner)
    params1 = state1.params
  mse_after = float(mse(params1))
  logging.info('stage 1: held-out transfer MSE %.4g -> %.4g', mse_before,
               mse_after)

  # Stage 2: phase-aware finetune (LoRA or full).
  def stage2_init():
    if lora_start is not None:
      lora = jax.tree.map(jnp.copy, lora_start)
    else:
      lora = (init_lora(params1, jax.random.PRNGKey(seed + 1), rank=rank,
                        targets=lora_targets) if rank else {})
    params = {'base': jax.tree.map(jnp.copy, params1), 'lora': lora}
    if frozen_teacher:
      params['teacher'] = jax.tree.map(jnp.copy, teacher_params)
    return params

  objective2 = stages.finetune_objective(
      student, split_mode=s2_cfg.split_mode, lora_alpha=alpha,
      kl_weight=kl_weight, hidden_weight=hidden_weight, placement=placement)
  stage2_dir = os.path.join(workdir, 'stage2')
  state2, hist2 = loop.train(
      s2_cfg, stage2_dir, student, stage2_init,
      make_data(dict(data_cfg, seed=int(data_cfg['seed']) + 1),
                teacher.vocab_size),
      train_step=step_lib.make_objective_step(
          objective2, partitioner=partitioner, trainable=s2_cfg.trainable),
      partitioner=partitioner)
  final = merge_lora(state2.params['base'], state2.params['lora'],
                     alpha=alpha)
  skipped1 = from_adapter or from_adapter2
  stage1_record = ({k: stage1_source[k] for k in ('steps', 'tokens')}
                   if skipped1 else
                   {'steps': s1_cfg.num_steps,
                    'tokens': s1_cfg.num_steps * tokens_per_step})
  total_steps = ((stage1_source['steps'] if skipped1 else s1_cfg.num_steps)
                 + (stage2_source['steps'] if from_adapter2 else 0)
                 + s2_cfg.num_steps)
  out_dir = os.path.join(workdir, 'orthros')
  if not os.path.isdir(os.path.join(out_dir, 'checkpoints',
                                    str(total_steps))):
    # The result in the unrolled layout whatever trained it: eval.py,
    # chat and export read it like any converted checkpoint.
    ckpt_lib.save_params(out_dir, unstack_layers(final), unrolled(student),
                         step=total_steps)
  if rank:
    # What the conversion adds, alone (feature maps, windows, LoRA): a few
    # MB to ship beside the teacher's own weights (conversion/adapter.py).
    adapter_lib.write_adapter(
        os.path.join(workdir, 'adapter'), student, teacher_params,
        state2.params['base'], state2.params['lora'], alpha=alpha,
        provenance={'conversion_workdir': workdir, 'teacher': teacher_info,
                    'stage1': stage1_record,
                    'stage2_step': s2_cfg.num_steps,
                    'stage2_tokens': s2_cfg.num_steps * tokens_per_step,
                    **({'stage1_from_adapter': stage1_source}
                       if from_adapter else {}),
                    **({'stage2_from_adapter': stage2_source}
                       if from_adapter2 else {})})

  # Held-out evaluation through the inference path.
  models = {'teacher': (teacher, teacher_params, 'inference'),
            'orthros': (student, final, 'inference'),
            'linear': (inference.pure_linear(student), final, 'prefill')}
  if plan.eval.after_stage1:
    models['orthros_stage1'] = (student, params1, 'inference')
  results = evaluate_models(models, plan.eval, tokenizer, progress)

  if skipped1:
    s1 = dict(stage1_source, loss_first=None, loss_last=None)
  else:
    s1 = stage_summary(hist1, stage1_dir, s1_cfg.num_steps,
                        tokens_per_step)
  s1.update(mse_before=mse_before, mse_after=mse_after,
            mse_factor=mse_before / max(mse_after, 1e-30))
  s2 = stage_summary(hist2, stage2_dir, s2_cfg.num_steps, tokens_per_step)
  s2.update(method=f'LoRA r={rank} alpha={alpha}' if rank else
            'full finetune', split_mode=s2_cfg.split_mode,
            kl_weight=kl_weight, hidden_weight=hidden_weight)
  if from_adapter2:
    s2['continued'] = stage2_source
  conv_tokens = ((s1['tokens'] or 0) + s2['tokens']
                 + ((stage2_source['tokens'] or 0) if from_adapter2 else 0))
  teacher_tokens = teacher_info.get('train_tokens')
  sets = [s for s in results['teacher'] if s != 'all']
  summary = {
      'loss_ratio': results['orthros']['all']['loss']
                    / results['teacher']['all']['loss'],
      'linear_loss_ratio': results['linear']['all']['loss']
                           / results['teacher']['all']['loss'],
      'exact_match_gap_points': {
          s: 100 * (results['orthros'][s]['exact_match']
                    - results['teacher'][s]['exact_match']) for s in sets
          if 'exact_match' in results['teacher'][s]},
  }
  report = {
      'teacher': teacher_info,
      'orthros_config': dataclasses.asdict(student),
      'checkpoint': os.path.join(out_dir, 'checkpoints', str(total_steps)),
      'conversion': {
          'stage1': s1, 'stage2': s2, 'tokens': conv_tokens,
          'fraction_of_teacher_tokens': (conv_tokens / teacher_tokens
                                         if teacher_tokens else None)},
      'eval': results, 'summary': summary,
  }
  table = write_report(workdir, report)
  print(table)
  print(f'report: {os.path.join(workdir, "report.md")}, '
        f'{os.path.join(workdir, "report.json")}; Orthros checkpoint: '
        f"{report['checkpoint']}")
  return report
