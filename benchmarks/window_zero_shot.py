"""Zero-shot: does a dense model keep retrieving with a sliding-window prefill?

On the teacher's own weights (nothing trained), the window rows of
orthros_jax/evaluation/variants.py: the prompt through a W-token window
softmax (linear term removed), with and without the first N tokens kept
exact (attention sinks, StreamingLLM), the answer decoded with exact
attention over the whole KV cache; beside the dense teacher. The window
rows do not depend on feature maps or window weights (the linear term is
exactly 0 and gamma cancels), so no conversion is needed.

  python benchmarks/window_zero_shot.py --teacher results/smollm2/hf \
      --lengths 2048 --num_examples 4 --out results/window_zero_shot
  python benchmarks/window_zero_shot.py --lengths 4096 --window 64,256,512 \
      --exact_tail 64 --num_examples 6     # rows window@W, window_sinks@W

Writes results.json and report.md (accuracy, Wilson 95% intervals).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from orthros_jax.conversion.pipeline import init_student  # pylint: disable=g-import-not-at-top,wrong-import-position
from orthros_jax.data import get_tokenizer  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import loading  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import retrieval  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import variants  # pylint: disable=wrong-import-position


def run(teacher: str, *, tasks, lengths, num_examples: int, window,
        sinks: int, seed: int, max_new_tokens: int, batch_size: int,
        tokenizer: str | None = None, exact_tail: int = 1) -> dict:
  """window: one W, or several (rows then named window@W,
  window_sinks@W)."""
  config, params, where = loading.load_dense(teacher)
  tokenizer = get_tokenizer(tokenizer or teacher)
  windows = [window] if isinstance(window, int) else list(window)
  models = {'teacher': (config, params, 'inference')}
  desc = {'teacher': f'{where}: the teacher as loaded, dense attention'}
  for w in windows:
    student = config.replace(attention=dict(kind='orthros', window=w,
                                            sinks=0, exact_tail=exact_tail))
    orthros_params = init_student(params, student, jax.random.PRNGKey(0))
    rows, rows_desc = variants.converted_rows(
        student, orthros_params, ['window', 'window_sinks'], sinks=sinks,
        where=f'{where}, unconverted')
    suffix = '' if len(windows) == 1 else f'@{w}'
    for name in rows:
      models[name + suffix] = rows[name]
      desc[name + suffix] = rows_desc[name]
  results = []
  for task in tasks:
    for length in lengths:
      out = retrieval.run_task(models, task, tokenizer, length=length,
                               num_examples=num_examples, seed=seed,
                               batch_size=batch_size,
                               max_new_tokens=max_new_tokens)
      for model, r in out.items():
        results.append(dict(r, task=task, length=length, model=model))
        print(f"{task} @ {length}: {model} {100 * r['accuracy']:.1f}% "
              f"(n={r['n']})", flush=True)
  return {'models': desc, 'rows': results,
          'settings': dict(tasks=list(tasks), lengths=list(lengths),
                           num_examples=num_examples, window=windows,
                           exact_tail=exact_tail,
                           sinks=sinks, seed=seed, batch_size=batch_size,
                           max_new_tokens=max_new_tokens)}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--teacher', default='results/smollm2/hf')
  p.add_argument('--tokenizer', default=None,
                 help="default: the teacher's directory; 'byte' for the "
                 'tiny models')
  p.add_argument('--tasks', default='passkey,niah')
  p.add_argument('--lengths', default='2048')
  p.add_argument('--num_examples', type=int, default=4)
  p.add_argument('--window', default='64',
                 help='W, or several: 64,128,256 (rows window@W, ...)')
  p.add_argument('--exact_tail', type=int, default=1,
                 help='prompt tokens decoded exactly (eval_smollm2: 64)')
  p.add_argument('--sinks', type=int, default=4)
  p.add_argument('--seed', type=int, default=1234)
  p.add_argument('--batch_size', type=int, default=4)
  p.add_argument('--max_new_tokens', type=int, default=0,
                 help='0: the longest answer plus its eos')
  p.add_argument('--out', default='results/window_zero_shot')
  args = p.parse_args(argv)
  res = run(args.teacher, tasks=args.tasks.split(','),
            lengths=[int(n) for n in args.lengths.split(',')],
            num_examples=args.num_examples,
            window=[int(w) for w in args.window.split(',')],
            exact_tail=args.exact_tail,
            sinks=args.sinks, seed=args.seed,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
            tokenizer=args.tokenizer)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(res, f, indent=1)
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
                     f"{100 * hi:.0f}] (n={r['n']})")
      lines.append(f'| {task} | {n} | ' + ' | '.join(cells) + ' |')
  md = ['# Window prefill, zero-shot', ''] + [
      f'- **{k}**: {v}' for k, v in res['models'].items()] + [''] + lines
  with open(os.path.join(args.out, 'report.md'), 'w') as f:
    f.write('\n'.join(md) + '\n')
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
