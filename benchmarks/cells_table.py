"""One retrieval table from the cells several eval.py runs stored.

eval.py stores every finished retrieval cell (task, length, depth, model)
in OUT/retrieval_cells.jsonl, with per-example scores. Runs of different
configs into the same OUT (configs/eval_smollm2.py:main with 100 / 50
examples for the teacher and Orthros, :baselines with 30 for every row)
leave cells of different sizes; this script puts them in one table: for
every (task, length, depth, model) the largest stored cell, summed over
depths, with the example count, the Wilson 95% interval and the
difference to the teacher (on the teacher's examples common to both: the
first n of each depth, n the smaller count).

  python benchmarks/cells_table.py --cells results/smollm2_eval \
      --out results/smollm2_eval/table

Writes table.json, table.md and retrieval.png. Nothing is computed but
sums of stored scores; a model name stored under two different
fingerprints (weights changed under the same out dir) is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from orthros_jax.evaluation import cells  # pylint: disable=wrong-import-position
from orthros_jax.evaluation.inference import wilson_interval  # pylint: disable=wrong-import-position

ORDER = ('teacher', 'dense', 'window', 'window_sinks', 'orthros',
         'orthros_nosinks', 'orthros_sinks', 'linear', 'linear_trained')


def load_cells(path: str) -> dict:
  """{(task, length, depth, model): largest stored row}."""
  if os.path.isdir(path):
    path = os.path.join(path, cells.CELLS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path} does not exist: run eval.py with --out '
                            'pointing at its directory first')
  keys: dict = {}
  best: dict = {}
  for key, rows in cells.read_cells(path).items():
    for row in rows:
      cell = (row['task'], row['length'], row['depth'], row['model'])
      if keys.setdefault(cell, key) != key:
        raise ValueError(
            f'{path}: {cell} is stored under two fingerprints (the weights or '
            'settings of that row changed under the same out dir); use a '
            'fresh out dir')
      if cell not in best or row['n'] > best[cell]['n']:
        best[cell] = row
  return best


def table(cells: dict) -> list[dict]:
  """One entry per (task, length, model): accuracy over its depths."""
  groups = defaultdict(list)
  for (task, length, _, model), row in cells.items():
    groups[(task, length, model)].append(row)
  out = []
  for (task, length, model), rows in sorted(groups.items()):
    n = sum(r['n'] for r in rows)
    acc = sum(r['accuracy'] * r['n'] for r in rows) / n
    lo, hi = wilson_interval(round(acc * n), n)
    entry = dict(task=task, length=length, model=model, n=n, accuracy=acc,
                 ci95=[lo, hi], depths=sorted(
                     (r['depth'] for r in rows), key=lambda d: (d is None, d)))
    teacher = [cells.get((task, length, r['depth'], 'teacher'))
               for r in rows]
    if model != 'teacher' and all(t is not None and 'scores' in t
                                  for t in teacher) and all(
                                      'scores' in r for r in rows):
      diffs, m = 0.0, 0
      for r, t in zip(rows, teacher):
        k = min(r['n'], t['n'])
        diffs += sum(r['scores'][:k]) - sum(t['scores'][:k])
        m += k
      entry['minus_teacher_points'] = 100 * diffs / m
      entry['paired_n'] = m
    out.append(entry)
  return out


def markdown(entries: list[dict]) -> str:
  models = [m for m in ORDER if any(e['model'] == m for e in entries)]
  models += sorted({e['model'] for e in entries} - set(models))
  lines = ['| task | length | ' + ' | '.join(models) + ' |',
           '|---|---|' + '---|' * len(models)]
  for task, length in sorted({(e['task'], e['length']) for e in entries}):
    cells = []
    for m in models:
      e = next((e for e in entries if e['task'] == task and
                e['length'] == length and e['model'] == m), None)
      if e is None:
        cells.append('-')
        continue
      lo, hi = e['ci95']
      cell = (f"{100 * e['accuracy']:.1f} [{100 * lo:.0f}, {100 * hi:.0f}] "
              f"n={e['n']}")
      if 'minus_teacher_points' in e:
        cell += f" ({e['minus_teacher_points']:+.1f})"
      cells.append(cell)
    lines.append(f'| {task} | {length} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def plot(entries: list[dict], path: str) -> str | None:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  tasks = sorted({e['task'] for e in entries})
  fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6),
                           squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for m in ORDER:
      es = sorted((e for e in entries if e['task'] == task and
                   e['model'] == m), key=lambda e: e['length'])
      if not es:
        continue
      ax.errorbar([e['length'] for e in es],
                  [100 * e['accuracy'] for e in es],
                  yerr=[[max(0.0, 100 * (e['accuracy'] - e['ci95'][0]))
                         for e in es],
                        [max(0.0, 100 * (e['ci95'][1] - e['accuracy']))
                         for e in es]],
                  marker='o', capsize=3, label=m)
    ax.set_xscale('log', base=2)
    ax.set_title(task)
    ax.set_xlabel('prompt length (tokens)')
    ax.set_ylabel('accuracy % (Wilson 95%)')
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=7, loc='lower left')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cells', default='results/smollm2_eval',
                 help='an eval.py out dir or its retrieval_cells.jsonl')
  p.add_argument('--out', default=None, help='default: CELLS/table')
  args = p.parse_args(argv)
  entries = table(load_cells(args.cells))
  out = args.out or os.path.join(
      args.cells if os.path.isdir(args.cells) else
      os.path.dirname(args.cells), 'table')
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'table.json'), 'w') as f:
    json.dump(entries, f, indent=1)
  md = markdown(entries)
  plot(entries, os.path.join(out, 'retrieval.png'))
  with open(os.path.join(out, 'table.md'), 'w') as f:
    f.write('# Retrieval accuracy % (greedy; Wilson 95%; n examples; in '
            'parentheses the points to the teacher on the same examples)\n\n'
            + md + '\n\n![retrieval](retrieval.png)\n')
  print(md)


if __name__ == '__main__':
  main()
