r"""Reports of a `kernels.py` run: ratios, slopes, markdown, acceptance, plots.

Everything here works on the measurement rows that `benchmarks/kernels.py`
collects (one dict per impl and length, with `section`, `impl`, `n`,
`status` and, when ok, `time_s`, `flops_per_s` / `bytes_per_s`, ...) and its
ceilings; nothing is timed here. Imported by kernels.py as
`from benchmarks import report`.
"""

from __future__ import annotations

import numpy as np


def _slope(xs, ys):
  """Least-squares slope of log(y) vs log(x); None for fewer than 2 points."""
  if len(xs) < 2:
    return None
  return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def _ok(rows, section, impl):
  return {r['n']: r for r in rows if r['section'] == section
          and r['impl'] == impl and r['status'] == 'ok'}


def analyse(rows):
  """Speed ratios per N and fitted log-log slopes."""
  out = {'ratios': {}, 'slopes': {}}
  for num, den in (('dense_xla', 'orthros_xla'),
                   ('dense_cudnn', 'orthros_pallas'),
                   ('dense_tpu_flash', 'orthros_pallas'),
                   ('dense_xla', 'orthros_pallas'),
                   ('orthros_xla', 'orthros_pallas'),
                   ('orthros_pallas_seq', 'orthros_pallas')):
    a, b = _ok(rows, 'prefill', num), _ok(rows, 'prefill', den)
    ns = sorted(set(a) & set(b))
    if not ns:
      continue
    ratio = {n: a[n]['time_s'] / b[n]['time_s'] for n in ns}
    upper = ns[len(ns) // 2:] if len(ns) >= 4 else ns
    out['ratios'][f'{num}/{den}'] = dict(
        per_n=ratio,
        slope_all=_slope(ns, [ratio[n] for n in ns]),
        slope_upper=_slope(upper, [ratio[n] for n in upper]),
        upper_ns=upper)
  for section in ('prefill', 'decode'):
    for impl in sorted({r['impl'] for r in rows if r['section'] == section}):
      ok = _ok(rows, section, impl)
      ns = sorted(ok)
      if len(ns) >= 2:
        out['slopes'][f'{section}/{impl}'] = _slope(
            ns, [ok[n]['time_s'] for n in ns])
  return out


def _fmt(x, spec):
  return '-' if x is None else format(x, spec)


def _status_rows(rows, section):
  """Rows of a section, a repeated non-ok status of an impl shown once."""
  seen = set()
  for r in rows:
    if r['section'] != section:
      continue
    if r['status'] != 'ok':
      if (r['impl'], r['status']) in seen:
        continue
      seen.add((r['impl'], r['status']))
    yield r


def markdown(info, ceilings, rows, analysis):
  lines = [f'## Machine: {info["backend"]} / {info["device_kind"]} '
           f'({info["cpu_count"]} CPUs usable), jax {info["jax_version"]}, '
           f'dtype {info["dtype"]}', '']
  lines += ['| ceiling | value |', '|---|---|']
  for name, rate in ceilings['matmul_flops_per_s'].items():
    lines.append(f'| matmul {name} {ceilings["matmul_size"]}^3 | '
                 f'{rate/1e9:.1f} GFLOP/s |')
  for name, err in ceilings['matmul_errors'].items():
    lines.append(f'| matmul {name} | failed: {err[:60]} |')
  lines.append(f'| copy bandwidth ({ceilings["copy_mib"]} MiB, read+write) | '
               f'{ceilings["copy_bytes_per_s"]/1e9:.1f} GB/s |')
  lines.append(f'| read bandwidth (sum of the same array) | '
               f'{ceilings["read_bytes_per_s"]/1e9:.1f} GB/s |')
  lines.append('')

  lines += ['### Prefill', '',
            '| N | impl | time (ms) | reps | GFLOP/s | frac of matmul | note |',
            '|---:|---|---:|---:|---:|---:|---|']
  for r in _status_rows(rows, 'prefill'):
    if r['status'] != 'ok':
      lines.append(f'| {r["n"]} | {r["impl"]} | - | - | - | - | '
                   f'{r["status"][:90]} |')
      continue
    note = ', '.join(f'{k[len("max_abs_diff_vs_"):]} diff {v:.1e}'
                     for k, v in r.items() if k.startswith('max_abs_diff'))
    lines.append(f'| {r["n"]} | {r["impl"]} | {r["time_s"]*1e3:.2f} | '
                 f'{r["reps"]} | {r["flops_per_s"]/1e9:.2f} | '
                 f'{_fmt(r.get("frac_matmul"), ".3f")} | {note} |')
  lines.append('')
  for key, rat in analysis['ratios'].items():
    lines += [f'Speed ratio {key} (time of the first / time of the second):',
              '', '| N | ratio |', '|---:|---:|']
    lines += [f'| {n} | {v:.2f} |' for n, v in rat['per_n'].items()]
    lines += ['', f'Slope of log(ratio) vs log(N): {_fmt(rat["slope_all"], ".3f")}'
              f' (all N), {_fmt(rat["slope_upper"], ".3f")} (N in '
              f'{rat["upper_ns"]}); ~1 means linear vs quadratic.', '']

  lines += ['### Decode (B = %d, T_q = 1, ragged lengths near full)' %
            info['shapes']['decode_batch'], '',
            '| cache S | impl | time (ms) | reps | GB/s (K/V read) | '
            'frac of copy bw | note |', '|---:|---|---:|---:|---:|---:|---|']
  for r in _status_rows(rows, 'decode'):
    if r['status'] != 'ok':
      lines.append(f'| {r["n"]} | {r["impl"]} | - | - | - | - | '
                   f'{r["status"][:90]} |')
      continue
    note = ', '.join(f'{k[len("max_abs_diff_vs_"):]} diff {v:.1e}'
                     for k, v in r.items() if k.startswith('max_abs_diff'))
    lines.append(f'| {r["n"]} | {r["impl"]} | {r["time_s"]*1e3:.3f} | '
                 f'{r["reps"]} | {r["bytes_per_s"]/1e9:.2f} | '
                 f'{r["frac_bandwidth"]:.3f} | {note} |')
  lines += ['', '### Fitted slopes of log(time) vs log(N)', '',
            '| series | slope |', '|---|---:|']
  lines += [f'| {k} | {_fmt(v, ".3f")} |'
            for k, v in analysis['slopes'].items()]
  return '\n'.join(lines)


def acceptance(analysis, check_len, check_ratio):
  """The pass/fail line: dense_xla/orthros_xla time ratio at check_len."""
  rat = analysis['ratios'].get('dense_xla/orthros_xla')
  n = check_len
  if not rat or n not in rat['per_n']:
    return f'Acceptance: no dense_xla and orthros_xla pair at N={n}.'
  r = rat['per_n'][n]
  verdict = 'PASS' if r >= check_ratio else 'FAIL'
  return (f'Acceptance: orthros_xla is {r:.1f}x faster than dense_xla at '
          f'N={n} (target >= {check_ratio:g}x): {verdict}; slope of '
          f'log(ratio) vs log(N) = {_fmt(rat["slope_all"], ".2f")} (all N), '
          f'{_fmt(rat["slope_upper"], ".2f")} (upper half; target ~1).')


def plot(rows, analysis, ceilings, out_dir, check_ratio):
  """Writes prefill.png and decode.png (nothing if matplotlib is missing)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print('matplotlib is missing: pip install -r requirements.txt; '
          'no PNGs written.', flush=True)
    return
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for impl in dict.fromkeys(r['impl'] for r in rows if r['section'] == 'prefill'):
    ok = _ok(rows, 'prefill', impl)
    if ok:
      ns = sorted(ok)
      ax.loglog(ns, [ok[n]['time_s'] for n in ns], 'o-', label=impl)
  ax.set(xlabel='prompt length N', ylabel='time per call (s)',
         title='prefill time')
  ax.grid(True, which='both', alpha=0.3)
  ax.legend()
  for key, rat in analysis['ratios'].items():
    ns = sorted(rat['per_n'])
    ax2.loglog(ns, [rat['per_n'][n] for n in ns], 's-',
               label=f'{key} (slope {_fmt(rat["slope_all"], ".2f")})')
  ax2.axhline(check_ratio, color='gray', ls='--', lw=1)
  ax2.set(xlabel='prompt length N', ylabel='speed ratio',
          title='dense / orthros time ratio')
  ax2.grid(True, which='both', alpha=0.3)
  if analysis['ratios']:
    ax2.legend()
  for a in (ax, ax2):
    a.set_xscale('log', base=2)
  fig.tight_layout()
  fig.savefig(out_dir / 'prefill.png', dpi=120)
  plt.close(fig)

  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for impl in dict.fromkeys(r['impl'] for r in rows if r['section'] == 'decode'):
    ok = _ok(rows, 'decode', impl)
    if ok:
      ns = sorted(ok)
      ax.loglog(ns, [ok[n]['time_s'] for n in ns], 'o-', label=impl)
      ax2.semilogx(ns, [ok[n]['bytes_per_s'] / 1e9 for n in ns], 'o-',
                   label=impl)
  ax2.axhline(ceilings['copy_bytes_per_s'] / 1e9, color='gray', ls='--',
              label='measured copy bandwidth')
  ax.set(xlabel='cache length S', ylabel='time per step (s)',
         title='decode time (T_q = 1)')
  ax2.set(xlabel='cache length S', ylabel='GB/s of K/V read',
          title='decode achieved bandwidth')
  for a in (ax, ax2):
    a.set_xscale('log', base=2)
    a.grid(True, which='both', alpha=0.3)
    a.legend()
  fig.tight_layout()
  fig.savefig(out_dir / 'decode.png', dpi=120)
  plt.close(fig)
