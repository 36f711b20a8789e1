"""Which GPU launch settings of the Pallas kernels fit a GPU's shared memory.

  python3 benchmarks/pallas_fit.py OUT_DIR

On an H200 (jax 0.11.2, 2026-12-04) the GPU (Triton) kernels, then at
num_stages 2 and splits of 512, failed with 'Shared memory size limit
exceeded' at the recipes' shapes (prefill with F = 128 features, decode
with head_dim 128); this sweep chose the settings the kernels now use
(benchmarks/RESULTS.md "Accelerators"). This
sweep compiles and runs each kernel over a grid of chunk / split sizes and
Triton `num_stages`, and records, per setting, the error against the XLA
reference, the median time of 5 runs, or the compiler's message (which
names the shared memory requested and available). Writes OUT/fit.json.
On CPU it runs the same grid in interpret mode at tiny sizes (a dry run).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from orthros_jax.attention import decode_attention  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import orthros_prefill  # pylint: disable=g-import-not-at-top
from pallas_kernels import flash_decode as fd  # pylint: disable=g-import-not-at-top
from pallas_kernels import linear_prefill as lp  # pylint: disable=g-import-not-at-top


def _median_time(fn, args, reps=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def prefill_case(t, h, k, d, f, window, chunk, dtype, interpret):
  rng = np.random.default_rng(0)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
  pos = lambda *s: jnp.asarray(rng.uniform(0.1, 1.0, size=s), jnp.float32)
  args = (arr(1, t, h, d), arr(1, t, k, d), arr(1, t, k, d),
          pos(1, t, h, f), pos(1, t, h, f),
          jnp.asarray(rng.uniform(0.05, 0.9, size=h), jnp.float32))
  kw = dict(window=window, chunk_size=chunk)
  plat = dict(interpret=True, platform='gpu') if interpret else {}
  kernel = jax.jit(lambda *a: lp.linear_prefill(*a, **kw, **plat)[0])
  ref = jax.jit(lambda *a: orthros_prefill(*a, **kw)[0])
  out = dict(error=_err(kernel(*args), ref(*args)))
  if not interpret:
    out['ms'] = 1e3 * _median_time(kernel, args)
  return out


def decode_case(s, h, k, d, split, dtype, interpret):
  rng = np.random.default_rng(0)
  arr = lambda *sh: jnp.asarray(rng.normal(size=sh), dtype)
  args = (arr(4, 1, h, d), arr(4, s, k, d), arr(4, s, k, d),
          jnp.asarray([s, s - 3, s // 2, s - 100], jnp.int32))
  plat = dict(interpret=True, platform='gpu') if interpret else {}
  kernel = jax.jit(lambda *a: fd.flash_decode(*a, max_split=split, **plat))
  out = dict(error=_err(kernel(*args), jax.jit(decode_attention)(*args)))
  if not interpret:
    out['ms'] = 1e3 * _median_time(kernel, args)
  return out


def main(out_dir: str) -> int:
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  interpret = jax.default_backend() == 'cpu'
  t, s = (256, 1024) if interpret else (8192, 32768)
  info = dict(jax=jax.__version__, backend=jax.default_backend(),
              device=str(jax.devices()[0].device_kind), interpret=interpret)
  grid = []
  for dtype in ('bfloat16', 'float32'):
    for stages in (1, 2):
      # SmolLM2-135M (9 / 3 heads of 64, F = 128), and an 8B-like head.
      for d, h, k in ((64, 9, 3), (128, 8, 2)):
        for chunk in (16, 32, 64):
          grid.append(('prefill', dtype, stages, dict(
              t=t, h=h, k=k, d=d, f=128, window=64, chunk=chunk)))
      for split in (128, 256, 512):
        grid.append(('decode', dtype, stages, dict(
            s=s, h=32, k=8, d=128, split=split)))
  rows = []
  saved = (dict(lp.GPU_COMPILER_PARAMS), dict(fd.GPU_COMPILER_PARAMS),
           fd.GPU_MAX_SPLIT_D64, fd.GPU_MAX_SPLIT_D128)
  # The sweep sets the split itself, past the kernel's own caps.
  fd.GPU_MAX_SPLIT_D64 = fd.GPU_MAX_SPLIT_D128 = 1 << 20
  for kind, dtype, stages, cfg in grid:
    lp.GPU_COMPILER_PARAMS['num_stages'] = stages
    fd.GPU_COMPILER_PARAMS['num_stages'] = stages
    fn = prefill_case if kind == 'prefill' else decode_case
    row = dict(kernel=kind, dtype=dtype, num_stages=stages, **cfg)
    try:
      row.update(fn(**cfg, dtype=jnp.dtype(dtype), interpret=interpret),
                 status='ok')
    except Exception as e:  # record what the compiler said, go on
      msg = f'{type(e).__name__}: {e}'
      row.update(status='failed', message=msg.splitlines()[0][:300],
                 trace=traceback.format_exc(limit=2)[-600:])
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != 'trace'}),
          flush=True)
    (out / 'fit.json').write_text(json.dumps(dict(info=info, rows=rows),
                                             indent=1))
  lp.GPU_COMPILER_PARAMS.update(saved[0])
  fd.GPU_COMPILER_PARAMS.update(saved[1])
  fd.GPU_MAX_SPLIT_D64, fd.GPU_MAX_SPLIT_D128 = saved[2:]
  return 0


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit('usage: python3 benchmarks/pallas_fit.py OUT_DIR')
  sys.exit(main(sys.argv[1]))
