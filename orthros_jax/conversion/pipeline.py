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

The config (configs/convert_tiny.py documents every field):
  teacher:   checkpoint (a train.py workdir) or hf_dir; step; train_tokens
  attention: the Orthros AttentionConfig fields
  data:      make_dataset arguments for both stages (tokenizer included)
  stage1, stage2: token budget and TrainConfig fields, plus stage1's
             from_adapter (a stage-1 adapter directory of this teacher and
             attention: its feature maps and windows replace the stage,
             which then trains nothing) and stage2's
             lora_rank (0 = full finetune), lora_alpha, kl_weight,
             hidden_weight (stages.finetune_objective)
  eval:      seq_len, batch_size, seed, num_examples, sets (name -> dataset
             overrides), modes
  mesh:      optional device mesh (orthros_jax/sharding.py): shape (axis ->
             size, one -1) and rules; the teacher is placed sharded and both
             stages run data / FSDP / tensor parallel on it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import tqdm

from orthros_jax import sharding
from orthros_jax.config import AttentionConfig
from orthros_jax.config import ModelConfig
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.conversion import stages
from orthros_jax.conversion.adapter import stage1_from_adapter
from orthros_jax.conversion.adapter import stage2_from_adapter
from orthros_jax.conversion.lora import init_lora
from orthros_jax.conversion.lora import merge_lora
from orthros_jax.conversion.teacher import init_student
from orthros_jax.conversion.teacher import load_teacher
from orthros_jax.conversion.teacher import orthros_attention
from orthros_jax.conversion.teacher import orthros_config
from orthros_jax.conversion.transfer import TRANSFER_PARAMS
from orthros_jax.data import get_tokenizer
from orthros_jax.data import make_dataset
from orthros_jax.evaluation import inference
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.training import loop
from orthros_jax.training import step as step_lib
from orthros_jax.training.metrics import read_metrics
from orthros_jax.training.train_lm import make_data
from orthros_jax.config import plain as _plain

_STAGE_KEYS = {'tokens'} | {f for f in loop.TrainConfig.__dataclass_fields__
                            if f not in ('num_steps', 'trainable')}
_STAGE1_KEYS = _STAGE_KEYS | {'from_adapter'}
_STAGE2_KEYS = _STAGE_KEYS | {'lora_rank', 'lora_alpha', 'kl_weight',
                              'hidden_weight',
                              'lora_targets', 'from_adapter'}


# ----------------------------------------------------------------- teacher


# ----------------------------------------------------------------- stages


def _stage_config(stage: Mapping[str, Any], name: str, allowed: set[str],
                  tokens_per_step: int, trainable) -> tuple[loop.TrainConfig,
                                                            dict]:
  stage = dict(_plain(stage))
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


def _stage_summary(history: list[dict], workdir: str, steps: int,
                   tokens_per_step: int) -> dict:
  """Losses at the start and end of a stage, from its metrics.jsonl (which
  also covers steps run before a resume)."""
  rows = [r for r in read_metrics(workdir) if 'loss' in r]
  if not rows:
    rows = [dict(h) for h in history]
  return {'steps': steps, 'tokens': steps * tokens_per_step,
          'loss_first': rows[0]['loss'] if rows else None,
          'loss_last': rows[-1]['loss'] if rows else None,
          'workdir': workdir}


# --------------------------------------------------------------- evaluate


def _eval_sets(eval_cfg: Mapping[str, Any], tokenizer) -> dict[str, Any]:
  eval_cfg = dict(_plain(eval_cfg))
  sets = eval_cfg.get('sets') or {}
  if not sets:
    raise ValueError('eval.sets is empty: name at least one held-out set')
  out = {}
  for name, overrides in sets.items():
    kwargs = dict(seq_len=eval_cfg['seq_len'],
                  batch_size=eval_cfg['batch_size'], seed=eval_cfg['seed'],
                  num_epochs=1)
    kwargs.update(overrides or {})
    if kwargs.get('source', 'synthetic') == 'synthetic':
      kwargs.setdefault('num_examples', eval_cfg['num_examples'])
    out[name] = functools.partial(make_dataset, tokenizer=tokenizer,
                                  **kwargs)
  return out


def evaluate_models(models: Mapping[str, tuple[ModelConfig, dict, str]],
                    eval_cfg: Mapping[str, Any], tokenizer,
                    progress: bool = True) -> dict:
  """{model: {set: scores, 'all': token-weighted loss}} for models given as
  name -> (config, params, route), every set scored on its route
  (orthros_jax/evaluation/routes.py, evaluation/inference.py)."""
  sets = _eval_sets(eval_cfg, tokenizer)
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


# ------------------------------------------------------------------ report


def _table(results: dict, sets: list[str]) -> str:
  head = ['model'] + [f'{s} loss' for s in sets + ['all']] + [
      f'{s} exact %' for s in sets]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for model, per in results.items():
    row = [model] + [f"{per[s]['loss']:.4f}" for s in sets + ['all']]
    for s in sets:
      lo, hi = per[s]['exact_match_ci95']
      row.append(f"{100 * per[s]['exact_match']:.1f} "
                 f'[{100 * lo:.0f}, {100 * hi:.0f}]')
    lines.append('| ' + ' | '.join(row) + ' |')
  return '\n'.join(lines)


def _continued(src: dict) -> str:
  tokens = (f"{src['tokens']:,} tokens" if src.get('tokens') is not None
            else 'tokens not recorded by the adapter')
  return (f"; continues the stage 2 of the adapter {src['from_adapter']} "
          f"({src['steps']} steps, {tokens})")


def write_report(workdir: str, report: dict) -> str:
  """report.json and report.md in workdir; returns the markdown table."""
  with open(os.path.join(workdir, 'report.json'), 'w') as f:
    json.dump(report, f, indent=1)
  sets = [s for s in next(iter(report['eval'].values())) if s != 'all']
  table = _table(report['eval'], sets)
  t, c = report['teacher'], report['conversion']
  frac = c.get('fraction_of_teacher_tokens')
  md = [
      '# Conversion report', '',
      f"Teacher: {t['source']} {t['path']}"
      + (f" (step {t['step']})" if t.get('step') is not None else '')
      + (f", trained on {t['train_tokens']:,} tokens"
         if t.get('train_tokens') else ''),
      f"Orthros attention: {report['orthros_config']['attention']}",
      '',
      f"Stage 1 (attention transfer): {c['stage1']['steps']} steps, "
      + (f"{c['stage1']['tokens']:,} tokens" if c['stage1']['tokens']
         is not None else 'tokens unknown')
      + (f" (from the adapter {c['stage1']['from_adapter']})"
         if c['stage1'].get('from_adapter') else '')
      + f"; held-out transfer MSE "
      f"{c['stage1']['mse_before']:.4g} -> {c['stage1']['mse_after']:.4g} "
      f"({c['stage1']['mse_factor']:.1f}x lower)",
      f"Stage 2 (phase-aware finetune, {c['stage2']['method']}): "
      f"{c['stage2']['steps']} steps, {c['stage2']['tokens']:,} tokens; "
      f"loss {c['stage2']['loss_first']:.4f} -> "
      f"{c['stage2']['loss_last']:.4f}"
      + (_continued(c['stage2']['continued'])
         if c['stage2'].get('continued') else ''),
      f"Conversion tokens: {c['tokens']:,}"
      + (f' = {100 * frac:.3g}% of the teacher\'s' if frac else ''), '',
      '## Held-out, through the inference path', '',
      'teacher: dense prefill + decode; orthros: hybrid prefill of the prompt '
      f"but its last {report['orthros_config']['attention']['exact_tail']} "
      'tokens, exact decode after; linear: the same weights with window 0 and '
      'no exact tail, every position through the prefill formula. Loss: mean '
      'next-token NLL on the scored positions (answers; the second half of '
      'plain text). Exact: % of examples whose every scored token is the '
      'greedy argmax (= greedy generation reproduces the answer), Wilson 95% '
      'interval.', '', table, '',
      f"Orthros / teacher loss (all): {report['summary']['loss_ratio']:.4f}",
  ]
  with open(os.path.join(workdir, 'report.md'), 'w') as f:
    f.write('\n'.join(md) + '\n')
  return table


# -------------------------------------------------------------------- main


@dataclasses.dataclass(frozen=True)
class ConversionPlan:
  """A conversion config, checked: what `convert` runs."""
  data: dict
  tokens_per_step: int
  attention: AttentionConfig
  stage1: loop.TrainConfig
  stage2: loop.TrainConfig
  stage2_extra: dict
  from_adapter: str
  stage2_from_adapter: str
  lora_rank: int
  lora_alpha: float
  kl_weight: float
  hidden_weight: float
  frozen_teacher: bool


def check_config(config) -> ConversionPlan:
  """Every check `convert` makes before it loads anything (README commands
  are tested with it): stage keys and token budgets, the stage-1 adapter's
  directory, stage 2's LoRA / distillation values, held-out sets, and a
  window + sinks that leaves some position to the linear part."""
  data_cfg = dict(_plain(config.data))
  tokens_per_step = int(data_cfg['batch_size']) * int(data_cfg['seq_len'])
  s1_cfg, s1_extra = _stage_config(config.stage1, 'stage1', _STAGE1_KEYS,
                                   tokens_per_step, TRANSFER_PARAMS)
  from_adapter = str(s1_extra.get('from_adapter') or '')
  if from_adapter and not adapter_lib.is_adapter(from_adapter):
    raise ValueError(f'stage1.from_adapter={from_adapter!r} is not an adapter '
                     f'directory (no {adapter_lib.CONFIG} in it)')
  s2_cfg, s2_extra = _stage_config(config.stage2, 'stage2', _STAGE2_KEYS,
                                   tokens_per_step, None)
  from_adapter2 = str(s2_extra.pop('from_adapter', '') or '')
  if from_adapter2:
    if not adapter_lib.is_adapter(from_adapter2):
      raise ValueError(f'stage2.from_adapter={from_adapter2!r} is not an '
                       f'adapter directory (no {adapter_lib.CONFIG} in it)')
    if from_adapter:
      raise ValueError('stage1.from_adapter and stage2.from_adapter are both '
                       'set: a stage-2 adapter already holds its stage 1; '
                       'set one')
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
  if not _plain(config.eval).get('sets'):
    raise ValueError('eval.sets is empty: name at least one held-out set')
  attention = orthros_attention(config.attention)
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
  return ConversionPlan(
      data=data_cfg, tokens_per_step=tokens_per_step, attention=attention,
      stage1=s1_cfg, stage2=s2_cfg, stage2_extra=s2_extra,
      from_adapter=from_adapter, stage2_from_adapter=from_adapter2,
      lora_rank=rank, lora_alpha=alpha,
      kl_weight=kl_weight, hidden_weight=hidden_weight,
      frozen_teacher=frozen_teacher)


def convert(config, workdir: str | os.PathLike) -> dict:
  """Runs the conversion described by `config` in `workdir` (resuming what
  a previous run there finished); returns the report dict."""
  workdir = os.path.abspath(os.fspath(workdir))
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(_plain(config), f, indent=1, default=str)
  progress = bool(config.get('progress', True))
  seed = int(config.get('seed', 0))

  # Every config value is checked before the (possibly large) teacher loads.
  plan = check_config(config)
  data_cfg, tokens_per_step = plan.data, plan.tokens_per_step
  s1_cfg, s2_cfg, attention = plan.stage1, plan.stage2, plan.attention
  from_adapter, rank, alpha = plan.from_adapter, plan.lora_rank, plan.lora_alpha
  from_adapter2 = plan.stage2_from_adapter
  lora_targets = tuple(plan.stage2_extra.get(
      'lora_targets', ('q_proj', 'k_proj', 'v_proj', 'o_proj')))
  kl_weight, hidden_weight = plan.kl_weight, plan.hidden_weight
  frozen_teacher = plan.frozen_teacher
  tokenizer = get_tokenizer(data_cfg.get('tokenizer', 'byte'))

  partitioner = sharding.Partitioner.from_config(config.get('mesh'))
  teacher, teacher_params, teacher_info = load_teacher(config.teacher)
  student = orthros_config(teacher, attention)
  if partitioner is not None:
    teacher_params = partitioner.shard_params(teacher_params, teacher)
  if tokenizer.vocab_size > teacher.vocab_size:
    raise ValueError(f'the tokenizer has {tokenizer.vocab_size} ids but the '
                     f'teacher only {teacher.vocab_size}: use the teacher\'s '
                     'tokenizer (data.tokenizer)')

  student_init = init_student(teacher_params, student,
                              jax.random.PRNGKey(seed))
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
    ckpt_lib.save_params(out_dir, final, student, step=total_steps)
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
  if config.eval.get('after_stage1', False):
    models['orthros_stage1'] = (student, params1, 'inference')
  results = evaluate_models(models, config.eval, tokenizer, progress)

  if skipped1:
    s1 = dict(stage1_source, loss_first=None, loss_last=None)
  else:
    s1 = _stage_summary(hist1, stage1_dir, s1_cfg.num_steps,
                        tokens_per_step)
  s1.update(mse_before=mse_before, mse_after=mse_after,
            mse_factor=mse_before / max(mse_after, 1e-30))
  s2 = _stage_summary(hist2, stage2_dir, s2_cfg.num_steps, tokens_per_step)
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
