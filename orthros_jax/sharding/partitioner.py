"""The Partitioner: a mesh plus logical-axis rules, and the shardings
of params, train states, batches and KV caches it derives from them."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orthros_jax import cache as cache_lib
from orthros_jax.attention.backend import AttentionBackend
from orthros_jax.attention.placement import Placement
from orthros_jax.attention.placement import axis_size
from orthros_jax.model import Transformer
from orthros_jax.model import transformer
from orthros_jax.sharding.mesh import make_mesh
from orthros_jax.sharding.rules import DEFAULT_RULES
from orthros_jax.sharding.rules import log_once
from orthros_jax.sharding.rules import normalize_rules
from orthros_jax.treepath import key_str
from orthros_jax.treepath import path_str


@dataclasses.dataclass(frozen=True, eq=False)
class Partitioner:
  """A mesh plus logical-axis rules; see `orthros_jax.sharding`."""

  mesh: Mesh
  rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES

  def __post_init__(self):
    object.__setattr__(self, 'rules', normalize_rules(self.rules))
    for name, target in self.rules:
      for axis in (target if isinstance(target, tuple) else (target,)):
        if axis is not None and axis not in self.mesh.shape:
          raise ValueError(f'sharding rule {name!r} -> {target!r} names mesh '
                           f'axis {axis!r}, not in the mesh '
                           f'{dict(self.mesh.shape)}')

  @classmethod
  def create(cls, shape=None, rules=None, *, devices=None) -> 'Partitioner':
    return cls(make_mesh(shape, devices=devices),
               DEFAULT_RULES if rules is None else rules)

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any] | None) -> 'Partitioner | None':
    """From a config's `mesh` entry: {'shape': {axis: size}, 'rules': [...]}.

    A size of -1 takes the devices left over; without one the mesh uses the
    first prod(sizes) devices. A mesh of one device (the configs' default
    shape, all 1) means no partitioner: the plain single-device path. Set
    e.g. --config.mesh.shape.data=-1 to use every device for data
    parallelism, or --config.mesh.shape.fsdp=8.
    """
    if not cfg:
      return None
    cfg = dict(cfg.to_dict() if hasattr(cfg, 'to_dict') else cfg)
    unknown = sorted(set(cfg) - {'shape', 'rules'})
    if unknown:
      raise ValueError(f'mesh config has unknown keys {unknown}; expected '
                       "'shape' and 'rules'")
    shape = dict(cfg.get('shape') or {})
    rules = cfg.get('rules') or None
    devices = jax.devices()
    sizes = [int(v) for v in shape.values()]
    if -1 not in sizes:
      need = math.prod(sizes)
      if need > len(devices):
        raise ValueError(f'mesh {shape} needs {need} devices but only '
                         f'{len(devices)} are available')
      devices = devices[:need]
    if len(devices) == 1:
      return None
    return cls.create(shape, rules, devices=devices)

  # -- sizes and specs ----------------------------------------------------

  def axis_size(self, axes) -> int:
    return axis_size(self.mesh, axes)

  def mesh_axes(self, logical: str):
    """Mesh axes of one logical name (None: unsharded)."""
    spec = nn.logical_to_mesh_axes((logical,), self.rules)
    return spec[0]

  @property
  def batch_axes(self):
    return self.mesh_axes('batch')

  @property
  def head_axes(self):
    return self.mesh_axes('kv_heads')

  @property
  def sequence_axis(self) -> str | None:
    axes = self.mesh_axes('cache_length')
    if axes is None or self.axis_size(axes) == 1:
      return None
    if not isinstance(axes, str):
      if len(axes) != 1:
        raise ValueError('context parallelism needs cache_length on a single '
                         f'mesh axis; the rules give {axes!r}')
      axes = axes[0]
    return axes

  def spec(self, logical: Sequence[str | None], shape: Sequence[int] | None
           = None, what: str = 'array') -> P:
    """The PartitionSpec of logical names; with `shape`, dimensions the mesh
    axes do not divide are left unsharded."""
    axes = list(nn.logical_to_mesh_axes(tuple(logical), self.rules))
    if shape is not None:
      for i, (ax, size) in enumerate(zip(axes, shape)):
        n = self.axis_size(ax)
        if n > 1 and size % n:
          log_once(f'{what}: dimension {i} ({logical[i]}, size {size}) is not '
                   f'divisible by mesh axes {ax} ({n} devices); left '
                   'unsharded')
          axes[i] = None
    return P(*axes)

  def sharding(self, logical: Sequence[str | None], shape=None,
               what: str = 'array') -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical, shape, what))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  # -- parameters ----------------------------------------------------------

  def abstract_params(self, model_config, seq_len: int = 8):
    """Boxed (LogicallyPartitioned) abstract params of the Transformer."""
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jax.eval_shape(
        lambda t: Transformer(model_config).init(
            jax.random.PRNGKey(0), t, phase='forward')['params'], tokens)

  def param_shardings(self, boxed):
    """NamedShardings for a tree of (boxed or plain) abstract params; plain
    leaves are replicated."""
    def one(path, x):
      if isinstance(x, nn.LogicallyPartitioned):
        return self.sharding(x.names, x.value.shape, path_str(path))
      return self.replicated
    return jax.tree_util.tree_map_with_path(
        one, boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))

  def model_param_shardings(self, model_config, params=None):
    """Shardings for `params` (default: the model's own tree). Leaves that
    are not model params (adapters, extra state) are replicated; leaves
    named like a model param shard like it when the shapes agree."""
    table = {}
    boxed = self.abstract_params(model_config)
    for path, x in jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]:
      table[path_str(path)] = x
    if params is None:
      return self.param_shardings(boxed)

    def one(path, x):
      entry = table.get(path_str(path))
      if (isinstance(entry, nn.LogicallyPartitioned) and
          tuple(entry.value.shape) == tuple(np.shape(x))):
        return self.sharding(entry.names, np.shape(x), path_str(path))
      return self.replicated
    return jax.tree_util.tree_map_with_path(one, params)

  def init_params(self, model_config, rng, *, seq_len: int = 8):
    """Initializes the Transformer's params directly sharded: eval_shape ->
    partition specs -> jit(init, out_shardings), so no device (or host)
    ever holds the full tree."""
    shardings = nn.unbox(self.model_param_shardings(model_config))
    tokens = jnp.zeros((1, seq_len), jnp.int32)

    def init(rng):
      return nn.unbox(Transformer(model_config).init(
          rng, tokens, phase='forward')['params'])
    with self.activate():
      return jax.jit(init, out_shardings=shardings)(rng)

  def shard_params(self, params, model_config):
    """Places existing params (a loaded checkpoint) on the mesh."""
    return jax.device_put(params, self.model_param_shardings(model_config,
                                                             params))

  def state_shardings(self, abstract_state, param_shardings):
    """Shardings for a train state (or any tree holding params-like
    leaves): a leaf whose path ends with a param's path and has its shape
    (Adam's mu and nu, the params themselves) shards like the param; the
    rest (step counts, scalars) is replicated."""
    table = {}
    for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]:
      table[path_str(path)] = s

    def one(path, x):
      keys = [key_str(k) for k in path]
      for i in range(len(keys)):
        s = table.get('/'.join(keys[i:]))
        if s is not None:
          spec = s.spec
          if all(a is None or np.shape(x)[d] % self.axis_size(a) == 0
                 for d, a in enumerate(spec)) and len(spec) <= np.ndim(x):
            return s
      return self.replicated
    return jax.tree_util.tree_map_with_path(one, abstract_state)

  # -- batches and caches --------------------------------------------------

  def batch_sharding(self, ndim: int, batch: int | None = None
                     ) -> NamedSharding:
    """[B, ...] arrays split over the batch axes."""
    logical = ('batch',) + (None,) * (ndim - 1)
    shape = None if batch is None else (batch,) + (1,) * (ndim - 1)
    return self.sharding(logical, shape, 'batch')

  def shard_batch(self, batch):
    """Process-local numpy rows -> global arrays split over the batch axes
    (each process passes its own rows, as the data pipeline yields them)."""
    def one(x):
      x = np.asarray(x)
      global_rows = x.shape[0] * jax.process_count()
      sharding = self.batch_sharding(x.ndim, global_rows)
      return jax.make_array_from_process_local_data(sharding, x)
    return jax.tree.map(one, batch)

  def cache_shardings(self, cache):
    """KV cache: k, v [B, S, K, D] by batch, sequence and kv heads; lengths
    [B] and folded [B] by batch; linear state S [B, H, F, D], z [B, H, F]
    by batch and heads. A stacked cache (scan_layers) keeps its leading
    layer axis whole."""
    lead = ('layers',) if cache_lib.is_stacked(cache) else ()

    def layer(c):
      kv = lead + ('batch', 'cache_length', 'kv_heads', 'head_dim')
      one = lambda names, x, what: self.sharding(lead + names, x.shape, what)
      return c.replace(
          k=self.sharding(kv, c.k.shape, 'cache k'),
          v=self.sharding(kv, c.v.shape, 'cache v'),
          lengths=one(('batch',), c.lengths, 'cache lengths'),
          S=one(('batch', 'heads', 'features', 'head_dim'), c.S, 'cache S'),
          z=one(('batch', 'heads', 'features'), c.z, 'cache z'),
          folded=one(('batch',), c.folded, 'cache folded'))
    return cache_lib.map_layers(layer, cache)

  def shard_cache(self, cache):
    seq = self.sequence_axis
    max_len = cache_lib.layer_meta(cache).max_len
    if seq is not None and max_len % self.mesh.shape[seq]:
      raise ValueError(
          f'cache max_len={max_len} must be a multiple of the '
          f"'{seq}' mesh axis ({self.mesh.shape[seq]}) for a sequence-sharded "
          'cache; allocate a larger cache')
    return jax.device_put(cache, self.cache_shardings(cache))

  # -- the model on this mesh ---------------------------------------------

  @property
  def placement(self) -> Placement:
    """The mesh and the axes attention splits over (batch, kv heads, cache
    positions)."""
    return Placement(self.mesh, self.batch_axes, self.head_axes,
                     self.sequence_axis)

  def attention_backend(self, model_config) -> AttentionBackend:
    """The model's attention on this mesh: Pallas kernels in shard_map over
    batch and heads, context parallelism over a sequence axis larger than
    1 (attention/backend.py)."""
    return AttentionBackend.for_model(model_config, self.placement)

  def model(self, model_config) -> Transformer:
    """The Transformer with this mesh's attention backend."""
    return transformer(model_config, self.placement)

  # -- context -------------------------------------------------------------

  @contextlib.contextmanager
  def activate(self):
    """Within: jitted code sees this mesh (jax.set_mesh) and flax's logical
    constraints use these rules. Which attention runs is the model's
    backend (`model(config)`), not this context."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield self
