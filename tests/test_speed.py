"""The speed section (orthros_jax/evaluation/speed.py): interleaved rows
of every variant, decode alone, ratios, and eval.py's speed.variants."""

import jax
import numpy as np
import pytest

from orthros_jax.evaluation import plan as plan_lib
from orthros_jax.evaluation import report as report_lib
from orthros_jax.evaluation import speed
from orthros_jax.evaluation import suite
from tests.test_eval import ORTHROS
from tests.test_eval import _init


def test_speed_rows_and_variants():
  params = _init(ORTHROS, jax.random.PRNGKey(0))
  seen = []
  rows = speed.measure(ORTHROS, params, [16, 40], reps=2, decode_steps=3,
                       on_compiled=lambda v, c: seen.append(v))
  # Length-major: every variant is compiled and timed at a length before
  # the next length (interleaved rounds).
  assert [(r['variant'], r['length']) for r in rows] == [
      (v, n) for n in (16, 40) for v in speed.VARIANTS]
  assert seen == list(speed.VARIANTS) * 2
  for r in rows:
    assert r['ttft_s'] > 0 and r['decode_tokens_per_s'] > 0
    assert len(r['ttft_times_s']) == r['reps'] == 2
    assert r['ttft_min_s'] <= r['ttft_s'] <= r['ttft_max_s']
    assert r['prefill_tokens_per_s'] == pytest.approx(r['length'] /
                                                      r['ttft_s'])
    assert r['decode_steps'] == 3
    assert r['decode_step_min_s'] <= r['decode_step_s'] <= r[
        'decode_step_max_s']
  # Decode alone: every timed call runs a chunk of steps by default,
  # interleaved like measure's.
  decode_rows = speed.measure_decode(ORTHROS, params, [20], reps=3)
  assert [r['variant'] for r in decode_rows] == ['dense', 'orthros']
  for r in decode_rows:
    assert r['decode_steps'] == ORTHROS.attention.chunk_size
    assert len(r['decode_times_s']) == 3
    assert r['decode_step_s'] == pytest.approx(
        np.median(r['decode_times_s']) / r['decode_steps'])
    assert r['decode_tokens_per_s'] == pytest.approx(1 / r['decode_step_s'])
  for bad in (0, 2.5):
    with pytest.raises(ValueError, match='decode_steps'):
      speed.measure_decode(ORTHROS, params, [20], steps=bad)
  ratios = speed.ratios(rows)
  assert [r['length'] for r in ratios] == [16, 40]
  assert all(r['dense_over_orthros_ttft'] > 0 for r in ratios)
  # The section runs the variants it is given; the table shows both ratios.
  assert plan_lib.SPEED_VARIANTS == speed.VARIANTS
  part = suite.run_speed({'orthros': (ORTHROS, params, None)},
                         {'lengths': (16,), 'variants': ('orthros', 'none'),
                          'reps': 1}, progress=False)
  assert [r['variant'] for r in part['rows']] == ['orthros', 'none']
  (ratio,) = part['ratios']
  assert ratio['dense_over_orthros_ttft'] is None
  assert ratio['orthros_over_none_ttft'] == pytest.approx(
      part['rows'][0]['ttft_s'] / part['rows'][1]['ttft_s'])
  line = report_lib.speed_table(part).splitlines()[-1]
  assert line.split(' | ')[4:6] == [
      '-', f"{ratio['orthros_over_none_ttft']:.2f}x"]
  assert speed.variant_config(ORTHROS, 'none').attention.impl == 'none'
  assert not speed.variant_config(ORTHROS, 'dense').is_orthros
  with pytest.raises(ValueError, match='unknown'):
    speed.variant_config(ORTHROS, 'sparse')
  with pytest.raises(ValueError, match="kind='orthros'"):
    speed.variant_config(ORTHROS.replace(attention={'kind': 'dense'}),
                         'orthros')
