"""Conversion throughput: the same convert.py command at two commits.

Runs `convert.py --config=CONFIG` for a few steps of each stage in a git
worktree of a base commit and in this checkout (or a second commit),
`--rounds` rounds of one run each (base first in even rounds, head first
in odd ones), and reads each stage's metrics.jsonl. Each logged step's wall time is its token count over its
rate (both written by the training loop at every commit); the first
`--skip` steps of a stage (compilation) are left out. A round's figure is
its median step; the table gives the median over rounds with min and max,
as tokens/s of batch_size x seq_len input tokens per step (every token is
real on packed text; the tiny recipe's task rows include padding, the same
at both commits) and the head / base ratio.

  python benchmarks/conversion_speed.py --config configs/convert_tiny.py \
      --set teacher.checkpoint=assets/tiny_teacher --out results/conv_speed_tiny
  python benchmarks/conversion_speed.py --config configs/convert_smollm2.py \
      --steps1 6 --steps2 6 --rounds 1 --eval_examples 1 \
      --set stage1.warmup_steps=2 --set stage2.warmup_steps=2 \
      --out results/conv_speed_smollm2

(A stage of fewer steps than its warmup is refused by convert.py; the
warmup changes the learning rate only, not the step's time.)

The base default is ba9642b, the last commit before the conversion speed
work (f771288 blocked exact attention, 468b73a trainable-only gradients);
configs/convert_smollm2.py exists there, so the command is the same. The
worktree gets a `results` link to this checkout's (the teacher and the
corpus). Writes conversion_speed.json, .csv, report.md and a plot.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = 'ba9642b'
STAGES = ('stage1', 'stage2')


def step_seconds(record: dict) -> float | None:
  """Wall time of one logged step (log_every=1) from its metrics record.

  Every commit writes `tokens` (the step's counted tokens) and a rate of
  those tokens: `loss_tokens_per_s` where the loop also logs input tokens,
  else `tokens_per_s`."""
  tokens = float(record.get('tokens', 0.0))
  rate = record.get('loss_tokens_per_s', record.get('tokens_per_s'))
  if tokens <= 0 or not rate or not isinstance(rate, (int, float)):
    return None
  return tokens / float(rate)


def stage_times(workdir: pathlib.Path, stage: str, skip: int) -> list[float]:
  path = workdir / stage / 'metrics.jsonl'
  if not path.is_file():
    raise FileNotFoundError(f'{path} is missing: the run did not reach '
                            f'{stage} (see its log in {workdir})')
  rows = [json.loads(line) for line in path.read_text().splitlines()
          if line.strip()]
  times = [(r['step'], step_seconds(r)) for r in rows
           if 'step' in r and not any(k.startswith('eval/') for k in r)]
  times = [t for s, t in times if s > skip and t is not None]
  if not times:
    raise ValueError(f'{path}: no timed step after the first {skip}')
  return times


def worktree(rev: str, scratch: pathlib.Path) -> pathlib.Path:
  """A detached worktree of `rev` with a `results` link to this checkout's."""
  tree = scratch / f'tree_{rev}'
  if not tree.exists():
    proc = subprocess.run(['git', '-C', str(ROOT), 'worktree', 'add',
                           '--detach', str(tree), rev], capture_output=True,
                          text=True, check=False)
    if proc.returncode:
      raise RuntimeError(f'git worktree add {tree} {rev} failed: '
                         f'{proc.stderr.strip()}')
  link = tree / 'results'
  if not (link.is_symlink() or link.exists()) and (ROOT / 'results').is_dir():
    link.symlink_to(ROOT / 'results')
  return tree


def commit_of(tree: pathlib.Path) -> str:
  out = subprocess.run(['git', '-C', str(tree), 'rev-parse', '--short',
                        'HEAD'], check=True, capture_output=True, text=True)
  dirty = subprocess.run(['git', '-C', str(tree), 'status', '--porcelain',
                          '--untracked-files=no'], check=True,
                         capture_output=True, text=True).stdout.strip()
  return out.stdout.strip() + ('+local changes' if dirty else '')


def run_once(tree: pathlib.Path, args, workdir: pathlib.Path) -> dict:
  """One convert.py run of steps1 + steps2 steps; its per-step times."""
  cmd = [sys.executable, 'convert.py', f'--config={args.config}',
         f'--workdir={workdir}',
         f'--config.stage1.tokens={args.steps1 * args.tokens_per_step}',
         f'--config.stage2.tokens={args.steps2 * args.tokens_per_step}',
         '--config.stage1.log_every=1', '--config.stage2.log_every=1',
         '--config.eval.after_stage1=False']
  if args.eval_examples:
    cmd.append(f'--config.eval.num_examples={args.eval_examples}')
  cmd += [f'--config.{kv}' for kv in args.set]
  if workdir.exists():  # a fresh run: no resume, no appended metrics
    shutil.rmtree(workdir)
  t0 = time.perf_counter()
  with open(workdir.with_suffix('.log'), 'w') as log:
    proc = subprocess.run(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                          check=False)
  wall = time.perf_counter() - t0
  if proc.returncode:
    raise RuntimeError(f'{" ".join(cmd)} failed in {tree} (exit '
                       f'{proc.returncode}); log: {workdir.with_suffix(".log")}')
  data = json.loads((workdir / 'config.json').read_text())['data']
  tokens = int(data['batch_size']) * int(data['seq_len'])
  if tokens != args.tokens_per_step:
    raise ValueError(f'{tree}: {tokens} tokens per step, not the '
                     f'{args.tokens_per_step} of this checkout\'s config: the '
                     'two commits do not run the same recipe')
  return {'wall_s': wall, **{s: stage_times(workdir, s, args.skip)
                             for s in STAGES}}


def tokens_per_step(config: str, overrides: list[str]) -> int:
  """batch_size x seq_len of the head's config (the same recipe at both)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  path, _, arg = config.partition(':')
  spec = importlib.util.spec_from_file_location('_conv_config', ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  data = dict(module.get_config(arg).data)
  for kv in overrides:
    key, _, value = kv.partition('=')
    if key in ('data.batch_size', 'data.seq_len'):
      data[key.split('.')[1]] = int(value)
  return int(data['batch_size']) * int(data['seq_len'])


def summarize(runs: dict, tps: int) -> list[dict]:
  rows = []
  for stage in STAGES:
    per = {}
    for name in ('base', 'head'):
      medians = [statistics.median(r[stage]) for r in runs[name]]
      per[name] = {'step_s': statistics.median(medians),
                   'step_min_s': min(min(r[stage]) for r in runs[name]),
                   'step_max_s': max(max(r[stage]) for r in runs[name]),
                   'steps_timed': sum(len(r[stage]) for r in runs[name])}
    for name in ('base', 'head'):
      p = per[name]
      rows.append({'stage': stage, 'commit': name, **p,
                   'tokens_per_s': tps / p['step_s'],
                   'tokens_per_s_min': tps / p['step_max_s'],
                   'tokens_per_s_max': tps / p['step_min_s'],
                   'speedup': per['base']['step_s'] / p['step_s']})
  return rows


def plot(rows: list[dict], info: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for i, name in enumerate(('base', 'head')):
    rs = [r for r in rows if r['commit'] == name]
    xs = [j + 0.38 * i for j in range(len(rs))]
    ys = [r['tokens_per_s'] for r in rs]
    err = [[y - r['tokens_per_s_min'] for y, r in zip(ys, rs)],
           [r['tokens_per_s_max'] - y for y, r in zip(ys, rs)]]
    ax.bar(xs, ys, width=0.36, yerr=err, capsize=3,
           label=f"{name} {info[name + '_commit']}")
  ax.set_xticks([j + 0.19 for j in range(len(STAGES))], STAGES)
  ax.set_ylabel('tokens / s (median, min-max)')
  ax.set_title(f"convert.py --config={info['config']}", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/convert_tiny.py',
                      help='convert.py --config, relative to each tree')
  parser.add_argument('--base', default=BASE)
  parser.add_argument('--head', default='',
                      help="a commit; '' (default) is this checkout as it is")
  parser.add_argument('--steps1', type=int, default=8)
  parser.add_argument('--steps2', type=int, default=8)
  parser.add_argument('--skip', type=int, default=2,
                      help='first steps of each stage left out (compiling)')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--eval_examples', type=int, default=0,
                      help="the final held-out check's examples (0: the "
                      "config's)")
  parser.add_argument('--set', action='append', default=[],
                      help='KEY=VALUE: --config.KEY=VALUE at both commits')
  parser.add_argument('--scratch', default='',
                      help='worktrees and workdirs (default a temp folder)')
  parser.add_argument('--out', default='results/conversion_speed')
  args = parser.parse_args(argv)
  if min(args.steps1, args.steps2) <= args.skip:
    parser.error(f'--steps1/--steps2 must exceed --skip ({args.skip})')
  if args.rounds < 1:
    parser.error('--rounds must be >= 1')
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  scratch = pathlib.Path(args.scratch or tempfile.mkdtemp(prefix='convspeed_'))
  scratch.mkdir(parents=True, exist_ok=True)
  args.tokens_per_step = tokens_per_step(args.config, args.set)
  trees = {'base': worktree(args.base, scratch),
           'head': worktree(args.head, scratch) if args.head else ROOT}
  info = {'config': args.config, 'set': args.set, 'steps1': args.steps1,
          'steps2': args.steps2, 'skip': args.skip, 'rounds': args.rounds,
          'tokens_per_step': args.tokens_per_step, 'python': sys.executable,
          **{f'{n}_commit': commit_of(t) for n, t in trees.items()}}
  runs = {'base': [], 'head': []}
  for rnd in range(args.rounds):
    # base first in even rounds, head first in odd ones: no order bias.
    for name in ('base', 'head')[::1 if rnd % 2 == 0 else -1]:
      workdir = scratch / f'run_{name}_{rnd}'
      print(f'round {rnd + 1}/{args.rounds}: {name} '
            f"({info[name + '_commit']}) ...", flush=True)
      res = run_once(trees[name], args, workdir)
      runs[name].append(res)
      print(f"  {res['wall_s']:.0f} s; median step: " + ', '.join(
          f'{s} {statistics.median(res[s]):.2f} s' for s in STAGES),
          flush=True)
  rows = summarize(runs, args.tokens_per_step)
  (out / 'conversion_speed.json').write_text(json.dumps(
      {'info': info, 'rows': rows, 'runs': runs}, indent=1))
  with open(out / 'conversion_speed.csv', 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  lines = [f"# Conversion throughput: `convert.py --config={args.config}`",
           '', f"base {info['base_commit']}, head {info['head_commit']}; "
           f'{args.rounds} round(s) of base and head (alternating which '
           f'goes first), steps {args.steps1} + '
           f'{args.steps2}, the first {args.skip} of each stage left out; '
           f'{args.tokens_per_step} input tokens per step.', '',
           '| stage | commit | step s (median) | tokens/s [min, max] | '
           'x base |', '|---|---|---|---|---|']
  for r in rows:
    lines.append(f"| {r['stage']} | {r['commit']} {info[r['commit'] + '_commit']}"
                 f" | {r['step_s']:.3f} | {r['tokens_per_s']:.1f} "
                 f"[{r['tokens_per_s_min']:.1f}, {r['tokens_per_s_max']:.1f}]"
                 f" | {r['speedup']:.2f} |")
  (out / 'report.md').write_text('\n'.join(lines) + '\n')
  plot(rows, info, out / 'conversion_speed.png')
  print('\n'.join(lines))
  return 0


if __name__ == '__main__':
  sys.exit(main())
