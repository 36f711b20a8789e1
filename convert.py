"""Convert a trained dense Transformer into an Orthros model.

  python convert.py --config=configs/convert_tiny.py \
      --config.teacher.checkpoint=/tmp/tiny --workdir=/tmp/tiny_orthros
  python convert.py --config=configs/convert_tiny.py \
      --config.teacher.hf_dir=/path/to/llama --config.data.tokenizer=\
/path/to/llama/tokenizer.json --workdir=/tmp/llama_orthros

Stage 1 (attention transfer) and stage 2 (phase-aware finetune) run with
their token budgets; the Orthros checkpoint goes to
WORKDIR/orthros/checkpoints, the comparison with the teacher and the
pure-linear floor to WORKDIR/report.{json,md}. A workdir holding a
partial run resumes it.

The console shows progress bars, tables and paths; --verbosity=0 adds the
INFO lines of orbax, absl and jax (orthros_jax/console.py).
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from orthros_jax import console
from orthros_jax import sharding
from orthros_jax.conversion.pipeline import convert

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
  convert(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
