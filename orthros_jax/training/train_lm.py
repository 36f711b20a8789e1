"""`train_and_evaluate(config, workdir)`: train a dense or Orthros model from
scratch on a grain pipeline; what train.py runs.

The config (an ml_collections.ConfigDict, see configs/tiny.py) is parsed
once by `check_config` into a frozen `TrainPlan`, every key and value
checked before anything trains. Its parts:
  model:     ModelConfig fields; model.attention holds AttentionConfig fields.
  data:      make_dataset arguments for training (source, seq_len,
             batch_size, seed, tasks, paths, tokenizer, ...).
  eval_data: the same for a held-out set (a different seed, a fixed
             num_examples), or None; eval_batches: how many batches to score.
  train:     TrainConfig fields (steps, learning rate, split mode, ...).
  mesh:      optional device mesh (orthros_jax/sharding/): shape (axis ->
             size for data, fsdp, tensor, sequence; one may be -1) and
             rules (logical axis -> mesh axes; empty = DEFAULT_RULES).
             Params and optimizer state are initialized (or restored)
             directly sharded, and every step runs on the mesh.
  init_from: warm start from another run's params ('' for none).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from orthros_jax import sharding
from orthros_jax.config import ModelConfig
from orthros_jax.config import model_config_from
from orthros_jax.config import plain
from orthros_jax.data import get_tokenizer
from orthros_jax.data import make_dataset
from orthros_jax.model import Transformer
from orthros_jax.layer_layout import layers_for
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.training import loop
from orthros_jax.training import step as step_lib


_TOP_KEYS = {'model', 'data', 'eval_data', 'eval_batches', 'train', 'mesh',
             'init_from'}


def make_data(data_cfg: Mapping[str, Any], vocab_size: int):
  """A checkpointable grain iterator; checks the tokenizer fits the model."""
  data_cfg = dict(plain(data_cfg))
  tokenizer = get_tokenizer(data_cfg.pop('tokenizer', 'byte'))
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f'the tokenizer has {tokenizer.vocab_size} ids but '
                     f'model.vocab_size={vocab_size}; set model.vocab_size >= '
                     f'{tokenizer.vocab_size}')
  return iter(make_dataset(tokenizer=tokenizer, **data_cfg))


@dataclasses.dataclass(frozen=True)
class TrainPlan:
  """A training config, checked (see the module docstring)."""
  model: ModelConfig
  train: loop.TrainConfig
  data: Mapping[str, Any]
  eval_data: Mapping[str, Any] | None = None
  eval_batches: int = 8
  mesh: Mapping[str, Any] | None = None
  init_from: str = ''
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def seq_len(self) -> int:
    return int(self.data['seq_len'])


def check_config(config: Mapping[str, Any] | TrainPlan) -> TrainPlan:
  """The plan of a training config (a plan passes through)."""
  if isinstance(config, TrainPlan):
    return config
  cfg = dict(plain(config))
  unknown = sorted(set(cfg) - _TOP_KEYS)
  if unknown:
    raise ValueError(f'the training config has unknown keys {unknown}; valid '
                     f'keys: {sorted(_TOP_KEYS)}')
  for key in ('model', 'data', 'train'):
    if not cfg.get(key):
      raise ValueError(f'the training config needs {key}')
  if not cfg['data'].get('seq_len'):
    raise ValueError('data.seq_len is missing')
  eval_batches = int(cfg.get('eval_batches', 8))
  if eval_batches <= 0:
    raise ValueError(f'eval_batches={eval_batches} must be positive')
  return TrainPlan(model=model_config_from(cfg['model']),
                   train=loop.TrainConfig.from_mapping(cfg['train'],
                                                        strict=True),
                   data=dict(cfg['data']),
                   eval_data=dict(cfg['eval_data']) if cfg.get('eval_data')
                   else None,
                   eval_batches=eval_batches, mesh=cfg.get('mesh') or None,
                   init_from=str(cfg.get('init_from') or ''), config=cfg)


def train_and_evaluate(config, workdir: str | os.PathLike):
  """Trains the plan's model on its data in `workdir` (resuming if it
  holds a checkpoint); returns (final TrainState, history). `config`: a
  training config or its TrainPlan."""
  plan = check_config(config)
  workdir = os.fspath(workdir)
  model_config = plan.model
  train_cfg = plan.train
  partitioner = sharding.Partitioner.from_config(plan.mesh)
  data = make_data(plan.data, model_config.vocab_size)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(plan.config, f, indent=1, default=str)

  seq_len = plan.seq_len

  def params_init():
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    init = jax.jit(lambda rng: Transformer(model_config).init(
        rng, tokens, phase='forward')['params'])
    return init(jax.random.PRNGKey(train_cfg.seed))

  init_from = plan.init_from
  if init_from:
    # Warm start: the params of another run (a train.py / convert.py workdir
    # or a committed params checkpoint); optimizer and schedule start fresh.
    # Checked against this config before training starts.
    loaded, _, from_step = ckpt_lib.load_params(init_from)
    # Either layer layout warm-starts either (layer_layout.layers_for).
    loaded = layers_for(model_config, loaded)
    ckpt_lib.check_params(model_config, loaded,
                          f'init_from={init_from} (step {from_step})')
    logging.info('warm start from %s (step %d)', init_from, from_step)
    params_init = lambda: jax.tree.map(
        lambda x: jnp.array(x, model_config.param_dtype, copy=True), loaded)

  eval_fn = None
  eval_data = plan.eval_data
  if eval_data:
    eval_step = step_lib.make_eval_step(model_config,
                                        split_mode=train_cfg.split_mode,
                                        partitioner=partitioner)
    num_batches = plan.eval_batches

    def eval_fn(state, step):
      del step
      batches = itertools.islice(make_data(eval_data,
                                           model_config.vocab_size),
                                 num_batches)
      return step_lib.evaluate(eval_step, state.params, batches)

  return loop.train(train_cfg, workdir, model_config, params_init, data,
                    eval_fn=eval_fn, partitioner=partitioner)
