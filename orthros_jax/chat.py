"""Multi-turn chat on one KV cache, streamed token by token.

Each user turn is rendered with the tokenizer's chat template and only its
new tokens run: a continued prefill onto the cache (for an Orthros model all
but the last `exact_tail` of them through the prefill formula, the tail
decoded exactly), then the reply decoded one token at a time with exact
attention over the whole conversation. Nothing before the turn is
recomputed, so the time to first token of a turn grows with the turn, not
with the conversation (tests/test_chat.py checks that the cache equals a
full re-prefill of the conversation: K/V exactly, the linear state up to
the tokens decoded since the last prefill, which decode never folds and
the next turn's prefill folds first).

  python chat.py --teacher=results/smollm2/hf \
      --adapter=assets/smollm2_orthros --attention=orthros
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax import cache as cache_lib
from orthros_jax.cache import Cache
from orthros_jax.cache import init_cache
from orthros_jax.config import ModelConfig
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.evaluation.loading import load_dense
from orthros_jax.generate import sample_logits
from orthros_jax.model import Transformer


@dataclasses.dataclass(frozen=True)
class Reply:
  """One assistant turn: text (special tokens dropped), ids (the generated
  tokens, an EOS included), prompt_tokens (the turn's new prompt tokens:
  template and user message), ttft_s (turn start to first reply token),
  decode_tokens_per_s (the reply's later tokens), stopped ('eos' or
  'length'), compiled (the turn traced and compiled a new program shape:
  its times include XLA compilation; the first turn always does)."""
  text: str
  ids: list[int]
  prompt_tokens: int
  ttft_s: float
  decode_tokens_per_s: float
  stopped: str
  compiled: bool


def _bucket(n: int) -> int:
  """Prompt widths are padded to a power of two (>= 64): each new width
  compiles the prefill once; turns of up to 64 new tokens share one."""
  return max(64, 1 << (n - 1).bit_length())


def _compiled_programs() -> int:
  """How many program shapes the chat's jitted functions hold."""
  return _prefill._cache_size() + _decode._cache_size()  # pylint: disable=protected-access


@functools.partial(jax.jit, static_argnames=('config',),
                   donate_argnames=('cache',))
def _prefill(config, params, tokens, lengths, cache):
  return Transformer(config).apply({'params': params}, tokens, phase='prefill',
                                   cache=cache, lengths=lengths)


@functools.partial(jax.jit, static_argnames=('config',),
                   donate_argnames=('cache',))
def _decode(config, params, tokens, lengths, cache):
  logits, cache = Transformer(config).apply(
      {'params': params}, tokens, phase='decode', cache=cache,
      lengths=lengths, check_overflow=False)
  return logits[0, lengths[0] - 1][None], cache


class ChatSession:
  """A conversation with one model; `send` runs a user turn.

  tokenizer: encode / decode / apply_chat_template(messages,
    add_generation_prompt=True) / eos_id / eos_token (its text), as
    orthros_jax.data.HFTokenizer.
  max_len: the cache's size in tokens; a turn that would not fit is an
    error before anything runs (the conversation so far is kept).
  system: an optional system message.
  temperature, top_k, top_p, seed: sampling (temperature 0: greedy).
  """

  def __init__(self, config: ModelConfig, params, tokenizer, *,
               max_len: int = 4096, system: str | None = None,
               temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int = 0,
               cache_dtype=None):
    if max_len < 2:
      raise ValueError(f'max_len={max_len} must be >= 2')
    if temperature < 0:
      raise ValueError(f'temperature={temperature} must be >= 0')
    self.config, self.params, self.tokenizer = config, params, tokenizer
    self.max_len = max_len
    self.messages: list[dict[str, str]] = (
        [{'role': 'system', 'content': system}] if system else [])
    # Every token of the conversation; the cache holds all but the last
    # (the last reply token, not yet fed back).
    self.ids: list[int] = []
    self.cache: Cache = init_cache(config, 1, max_len, cache_dtype)
    self._text = ''  # the conversation as the template renders it
    self._sampling = dict(temperature=float(temperature), top_k=top_k,
                          top_p=top_p)
    self._rng = jax.random.PRNGKey(seed)
    self._broken = False  # a turn failed after the cache had changed

  @property
  def cached(self) -> int:
    return int(cache_lib.lengths(self.cache)[0])

  def _new_prompt_ids(self, messages) -> list[int]:
    """The tokens this turn adds: the template's rendering of the whole
    conversation minus what is already in `ids`, encoded on its own."""
    full = self.tokenizer.apply_chat_template(messages,
                                              add_generation_prompt=True)
    if not full.startswith(self._text):
      raise ValueError(
          'the chat template does not render the conversation as a prefix of '
          'its next turn, so the cache cannot be continued; start a new '
          'ChatSession')
    suffix = full[len(self._text):]
    self._pending_text = full
    return list(self.tokenizer.encode(suffix))

  def send(self, text: str, *, max_new_tokens: int = 256,
           on_token: Callable[[str], None] | None = None) -> Reply:
    """Runs one user turn; on_token(piece) streams the reply's text."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise ValueError(f'max_new_tokens={max_new_tokens!r} must be an int '
                       '>= 1')
    if self._broken:
      raise RuntimeError('an earlier turn of this session failed after its '
                         'tokens entered the cache: start a new ChatSession')
    messages = self.messages + [{'role': 'user', 'content': text}]
    prompt = self._new_prompt_ids(messages)
    # The last reply token is in `ids` but not yet in the cache.
    new = self.ids[-1:] + prompt
    need = self.cached + len(new) + max_new_tokens - 1
    if need > self.max_len:
      raise ValueError(
          f'this turn needs {need} cache slots (cached {self.cached} + new '
          f'prompt {len(new)} + max_new_tokens {max_new_tokens} - 1) > '
          f'max_len={self.max_len}: start a session with a larger max_len')
    bad = [i for i in new if not 0 <= i < self.config.vocab_size]
    if bad:
      raise ValueError(f'the tokenizer produced ids {bad[:5]} outside the '
                       f'model vocabulary [0, {self.config.vocab_size})')
    programs = _compiled_programs()
    self._broken = True  # until the turn's bookkeeping below is done
    t0 = time.perf_counter()
    logits = self._run_prompt(new)
    ids, stopped = [], 'length'
    first_s = None
    eos = getattr(self.tokenizer, 'eos_id', None)
    shown = ''
    for step in range(max_new_tokens):
      self._rng, sub = jax.random.split(self._rng)
      tok = int(sample_logits(logits, sub, **self._sampling)[0])
      if first_s is None:
        first_s = time.perf_counter()
      ids.append(tok)
      if tok == eos:
        stopped = 'eos'
        break
      # Streamed as text: decode the reply so far, print what is new (a
      # token can complete a multi-byte character of the previous one).
      now = self.tokenizer.decode(ids)
      if on_token is not None and len(now) > len(shown) and not now.endswith(
          '\ufffd'):
        on_token(now[len(shown):])
        shown = now
      if step + 1 < max_new_tokens:
        logits, self.cache = _decode(self.config, self.params,
                                     jnp.asarray([[tok]], jnp.int32),
                                     jnp.asarray([1], jnp.int32), self.cache)
    end = time.perf_counter()
    reply_ids = ids[:-1] if stopped == 'eos' else ids
    reply = self.tokenizer.decode(reply_ids)
    if on_token is not None and len(reply) > len(shown):
      on_token(reply[len(shown):])
    self.ids += prompt + ids
    self.messages = messages + [{'role': 'assistant', 'content': reply}]
    # What the cache holds as text: the rendered prompt, then the reply and
    # (after an EOS) the EOS token's own text, as the template writes it.
    eos_text = self.tokenizer.eos_token if stopped == 'eos' else ''
    self._text = self._pending_text + reply + eos_text
    self._broken = False
    later = len(ids) - 1
    return Reply(reply, ids, len(prompt), first_s - t0,
                 later / (end - first_s) if later else 0.0, stopped,
                 _compiled_programs() > programs)

  def _run_prompt(self, new: Sequence[int]) -> jax.Array:
    """Continued prefill of the turn's tokens; the last one's logits [1, V].
    Orthros: all but the last exact_tail through the prefill formula, the
    tail decoded exactly (as `generate` does)."""
    tail = (min(self.config.attention.exact_tail, len(new))
            if self.config.is_orthros else 0)
    head = len(new) - tail
    logits = None
    for part, fn in ((new[:head], _prefill), (new[head:], _decode)):
      if not part:
        continue
      # The tail is at most exact_tail tokens: one width for every turn.
      width = (_bucket(len(part)) if fn is _prefill else
               self.config.attention.exact_tail)
      width = max(min(width, self.max_len - self.cached), len(part))
      tokens = np.zeros((1, width), np.int32)
      tokens[0, :len(part)] = part
      logits, self.cache = fn(self.config, self.params, jnp.asarray(tokens),
                              jnp.asarray([len(part)], jnp.int32), self.cache)
    return logits


def load_chat_model(teacher: str, adapter: str | None, attention: str,
                    exact_tail: int = -1) -> tuple[ModelConfig, dict, str]:
  """(config, params, description) for chat.py: 'dense' is the teacher as
  loaded (a Hugging Face directory or a train.py checkpoint), 'orthros' the
  adapter applied to it (exact_tail >= 0 overrides the converted one)."""
  if attention not in ('dense', 'orthros'):
    raise ValueError(f"attention={attention!r}: use 'dense' or 'orthros'")
  config, params, where = load_dense(teacher)
  if attention == 'dense':
    return config, params, f'{where}: the teacher, dense attention'
  if not adapter:
    raise ValueError("attention='orthros' needs an adapter (an Orthros "
                     'adapter directory made by convert.py)')
  config, params = adapter_lib.apply_adapter(adapter, config, params)
  if exact_tail >= 0:
    config = config.replace(attention={'exact_tail': exact_tail})
  a = config.attention
  return config, params, (
      f'{adapter} on {teacher}: Orthros W={a.window}, sinks {a.sinks}, '
      f'exact tail {a.exact_tail}')
