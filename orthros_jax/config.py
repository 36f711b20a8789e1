"""Model and attention configuration: frozen dataclasses with validation.

Every field a user can set is checked in `__post_init__`, and a bad value raises
a `ValueError` whose message names the field and what would be valid. The
dataclasses are hashable, so a config can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

import jax.numpy as jnp

AttentionKind = Literal['dense', 'orthros']
FeatureMapName = Literal['hedgehog', 'elu', 'relu', 'taylor']
Impl = Literal['auto', 'xla', 'pallas', 'none']

_KINDS = ('dense', 'orthros')
_FEATURE_MAPS = ('hedgehog', 'elu', 'relu', 'taylor')
_IMPLS = ('auto', 'xla', 'pallas', 'none')
_ROPE_KINDS = ('linear', 'llama3')


def _check(ok: bool, field: str, value, expected: str) -> None:
  if not ok:
    raise ValueError(f'{field}={value!r} is invalid: expected {expected}.')


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How attention is computed.

  kind: 'dense' (exact softmax in every phase) or 'orthros' (hybrid prefill,
    exact decode; docs/ARCHITECTURE.md section 3).
  feature_map: phi for the linear part: 'hedgehog' (learned projection then
    [softmax(xW), softmax(-xW)]), 'elu' (elu(xW)+1), 'relu' (relu(xW)),
    'taylor' (2nd-order Taylor expansion of exp, as in Based).
  feature_dim: width P of the learned per-head projection W [D, P] inside the
    feature map. The map's output width F (the linear state's size) is
    `state_dim`: 2P for hedgehog, P for elu/relu, 1 + P + P^2 for taylor.
  window: W, tokens of exact softmax per query in prefill (self included);
    0 means pure linear attention.
  chunk_size: C, tokens per chunk of the chunk-wise prefill scan.
  exact_tail: the last N prompt tokens go through the exact decode path in
    `generate`, so the first answer token is produced by exact attention.
  impl: 'auto' | 'xla' | 'pallas' kernel choice for prefill and decode;
    'none' removes attention (y = q; the speed benchmarks' ceiling only).
  window_init: initial gamma = sigmoid(g) of the window weight.
  sinks: N >= 0, the first N tokens of the sequence stay in every prefill
    query's exact set (attention sinks, as StreamingLLM) and never enter the
    linear part or its state; 0 = none. XLA prefill only (the Pallas prefill
    kernel has no sinks: impl='pallas' raises, 'auto' uses XLA).
  length_scale: scale every prefill query's linear weights by
    (n_old / W) ** -alpha_h, n_old = max(1, t + 1 - W - sinks) the number of
    older tokens of the query at position t and alpha_h a learned per-head
    exponent (param `length_exponent`, init 0: the plain formula). Hedgehog
    maps of RoPE'd q and k cannot see distance, so their mass on older
    tokens grows with n_old where a pretrained model's softmax mass barely
    moves (benchmarks/linear_share.py); alpha, fitted on every prefix of
    the training rows, lets the linear share follow it. Folded into phi_q,
    so every prefill path and the fold of decoded tokens are unchanged. Needs
    window > 0 or sinks > 0 (with linear weights alone it cancels).
  """

  kind: AttentionKind = 'dense'
  feature_map: FeatureMapName = 'hedgehog'
  feature_dim: int = 32
  window: int = 64
  chunk_size: int = 64
  exact_tail: int = 1
  impl: Impl = 'auto'
  window_init: float = 0.1
  sinks: int = 0
  length_scale: bool = False

  def __post_init__(self):
    _check(self.kind in _KINDS, 'attention.kind', self.kind, f'one of {_KINDS}')
    _check(self.feature_map in _FEATURE_MAPS, 'attention.feature_map',
           self.feature_map, f'one of {_FEATURE_MAPS}')
    _check(isinstance(self.feature_dim, int) and self.feature_dim >= 1,
           'attention.feature_dim', self.feature_dim, 'an integer >= 1')
    _check(isinstance(self.window, int) and self.window >= 0,
           'attention.window', self.window, 'an integer >= 0 (0 = pure linear)')
    _check(isinstance(self.chunk_size, int) and self.chunk_size >= 1,
           'attention.chunk_size', self.chunk_size, 'an integer >= 1')
    _check(isinstance(self.exact_tail, int) and self.exact_tail >= 0,
           'attention.exact_tail', self.exact_tail, 'an integer >= 0')
    _check(self.impl in _IMPLS, 'attention.impl', self.impl, f'one of {_IMPLS}')
    _check(0.0 < self.window_init < 1.0, 'attention.window_init',
           self.window_init, 'a number strictly between 0 and 1')
    _check(isinstance(self.sinks, int) and self.sinks >= 0,
           'attention.sinks', self.sinks, 'an integer >= 0 (0 = no sinks)')
    _check(isinstance(self.length_scale, bool), 'attention.length_scale',
           self.length_scale, 'True or False')
    _check(not (self.length_scale and self.kind == 'orthros'
                and self.window == 0 and self.sinks == 0),
           'attention.length_scale', self.length_scale,
           'False with window 0 and no sinks (a pure-linear output does '
           'not change when its weights are scaled)')

  @property
  def state_dim(self) -> int:
    """F: output width of the feature map (0 for dense attention)."""
    if self.kind == 'dense':
      return 0
    p = self.feature_dim
    return {'hedgehog': 2 * p, 'elu': p, 'relu': p, 'taylor': 1 + p + p * p}[
        self.feature_map]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. kind='linear' divides positions by `factor`;
  kind='llama3' rescales low frequencies as in Llama 3.1."""

  kind: Literal['linear', 'llama3'] = 'llama3'
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192

  def __post_init__(self):
    _check(self.kind in _ROPE_KINDS, 'rope_scaling.kind', self.kind,
           f'one of {_ROPE_KINDS}')
    _check(self.factor > 0, 'rope_scaling.factor', self.factor, 'a number > 0')
    if self.kind == 'llama3':
      _check(self.high_freq_factor > self.low_freq_factor > 0,
             'rope_scaling.high_freq_factor', self.high_freq_factor,
             'a number > low_freq_factor > 0')
      _check(self.original_max_len >= 1, 'rope_scaling.original_max_len',
             self.original_max_len, 'an integer >= 1')


# 'none': keep every activation; 'full': keep only each block's input
# (recompute the block in the backward pass); 'dots': keep the matmul
# outputs; 'dots_no_batch': keep the matmuls without batch dimensions
# (the projections and the MLP, not attention's score matrices).
REMAT_POLICIES = ('none', 'full', 'dots', 'dots_no_batch')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (Llama 2/3, Mistral, Qwen2 layouts).

  The defaults are a tiny model that runs anywhere; real sizes come from
  configs/ or from `load_hf`.
  """

  vocab_size: int = 256
  num_layers: int = 2
  embed_dim: int = 64
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 128
  norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  qkv_bias: bool = False      # Qwen2 style biases on q, k, v
  out_bias: bool = False      # bias on the attention output projection
  tie_embeddings: bool = False
  dtype: str = 'float32'      # activations
  param_dtype: str = 'float32'
  attention: AttentionConfig = AttentionConfig()
  # Layers as one `nn.scan` over stacked params (compiled once, params
  # under 'layers' with a leading layer axis, the cache one LayerCache of
  # [L, ...] arrays) instead of L unrolled blocks 'layers_{i}';
  # `layer_layout.stack_layers` / `unstack_layers` convert between the two.
  scan_layers: bool = False
  # Rematerialization of each block in training: one of REMAT_POLICIES
  # (model.py maps them to jax.checkpoint_policies).
  remat: str = 'none'

  def __post_init__(self):
    _check(isinstance(self.scan_layers, bool), 'scan_layers',
           self.scan_layers, 'True or False')
    _check(self.remat in REMAT_POLICIES, 'remat', self.remat,
           f'one of {REMAT_POLICIES}')
    for name in ('vocab_size', 'num_layers', 'embed_dim', 'num_heads',
                 'num_kv_heads', 'head_dim', 'mlp_dim'):
      value = getattr(self, name)
      _check(isinstance(value, int) and value >= 1, name, value,
             'an integer >= 1')
    _check(self.num_heads % self.num_kv_heads == 0, 'num_kv_heads',
           self.num_kv_heads,
           f'a divisor of num_heads={self.num_heads} (grouped-query attention)')
    _check(self.head_dim % 2 == 0, 'head_dim', self.head_dim,
           'an even number (RoPE rotates pairs)')
    _check(self.norm_eps > 0, 'norm_eps', self.norm_eps, 'a number > 0')
    _check(self.rope_theta > 0, 'rope_theta', self.rope_theta, 'a number > 0')
    for name in ('dtype', 'param_dtype'):
      value = getattr(self, name)
      try:
        ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
      except TypeError:
        ok = False
      _check(ok, name, value, "a floating dtype name such as 'float32' or "
             "'bfloat16'")
    _check(isinstance(self.attention, AttentionConfig), 'attention',
           self.attention, 'an AttentionConfig')
    _check(self.rope_scaling is None or isinstance(self.rope_scaling,
                                                   RopeScaling),
           'rope_scaling', self.rope_scaling, 'None or a RopeScaling')

  @property
  def num_groups(self) -> int:
    """G = H / K query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @property
  def is_orthros(self) -> bool:
    return self.attention.kind == 'orthros'

  def replace(self, **kwargs) -> 'ModelConfig':
    """A copy with fields replaced; `attention=dict(...)` updates fields of the
    attention config."""
    attention = kwargs.get('attention')
    if isinstance(attention, dict):
      kwargs['attention'] = dataclasses.replace(self.attention, **attention)
    return dataclasses.replace(self, **kwargs)

  def num_params(self) -> int:
    e, h, k, d, m, v = (self.embed_dim, self.num_heads, self.num_kv_heads,
                        self.head_dim, self.mlp_dim, self.vocab_size)
    per_layer = e * (h + 2 * k) * d + h * d * e + 3 * e * m + 2 * e
    total = self.num_layers * per_layer + v * e + e
    return total + (0 if self.tie_embeddings else e * v)


def inverse_sigmoid(p: float) -> float:
  return math.log(p / (1.0 - p))


# ------------------------------------------------- configs from mappings


def plain(x: Any) -> Any:
  """ConfigDicts (and FrozenConfigDicts) to plain dicts, recursively."""
  if hasattr(x, 'to_dict'):
    x = x.to_dict()
  if isinstance(x, Mapping):
    return {k: plain(v) for k, v in x.items()}
  if isinstance(x, list):
    return [plain(v) for v in x]
  return x


def model_config_from(cfg: Mapping[str, Any]) -> ModelConfig:
  """ModelConfig from a mapping with a nested 'attention' (and optional
  'rope_scaling') mapping; unknown keys raise a ValueError naming them."""
  cfg = dict(plain(cfg))
  attention = dict(cfg.pop('attention', {}) or {})
  rope = cfg.pop('rope_scaling', None)
  for name, fields, given in (
      ('model', ModelConfig.__dataclass_fields__, cfg),
      ('model.attention', AttentionConfig.__dataclass_fields__, attention)):
    unknown = sorted(set(given) - set(fields))
    if unknown:
      raise ValueError(f'{name} has unknown keys {unknown}; valid keys: '
                       f'{sorted(fields)}')
  return ModelConfig(**cfg, attention=AttentionConfig(**attention),
                     rope_scaling=RopeScaling(**rope) if rope else None)
