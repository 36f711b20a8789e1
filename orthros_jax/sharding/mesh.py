"""Device meshes: the named axes and how many devices each gets."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import Mesh

MESH_AXES = ('data', 'fsdp', 'tensor', 'sequence')


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
