r"""Model-level speed on the device: the SmolLM2-135M shape, random weights.

  python3 benchmarks/device_model.py --out OUT/model --budget_s 240
  python3 benchmarks/device_model.py --out /tmp/model --tiny     # CPU dry run

The shape of SmolLM2-135M (vocab 49152, 30 layers, d_model 576, 9 query /
3 kv heads of 64, MLP 1536, RoPE theta 1e5, tied embeddings), random
weights, parameters and activations in bfloat16, with the Orthros attention
of configs/convert_smollm2.py (hedgehog feature_dim P = 64, so F = 128
features; window 64, chunk 64, exact_tail 1), batch 1. For each prompt
length (default 4K, 8K, 16K, 32K) and variant it runs
`orthros_jax.evaluation.speed.measure`:

  orthros         the recipe's attention with sinks = 0: the Pallas prefill
                  kernel has no sink tokens (with sinks, dispatch falls back
                  to the XLA prefill); the row's `prefill_impl` says which
                  function the prefill took here;
  dense           the same network with exact attention (phase='prefill':
                  the XLA blocked online softmax over the cache, not cuDNN);
  none            attention removed (the ceiling);
  extras, run only while the time box allows:
  dense_forward   phase='forward' of the dense network, argmax of the last
                  position: the model's cuDNN flash attention path on GPU
                  (no cache written; the LM head may run at every position);
  orthros_sinks4  the recipe as converted (sinks = 4: the XLA prefill).

Per row: TTFT median / min / max of `--reps` timed runs after a warm-up,
decode step time and tokens/s over a cache of N tokens, XLA's compiled
memory estimate of the prefill, the process's peak device memory so far,
which attention functions dispatch chose (`prefill_impl`, `decode_impl`),
and the custom calls in the compiled prefill (cuDNN, Triton/Pallas,
cuBLAS: evidence of what ran). Also the machine's matmul rate and copy
bandwidth (`benchmarks/kernels.py`'s `measure_ceilings`).

Time box: a measurement whose predicted wall time (from the variant's
previous length: compile time plus run time scaled by N or N^2) does not
fit in what is left of `--budget_s` is skipped with the reason recorded.
Lengths run in priority order (shortest, longest, then the rest, longest
first). model.json and model.csv are rewritten after every row, so a run
killed from outside keeps every finished row; model.png at the end (if
matplotlib imports).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import importlib.util
import json
import os
import pathlib
import platform
import re
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

# orthros_jax/__init__.py imports orthros_jax.checkpoints.hf, which imports
# safetensors at module level (checkpoint loading; nothing here uses it). A
# device image with only jax / flax / optax / orbax may lack it.
OPTIONAL_MODULES = ('safetensors',)
_STUB = '''"""Stand-in written by benchmarks/device_model.py: {name} is not
installed here. Any attribute is a function that raises ImportError."""


def __getattr__(attr):
  if attr.startswith('__'):
    raise AttributeError(attr)

  def missing(*args, **kwargs):
    raise ImportError('{name} is not installed (stand-in module)')

  return missing
'''


def stub_missing_modules(names=OPTIONAL_MODULES) -> list[str]:
  """Puts a stand-in package for each missing module of `names` in a temp
  folder first on sys.path and on PYTHONPATH (child processes see it too).
  Returns the names stubbed (empty where all are installed)."""
  missing = [n for n in names if importlib.util.find_spec(n) is None]
  if not missing:
    return []
  folder = pathlib.Path(tempfile.mkdtemp(prefix='orthros_stubs_'))
  for name in missing:
    (folder / name).mkdir()
    (folder / name / '__init__.py').write_text(_STUB.format(name=name))
  sys.path.insert(0, str(folder))
  os.environ['PYTHONPATH'] = os.pathsep.join(
      p for p in (str(folder), os.environ.get('PYTHONPATH')) if p)
  return missing


STUBBED = stub_missing_modules()

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from orthros_jax.attention import dispatch  # pylint: disable=g-import-not-at-top
from orthros_jax.attention import softmax  # pylint: disable=g-import-not-at-top
from orthros_jax.config import AttentionConfig  # pylint: disable=g-import-not-at-top
from orthros_jax.config import ModelConfig  # pylint: disable=g-import-not-at-top
from orthros_jax.evaluation import speed  # pylint: disable=g-import-not-at-top
from orthros_jax.model import Transformer  # pylint: disable=g-import-not-at-top

_K = 1024
LENGTHS = (4 * _K, 8 * _K, 16 * _K, 32 * _K)
TINY_LENGTHS = (64, 128)
MAIN = ('orthros', 'dense', 'none')
EXTRAS = ('dense_forward', 'orthros_sinks4')
# The attention of configs/convert_smollm2.py (tests/test_benchmarks.py
# checks they agree), sinks set per variant.
RECIPE_ATTENTION = dict(kind='orthros', feature_map='hedgehog', feature_dim=64,
                        window=64, chunk_size=64, exact_tail=1,
                        window_init=0.1, sinks=4, length_scale=False)
_QUADRATIC = ('dense', 'dense_forward')
_CSV_FIELDS = [
    'variant', 'length', 'status', 'ttft_s', 'ttft_min_s', 'ttft_max_s',
    'reps', 'prefill_tokens_per_s', 'decode_step_s', 'decode_tokens_per_s',
    'prefill_memory_bytes', 'device_peak_bytes_so_far', 'compile_s',
    'wall_s', 'prefill_impl', 'decode_impl', 'sinks', 'error']


def smollm2_config(*, tiny: bool = False, sinks: int = 0) -> ModelConfig:
  """The SmolLM2-135M shape in bfloat16 with the recipe's Orthros attention
  (`sinks` replaced); tiny: a 2-layer stand-in for CPU dry runs."""
  if tiny:
    return ModelConfig(
        vocab_size=512, num_layers=2, embed_dim=64, num_heads=3,
        num_kv_heads=1, head_dim=16, mlp_dim=128, norm_eps=1e-5,
        rope_theta=1e5, tie_embeddings=True, dtype='bfloat16',
        param_dtype='bfloat16', attention=AttentionConfig(
            **dict(RECIPE_ATTENTION, feature_dim=8, window=16, chunk_size=16,
                   sinks=sinks)))
  return ModelConfig(
      vocab_size=49152, num_layers=30, embed_dim=576, num_heads=9,
      num_kv_heads=3, head_dim=64, mlp_dim=1536, norm_eps=1e-5,
      rope_theta=1e5, tie_embeddings=True, dtype='bfloat16',
      param_dtype='bfloat16',
      attention=AttentionConfig(**dict(RECIPE_ATTENTION, sinks=sinks)))


def device_info() -> dict:
  dev = jax.devices()[0]
  try:
    jaxlib_version = importlib.import_module('jaxlib').__version__
  except Exception:  # pylint: disable=broad-except
    jaxlib_version = None
  return dict(jax=jax.__version__, jaxlib=jaxlib_version,
              backend=jax.default_backend(), device_kind=dev.device_kind,
              num_devices=jax.device_count(),
              python=platform.python_version(), platform=platform.platform(),
              xla_flags=os.environ.get('XLA_FLAGS'),
              preallocate=os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'),
              stubbed_modules=STUBBED)


def _fn_name(fn) -> str:
  return f'{getattr(fn, "__module__", "?")}.{getattr(fn, "__name__", fn)}'


def _exact_name(fn, cfg: ModelConfig, n: int) -> str:
  """What `dispatch.exact_attention`'s choice runs for a prompt of n."""
  name = _fn_name(fn)
  if fn is dispatch._cudnn_or_xla:  # pylint: disable=protected-access
    d = cfg.head_dim
    cudnn = (jnp.dtype(cfg.dtype) in (jnp.bfloat16, jnp.float16)
             and d % 8 == 0 and d <= 128)
    name += (" -> jax.nn.dot_product_attention(implementation='cudnn')"
             if cudnn else ' -> softmax_attention (XLA)')
  elif fn is dispatch._tpu_flash_or_xla:  # pylint: disable=protected-access
    name += (' -> Pallas TPU flash_attention'
             if n % dispatch.TPU_FLASH_BLOCK == 0
             else ' -> softmax_attention (XLA)')
  return name


def implementations(variant: str, cfg: ModelConfig, n: int) -> dict:
  """The attention functions `dispatch` picks for this variant's prefill
  (TTFT) and decode step here: the same calls the model makes at trace
  time (orthros_jax/model.py), so the same answer on this backend."""
  a, g = cfg.attention, cfg.num_groups
  if variant == 'dense_forward':
    fn = dispatch.exact_attention(a.impl)
    name = _fn_name(fn)
    return {'prefill_impl': _exact_name(fn, cfg, n)}
  decode = dispatch.decode_impl(a.impl, head_dim=cfg.head_dim,
                                query_rows=g)
  out = {'decode_impl': _fn_name(decode)}
  if cfg.is_orthros:
    prefill = dispatch.prefill_impl(a.impl, chunk_size=a.chunk_size,
                                    sinks=a.sinks)
    out['prefill_impl'] = _fn_name(prefill)
    tail = min(a.exact_tail, n - 1)
    if tail:
      out['tail_impl'] = _fn_name(dispatch.decode_impl(
          a.impl, head_dim=cfg.head_dim, query_rows=g * tail))
    return out
  fresh = dispatch.fresh_prompt_attention(a.impl)
  if fresh is not None:  # an empty cache: the prompt attends to itself
    out['prefill_impl'] = _exact_name(fresh, cfg, n)
    return out
  prefill = dispatch.decode_impl(a.impl, head_dim=cfg.head_dim,
                                 query_rows=g * n)
  name = _fn_name(prefill)
  if prefill is softmax.decode_attention:
    block = softmax._auto_block(n, n)  # pylint: disable=protected-access
    name += (' (XLA, one einsum)' if block is None else
             f' (XLA blocked online softmax, block {block})')
  out['prefill_impl'] = name
  return out


def custom_calls(compiled) -> dict[str, int]:
  """Custom-call targets and custom fusion kinds (e.g. '__cudnn$fusion',
  '__triton_gemm', as 'fusion:<kind>') -> count in the compiled program's
  HLO (Pallas kernels on GPU are '__gpu$xla.gpu.triton' custom calls)."""
  try:
    text = compiled.as_text() or ''
  except Exception:  # pylint: disable=broad-except
    return {}
  found = re.findall(r'custom_call_target="([^"]+)"', text)
  found += ['fusion:' + k for k in re.findall(r'"kind":"(__[^"]+)"', text)]
  return dict(collections.Counter(found))


def _measure_forward(cfg: ModelConfig, params, n: int, reps: int) -> dict:
  """dense_forward: phase='forward' of the whole prompt (cuDNN attention on
  GPU), argmax of the last position; TTFT only (decode is 'dense')."""
  model = Transformer(cfg)

  def ttft(p, tokens):
    logits, _ = model.apply({'params': p}, tokens, phase='forward')
    return jnp.argmax(logits[:, -1], axis=-1)

  tokens = jnp.asarray(np.random.default_rng(0).integers(
      0, cfg.vocab_size, (1, n)), jnp.int32)
  t0 = time.perf_counter()
  compiled = jax.jit(ttft).lower(params, tokens).compile()
  compile_s = time.perf_counter() - t0
  times = speed._interleaved(  # pylint: disable=protected-access
      {'forward': lambda: jax.block_until_ready(compiled(params, tokens))},
      reps)['forward']
  median = float(np.median(times))
  return {'variant': 'dense_forward', 'length': n, 'batch': 1,
          'ttft_s': median, 'ttft_min_s': min(times),
          'ttft_max_s': max(times), 'ttft_times_s': times,
          'prefill_tokens_per_s': n / median,
          'prefill_memory_bytes': speed._memory_bytes(compiled),  # pylint: disable=protected-access
          'compile_s': compile_s, 'reps': reps,
          'custom_calls': custom_calls(compiled)}


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
  """Parameters of the model's shapes and dtypes, filled on the host
  (vectors 1, matrices N(0, 0.02^2)): values do not change the timings,
  and this skips compiling and running `init` (tens of seconds for 30
  layers)."""
  shapes = jax.eval_shape(lambda key: Transformer(cfg).init(
      key, jnp.zeros((1, 8), jnp.int32), phase='forward'),
                          jax.random.PRNGKey(0))
  rng = np.random.default_rng(seed)

  def fill(s):
    if len(s.shape) <= 1:
      return jnp.ones(s.shape, s.dtype)
    x = rng.standard_normal(s.shape, np.float32) * np.float32(0.02)
    return jnp.asarray(x, s.dtype)

  return jax.block_until_ready(jax.tree.map(fill, nn.unbox(shapes['params'])))


def _peak_bytes():
  try:
    return (jax.devices()[0].memory_stats() or {}).get('peak_bytes_in_use')
  except Exception:  # pylint: disable=broad-except
    return None


def measure_one(variant: str, configs: dict, params, n: int,
                reps: int) -> dict:
  """One row: speed.measure (or the forward TTFT) of `variant` at n."""
  cfg = configs['sinks4' if variant == 'orthros_sinks4' else 'sinks0']
  impl_cfg = speed.variant_config(
      cfg, {'orthros_sinks4': 'orthros', 'dense_forward': 'dense'}.get(
          variant, variant))
  t0 = time.perf_counter()
  if variant == 'dense_forward':
    row = _measure_forward(impl_cfg, params, n, reps)
  else:
    sink = {}
    (row,) = speed.measure(
        cfg, params, [n], variants=(
            'orthros' if variant == 'orthros_sinks4' else variant,),
        reps=reps, on_compiled=lambda _, c: sink.update(
            custom_calls=custom_calls(c)))
    row.update(variant=variant, custom_calls=sink['custom_calls'])
  row.update(implementations(variant, impl_cfg, n), status='ok',
             sinks=impl_cfg.attention.sinks if impl_cfg.is_orthros else None,
             wall_s=time.perf_counter() - t0,
             device_peak_bytes_so_far=_peak_bytes())
  return row


def priority(lengths) -> list[int]:
  """Shortest, longest, then the rest longest first."""
  ls = sorted(set(lengths))
  return ls[:1] + ls[-1:] + ls[-2:0:-1] if len(ls) > 1 else ls


def predict_s(variant: str, n: int, done: list[dict], reps: int):
  """Wall seconds of `variant` at n from its nearest finished length:
  compile (constant) + run time scaled by (n / n0)^e, e = 2 for dense
  prefill, 1 otherwise. Without a finished row of the variant: the longest
  wall time of another variant at n; None without either."""
  rows = [r for r in done if r['variant'] == variant and r['status'] == 'ok']
  if not rows:
    same_n = [r['wall_s'] for r in done
              if r['length'] == n and r['status'] == 'ok']
    return max(same_n) if same_n else None
  r = min(rows, key=lambda r: abs(np.log(r['length'] / n)))
  run = (reps + 1) * r['ttft_s'] + (reps + 2) * r.get('decode_step_s', 0.0)
  compile_part = max(r['wall_s'] - run, 0.0)
  e = 2 if variant in _QUADRATIC else 1
  return compile_part + run * (n / r['length']) ** e


def _write(out: pathlib.Path, result: dict) -> None:
  (out / 'model.json').write_text(json.dumps(result, indent=1, default=str))
  with open(out / 'model.csv', 'w', newline='') as fh:
    writer = csv.DictWriter(fh, _CSV_FIELDS, extrasaction='ignore')
    writer.writeheader()
    writer.writerows(result['rows'])


def run(out_dir: str, *, tiny: bool = False, lengths=None, reps: int = 3,
        budget_s: float = 240.0, variants=MAIN, extras=EXTRAS,
        ceilings: bool = True, margin_s: float = 5.0) -> dict:
  start = time.perf_counter()
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  lengths = list(lengths or (TINY_LENGTHS if tiny else LENGTHS))
  configs = {'sinks0': smollm2_config(tiny=tiny, sinks=0),
             'sinks4': smollm2_config(tiny=tiny, sinks=4)}
  base = configs['sinks0']
  result = dict(
      info=device_info(), tiny=tiny, lengths=lengths, reps=reps,
      budget_s=budget_s,
      model=dict(vocab_size=base.vocab_size, num_layers=base.num_layers,
                 embed_dim=base.embed_dim, num_heads=base.num_heads,
                 num_kv_heads=base.num_kv_heads, head_dim=base.head_dim,
                 mlp_dim=base.mlp_dim, rope_theta=base.rope_theta,
                 tie_embeddings=base.tie_embeddings, dtype=base.dtype,
                 param_dtype=base.param_dtype,
                 attention=dataclasses.asdict(base.attention),
                 state_dim_F=base.attention.state_dim,
                 num_params=base.num_params()),
      notes=[
          'Random weights (bfloat16); batch 1; prompts are random token ids.',
          "'orthros' runs sinks=0: the Pallas prefill kernel has no sink "
          'tokens (dispatch.prefill_impl falls back to the XLA '
          "orthros_prefill with sinks); 'orthros_sinks4' is the recipe "
          'as converted (sinks=4), an extra run only if time allows.',
          "Orthros TTFT = prefill of N - exact_tail tokens + the last "
          'token through exact decode (exact_tail=1), as speed.measure.',
          "'dense' TTFT is phase='prefill' of a dense model into an "
          'empty cache: on GPU / TPU the prompt attends to itself '
          '(dispatch.fresh_prompt_attention: cuDNN in bf16 / f16 on GPU, '
          'Pallas flash on TPU for lengths that are multiples of 128), '
          'elsewhere exact attention over the cache through '
          "dispatch.decode_impl. 'dense_forward' (extra) is "
          "phase='forward' (dispatch.exact_attention), no cache write, LM "
          'head possibly over every position.',
          'Decode: one step over a cache of N tokens (exact attention for '
          'every variant), median of reps steps.',
          'ttft_s / ttft_min_s come from speed.measure; ttft_times_s (and '
          'ttft_max_s) are the same calls timed just inside its loop, so '
          'a few microseconds shorter.',
          'prefill_memory_bytes: XLA compiled memory analysis of the TTFT '
          'program; device_peak_bytes_so_far: the process peak, '
          'cumulative over the rows before.',
          'custom_calls: custom-call targets in the compiled TTFT program '
          '(e.g. cuDNN fMHA, Triton = Pallas kernels, cuBLAS GEMMs).'],
      ceilings=None, rows=[], skipped=[])
  _write(out, result)
  print(json.dumps(result['info']), flush=True)

  if ceilings:
    t0 = time.perf_counter()
    try:
      from benchmarks import kernels  # pylint: disable=g-import-not-at-top
      argv = [sys.argv[0]]
      if tiny:
        argv += ['--matmul_size=256', '--copy_mb=8', '--rep_budget_s=0.5']
      kernels.FLAGS(argv)
      result['ceilings'] = kernels.measure_ceilings(jax.default_backend())
    except Exception as e:  # pylint: disable=broad-except
      result['ceilings'] = {'error': f'{type(e).__name__}: {e}'[:500]}
    result['ceilings_s'] = time.perf_counter() - t0
    _write(out, result)

  t0 = time.perf_counter()
  params = random_params(base)
  result['init_s'] = time.perf_counter() - t0
  print(f'[model] {base.num_params() / 1e6:.1f}M params in '
        f'{result["init_s"]:.1f} s; lengths {lengths}', flush=True)

  plan = [(v, n) for n in priority(lengths) for v in variants]
  plan += [(v, n) for n in priority(lengths) for v in extras]
  deadline = start + budget_s
  for variant, n in plan:
    left = deadline - time.perf_counter()
    guess = predict_s(variant, n, result['rows'], reps)
    reason = None
    if left < margin_s:
      reason = f'time box: {left:.0f} s left of --budget_s {budget_s:.0f}'
    elif guess is not None and guess > left - margin_s:
      reason = (f'time box: predicted {guess:.0f} s > {left:.0f} s left of '
                f'--budget_s {budget_s:.0f}')
    if reason:
      result['skipped'].append(dict(variant=variant, length=n,
                                    status='skipped: ' + reason))
      print(f'[model] {variant:<15} N={n:>6} skipped ({reason})', flush=True)
      _write(out, result)
      continue
    t0 = time.perf_counter()
    try:
      row = measure_one(variant, configs, params, n, reps)
    except Exception as e:  # pylint: disable=broad-except
      row = dict(variant=variant, length=n, status='error',
                 error=f'{type(e).__name__}: {e}'[:1000],
                 traceback=traceback.format_exc(limit=6)[-3000:],
                 wall_s=time.perf_counter() - t0)
    result['rows'].append(row)
    result['rows'].sort(key=lambda r: (r['length'], r['variant']))
    _write(out, result)
    if row['status'] == 'ok':
      decode = (f'decode {row["decode_tokens_per_s"]:7.1f} tok/s'
                if 'decode_tokens_per_s' in row else 'no decode')
      print(f'[model] {variant:<15} N={n:>6} TTFT {row["ttft_s"]*1e3:9.1f} ms'
            f' (min {row["ttft_min_s"]*1e3:.1f}, max '
            f'{row["ttft_max_s"]*1e3:.1f}), {decode}, compile '
            f'{row["compile_s"]:.1f} s, wall {row["wall_s"]:.1f} s; prefill '
            f'{row["prefill_impl"]}', flush=True)
    else:
      print(f'[model] {variant:<15} N={n:>6} ERROR {row["error"][:300]}',
            flush=True)

  ok = [r for r in result['rows'] if r['status'] == 'ok' and
        r['variant'] in speed.VARIANTS]
  result['ratios'] = speed.ratios(ok) if ok else []
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
    del matplotlib
    result['plot'] = (speed.plot(ok, str(out / 'model.png')) if ok else
                      'skipped: no finished rows')
  except ImportError:
    result['plot'] = 'skipped: matplotlib is not installed'
  result['wall_s'] = time.perf_counter() - start
  _write(out, result)
  print(f'[model] wrote {out}/model.json, model.csv in '
        f'{result["wall_s"]:.0f} s; ratios {result["ratios"]}', flush=True)
  return result


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', default='results/device_model')
  p.add_argument('--tiny', action='store_true',
                 help='2-layer stand-in model, short prompts (CPU dry run)')
  p.add_argument('--lengths', default=None,
                 help='comma-separated prompt lengths (default 4K..32K)')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--budget_s', type=float, default=240.0)
  p.add_argument('--variants', default=','.join(MAIN))
  p.add_argument('--extras', default=','.join(EXTRAS),
                 help="extra variants after the main grid ('' for none)")
  p.add_argument('--no_ceilings', action='store_true')
  a = p.parse_args(argv)
  split = lambda s: [x for x in s.split(',') if x]
  result = run(a.out, tiny=a.tiny,
               lengths=[int(x) for x in split(a.lengths or '')] or None,
               reps=a.reps, budget_s=a.budget_s, variants=split(a.variants),
               extras=split(a.extras), ceilings=not a.no_ceilings)
  return 0 if any(r['status'] == 'ok' for r in result['rows']) else 1


if __name__ == '__main__':
  sys.exit(main())
