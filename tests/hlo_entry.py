"""What a compiled XLA program's entry computation computes, from its text.

Used by the tests that check a program makes no copy of a large buffer
(decode reading the KV cache in place).
"""

from __future__ import annotations

import re

import numpy as np

# Results that are the operands themselves, not new buffers.
_VIEWS = ('parameter', 'bitcast', 'tuple', 'get-tuple-element')


def entry_results(compiled_text: str) -> list[tuple[str, str, int]]:
  """(name, op, largest element count among its result's arrays) of every
  instruction of the ENTRY computation that makes a new result (parameters,
  bitcasts and tuple plumbing left out); tuple-shaped results count their
  largest array."""
  entry = compiled_text[compiled_text.index('\nENTRY'):]
  entry = entry[:entry.index('\n}')]
  out = []
  for line in entry.splitlines()[1:]:
    m = re.match(r'\s*(?:ROOT )?(%\S+) = (.*?) ([\w-]+)\(', line)
    if not m or m.group(3) in _VIEWS:
      continue
    sizes = [int(np.prod([int(x) for x in dims.split(',') if x]))
             for dims in re.findall(r'\w+\[([\d,]*)\]', m.group(2))]
    if sizes:
      out.append((m.group(1), m.group(3), max(sizes)))
  return out
