"""How evaluation runs a model over a sequence: one word, `route`, for
scoring (`inference.py`), generation (`retrieval.py`), the lm-eval bridge,
the suite and its reports.

The prefill/decode hand-off has one name, the **boundary**: the position
where the prefill stops. Positions t < boundary go through
`phase='prefill'` (Orthros: window + sinks + linear over older tokens),
the rest through exact decode over the cache. The attention config's
`exact_tail` sets it per example: boundary = prompt length - exact_tail.
The model's training forward takes the same per-example position as its
`split` argument (`phase='forward', split=boundary`), and conversion's
`split_mode` says how training draws it (docs/ARCHITECTURE.md, section 3).

Routes:
  'inference'  the boundary above: the prompt (all but its exact tail)
               through the prefill, everything after it decoded exactly;
               what `orthros_jax.generate` does (dense models: dense
               prefill of the whole prompt).
  'prefill'    boundary = the whole sequence: every token, prompt and
               generated, through the prefill formula. With window 0, no
               sinks and no exact tail this is a pure linear-attention
               (recurrent) model: the floor of every report.
  'forward'    scoring only: the training forward (teacher forcing, no
               cache) with the 'inference' boundary as its split; equal to
               'inference' up to float rounding (a tested identity) and
               cheaper.
"""

from __future__ import annotations

ROUTES = ('inference', 'prefill', 'forward')
# Generation has no training forward: it needs a cache to decode into.
GENERATION_ROUTES = ('inference', 'prefill')


def check(route: str, allowed: tuple[str, ...] = ROUTES) -> str:
  """`route` if it is one of `allowed`, else a ValueError that lists them."""
  if route not in allowed:
    raise ValueError(f'route={route!r} is unknown here: expected one of '
                     f'{allowed} (orthros_jax/evaluation/routes.py)')
  return route
