"""One prepared accelerator check: compiled kernels vs the XLA references,
then the kernel benchmark. Writes everything under OUT.

  python3 benchmarks/device_check.py OUT        (or benchmarks/device_check.sh OUT)

Runs the Pallas kernels compiled for the machine's backend (not
interpreted) at a few shapes (f32 and bf16, GQA, ragged lengths, continued
prefill, T_q in {1, 5}, gradients) against `orthros_jax.attention`, writes
OUT/check.json, then runs benchmarks/kernels.py with accelerator sizes into
OUT/bench. Meant to finish within 8 minutes on one H200 or TPU chip.
"""

from __future__ import annotations

import json
import pathlib
import platform
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from orthros_jax.attention import LinearState  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import WindowPrefix  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import decode_attention  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import orthros_prefill  # pylint: disable=g-import-not-at-top
from pallas_kernels.flash_decode import flash_decode  # pylint: disable=g-import-not-at-top
from pallas_kernels.linear_prefill import linear_prefill  # pylint: disable=g-import-not-at-top


def _rel_err(a, b, mask=None):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if mask is not None:
    a, b = a[mask], b[mask]
  return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _prefill_case(seed, b, t, h, k, d, f, window, chunk, dtype, continued):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
  pos = lambda *s: jnp.asarray(rng.uniform(0.1, 1.0, size=s), jnp.float32)
  q, kk, v = arr(b, t, h, d), arr(b, t, k, d), arr(b, t, k, d)
  pq, pk = pos(b, t, h, f), pos(b, t, h, f)
  gamma = jnp.asarray(rng.uniform(0.05, 0.9, size=h), jnp.float32)
  lengths = jnp.asarray(rng.integers(t // 2, t + 1, size=b), jnp.int32)
  kw = dict(window=window, chunk_size=chunk, lengths=lengths)
  if continued:
    state = LinearState(pos(b, h, f, d), pos(b, h, f))
    n_valid = rng.integers(0, window + 1, size=b)
    valid = jnp.arange(window)[None, :] >= (window - n_valid)[:, None]
    kw.update(initial_state=state, prefix=WindowPrefix(
        arr(b, window, k, d), arr(b, window, k, d), pos(b, window, h, f),
        valid))
  kernel = jax.jit(lambda *a: linear_prefill(*a, **kw))
  ref = jax.jit(lambda *a: orthros_prefill(*a, **kw))
  args = (q, kk, v, pq, pk, gamma)
  (y, st), (yr, sr) = kernel(*args), ref(*args)
  mask = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
  out = dict(y=_rel_err(y, yr, mask), S=_rel_err(st.S, sr.S),
             z=_rel_err(st.z, sr.z))
  if dtype == jnp.float32 and not continued:
    probe = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
    loss = lambda fn: (lambda *a: jnp.sum(
        fn(*a, **kw)[0].astype(jnp.float32) * probe) + jnp.sum(fn(*a, **kw)[1].S))
    g1 = jax.jit(jax.grad(loss(linear_prefill), argnums=(0, 1, 2, 3, 4, 5)))(*args)
    g2 = jax.jit(jax.grad(loss(orthros_prefill), argnums=(0, 1, 2, 3, 4, 5)))(*args)
    out['grad'] = max(_rel_err(a, b) for a, b in zip(g1, g2))
  return out


def _decode_case(seed, b, s, tq, h, k, d, dtype):
  rng = np.random.default_rng(seed)
  arr = lambda *sh: jnp.asarray(rng.normal(size=sh), dtype)
  q, kc, vc = arr(b, tq, h, d), arr(b, s, k, d), arr(b, s, k, d)
  lengths = jnp.asarray(rng.integers(tq, s + 1, size=b), jnp.int32)
  out = jax.jit(flash_decode)(q, kc, vc, lengths)
  ref = jax.jit(decode_attention)(q, kc, vc, lengths)
  return dict(y=_rel_err(out, ref))


def main(out_dir: str) -> int:
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  info = dict(jax=jax.__version__, backend=jax.default_backend(),
              device=str(jax.devices()[0].device_kind),
              num_devices=jax.device_count(), python=platform.python_version())
  print(json.dumps(info))
  tol = {'float32': 1e-4, 'bfloat16': 2e-2}
  cases = []
  for dtype in (jnp.float32, jnp.bfloat16):
    name = jnp.dtype(dtype).name
    for cfg in [dict(b=2, t=1000, h=8, k=2, d=64, f=64, window=64, chunk=64,
                     continued=False),
                dict(b=3, t=777, h=4, k=4, d=128, f=128, window=128, chunk=64,
                     continued=True),
                dict(b=1, t=4096, h=8, k=1, d=128, f=64, window=0, chunk=128,
                     continued=False)]:
      cases.append(('prefill', name, cfg, lambda c=cfg, dt=dtype:
                    _prefill_case(0, **c, dtype=dt)))
    for cfg in [dict(b=4, s=4096, tq=1, h=32, k=8, d=128),
                dict(b=3, s=3000, tq=5, h=8, k=2, d=128),
                dict(b=2, s=32768, tq=1, h=8, k=8, d=64)]:
      cases.append(('decode', name, cfg, lambda c=cfg, dt=dtype:
                    _decode_case(0, **c, dtype=dt)))
  results, ok = [], True
  for kind, dtype, cfg, fn in cases:
    t0 = time.perf_counter()
    try:
      errs = fn()
      passed = all(v <= tol[dtype] for v in errs.values())
      rec = dict(kernel=kind, dtype=dtype, **cfg, errors=errs, passed=passed)
    except Exception:  # record the failure and go on with the next case
      rec = dict(kernel=kind, dtype=dtype, **cfg, passed=False,
                 error=traceback.format_exc(limit=4))
    rec['seconds'] = round(time.perf_counter() - t0, 2)
    ok &= rec['passed']
    results.append(rec)
    print(('PASS ' if rec['passed'] else 'FAIL ') + json.dumps(rec)[:400],
          flush=True)
  (out / 'check.json').write_text(json.dumps(dict(info=info, cases=results),
                                             indent=1))
  bench = [sys.executable, str(ROOT / 'benchmarks' / 'kernels.py'),
           f'--out={out / "bench"}']
  print('running', ' '.join(bench), flush=True)
  rc = subprocess.call(bench, cwd=ROOT)
  print(f'correctness: {"all passed" if ok else "FAILURES"}; benchmark rc={rc}')
  return 0 if ok and rc == 0 else 1


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit('usage: python3 benchmarks/device_check.py OUT_DIR')
  sys.exit(main(sys.argv[1]))
