"""Llama-family decoder whose attention is chosen by a static `phase`.

Einsum legend: B batch, T tokens, S cache length, E embed, H query heads,
K kv heads, G group (H / K), D head dim, F feature dim, M mlp, V vocab.

phase='forward'  full sequence, no cache (training and scoring). Orthros:
                 positions t < split use the prefill formula, t >= split exact
                 softmax over all j <= t (split None = prefill everywhere).
phase='prefill'  a right-padded prompt (optionally continuing a cache):
                 Orthros hybrid attention (dense: exact), writes K/V and the
                 linear state into the cache.
phase='decode'   T_q >= 1 new tokens with exact attention over the cache;
                 appends them. Decode never reads or writes the linear
                 state (`LayerCache.folded` says how far it reaches); a
                 continued prefill first folds the tokens decoded since.
Parameters and activations carry logical axis names (batch, length, embed,
heads, kv_heads, head_dim, mlp, vocab, features) for sharding rules. The
`backend` field (attention/backend.py) says which functions compute the
attention and where: built by `Partitioner.attention_backend`
(orthros_jax/sharding/) for a mesh, the Pallas kernels run in `shard_map`
over batch and heads, and with a 'sequence' mesh axis larger than 1 prefill
and decode use the context-parallel attention (attention/context_parallel.py)
over a position-sharded KV cache. Without one the model runs on one device.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax import attention as attn_lib
from orthros_jax import cache as cache_lib
from orthros_jax import rope
from orthros_jax.attention.backend import AttentionBackend
from orthros_jax.config import ModelConfig
from orthros_jax.config import inverse_sigmoid
from orthros_jax.feature_maps import FeatureMap

Array = jax.Array
PHASES = ('forward', 'prefill', 'decode')
# config.REMAT_POLICIES -> what each block keeps for the backward pass.
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _partitioned(init, axes):
  return nn.with_logical_partitioning(init, axes)


def _constrain(x, axes):
  return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param('scale', _partitioned(nn.initializers.ones, ('embed',)),
                       (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) +
                            self.eps)
    return scale.astype(self.dtype) * y.astype(self.dtype)


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dense = lambda m, axes, name: nn.DenseGeneral(
        m, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        kernel_init=_partitioned(nn.initializers.lecun_normal(), axes),
        name=name)
    gate = dense(cfg.mlp_dim, ('embed', 'mlp'), 'gate_proj')(x)
    up = dense(cfg.mlp_dim, ('embed', 'mlp'), 'up_proj')(x)
    h = _constrain(nn.silu(gate) * up, ('batch', 'length', 'mlp'))
    return dense(cfg.embed_dim, ('mlp', 'embed'), 'down_proj')(h)


class HeadDense(nn.Module):
  """nn.DenseGeneral for the attention projections (same params, init and
  math), with the logical axes on the full-rank kernel: [E, heads, D] for
  q/k/v, [H, D, E] for o. DenseGeneral boxes its flattened 2-D kernel, which
  breaks flax's shape check under active sharding rules.

  features: output dims; in_dims: trailing input dims contracted.
  """
  features: tuple[int, ...]
  in_dims: int
  kernel_axes: tuple[str, ...]
  use_bias: bool
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: Array) -> Array:
    n = self.in_dims
    in_shape = x.shape[x.ndim - n:]
    fan = (int(np.prod(in_shape)), int(np.prod(self.features)))

    def kernel_init(rng, shape, dtype):
      # lecun_normal on the flattened [fan_in, fan_out] kernel, as
      # DenseGeneral does.
      return nn.initializers.lecun_normal()(rng, fan, dtype).reshape(shape)

    kernel = self.param('kernel', _partitioned(kernel_init, self.kernel_axes),
                        in_shape + tuple(self.features), self.param_dtype)
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    dims = (tuple(range(x.ndim - n, x.ndim)), tuple(range(n)))
    y = jax.lax.dot_general(x, kernel, (dims, ((), ())))
    if self.use_bias:
      bias = self.param('bias', _partitioned(nn.initializers.zeros,
                                             self.kernel_axes[n:]),
                        tuple(self.features), self.param_dtype)
      y = y + bias.astype(self.dtype)
    return y


class Attention(nn.Module):
  """One attention module for all phases (GQA, RoPE, optional biases).

  backend: which functions compute attention and where (kernels, shard_map,
  context parallelism; attention/backend.py); None: one device.
  """
  config: ModelConfig
  backend: AttentionBackend | None = None

  def setup(self):
    cfg = self.config
    h, k, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim

    def proj(heads, axes, bias, name):
      return HeadDense((heads, d), 1, axes, bias, cfg.dtype,
                       cfg.param_dtype, name=name)

    self.q_proj = proj(h, ('embed', 'heads', 'head_dim'), cfg.qkv_bias,
                       'q_proj')
    self.k_proj = proj(k, ('embed', 'kv_heads', 'head_dim'), cfg.qkv_bias,
                       'k_proj')
    self.v_proj = proj(k, ('embed', 'kv_heads', 'head_dim'), cfg.qkv_bias,
                       'v_proj')
    self.o_proj = HeadDense((e,), 2, ('heads', 'head_dim', 'embed'),
                            cfg.out_bias, cfg.dtype, cfg.param_dtype,
                            name='o_proj')
    self.inv_freq = rope.inverse_frequencies(cfg)
    if cfg.is_orthros:
      a = cfg.attention
      fmap = lambda name: FeatureMap(a.feature_map, h, d, a.feature_dim,
                                     cfg.param_dtype, name=name)
      self.phi_q = fmap('phi_q')
      self.phi_k = fmap('phi_k')
      self.window_logit = self.param(
          'window_logit', _partitioned(
              nn.initializers.constant(inverse_sigmoid(a.window_init)),
              ('heads',)), (h,), cfg.param_dtype)
      if a.length_scale:
        self.length_exponent = self.param(
            'length_exponent', _partitioned(nn.initializers.zeros,
                                            ('heads',)), (h,), cfg.param_dtype)

  def key_features(self, k: Array) -> Array:
    """phi_k of keys [B, N, K, D], repeated per query head -> [B, N, H, F]."""
    return self.phi_k(jnp.repeat(k, self.config.num_groups, axis=2))

  def __call__(self, x, positions, *, phase, cache=None, lengths=None,
               split=None):
    cfg = self.config
    q = rope.apply_rope(self.q_proj(x), positions, self.inv_freq)
    k = rope.apply_rope(self.k_proj(x), positions, self.inv_freq)
    v = self.v_proj(x)
    q = _constrain(q, ('batch', 'length', 'heads', 'head_dim'))
    k = _constrain(k, ('batch', 'length', 'kv_heads', 'head_dim'))
    v = _constrain(v, ('batch', 'length', 'kv_heads', 'head_dim'))
    if phase == 'forward':
      y, new_cache = self._forward(q, k, v, split), None
    elif phase == 'prefill':
      y, new_cache = self._prefill(q, k, v, cache, lengths)
    else:
      y, new_cache = self._decode(q, k, v, cache, lengths)
    y = _constrain(y.astype(cfg.dtype), ('batch', 'length', 'heads',
                                         'head_dim'))
    return self.o_proj(y), new_cache

  @property
  def attention_backend(self) -> AttentionBackend:
    """The backend given to the model, or the single-device one. A given
    backend must be this config's (`AttentionBackend.for_model(config,
    placement)`): it carries the window, sinks, chunk and heads it was
    built for, and a mismatch would run another attention."""
    if self.backend is None:
      return AttentionBackend.for_model(self.config)
    own = AttentionBackend.for_model(self.config, self.backend.placement)
    if self.backend != own:
      raise ValueError(f'the attention backend {self.backend} was built for '
                       f'another config than this model\'s ({own}); build '
                       'it with AttentionBackend.for_model(config, '
                       'placement) or Partitioner.model(config)')
    return self.backend

  def _orthros_inputs(self, q, k, positions):
    """(phi_q, phi_k, gamma); positions [B, T]: each query's absolute
    position (attention.length_scale scales phi_q by it)."""
    a = self.config.attention
    gamma = jax.nn.sigmoid(self.window_logit.astype(jnp.float32))
    phi_q = self.phi_q(q)
    if a.length_scale:
      scale = attn_lib.length_scales(positions, self.length_exponent,
                                     window=a.window, sinks=a.sinks)
      phi_q = phi_q * scale.astype(phi_q.dtype)[..., None]
    return phi_q, self.key_features(k), gamma

  def _forward(self, q, k, v, split):
    cfg = self.config
    backend = self.attention_backend
    if not cfg.is_orthros:
      return backend.exact()(q, k, v, causal=True)
    a = cfg.attention
    b, t = q.shape[:2]
    phi_q, phi_k, gamma = self._orthros_inputs(
        q, k, jnp.broadcast_to(jnp.arange(t), (b, t)))
    extra = {}
    if a.sinks:
      n = min(a.sinks, t)
      extra['sinks'] = attn_lib.Sinks(k[:, :n], v[:, :n],
                                      jnp.ones((b, n), bool),
                                      jnp.zeros((b,), jnp.int32))
    if split is not None:
      # Rows at t >= split take the exact path: the prefill formula need not
      # reach them (its valid length), the exact half skips the rows before.
      split = jnp.broadcast_to(jnp.asarray(split, jnp.int32), (b,))
      extra['lengths'] = split
    y, _ = backend.prefill(q.shape[0])(
        q, k, v, phi_q, phi_k, gamma, window=a.window, chunk_size=a.chunk_size,
        **extra)
    if split is None:
      return y
    exact = backend.exact_after_split()(q, k, v, split)
    use_prefill = jnp.arange(t)[None, :] < split[:, None]  # [B, T]
    return jnp.where(use_prefill[..., None, None], y, exact)

  def _prefill(self, q, k, v, cache: cache_lib.LayerCache, lengths):
    cfg = self.config
    b, t = q.shape[:2]
    start = cache.lengths
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    backend = self.attention_backend
    k_cache, v_cache = cache_lib.write_kv(
        cache, k, v, valid, flat_heads=backend.reads_flat_cache)
    new_lengths = start + lengths
    if not cfg.is_orthros:
      # Query t of example b sits at start[b] + t, as `decode_attention`
      # places the last T of start + T keys.
      decode = backend.decode(t, b)
      fresh = backend.fresh_prompt()
      if fresh is None:
        y = decode(q, k_cache, v_cache, start + t)
      else:
        # An empty cache (every start 0): the prompt attends to itself, so
        # a flash kernel (cuDNN on GPU) runs on q, k, v as given. Queries
        # past an example's length differ (they see its padding) and are
        # never read; every real query sees the same keys either way.
        y = jax.lax.cond(jnp.all(start == 0),
                         lambda: fresh(q, k, v, causal=True).astype(q.dtype),
                         lambda: decode(q, k_cache, v_cache, start + t))
      return y, cache.replace(k=k_cache, v=v_cache, lengths=new_lengths)
    a = cfg.attention
    phi_q, phi_k, gamma = self._orthros_inputs(
        q, k, start[:, None] + jnp.arange(t)[None, :])
    prefix = None
    if a.window > 0:
      # The W cached tokens before the prompt are not in (S, z) yet.
      pos = start[:, None] - a.window + jnp.arange(a.window)[None, :]
      pk, pv = cache_lib.gather_kv(cache.k, cache.v, pos)
      prefix = attn_lib.WindowPrefix(pk, pv, self.key_features(pk), pos >= 0)
    extra = {}
    if a.sinks:
      n = min(a.sinks, k_cache.shape[1])
      extra['sinks'] = attn_lib.Sinks(
          k_cache[:, :n], v_cache[:, :n],
          jnp.arange(n)[None, :] < new_lengths[:, None], start)
    # Context parallel on a mesh with a sequence axis (None: the ordinary
    # path, also for a prompt too short to give every shard a window).
    fn = backend.context_parallel_prefill(t, b) or backend.prefill(b)
    # The state must hold every token before the W-token prefix: fold what
    # decode steps left (none after a prefill; every token decoded since,
    # which decode never folds), a chunk per iteration, so the temporaries
    # stay a chunk's whatever the cache's length.
    upto = jnp.maximum(start - a.window, 0)

    def fold_chunk(mdl, carry):
      state, folded = carry
      return mdl._fold_behind(k_cache, v_cache, cache.replace(
          S=state.S, z=state.z, folded=folded), upto, n=a.chunk_size)

    initial, _ = nn.while_loop(
        lambda mdl, carry: jnp.any(carry[1] < upto), fold_chunk, self,
        (attn_lib.LinearState(cache.S, cache.z), cache.folded))
    y, state = fn(
        q, k, v, phi_q, phi_k, gamma, window=a.window,
        chunk_size=a.chunk_size, lengths=lengths, initial_state=initial,
        prefix=prefix, **extra)
    return y, cache.replace(k=k_cache, v=v_cache, lengths=new_lengths,
                            S=state.S, z=state.z,
                            folded=jnp.maximum(new_lengths - a.window, 0))

  def _fold_behind(self, k_cache, v_cache, cache: cache_lib.LayerCache,
                   upto, *, n: int):
    """Folds the cached tokens cache.folded <= j < upto (sinks excepted:
    they stay exact), at most n per example, into (cache.S, cache.z).
    Returns the state and how far it now reaches."""
    pos = cache.folded[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    fk, fv = cache_lib.gather_kv(k_cache, v_cache, pos)
    state = attn_lib.fold_into_state(
        attn_lib.LinearState(cache.S, cache.z), self.key_features(fk), fv,
        (pos < upto[:, None]) & (pos >= self.config.attention.sinks))
    return state, jnp.maximum(cache.folded,
                              jnp.minimum(cache.folded + n, upto))

  def _decode(self, q, k, v, cache: cache_lib.LayerCache, lengths):
    b, t = q.shape[:2]
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    backend = self.attention_backend
    k_cache, v_cache = cache_lib.write_kv(
        cache, k, v, valid, flat_heads=backend.reads_flat_cache)
    new_lengths = cache.lengths + lengths
    # Query i sits at cache.lengths + i: the attention places the last T of
    # cache.lengths + T keys. Queries past an example's length are never
    # read; its real queries see only written keys (causality).
    y = backend.decode(t, b)(q, k_cache, v_cache, cache.lengths + t)
    # Decode never reads the linear state: it stays where the last prefill
    # left it (`folded`), and the next continued prefill folds the tokens
    # decoded since, a chunk per iteration (`_prefill`), so a decode step
    # costs and compiles as dense decode does.
    return y, cache.replace(k=k_cache, v=v_cache, lengths=new_lengths)


class Block(nn.Module):
  config: ModelConfig
  backend: AttentionBackend | None = None

  @nn.compact
  def __call__(self, x, positions, **kwargs):
    cfg = self.config
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype,
                                name=name)
    h, new_cache = Attention(cfg, self.backend, name='attn')(
        norm('input_norm')(x), positions, **kwargs)
    x = _constrain(x + h, ('batch', 'length', 'embed'))
    x = x + Mlp(cfg, name='mlp')(norm('post_attn_norm')(x))
    return _constrain(x, ('batch', 'length', 'embed')), new_cache


class Transformer(nn.Module):
  """The decoder. Returns (logits float32, cache or None).

  tokens: [B, T] int32.
  phase: 'forward' | 'prefill' | 'decode' (static).
  cache: from `init_cache`; required for prefill and decode.
  lengths: [B] valid tokens of a right-padded prefill or decode batch
    (default T); decode logits past an example's length are not meaningful.
  split: [B] or scalar, forward only: first position computed exactly.
  all_logits: prefill returns [B, T, V] instead of the last valid token's
    [B, V]. forward returns [B, T, V]; decode returns [B, T_q, V].
  check_overflow: with traced cache lengths (under jit), check on the host
    that the new tokens fit the cache (a `jax.debug.callback`, one host
    round trip per call); False for loops whose caller sized the cache
    (`generate`, the speed benchmark), which then skip that round trip.

  backend: the attention backend (attention/backend.py); None: one device.
  On a mesh, `Partitioner.model(config)` gives the model with its backend.
  """
  config: ModelConfig
  backend: AttentionBackend | None = None

  @nn.compact
  def __call__(self, tokens, *, phase: str, cache=None, lengths=None,
               split=None, all_logits: bool = False,
               check_overflow: bool = True):
    cfg = self.config
    b, t = _check_call(cfg, tokens, phase, cache, lengths, split,
                       check_overflow)
    embed = nn.Embed(
        cfg.vocab_size, cfg.embed_dim, dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        embedding_init=_partitioned(nn.initializers.normal(0.02),
                                    ('vocab', 'embed')), name='embed')
    x = _constrain(embed(tokens), ('batch', 'length', 'embed'))
    if phase == 'forward':
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    else:
      positions = (cache_lib.lengths(cache)[:, None]
                   + jnp.arange(t, dtype=jnp.int32))
    if lengths is None:
      lengths = jnp.full((b,), t, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)

    def layer(block, x, layer_cache, positions, lengths, split):
      return block(x, positions, phase=phase, cache=layer_cache,
                   lengths=lengths, split=split)

    if cfg.remat != 'none':
      layer = nn.remat(layer, policy=REMAT_POLICIES[cfg.remat],
                       prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      x, new_cache = nn.scan(
          layer, variable_axes={'params': 0, 'intermediates': 0},
          split_rngs={'params': True},
          in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
          length=cfg.num_layers,
          metadata_params={nn.PARTITION_NAME: 'layers'})(
              Block(cfg, self.backend, name='layers'), x, cache, positions,
              lengths, split)
    else:
      new_cache = []
      for i in range(cfg.num_layers):
        x, layer_cache = layer(
            Block(cfg, self.backend, name=f'layers_{i}'), x,
            None if cache is None else cache[i], positions, lengths, split)
        new_cache.append(layer_cache)
      new_cache = tuple(new_cache)
    x = RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, name='final_norm')(x)
    if phase == 'prefill' and not all_logits:
      last = jnp.clip(lengths - 1, 0, t - 1)
      x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, E]
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.DenseGeneral(
          cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
          param_dtype=cfg.param_dtype,
          kernel_init=_partitioned(nn.initializers.lecun_normal(),
                                   ('embed', 'vocab')), name='lm_head')(x)
    return logits.astype(jnp.float32), (None if phase == 'forward'
                                        else new_cache)


def transformer(config: ModelConfig, placement=None) -> Transformer:
  """The Transformer of `config`, its attention placed on `placement` (an
  `attention.placement.Placement`, e.g. `Partitioner.placement`; None: one
  device)."""
  if placement is None:
    return Transformer(config)
  return Transformer(config, AttentionBackend.for_model(config, placement))


def _is_concrete(x) -> bool:
  return x is not None and not isinstance(x, jax.core.Tracer)


def _raise_on_overflow(need, max_len: int) -> None:
  need = np.asarray(need)
  if need.size and int(need.max()) > max_len:
    raise ValueError(
        f'cache overflow: cached + new tokens reach {int(need.max())} '
        f'> max_len={max_len}; allocate a larger cache')


def _check_call(cfg, tokens, phase, cache, lengths, split,
                check_overflow=True):
  """Static checks always; value checks when the inputs are concrete."""
  if phase not in PHASES:
    raise ValueError(f'phase={phase!r} is unknown: expected one of {PHASES}')
  if tokens.ndim != 2:
    raise ValueError(f'tokens must be [batch, length]; got shape '
                     f'{tokens.shape}')
  b, t = tokens.shape
  if b == 0 or t == 0:
    raise ValueError(f'tokens has shape {tokens.shape}: every call needs at '
                     'least one sequence of at least one token')
  if phase == 'forward':
    if cache is not None:
      raise ValueError("phase='forward' takes no cache; use 'prefill'")
  else:
    if cache is None:
      raise ValueError(f"phase={phase!r} needs a cache: pass "
                       'cache=init_cache(config, batch, max_len)')
    if cache_lib.is_stacked(cache) != cfg.scan_layers:
      layout = ('one stacked LayerCache' if cache_lib.is_stacked(cache)
                else 'a tuple of LayerCaches')
      raise ValueError(f'the model has scan_layers={cfg.scan_layers}, the '
                       f'cache is {layout}: create it with '
                       'init_cache(config, ...)')
    if cache_lib.num_layers(cache) != cfg.num_layers:
      raise ValueError(f'cache has {cache_lib.num_layers(cache)} layers, the '
                       f'model {cfg.num_layers}')
    c0 = cache_lib.layer_meta(cache)
    if c0.k.shape[0] != b:
      raise ValueError(f'cache batch {c0.k.shape[0]} != tokens batch {b}')
    if c0.S.shape[2] != cfg.attention.state_dim:
      raise ValueError(f'cache feature dim {c0.S.shape[2]} does not match '
                       f'attention.state_dim={cfg.attention.state_dim}; '
                       'create it with init_cache(config, ...)')
    if t > c0.max_len:
      raise ValueError(f'{t} tokens do not fit a cache of max_len='
                       f'{c0.max_len}')
    if _is_concrete(c0.lengths) and (lengths is None or
                                     _is_concrete(lengths)):
      need = np.asarray(c0.lengths) + (
          t if lengths is None or phase == 'decode' else np.asarray(lengths))
      _raise_on_overflow(need, c0.max_len)
    elif check_overflow:
      # Under jit the lengths are traced: the same check runs on the host
      # when the values exist (a write past max_len would be dropped and
      # the logits silently wrong). The error reaches the caller as the
      # runtime error of the jitted call, with this message.
      need = c0.lengths + (t if lengths is None or phase == 'decode'
                           else lengths)
      jax.debug.callback(functools.partial(_raise_on_overflow,
                                           max_len=c0.max_len), need)
  if split is not None and phase != 'forward':
    raise ValueError("split is only used by phase='forward'")
  if split is not None:
    shape = np.shape(split)
    if shape not in ((), (b,)):
      raise ValueError(f'split must be a scalar or [B]={b} values; got shape '
                       f'{shape}')
    if not jnp.issubdtype(jnp.result_type(split), jnp.integer):
      raise ValueError(f'split must hold integers (first exact position); '
                       f'got {jnp.result_type(split)}')
    if _is_concrete(split):
      arr = np.asarray(split)
      if np.any(arr < 0) or np.any(arr > t):
        raise ValueError(f'split must lie in [0, T={t}] (0 = all exact, T = '
                         f'all prefill formula); got {arr.tolist()}')
  if lengths is not None and phase == 'forward':
    raise ValueError("lengths is used by phase='prefill' and 'decode' (a "
                     "forward pass takes every position: use split)")
  if _is_concrete(lengths):
    lengths_arr = np.asarray(lengths)
    if lengths_arr.shape != (b,) or np.any(lengths_arr < 0) or np.any(
        lengths_arr > t):
      raise ValueError(f'lengths must be [B]={b} values in [0, {t}]; got '
                       f'{lengths_arr}')
  if _is_concrete(tokens):
    lo, hi = int(np.min(np.asarray(tokens))), int(np.max(np.asarray(tokens)))
    if lo < 0 or hi >= cfg.vocab_size:
      raise ValueError(f'token ids must lie in [0, vocab_size={cfg.vocab_size})'
                       f'; got min {lo}, max {hi}')
  return b, t


def init_orthros_params(config: ModelConfig, rng: Array | None = None) -> dict:
  """Fresh feature-map and window params for every layer (the starting point
  of a conversion): {'layers_i': {'attn': {'phi_q', 'phi_k', 'window_logit'}}}
  and, with attention.length_scale, 'length_exponent' (zeros).
  """
  if not config.is_orthros:
    raise ValueError('init_orthros_params needs attention.kind="orthros"')
  rng = jax.random.PRNGKey(0) if rng is None else rng
  a = config.attention
  h, d = config.num_heads, config.head_dim
  x = jnp.zeros((1, 1, h, d), jnp.float32)
  out = {}
  for i, key in enumerate(jax.random.split(rng, config.num_layers)):
    kq, kk = jax.random.split(key)
    fmap = FeatureMap(a.feature_map, h, d, a.feature_dim, config.param_dtype)
    out[f'layers_{i}'] = {'attn': {
        'phi_q': nn.unbox(fmap.init(kq, x)['params']),
        'phi_k': nn.unbox(fmap.init(kk, x)['params']),
        'window_logit': jnp.full((h,), inverse_sigmoid(a.window_init),
                                 config.param_dtype)}}
    if a.length_scale:
      out[f'layers_{i}']['attn']['length_exponent'] = jnp.zeros(
          (h,), config.param_dtype)
  return out
