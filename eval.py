"""Evaluate an Orthros checkpoint three ways: dense teacher, Orthros, pure
linear (same weights; see orthros_jax/evaluation/suite.py).

  python eval.py --config=configs/eval_tiny.py \
      --config.checkpoint=/tmp/tiny_orthros --config.teacher=/tmp/tiny
  python eval.py --config=configs/eval_tiny.py:speed \
      --config.checkpoint=/tmp/tiny_orthros        # speed mode only

Writes results/<name>/ (or --out): results.json, report.md, PNG plots and
speed.csv.

The console shows progress bars, tables and paths; --verbosity=0 adds the
INFO lines of orbax, absl and jax (orthros_jax/console.py).
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from orthros_jax import console
from orthros_jax import sharding
from orthros_jax.evaluation.suite import run

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.',
                                          lock_config=True)
_OUT = flags.DEFINE_string('out', None, 'Output dir (default '
                           'results/<config.name>).')
flags.mark_flags_as_required(['config'])
_DISTRIBUTED = flags.DEFINE_enum(
    'distributed', 'auto', ['auto', 'on', 'off'],
    'jax.distributed.initialize() for a multi-process run: auto = on a '
    'multi-host TPU slice or when JAX_COORDINATOR_ADDRESS is set.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  console.quiet_logging()
  sharding.initialize_distributed(_DISTRIBUTED.value)
  config = _CONFIG.value
  run(config, _OUT.value or os.path.join('results', config.name))


if __name__ == '__main__':
  app.run(main)
