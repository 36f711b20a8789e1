"""Names of pytree leaves: one spelling of a jax key path as a string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def key_str(k: Any) -> str:
  """One entry of a jax key path: a dict key, attribute name or index."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_str(path: Sequence[Any], sep: str = '/') -> str:
  """'layers_0/attn/phi_q/kernel' for a jax key path (`sep` between the
  entries)."""
  return sep.join(key_str(k) for k in path)
