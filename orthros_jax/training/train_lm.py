"""`train_and_evaluate(config, workdir)`: train a dense or Orthros model from
scratch on a grain pipeline; what train.py runs.

The config (an ml_collections.ConfigDict, see configs/) has four parts:
  model:     ModelConfig fields; model.attention holds AttentionConfig fields.
  data:      make_dataset arguments for training (source, seq_len,
             batch_size, seed, tasks, paths, tokenizer, ...).
  eval_data: the same for a held-out set (a different seed, a fixed
             num_examples), or None; eval_batches: how many batches to score.
  train:     TrainConfig fields (steps, learning rate, split mode, ...).
  mesh:      optional device mesh (orthros_jax/sharding.py): shape (axis ->
             size for data, fsdp, tensor, sequence; one may be -1) and
             rules (logical axis -> mesh axes; empty = DEFAULT_RULES).
             Params and optimizer state are initialized (or restored)
             directly sharded, and every step runs on the mesh.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from orthros_jax import sharding
from orthros_jax.config import model_config_from
from orthros_jax.config import plain as _plain
from orthros_jax.data import get_tokenizer
from orthros_jax.data import make_dataset
from orthros_jax.model import Transformer
from orthros_jax.training import checkpoint as ckpt_lib
from orthros_jax.training import loop
from orthros_jax.training import step as step_lib


def make_data(data_cfg: Mapping[str, Any], vocab_size: int):
  """A checkpointable grain iterator; checks the tokenizer fits the model."""
  data_cfg = dict(_plain(data_cfg))
  tokenizer = get_tokenizer(data_cfg.pop('tokenizer', 'byte'))
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f'the tokenizer has {tokenizer.vocab_size} ids but '
                     f'model.vocab_size={vocab_size}; set model.vocab_size >= '
                     f'{tokenizer.vocab_size}')
  return iter(make_dataset(tokenizer=tokenizer, **data_cfg))


def train_and_evaluate(config, workdir: str | os.PathLike):
  """Trains `config.model` on `config.data` in `workdir` (resuming if it
  holds a checkpoint); returns (final TrainState, history)."""
  workdir = os.fspath(workdir)
  model_config = model_config_from(config.model)
  train_cfg = loop.TrainConfig.from_mapping(_plain(config.train))
  partitioner = sharding.Partitioner.from_config(config.get('mesh'))
  data = make_data(config.data, model_config.vocab_size)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(_plain(config), f, indent=1, default=str)

  seq_len = int(config.data.seq_len)

  def params_init():
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    init = jax.jit(lambda rng: Transformer(model_config).init(
        rng, tokens, phase='forward')['params'])
    return init(jax.random.PRNGKey(train_cfg.seed))

  init_from = config.get('init_from') or ''
  if init_from:
    # Warm start: the params of another run (a train.py / convert.py workdir
    # or a committed params checkpoint); optimizer and schedule start fresh.
    # Checked against this config before training starts.
    loaded, _, from_step = ckpt_lib.load_params(init_from)
    ckpt_lib.check_params(model_config, loaded,
                          f'init_from={init_from} (step {from_step})')
    logging.info('warm start from %s (step %d)', init_from, from_step)
    params_init = lambda: jax.tree.map(
        lambda x: jnp.array(x, model_config.param_dtype, copy=True), loaded)

  eval_fn = None
  eval_data = config.get('eval_data')
  if eval_data:
    eval_step = step_lib.make_eval_step(model_config,
                                        split_mode=train_cfg.split_mode,
                                        partitioner=partitioner)
    num_batches = int(config.get('eval_batches', 8))

    def eval_fn(state, step):
      del step
      batches = itertools.islice(make_data(eval_data,
                                           model_config.vocab_size),
                                 num_batches)
      return step_lib.evaluate(eval_step, state.params, batches)

  return loop.train(train_cfg, workdir, model_config, params_init, data,
                    eval_fn=eval_fn, partitioner=partitioner)
