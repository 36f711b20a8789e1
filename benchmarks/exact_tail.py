"""How many prompt tokens must decode exactly? Retrieval vs exact_tail.

An Orthros model prefills all but the last `exact_tail` prompt tokens with
the hybrid formula and decodes those and the answer with exact attention
over the KV cache. With exact_tail = 1 only the last prompt token reads the
cache exactly; the question before it is built from its window (and, for
Orthros, the linear summary). This script measures greedy retrieval of a
converted model (a convert.py workdir or an adapter on its teacher) at
several tails, for the Orthros row and the window + sinks row (same
weights, linear term removed), beside the teacher.

  python benchmarks/exact_tail.py --checkpoint assets/smollm2_orthros_stage1 \
      --teacher results/smollm2/hf --tails 1,64 --lengths 2048 \
      --num_examples 8 --seed 99 --out results/exact_tail

The seed defaults to 99, not the evaluation's 1234 (configs/eval_smollm2.py),
so choosing a tail here does not look at the evaluation's examples.
Writes results.json and report.md (accuracy, Wilson 95% intervals).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import ml_collections  # pylint: disable=wrong-import-position

from orthros_jax.data import get_tokenizer  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import loading  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import retrieval  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import variants  # pylint: disable=wrong-import-position

ROWS = ('window_sinks', 'orthros')


def run(checkpoint: str, teacher: str, *, tails, tasks, lengths,
        num_examples: int, seed: int, sinks: int, max_new_tokens: int,
        batch_size: int, tokenizer: str | None = None) -> dict:
  if any(t < 0 for t in tails):
    raise ValueError(f'tails {tails} must be >= 0')
  cfg = ml_collections.ConfigDict(dict(
      checkpoint=checkpoint, teacher=teacher, models=('teacher', 'orthros'),
      sinks=sinks))
  loaded, desc = loading.load_models(cfg)
  student, params, _ = loaded['orthros']
  models = {'teacher': loaded['teacher']}
  descriptions = {'teacher': desc['teacher']}
  for tail in tails:
    rows, rows_desc = variants.converted_rows(
        student.replace(attention={'exact_tail': int(tail)}), params, ROWS,
        sinks=sinks, where=checkpoint)
    for name in ROWS:
      models[f'{name}@tail{tail}'] = rows[name]
      descriptions[f'{name}@tail{tail}'] = rows_desc[name]
  tok = get_tokenizer(tokenizer or teacher)
  results = []
  for task in tasks:
    for length in lengths:
      out = retrieval.run_task(models, task, tok, length=length,
                               num_examples=num_examples, seed=seed,
                               batch_size=batch_size,
                               max_new_tokens=max_new_tokens)
      for model, r in out.items():
        results.append(dict(r, task=task, length=length, model=model))
        print(f"{task} @ {length}: {model} {100 * r['accuracy']:.1f}% "
              f"(n={r['n']})", flush=True)
  return {'models': descriptions, 'rows': results,
          'settings': dict(checkpoint=checkpoint, teacher=teacher,
                           tails=list(tails), tasks=list(tasks),
                           lengths=list(lengths), num_examples=num_examples,
                           seed=seed, sinks=sinks, batch_size=batch_size,
                           max_new_tokens=max_new_tokens)}


def table(res: dict) -> str:
  names = list(res['models'])
  lines = ['| task | length | ' + ' | '.join(names) + ' |',
           '|---|---|' + '---|' * len(names)]
  for task in res['settings']['tasks']:
    for n in res['settings']['lengths']:
      cells = []
      for m in names:
        r = next(r for r in res['rows'] if r['task'] == task
                 and r['length'] == n and r['model'] == m)
        lo, hi = r['ci95']
        cells.append(f"{100 * r['accuracy']:.1f} [{100 * lo:.0f}, "
                     f"{100 * hi:.0f}]")
      lines.append(f'| {task} | {n} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--checkpoint', default='assets/smollm2_orthros_stage1',
                 help='a convert.py workdir or an adapter directory')
  p.add_argument('--teacher', default='results/smollm2/hf')
  p.add_argument('--tokenizer', default=None,
                 help="default: the teacher's directory; 'byte' for the "
                 'tiny models')
  p.add_argument('--tails', default='1,64')
  p.add_argument('--tasks', default='passkey,niah')
  p.add_argument('--lengths', default='2048')
  p.add_argument('--num_examples', type=int, default=8)
  p.add_argument('--seed', type=int, default=99)
  p.add_argument('--sinks', type=int, default=4)
  p.add_argument('--batch_size', type=int, default=4)
  p.add_argument('--max_new_tokens', type=int, default=24)
  p.add_argument('--out', default='results/exact_tail')
  args = p.parse_args(argv)
  res = run(args.checkpoint, args.teacher,
            tails=[int(t) for t in args.tails.split(',')],
            tasks=args.tasks.split(','),
            lengths=[int(n) for n in args.lengths.split(',')],
            num_examples=args.num_examples, seed=args.seed, sinks=args.sinks,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
            tokenizer=args.tokenizer)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(res, f, indent=1)
  md = ['# Retrieval vs exact tail', ''] + [
      f'- **{k}**: {v}' for k, v in res['models'].items()] + ['', table(res)]
  with open(os.path.join(args.out, 'report.md'), 'w') as f:
    f.write('\n'.join(md) + '\n')
  print(table(res))


if __name__ == '__main__':
  main()
