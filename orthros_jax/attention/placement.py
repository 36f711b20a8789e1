"""Where attention runs on a device mesh: the mesh and the mesh axes that
carry the batch, the kv heads and (context parallelism) the cache positions.

A `Placement` is a plain value: `sharding.Partitioner.placement` builds it
from its logical-axis rules, and `backend.AttentionBackend` uses it to wrap
kernels in `shard_map` and to pick the context-parallel paths. This module
imports nothing else of the project, so every attention path can use it
without an import circle (docs/ARCHITECTURE.md, section 6).
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh

Axis = str | tuple[str, ...] | None


def axis_size(mesh: Mesh, axes: Axis) -> int:
  """Devices along mesh axes (a name, a tuple of names, or None = 1)."""
  if axes is None:
    return 1
  names = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[name] for name in names)


def check_divisible(mesh: Mesh, batch_axes: Axis, head_axes: Axis,
                    batch: int, kv_heads: int) -> None:
  """A clear error when `shard_map` cannot split batch or kv heads."""
  if batch % axis_size(mesh, batch_axes):
    raise ValueError(f'batch {batch} is not divisible by mesh axes '
                     f'{batch_axes!r} ({axis_size(mesh, batch_axes)} devices)')
  if kv_heads % axis_size(mesh, head_axes):
    raise ValueError(f'kv heads {kv_heads} are not divisible by mesh axes '
                     f'{head_axes!r} ({axis_size(mesh, head_axes)} devices)')


@dataclasses.dataclass(frozen=True)
class Placement:
  """A mesh and the axes attention splits over.

  batch_axes: mesh axes of the batch; head_axes: of the kv (and query)
  heads; sequence_axis: the one axis of the cache positions when it has
  more than one device (context parallelism), else None.
  """
  mesh: Mesh
  batch_axes: Axis = None
  head_axes: Axis = None
  sequence_axis: str | None = None

  def axes_for(self, batch: int, kv_heads: int) -> tuple[Axis, Axis]:
    """(batch axes, head axes) for these sizes: an axis group that does not
    divide its size is dropped (that dimension stays whole)."""
    fits = lambda axes, n: axes if n % axis_size(self.mesh, axes) == 0 else None
    return fits(self.batch_axes, batch), fits(self.head_axes, kv_heads)

  def sequence_devices(self) -> int:
    """Devices along the sequence axis (1 without one)."""
    return axis_size(self.mesh, self.sequence_axis)
