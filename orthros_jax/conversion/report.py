"""A conversion's report: report.json and report.md in its workdir (the
stages' token counts and losses, the held-out table of every model scored
on its inference route), written by conversion/pipeline.py."""

from __future__ import annotations

import json
import os

from orthros_jax.training.metrics import read_metrics


def stage_summary(history: list[dict], workdir: str, steps: int,
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
