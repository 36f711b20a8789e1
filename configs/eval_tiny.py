"""Evaluate the tiny converted model (configs/convert_tiny.py) on CPU.

  python eval.py --config=configs/eval_tiny.py \
      --config.checkpoint=/tmp/tiny_orthros --config.teacher=/tmp/tiny

`arg`: '' the full tiny suite; 'smoke' a few examples of each section
(tests); 'speed' only the speed section, at longer lengths; 'retrieval'
only the retrieval tasks (the same examples as the full suite), e.g. with
--config.models="('orthros',)" to score one converted model quickly.
Task lengths are in tokens (bytes for the byte tokenizer).
"""

import ml_collections


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  if arg not in ('', 'smoke', 'speed', 'retrieval'):
    raise ValueError(f'configs/eval_tiny.py:{arg}: expected one of smoke, '
                     'speed, retrieval (or nothing)')
  smoke = arg == 'smoke'
  c = ml_collections.ConfigDict()
  c.name = 'tiny' if not arg else f'tiny_{arg}'
  # An Orthros checkpoint (a convert.py workdir or its orthros/ dir) and,
  # optionally, the dense teacher it came from (a train.py workdir); without
  # a teacher the dense row uses the Orthros weights with dense attention.
  c.checkpoint = ''
  c.teacher = ''
  # Rows (orthros_jax/evaluation/variants.py): teacher, dense, window,
  # window_sinks, orthros, orthros_nosinks / orthros_sinks, linear,
  # linear_trained (needs linear_checkpoint); sinks: N of the sink rows.
  # 'window' (the linear term removed, same weights) shows whether the
  # linear part matters at these lengths.
  c.models = (('teacher', 'orthros', 'linear') if smoke else
              ('teacher', 'window', 'orthros', 'linear'))
  c.sinks = 4
  # Prompt tokens decoded exactly by every row on the converted weights
  # (an inference setting); -1: as converted.
  c.exact_tail = -1
  c.linear_checkpoint = ''
  c.tokenizer = 'byte'
  c.seed = 1234
  c.progress = not smoke
  n = 4
  # task -> lengths (tokens), depths (passkey / niah: fraction of the
  # context before the needle), num_examples per cell, task options. The
  # tiny teacher saw passkey/niah only at 384 tokens (its seq_len); 256
  # shows how it generalises to shorter contexts.
  c.tasks = dict(
      passkey=dict(lengths=(300,) if smoke else (256, 384),
                   depths=(0.5,) if smoke else (0.0, 0.25, 0.5, 0.75, 1.0),
                   num_examples=n // 2 if smoke else 12),
      niah=dict(lengths=(300,) if smoke else (256, 384),
                depths=(0.5,) if smoke else (0.0, 0.25, 0.5, 0.75, 1.0),
                num_examples=n // 2 if smoke else 12),
      mqar=dict(lengths=(96,), num_examples=n if smoke else 60,
                num_pairs=4 if smoke else 8),
  )
  if arg == 'speed':
    c.tasks = {}
  c.quality = dict(source='synthetic', tasks={'filler': 1.0},
                   seq_len=96 if smoke else 384, batch_size=4 if smoke else 16,
                   seed=5, num_examples=4 if smoke else 64)
  if arg in ('speed', 'retrieval'):
    c.quality = {}
  lengths = (64, 128) if smoke else (256, 1024, 4096)
  if arg == 'speed':
    lengths = (512, 1024, 2048, 4096, 8192, 16384)
  c.speed = dict(lengths=lengths, batch=1, decode_batch=1,
                 reps=1 if smoke else 3, decode_steps=0)
  if arg == 'retrieval':
    c.speed = {}
  return c
