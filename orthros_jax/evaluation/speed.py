"""Model-level speed: time to first token and decode tokens/s versus prompt
length, for the same model shape with dense, Orthros and no attention.

  ttft(N)       prefill of an N-token prompt (Orthros: N - exact_tail tokens
                through the hybrid prefill, the tail through exact decode)
                plus the first token's argmax: compiled once, then the
                median of `reps` timed runs, interleaved with the other
                variants' runs at the same length.
  decode(N)     decode steps of `decode_batch` sequences over a cache
                holding N tokens (exact attention over the whole cache for
                every variant; Orthros' decode never touches its linear
                state, which the next prefill catches up): each timed call
                runs `decode_steps` steps (default the Orthros chunk size),
                step time = the median call / decode_steps, tokens/s =
                decode_batch / step time. The fold of the decoded tokens is
                paid by the next continued prefill (a chat turn), which
                neither timing here includes.
  memory        XLA's compiled memory analysis of the prefill (arguments +
                outputs + temporaries, bytes): a per-program peak estimate
                that exists on every backend (CPU has no live memory stats).

'none' is the same network with attention removed (attention.impl='none':
projections, cache writes and MLPs stay, token mixing goes): the ceiling
Orthros' prefill approaches as its linear-time attention gets cheaper.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax import cache as cache_lib
from orthros_jax.cache import init_cache
from orthros_jax.config import ModelConfig
from orthros_jax.model import Transformer

VARIANTS = ('dense', 'orthros', 'none')


def variant_config(config: ModelConfig, variant: str) -> ModelConfig:
  """The config of `variant` for a model shape given as an Orthros (or
  dense) config: 'dense' exact attention, 'orthros' (needs Orthros
  attention settings), 'none' no attention (dense kind, impl 'none')."""
  if variant == 'dense':
    return config.replace(attention={'kind': 'dense'})
  if variant == 'orthros':
    if not config.is_orthros:
      raise ValueError("variant 'orthros' needs attention.kind='orthros' "
                       'settings in the config')
    return config
  if variant == 'none':
    return config.replace(attention={'kind': 'dense', 'impl': 'none'})
  raise ValueError(f'variant={variant!r} is unknown: expected one of '
                   f'{VARIANTS}')


def _interleaved(calls: dict[str, Callable[[], Any]], reps: int
                 ) -> dict[str, list[float]]:
  """Seconds of each call, `reps` rounds in which every call runs once in
  turn (so a slow spell of the machine hits every variant alike), after
  one untimed warm-up of each."""
  for call in calls.values():
    call()
  times: dict[str, list[float]] = {name: [] for name in calls}
  for _ in range(reps):
    for name, call in calls.items():
      t0 = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - t0)
  return times


def _memory_bytes(compiled) -> int | None:
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes +
             m.temp_size_in_bytes - getattr(m, 'alias_size_in_bytes', 0))


def _ttft_fn(config: ModelConfig, batch: int, n: int) -> Callable:
  tail = min(config.attention.exact_tail, n - 1) if config.is_orthros else 0
  model = Transformer(config)

  def ttft(params, tokens):
    cache = init_cache(config, batch, n)
    lengths = jnp.full((batch,), n - tail, jnp.int32)
    # The cache is made to fit here: no host-side overflow check in the
    # timed program.
    logits, cache = model.apply({'params': params}, tokens, phase='prefill',
                                cache=cache, lengths=lengths,
                                check_overflow=False)
    if tail:
      logits, _ = model.apply({'params': params}, tokens[:, n - tail:],
                              phase='decode', cache=cache,
                              check_overflow=False)
      logits = logits[:, -1]
    return jnp.argmax(logits, axis=-1)

  return ttft


def _decode_fn(config: ModelConfig) -> Callable:
  model = Transformer(config)

  def step(params, token, cache):
    logits, cache = model.apply({'params': params}, token, phase='decode',
                                cache=cache, check_overflow=False)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

  return step


def _decode_call(config: ModelConfig, params, n: int, batch: int,
                 steps: int, reps: int) -> Callable[[], None]:
  """A call that runs `steps` decode steps of `batch` sequences over a cache
  holding n tokens, one new token per sequence per step, the cache donated
  from step to step as in `generate`. Every call starts from n cached
  tokens with the linear state as a prefill leaves it (folded = n - W; decode
  leaves it there); the contents do not change the cost. Compiled by a first
  call here, so the timed calls run the program compiled for the
  committed cache."""
  del reps  # every call starts over: the cache needs n + steps tokens
  folded = max(n - config.attention.window, 0) if config.is_orthros else 0
  reset = lambda c: c.replace(
      lengths=jnp.full(c.lengths.shape, n, jnp.int32),
      folded=jnp.full(c.folded.shape, folded, jnp.int32))
  state = {'cache': init_cache(config, batch, n + steps + 1),
           'step': jax.jit(_decode_fn(config), donate_argnums=2)}

  def run(k: int) -> None:
    token = jnp.zeros((batch, 1), jnp.int32)
    cache = cache_lib.map_layers(reset, state['cache'])
    for _ in range(k):
      token, cache = state['step'](params, token, cache)
      token = token[:, None]
    state['cache'] = jax.block_until_ready(cache)

  run(steps)
  return lambda: run(steps)


def _default_steps(config: ModelConfig, steps: int | None) -> int:
  steps = config.attention.chunk_size if steps is None else steps
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f'decode_steps={steps!r} must be an integer >= 1')
  return steps


def _decode_row(batch: int, steps: int, times: list[float]) -> dict:
  step = float(np.median(times)) / steps
  return dict(decode_batch=batch, decode_steps=steps, decode_step_s=step,
              decode_step_min_s=min(times) / steps,
              decode_step_max_s=max(times) / steps,
              decode_tokens_per_s=batch / step)


def measure(config: ModelConfig, params, lengths: Sequence[int], *,
            variants: Sequence[str] = VARIANTS, batch: int = 1,
            decode_batch: int = 1, decode_steps: int | None = None,
            reps: int = 3, seed: int = 0,
            progress: Callable[[str], None] | None = None,
            on_compiled: Callable[[str, Any], None] | None = None
            ) -> list[dict]:
  """One row per (variant, length): ttft_s (median), ttft_min_s,
  ttft_max_s, ttft_times_s (every timed call), prefill_tokens_per_s,
  decode_step_s (median, with min and max), decode_tokens_per_s,
  decode_steps, prefill_memory_bytes, compile_s.
  `on_compiled(variant, compiled)` sees each compiled prefill program.

  At each length every variant is compiled first, then timed in
  interleaved rounds (`reps` rounds of one call per variant, for the
  prefill and then for `decode_steps` decode steps), so the ratios compare
  calls made side by side. `params` must fit the Orthros config (dense and
  none ignore the feature maps). Prompts are random token ids (the same for
  every variant): speed does not depend on them.
  """
  if reps < 1:
    raise ValueError(f'reps={reps} must be >= 1')
  steps = _default_steps(config, decode_steps)
  rows = []
  rng = np.random.default_rng(seed)
  for n in lengths:
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, n)),
                         jnp.int32)
    prefill, decode, found = {}, {}, {}
    for variant in variants:
      if progress:
        progress(f'{variant} N={n}')
      cfg = variant_config(config, variant)
      t0 = time.perf_counter()
      compiled = jax.jit(_ttft_fn(cfg, batch, n)).lower(params,
                                                       tokens).compile()
      found[variant] = {'compile_s': time.perf_counter() - t0,
                        'prefill_memory_bytes': _memory_bytes(compiled)}
      if on_compiled:
        on_compiled(variant, compiled)
      prefill[variant] = (lambda c=compiled: jax.block_until_ready(
          c(params, tokens)))
      decode[variant] = _decode_call(cfg, params, n, decode_batch, steps,
                                     reps)
    ttft = _interleaved(prefill, reps)
    calls = _interleaved(decode, reps)
    del prefill, decode
    for variant in variants:
      med = float(np.median(ttft[variant]))
      rows.append(dict(
          variant=variant, length=n, batch=batch, ttft_s=med,
          ttft_min_s=float(min(ttft[variant])),
          ttft_max_s=float(max(ttft[variant])), ttft_times_s=ttft[variant],
          prefill_tokens_per_s=batch * n / med, reps=reps,
          **_decode_row(decode_batch, steps, calls[variant]),
          **found[variant]))
  return rows


def measure_decode(config: ModelConfig, params, lengths: Sequence[int], *,
                   variants: Sequence[str] = ('dense', 'orthros'),
                   batch: int = 1, steps: int | None = None, reps: int = 3,
                   progress: Callable[[str], None] | None = None
                   ) -> list[dict]:
  """Decode alone, as `measure` times it: one row per (variant, length)
  with decode_step_s (median of `reps` interleaved calls of `steps` steps,
  min and max), decode_tokens_per_s, decode_times_s (every timed call)."""
  if reps < 1:
    raise ValueError(f'reps={reps} must be >= 1')
  steps = _default_steps(config, steps)
  rows = []
  for n in lengths:
    calls = {}
    for variant in variants:
      if progress:
        progress(f'{variant} N={n}')
      calls[variant] = _decode_call(variant_config(config, variant), params,
                                    n, batch, steps, reps)
    times = _interleaved(calls, reps)
    del calls
    rows.extend(dict(variant=v, length=n, reps=reps,
                     decode_times_s=times[v],
                     **_decode_row(batch, steps, times[v]))
                for v in variants)
  return rows


def ratios(rows: list[dict]) -> list[dict]:
  """Per length: dense / Orthros TTFT and Orthros / no-attention TTFT."""
  by = {(r['variant'], r['length']): r for r in rows}
  out = []
  for n in sorted({r['length'] for r in rows}):
    d, o, z = (by.get((v, n)) for v in VARIANTS)
    out.append({'length': n,
                'dense_over_orthros_ttft': (d['ttft_s'] / o['ttft_s']
                                            if d and o else None),
                'orthros_over_none_ttft': (o['ttft_s'] / z['ttft_s']
                                           if o and z else None)})
  return out


def plot(rows: list[dict], path: str) -> str | None:
  """Log-log TTFT and decode tokens/s vs length; None without matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  styles = {'dense': ('tab:red', '-o'), 'orthros': ('tab:blue', '-s'),
            'none': ('gray', '--')}
  for variant in VARIANTS:
    rs = sorted((r for r in rows if r['variant'] == variant),
                key=lambda r: r['length'])
    if not rs:
      continue
    color, style = styles[variant]
    label = 'no attention (ceiling)' if variant == 'none' else variant
    n = [r['length'] for r in rs]
    axes[0].plot(n, [r['ttft_s'] for r in rs], style, color=color,
                 label=label)
    axes[1].plot(n, [r['decode_tokens_per_s'] for r in rs], style,
                 color=color, label=label)
  for ax, title, ylabel in ((axes[0], 'time to first token', 'seconds'),
                            (axes[1], 'decode', 'tokens / s')):
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('prompt length (tokens)')
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
