"""Memory accounting: how many bytes of a tree each device holds."""

from __future__ import annotations

from typing import Any

import jax


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
