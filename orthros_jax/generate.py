"""Batched generation: a jitted prefill, a jitted exact tail, a jitted
`lax.while_loop` decode loop; the cache is donated from one to the next.

For an Orthros model the prompt is split at the prefill/decode boundary: all
but the last `exact_tail` tokens of each prompt go through the hybrid
prefill, the tail goes through exact decode attention, so the first answer
token is produced by exact attention over the whole prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax.cache import Cache
from orthros_jax.cache import init_cache
from orthros_jax.config import ModelConfig
from orthros_jax.model import transformer

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """tokens: [B, max_new_tokens] int32, `pad_id` after each sequence's end;
  lengths: [B] generated tokens per sequence (an EOS included);
  prompt_lengths: [B]; boundary: [B] prompt tokens that went through the
  prefill (the rest of each prompt went through exact decode); cache: the
  final cache (prompt and generated tokens but the last one), to continue a
  conversation. A sequence that stopped at EOS keeps decoding `pad_id` until
  the batch ends, so its cache also holds those pad tokens: continue from it
  only for sequences with lengths == max_new_tokens, or re-prefill."""
  tokens: np.ndarray
  lengths: np.ndarray
  prompt_lengths: np.ndarray
  boundary: np.ndarray
  cache: Cache


@flax.struct.dataclass
class _LoopState:
  step: Array       # [] int32, tokens generated so far
  tokens: Array     # [B, N] int32
  done: Array       # [B] bool
  cache: Cache
  rng: Array


def sample_logits(logits: Array, rng: Array | None, *, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None
                  ) -> Array:
  """Next tokens [B] from logits [B, V]: greedy when temperature == 0,
  otherwise sampling from softmax(logits / temperature) restricted to the
  top_k tokens and to the smallest set with probability >= top_p."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p is not None and top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of better tokens
    keep = before < top_p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1,
                     keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('config', 'placement'),
                   donate_argnames=('cache',))
def prefill(config: ModelConfig, params, tokens: Array, lengths: Array,
            cache: Cache, placement=None) -> tuple[Array, Cache]:
  """Prefill right-padded prompts; returns last-token logits [B, V].
  placement: the mesh of a sharded run (`Partitioner.placement`)."""
  return transformer(config, placement).apply(
      {'params': params}, tokens, phase='prefill', cache=cache,
      lengths=lengths)


@functools.partial(jax.jit, static_argnames=('config', 'placement'),
                   donate_argnames=('cache',))
def decode(config: ModelConfig, params, tokens: Array, cache: Cache,
           lengths: Array | None = None, placement=None
           ) -> tuple[Array, Cache]:
  """Exact attention of tokens [B, Tq] over the cache; logits [B, Tq, V].
  lengths: [B] tokens of each row to append (right-padded rows)."""
  return transformer(config, placement).apply(
      {'params': params}, tokens, phase='decode', cache=cache,
      lengths=lengths)


@functools.partial(
    jax.jit, static_argnames=('config', 'max_new_tokens', 'temperature',
                              'top_k', 'top_p', 'eos_id', 'pad_id',
                              'placement'),
    donate_argnames=('cache',))
def decode_loop(config: ModelConfig, params, first_logits: Array, cache: Cache,
                rng: Array, *, max_new_tokens: int, temperature: float,
                top_k: int | None, top_p: float | None, eos_id: int | None,
                pad_id: int, placement=None) -> tuple[Array, Array, Cache]:
  """Samples up to max_new_tokens tokens; returns (tokens [B, N], done [B],
  cache). The cache holds every token except the last generated one."""
  model = transformer(config, placement)
  b = first_logits.shape[0]
  rng, sub = jax.random.split(rng)
  first = sample_logits(first_logits, sub, temperature=temperature,
                        top_k=top_k, top_p=top_p)
  tokens = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  is_eos = (lambda t: t == eos_id) if eos_id is not None else (
      lambda t: jnp.zeros_like(t, bool))
  state = _LoopState(jnp.int32(1), tokens, is_eos(first), cache, rng)

  def cond(s: _LoopState):
    return (s.step < max_new_tokens) & ~jnp.all(s.done)

  def body(s: _LoopState):
    last = s.tokens[:, s.step - 1]
    # generate() sized the cache for every new token: no host check.
    logits, cache = model.apply({'params': params}, last[:, None],
                                phase='decode', cache=s.cache,
                                check_overflow=False)
    rng, sub = jax.random.split(s.rng)
    tok = sample_logits(logits[:, 0], sub, temperature=temperature,
                        top_k=top_k, top_p=top_p)
    tok = jnp.where(s.done, pad_id, tok)
    return _LoopState(s.step + 1, s.tokens.at[:, s.step].set(tok),
                      s.done | is_eos(tok), cache, rng)

  state = jax.lax.while_loop(cond, body, state)
  return state.tokens, state.done, state.cache


def pad_prompts(prompts, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """A list of token lists (or a [B, T] array) -> ([B, T] int32, lengths)."""
  if isinstance(prompts, (np.ndarray, jax.Array)):
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(f'prompts array must be [batch, length]; got shape '
                       f'{arr.shape}')
    _check_integer_ids(arr, 'prompts')
    return arr.astype(np.int32), np.full((arr.shape[0],), arr.shape[1],
                                         np.int32)
  prompts = [list(p) for p in prompts]
  if not prompts:
    raise ValueError('prompts is empty: pass at least one prompt')
  for i, p in enumerate(prompts):
    if p:
      _check_integer_ids(np.asarray(p), f'prompt {i}')
  lengths = np.array([len(p) for p in prompts], np.int32)
  out = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, lengths


def generate(config: ModelConfig, params, prompts: Sequence[Sequence[int]] |
             np.ndarray, *, max_new_tokens: int, max_len: int | None = None,
             rng: Array | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_id: int | None = None, pad_id: int = 0,
             exact_tail: int | None = None, lengths=None,
             cache_dtype=None, partitioner=None) -> GenerateOutput:
  """Generates continuations of a batch of (ragged) prompts.

  Args:
    config, params: the model.
    prompts: list of token-id lists, or a [B, T] array (with `lengths` for a
      right-padded one).
    max_new_tokens: tokens to generate per prompt (fewer after EOS).
    max_len: cache size; default longest prompt + max_new_tokens.
    rng: PRNG key, required when temperature > 0.
    temperature, top_k, top_p: sampling; temperature 0 is greedy.
    eos_id: stop a sequence after it emits this token.
    exact_tail: prompt tokens decoded exactly (Orthros only); default
      config.attention.exact_tail; per prompt, capped at its own length
      (a prompt's boundary never depends on the rest of the batch).
    partitioner: a sharding.Partitioner to run on its mesh (params placed
      with `partitioner.shard_params`): the cache is split by batch, kv
      heads and, with a 'sequence' axis, by position (max_len is rounded up
      to a multiple of that axis; prefill and decode are then context
      parallel).
  """
  tokens, prompt_lengths = pad_prompts(prompts, pad_id)
  if lengths is not None:
    prompt_lengths = np.asarray(lengths, np.int32).reshape(-1)
    if prompt_lengths.shape != (tokens.shape[0],):
      raise ValueError(f'lengths must have one entry per prompt; got '
                       f'{prompt_lengths.shape} for {tokens.shape[0]} prompts')
  b = tokens.shape[0]
  _check_generate_args(config, tokens, prompt_lengths, max_new_tokens,
                       temperature, top_k, top_p, rng, eos_id, pad_id)
  # Whatever lies past each prompt is replaced by pad_id (a valid id).
  tokens = np.where(np.arange(tokens.shape[1])[None, :] <
                    prompt_lengths[:, None], tokens, pad_id).astype(np.int32)
  needed = int(prompt_lengths.max()) + max_new_tokens
  max_len = needed if max_len is None else max_len
  if needed > max_len:
    raise ValueError(
        f'prompt ({int(prompt_lengths.max())} tokens) + max_new_tokens '
        f'({max_new_tokens}) = {needed} exceeds max_len={max_len}; raise '
        'max_len or shorten the prompt')

  tail = 0
  if config.is_orthros:
    tail = config.attention.exact_tail if exact_tail is None else exact_tail
    try:
      tail = operator.index(tail)  # ints, numpy ints, 0-d integer arrays
    except TypeError:
      raise ValueError(f'exact_tail={tail!r} must be an int >= 0') from None
    if tail < 0:
      raise ValueError(f'exact_tail={tail!r} must be an int >= 0')
  tails = np.minimum(tail, prompt_lengths).astype(np.int32)  # [B]
  boundary = prompt_lengths - tails
  width = int(tails.max())  # the tail decode's width; shorter tails padded

  context = contextlib.nullcontext()
  placement = None
  if partitioner is not None:
    placement = partitioner.placement
    seq = partitioner.sequence_axis
    if seq is not None:
      n = partitioner.mesh.shape[seq]
      max_len = -(-max_len // n) * n
    context = partitioner.activate()
  cache = init_cache(config, b, max_len, cache_dtype)
  if partitioner is not None:
    cache = partitioner.shard_cache(cache)
  with context:
    logits, cache = prefill(config, params, jnp.asarray(tokens),
                            jnp.asarray(boundary), cache, placement)
    if width:
      idx = np.minimum(boundary[:, None] + np.arange(width)[None, :],
                       tokens.shape[1] - 1)
      tail_tokens = np.take_along_axis(tokens, idx, axis=1)
      tail_logits, cache = decode(config, params, jnp.asarray(tail_tokens),
                                  cache, jnp.asarray(tails), placement)
      # tail > 0 gives every prompt (>= 1 token) a tail of at least 1.
      logits = tail_logits[jnp.arange(b), jnp.asarray(tails - 1)]
    rng = jax.random.PRNGKey(0) if rng is None else rng
    out, _, cache = decode_loop(
        config, params, logits, cache, rng, max_new_tokens=max_new_tokens,
        temperature=float(temperature), top_k=top_k,
        top_p=None if top_p is None else float(top_p), eos_id=eos_id,
        pad_id=pad_id, placement=placement)
  out = np.asarray(out)
  if eos_id is None:
    gen_lengths = np.full((b,), max_new_tokens, np.int32)
  else:
    hit = out == eos_id
    gen_lengths = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1,
                           max_new_tokens).astype(np.int32)
  return GenerateOutput(out, gen_lengths, prompt_lengths, boundary, cache)


def _check_integer_ids(arr: np.ndarray, what: str) -> None:
  """Token ids must be integers: a float id would be truncated silently."""
  if arr.size and arr.dtype.kind not in 'iu':
    raise ValueError(f'{what} holds {arr.dtype} values: token ids must be '
                     'integers (a float id would be truncated)')


def _check_generate_args(config, tokens, lengths, max_new_tokens, temperature,
                         top_k, top_p, rng, eos_id, pad_id):
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f'max_new_tokens={max_new_tokens!r} must be an int >= 1')
  if np.any(lengths < 1) or np.any(lengths > tokens.shape[1]):
    raise ValueError(f'every prompt needs 1..{tokens.shape[1]} tokens; got '
                     f'lengths {lengths.tolist()}')
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  ids = tokens[valid]
  if ids.min() < 0 or ids.max() >= config.vocab_size:
    raise ValueError(f'token ids must lie in [0, vocab_size='
                     f'{config.vocab_size}); got min {ids.min()}, max '
                     f'{ids.max()}')
  if temperature < 0:
    raise ValueError(f'temperature={temperature} must be >= 0 (0 = greedy)')
  if temperature > 0 and rng is None:
    raise ValueError('sampling (temperature > 0) needs an explicit rng key')
  if top_k is not None and not 1 <= top_k <= config.vocab_size:
    raise ValueError(f'top_k={top_k} must be in [1, {config.vocab_size}]')
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f'top_p={top_p} must be in (0, 1]')
  if not 0 <= pad_id < config.vocab_size:
    raise ValueError(f'pad_id={pad_id} must be a token id in [0, '
                     f'{config.vocab_size})')
  if eos_id is not None and not 0 <= eos_id < config.vocab_size:
    raise ValueError(f'eos_id={eos_id} must be a token id in [0, '
                     f'{config.vocab_size})')
