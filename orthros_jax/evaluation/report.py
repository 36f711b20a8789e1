"""The evaluation report: markdown tables, plots and report.md of a suite
run (evaluation/suite.py computes the results)."""

from __future__ import annotations

import csv
import os

import numpy as np

from orthros_jax.evaluation import inference
from orthros_jax.evaluation import speed as speed_lib


def retrieval_table(rows: list[dict], models: list[str]) -> str:
  """Accuracy % per task and length (averaged over depths), per model."""
  keys = sorted({(r['task'], r['length']) for r in rows})
  lines = ['| task | length | ' + ' | '.join(models) + ' |',
           '|---|---|' + '---|' * len(models)]
  for task, length in keys:
    cells = []
    for m in models:
      rs = [r for r in rows if r['task'] == task and r['length'] == length
            and r['model'] == m]
      if not rs:
        cells.append('-')
        continue
      n = sum(r['n'] for r in rs)
      acc = sum(r['accuracy'] * r['n'] for r in rs) / n
      lo, hi = inference.wilson_interval(round(acc * n), n)
      cells.append(f'{100 * acc:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]')
    lines.append(f'| {task} | {length} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def summary_table(rows: list[dict], quality: dict | None,
                  models: list[str]) -> str:
  """The three-way table: each task at its longest length, and perplexity."""
  lines = ['| metric | ' + ' | '.join(models) + ' |',
           '|---|' + '---|' * len(models)]
  for task in sorted({r['task'] for r in rows}):
    longest = max(r['length'] for r in rows if r['task'] == task)
    cells = []
    for m in models:
      rs = [r for r in rows if r['task'] == task and r['length'] == longest
            and r['model'] == m]
      n = sum(r['n'] for r in rs)
      cells.append(f"{100 * sum(r['accuracy'] * r['n'] for r in rs) / n:.1f}"
                   if n else '-')
    lines.append(f'| {task} @ {longest} tokens (accuracy %) | '
                 + ' | '.join(cells) + ' |')
  if quality:
    lines.append('| perplexity, inference path | ' + ' | '.join(
        f"{quality[m]['inference']['perplexity']:.3f}" if m in quality
        else '-' for m in models) + ' |')
    lines.append('| perplexity, teacher-forced prefill | ' + ' | '.join(
        f"{quality[m]['teacher_forced']['perplexity']:.3f}" if m in quality
        else '-' for m in models) + ' |')
  return '\n'.join(lines)


def speed_table(speed: dict) -> str:
  lines = ['| length | dense TTFT ms | Orthros TTFT ms | no-attention TTFT ms '
           '| dense / Orthros | Orthros / no attention | dense decode tok/s '
           '| Orthros decode tok/s |',
           '|---|---|---|---|---|---|---|---|']
  by = {(r['variant'], r['length']): r for r in speed['rows']}
  for ratio in speed['ratios']:
    n = ratio['length']
    d, o, z = (by.get((v, n)) for v in speed_lib.VARIANTS)
    f = lambda r, k, s=1e3: f'{r[k] * s:.1f}' if r else '-'
    lines.append(
        f"| {n} | {f(d, 'ttft_s')} | {f(o, 'ttft_s')} | {f(z, 'ttft_s')} | "
        + ' | '.join(f'{ratio[k]:.2f}x' if ratio[k] else '-' for k in (
            'dense_over_orthros_ttft', 'orthros_over_none_ttft'))
        + f" | {f(d, 'decode_tokens_per_s', 1)} | "
          f"{f(o, 'decode_tokens_per_s', 1)} |")
  return '\n'.join(lines)


def quality_plot(out_dir: str, quality: dict) -> list[str]:
  """Perplexity per model: inference path and teacher-forced prefill."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []
  names = list(quality)
  x = np.arange(len(names))
  fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2.5, 3.5))
  for i, label in enumerate(('inference', 'teacher_forced')):
    ppl = [quality[m][label]['perplexity'] for m in names]
    ax.bar(x + (i - 0.5) * 0.38, ppl, 0.38, label=label.replace('_', '-'))
  ax.set_xticks(x, names, rotation=20)
  ax.set_ylabel('perplexity (log scale)')
  ax.set_yscale('log')
  ax.legend()
  ax.grid(alpha=0.3, axis='y')
  fig.tight_layout()
  path = os.path.join(out_dir, 'quality.png')
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [path]


def retrieval_plots(out_dir: str, rows: list[dict], models: list[str]) -> list[str]:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []
  written = []
  tasks = sorted({r['task'] for r in rows})
  if tasks:
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.5),
                             squeeze=False)
    for ax, task in zip(axes[0], tasks):
      for m in models:
        lengths = sorted({r['length'] for r in rows if r['task'] == task})
        acc = []
        for n in lengths:
          rs = [r for r in rows if r['task'] == task and r['length'] == n
                and r['model'] == m]
          acc.append(100 * sum(r['accuracy'] * r['n'] for r in rs)
                     / max(sum(r['n'] for r in rs), 1))
        ax.plot(lengths, acc, '-o', label=m)
      ax.set_title(task)
      ax.set_xlabel('length (tokens)')
      ax.set_ylabel('accuracy %')
      ax.set_ylim(-5, 105)
      ax.grid(alpha=0.3)
      ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, 'retrieval.png')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  for task in tasks:
    depth_rows = [r for r in rows if r['task'] == task
                  and r['depth'] is not None]
    if not depth_rows:
      continue
    lengths = sorted({r['length'] for r in depth_rows})
    depths = sorted({r['depth'] for r in depth_rows})
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.2),
                             squeeze=False)
    for ax, m in zip(axes[0], models):
      grid = np.full((len(depths), len(lengths)), np.nan)
      for r in depth_rows:
        if r['model'] == m:
          grid[depths.index(r['depth']), lengths.index(r['length'])] = (
              100 * r['accuracy'])
      im = ax.imshow(grid, vmin=0, vmax=100, cmap='RdYlGn', aspect='auto',
                     origin='upper')
      ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
      ax.set_yticks(range(len(depths)), [f'{100 * d:.0f}%' for d in depths])
      ax.set_xlabel('length (tokens)')
      ax.set_ylabel('depth')
      ax.set_title(f'{task}: {m}')
      for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
          ax.text(j, i, f'{v:.0f}', ha='center', va='center', fontsize=7)
    fig.subplots_adjust(wspace=0.45, bottom=0.2, right=0.85)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    path = os.path.join(out_dir, f'{task}_heatmap.png')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


def write_report(out_dir: str, results: dict, rows: list[dict],
                 quality: dict | None, harness: dict | None,
                 names: list[str]) -> tuple[str, list[str]]:
  """report.md (and speed.csv, the plots) in out_dir from a suite run's
  results; returns (the summary table, the plot paths)."""
  descriptions = results['models']
  md = [f"# Evaluation: {results['name']}", '',
        f"{results['date']}; backend {results['machine']['backend']}, jax "
        f"{results['machine']['jax']}", '', '## Models', '']
  md += [f'- **{k}**: {v}' for k, v in descriptions.items()]
  summary = ''
  if rows or quality:
    summary = summary_table(rows, quality, names)
    md += ['', '## Summary (each row\'s weights and attention: Models above)', '', summary]
  if rows:
    md += ['', '## Retrieval accuracy % (greedy; mean over depths; Wilson '
           '95% interval; multi-answer tasks score the fraction of answers '
           'found)', '',
           retrieval_table(rows, names)]
  if quality:
    md += ['', '## Quality', '', '| model | inference-path loss | '
           'inference-path ppl | teacher-forced ppl | tokens |',
           '|---|---|---|---|---|']
    for m, q in quality.items():
      md.append(f"| {m} | {q['inference']['loss']:.4f} | "
                f"{q['inference']['perplexity']:.3f} | "
                f"{q['teacher_forced']['perplexity']:.3f} | "
                f"{int(q['inference']['tokens'])} |")
  if results.get('speed'):
    sp = results['speed']
    md += ['', '## Speed (this machine, same model shape)', '',
           speed_table(sp)]
    with open(os.path.join(out_dir, 'speed.csv'), 'w', newline='') as f:
      w = csv.DictWriter(f, fieldnames=list(sp['rows'][0]))
      w.writeheader()
      w.writerows(sp['rows'])
    plot = speed_lib.plot(sp['rows'], os.path.join(out_dir, 'speed.png'))
    if plot:
      md += ['', '![speed](speed.png)']
  if harness:
    md += ['', '## lm-evaluation-harness (zero-shot unless num_fewshot; '
           'each column a row of Models above)', '', harness['table']]
  plots = retrieval_plots(out_dir, rows, names)
  if quality:
    plots += quality_plot(out_dir, quality)
  md += [''] + [f'![{os.path.basename(p)}]({os.path.basename(p)})'
                for p in plots]
  with open(os.path.join(out_dir, 'report.md'), 'w') as f:
    f.write('\n'.join(md) + '\n')
  return summary, plots
