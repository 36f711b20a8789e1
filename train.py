"""Train a dense or Orthros model from scratch.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python train.py --config=configs/tiny.py --config.train.num_steps=50 \
      --config.model.attention.kind=orthros --workdir=/tmp/tiny_orthros

A workdir that already holds a checkpoint is resumed. Metrics go to
WORKDIR/metrics.jsonl and WORKDIR/tensorboard.

The console shows progress bars, tables and paths; --verbosity=0 adds the
INFO lines of orbax, absl and jax (orthros_jax/console.py).
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from orthros_jax import console
from orthros_jax import sharding
from orthros_jax.training.train_lm import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output and checkpoint dir.')
flags.mark_flags_as_required(['config', 'workdir'])
_DISTRIBUTED = flags.DEFINE_enum(
    'distributed', 'auto', ['auto', 'on', 'off'],
    'jax.distributed.initialize() for a multi-process run: auto = on a '
    'multi-host TPU slice or when JAX_COORDINATOR_ADDRESS is set.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  console.quiet_logging()
  sharding.initialize_distributed(_DISTRIBUTED.value)
  train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
