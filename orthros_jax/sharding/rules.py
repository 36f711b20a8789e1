"""Logical-axis rules: the model's axis names -> mesh axes."""

from __future__ import annotations

import functools
import logging
from typing import Any

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
    ('layers', None),  # the stacked layer axis of scan_layers
)


@functools.lru_cache(maxsize=None)
def log_once(message: str) -> None:
  logging.info(message)


def normalize_rules(rules) -> tuple[tuple[str, Any], ...]:
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
