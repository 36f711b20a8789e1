"""Device meshes and logical-axis rules: how the model is laid out on chips.

One `Partitioner` holds a mesh with the axes

  data      pure data parallelism (params replicated);
  fsdp      data parallelism with params, gradients and optimizer state
            sharded (ZeRO-3 / FSDP: XLA all-gathers a layer's weights when
            it needs them);
  tensor    Megatron-style tensor parallelism over heads and the MLP width;
  sequence  context parallelism: a long prompt's tokens and the KV cache
            split by position (see orthros_jax/attention/context_parallel.py);

and the rules mapping the model's logical axis names (model.py: batch,
length, embed, heads, kv_heads, head_dim, mlp, vocab, features; cache_length
for the KV cache) to mesh axes. Everything goes through JAX's own SPMD
runtime: `jax.jit` with NamedShardings, `with_sharding_constraint` inside
the model (flax's logical constraints) and `shard_map` for the kernels and
the context-parallel attention.

  partitioner = Partitioner.create({'data': 2, 'fsdp': 4})
  params = partitioner.init_params(model_config, rng, seq_len=512)
  model = partitioner.model(model_config)  # attention backend of this mesh
  with partitioner.activate():
    ...  # jitted model calls see the mesh and the rules

A dimension whose size the mesh axes do not divide is left unsharded (with a
one-time log line), so the byte-level tiny model (vocab 259) still runs on
any mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orthros_jax.attention.backend import AttentionBackend
from orthros_jax.attention.placement import Placement
from orthros_jax.attention.placement import axis_size
from orthros_jax.attention.placement import check_divisible  # noqa: F401
from orthros_jax.model import Transformer
from orthros_jax.model import transformer

MESH_AXES = ('data', 'fsdp', 'tensor', 'sequence')

# Logical axis -> mesh axes, in priority order: a mesh axis already used by
# an earlier dimension of the same array is skipped (so activations
# [batch, length, embed] shard batch over data+fsdp and leave embed whole,
# while weights [embed, heads, head_dim] shard embed over fsdp).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ('batch', ('data', 'fsdp')),
    ('length', 'sequence'),
    ('cache_length', 'sequence'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('features', 'fsdp'),
    ('head_dim', None),
)

@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
  logging.info(message)


def make_mesh(shape: Mapping[str, int] | Sequence[int] | None = None, *,
              axes: Sequence[str] = MESH_AXES,
              devices: Sequence[Any] | None = None) -> Mesh:
  """A mesh over `devices` (default all) with `axes`.

  shape: axis -> size (missing axes get 1; one axis may be -1, filled with
  the devices left), or a sequence of sizes in `axes` order. The product
  must equal the number of devices. Default: everything on 'data'.
  """
  devices = list(jax.devices() if devices is None else devices)
  axes = tuple(axes)
  if len(set(axes)) != len(axes):
    raise ValueError(f'mesh axes {axes} repeat a name')
  if shape is None:
    shape = {axes[0]: -1}
  if not isinstance(shape, Mapping):
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axes):
      raise ValueError(f'mesh shape {shape} must have one size per axis '
                       f'{axes}')
    shape = dict(zip(axes, shape))
  unknown = sorted(set(shape) - set(axes))
  if unknown:
    raise ValueError(f'mesh shape names unknown axes {unknown}; the axes are '
                     f'{axes}')
  sizes = [int(shape.get(a, 1)) for a in axes]
  if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f'mesh shape {dict(zip(axes, sizes))}: sizes must be >= '
                     '1, with at most one -1 (use the remaining devices)')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f'{len(devices)} devices cannot fill mesh '
                       f'{dict(zip(axes, sizes))}: {known} does not divide '
                       'them')
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(
        f'mesh {dict(zip(axes, sizes))} needs {math.prod(sizes)} devices but '
        f'{len(devices)} are available; make the sizes multiply to '
        f'{len(devices)} (one size may be -1)')
  return jax.make_mesh(tuple(sizes), axes, axis_types=(AxisType.Auto,) *
                       len(axes), devices=devices)


def _normalize_rules(rules) -> tuple[tuple[str, Any], ...]:
  out = []
  for rule in rules:
    if len(rule) != 2:
      raise ValueError(f'sharding rule {rule!r} must be (logical name, mesh '
                       'axes)')
    name, target = rule
    if isinstance(target, list):
      target = tuple(target)
    out.append((str(name), target))
  return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class Partitioner:
  """A mesh plus logical-axis rules; see the module docstring."""

  mesh: Mesh
  rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES

  def __post_init__(self):
    object.__setattr__(self, 'rules', _normalize_rules(self.rules))
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
          _log_once(f'{what}: dimension {i} ({logical[i]}, size {size}) is not '
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
        return self.sharding(x.names, x.value.shape, _path(path))
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
      table[_path(path)] = x
    if params is None:
      return self.param_shardings(boxed)

    def one(path, x):
      entry = table.get(_path(path))
      if (isinstance(entry, nn.LogicallyPartitioned) and
          tuple(entry.value.shape) == tuple(np.shape(x))):
        return self.sharding(entry.names, np.shape(x), _path(path))
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
      table[_path(path)] = s

    def one(path, x):
      keys = [_key(k) for k in path]
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
    [B] by batch; linear state S [B, H, F, D], z [B, H, F] by batch and
    heads."""
    def layer(c):
      kv = ('batch', 'cache_length', 'kv_heads', 'head_dim')
      return c.replace(
          k=self.sharding(kv, c.k.shape, 'cache k'),
          v=self.sharding(kv, c.v.shape, 'cache v'),
          lengths=self.sharding(('batch',), c.lengths.shape, 'cache lengths'),
          S=self.sharding(('batch', 'heads', 'features', 'head_dim'),
                          c.S.shape, 'cache S'),
          z=self.sharding(('batch', 'heads', 'features'), c.z.shape,
                          'cache z'))
    return tuple(layer(c) for c in cache)

  def shard_cache(self, cache):
    seq = self.sequence_axis
    if seq is not None and cache[0].k.shape[1] % self.mesh.shape[seq]:
      raise ValueError(
          f'cache max_len={cache[0].k.shape[1]} must be a multiple of the '
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


def _key(k) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _path(path) -> str:
  return '/'.join(_key(k) for k in path)


def bytes_per_device(tree) -> dict[str, float]:
  """Total bytes of a tree of arrays and the largest amount any one device
  holds (from the arrays' shardings), plus their ratio."""
  total = 0
  per_device: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    total += x.size * x.dtype.itemsize
    for shard in x.addressable_shards:
      per_device[shard.device] = (per_device.get(shard.device, 0) +
                                  shard.data.size * shard.data.dtype.itemsize)
  most = max(per_device.values()) if per_device else 0
  return {'total_bytes': float(total), 'max_device_bytes': float(most),
          'fraction': most / total if total else 0.0}


def initialize_distributed(mode: str = 'auto') -> bool:
  """Calls `jax.distributed.initialize()` for a multi-process run.

  mode 'on' always initializes (TPU slices, SLURM and Open MPI are detected
  by JAX; elsewhere set JAX_COORDINATOR_ADDRESS=host:port plus
  JAX_NUM_PROCESSES and JAX_PROCESS_ID, which this function passes on);
  'off' never; 'auto' initializes on a multi-host TPU slice
  (TPU_WORKER_HOSTNAMES lists more than one host) or when
  JAX_COORDINATOR_ADDRESS is set. Returns whether it initialized. Call it
  before anything touches the devices.
  """
  if mode not in ('auto', 'on', 'off'):
    raise ValueError(f"distributed={mode!r} must be 'auto', 'on' or 'off'")
  if mode == 'off':
    return False
  if mode == 'auto':
    hosts = [h for h in re.split(r'[,\s]+',
                                 os.environ.get('TPU_WORKER_HOSTNAMES', ''))
             if h]
    if len(hosts) <= 1 and not os.environ.get('JAX_COORDINATOR_ADDRESS'):
      return False
  kwargs = {}
  for env, name in (('JAX_NUM_PROCESSES', 'num_processes'),
                    ('JAX_PROCESS_ID', 'process_id')):
    if os.environ.get(env):
      kwargs[name] = int(os.environ[env])
  jax.distributed.initialize(**kwargs)
  logging.info('jax.distributed: process %d of %d, %d local / %d global '
               'devices', jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True
