"""The training library shared by train.py and convert.py: optimizer, loss,
train state, jitted steps, checkpoints, metrics and the loop."""

from orthros_jax.training.checkpoint import CheckpointManager
from orthros_jax.training.checkpoint import load_params
from orthros_jax.training.checkpoint import restore_or_init
from orthros_jax.training.checkpoint import save_params
from orthros_jax.training.loop import TrainConfig
from orthros_jax.training.loop import train
from orthros_jax.training.loss import cross_entropy
from orthros_jax.training.loss import next_token_loss
from orthros_jax.training.metrics import MetricsWriter
from orthros_jax.training.metrics import ProgressBar
from orthros_jax.training.metrics import read_metrics
from orthros_jax.training.optim import make_optimizer
from orthros_jax.training.optim import make_schedule
from orthros_jax.training.state import TrainState
from orthros_jax.training.step import evaluate
from orthros_jax.training.step import make_eval_step
from orthros_jax.training.step import make_objective_step
from orthros_jax.training.step import make_train_step

__all__ = [
    'CheckpointManager', 'MetricsWriter', 'ProgressBar', 'TrainConfig',
    'TrainState', 'cross_entropy', 'evaluate', 'load_params',
    'make_eval_step', 'make_objective_step', 'make_optimizer',
    'make_schedule', 'make_train_step', 'next_token_loss', 'read_metrics',
    'restore_or_init', 'save_params', 'train',
]
