"""What the entry points print: progress bars, tables and paths, not the
INFO lines of the libraries underneath (orbax's checkpoint manager, absl,
jax), nor the per-step metrics the loop also writes to metrics.jsonl.

`quiet_logging()` is called first by train.py, convert.py and eval.py:
unless the user passed absl's own `--verbosity` (or `-v`), logging shows
WARNING and above. `--verbosity=0` brings the INFO lines back, `1` adds
DEBUG.
"""

from __future__ import annotations

import logging

from absl import flags
from absl import logging as absl_logging

# Python loggers of the libraries that log at INFO during a run (absl's own
# logger carries orbax's and this project's absl.logging calls).
LIBRARY_LOGGERS = ('absl', 'jax', 'orbax', 'etils')


def quiet_logging(flag_values: flags.FlagValues | None = None) -> bool:
  """WARNING-level logging unless --verbosity was given; True if quieted."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  if 'verbosity' in flag_values and flag_values['verbosity'].present:
    return False
  absl_logging.set_verbosity(absl_logging.WARNING)
  for name in LIBRARY_LOGGERS:
    logging.getLogger(name).setLevel(logging.WARNING)
  return True
