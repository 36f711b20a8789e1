"""Checkpoints: train state + data-iterator state + model config, together.

A thin wrapper over `orbax.checkpoint.CheckpointManager`. Each step directory
holds three items, written atomically by orbax (a `<step>.orbax-checkpoint-tmp-*`
directory renamed on commit, so a run killed mid-save leaves nothing that a
restore would pick up):
  state   the TrainState pytree (StandardSave): step, params, opt_state;
  data    the iterator's get_state() as JSON: a dict as is, bytes base64-encoded
          (grain's DataLoader iterator returns bytes, its dataset iterators dicts);
  config  the ModelConfig as JSON, compared on restore (differences warn).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

from orthros_jax.config import ModelConfig
from orthros_jax.model import Transformer
from orthros_jax.treepath import path_str
from orthros_jax.training.state import TrainState


def encode_iterator_state(iterator) -> dict:
  """{'kind': 'none' | 'json' | 'bytes', 'value': ...} for a JSON item."""
  if iterator is None or not hasattr(iterator, 'get_state'):
    return {'kind': 'none', 'value': None}
  state = iterator.get_state()
  if isinstance(state, (bytes, bytearray)):
    return {'kind': 'bytes', 'value': base64.b64encode(state).decode('ascii')}
  return {'kind': 'json', 'value': state}


def decode_iterator_state(item: dict):
  if item['kind'] == 'bytes':
    return base64.b64decode(item['value'])
  return item['value']


def config_to_json(config: ModelConfig | None) -> dict:
  return {} if config is None else dataclasses.asdict(config)


def _flat_shapes(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_str(p): tuple(getattr(x, 'shape', ())) for p, x in leaves}


def check_params(config, params, where: str) -> None:
  """Raises ValueError naming the missing, unexpected and wrongly shaped
  entries when `params` do not fit the model of `config` (a ModelConfig);
  `where` names the params in the message."""
  want = _flat_shapes(jax.eval_shape(
      lambda: nn.unbox(Transformer(config).init(
          jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32),
          phase='forward')['params'])))
  have = _flat_shapes(params)
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
  if missing or extra or wrong:
    raise ValueError(
        f'{where} does not match the model config: missing {missing[:5]}, '
        f'unexpected {extra[:5]}, wrong shapes '
        f'{[(k, have[k], want[k]) for k in wrong[:5]]}')


def _diff_dicts(a: dict, b: dict, prefix: str = '') -> list[str]:
  out = []
  for k in sorted(set(a) | set(b)):
    va, vb = a.get(k), b.get(k)
    if isinstance(va, dict) and isinstance(vb, dict):
      out += _diff_dicts(va, vb, f'{prefix}{k}.')
    elif va != vb:
      out.append(f'{prefix}{k}: checkpoint {va!r}, now {vb!r}')
  return out


class CheckpointManager:
  """Saves and restores (TrainState, iterator state) under `directory`.

  max_to_keep: newest N checkpoints kept (None keeps all).
  save_interval_steps: `save` writes only at multiples of it (or force=True).
  create: make the directory; with create=False a missing one raises.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None
               = 3, save_interval_steps: int = 1,
               model_config: ModelConfig | None = None,
               async_save: bool = True, create: bool = True):
    self.directory = os.path.abspath(os.fspath(directory))
    if not create and not os.path.isdir(self.directory):
      raise FileNotFoundError(
          f'checkpoint directory {self.directory} does not exist; check the '
          'path (or --workdir) or create it by starting a fresh run')
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f'max_to_keep={max_to_keep!r} is invalid: expected '
                       'None or an integer >= 1.')
    if save_interval_steps < 1:
      raise ValueError(f'save_interval_steps={save_interval_steps!r} is '
                       'invalid: expected an integer >= 1.')
    self.model_config = model_config
    # The interval is applied here: orbax's own also saves the first step.
    self.save_interval_steps = save_interval_steps
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=create, cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save)
    # Handlers up front, so a fresh manager can read metadata before restore.
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_handlers={
            'state': ocp.StandardCheckpointHandler(),
            'data': ocp.JsonCheckpointHandler(),
            'config': ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState, data_iterator=None, *,
           force: bool = False) -> bool:
    """Writes a checkpoint if `step` is due (or force); True if it did."""
    step = int(step)
    if step in self._manager.all_steps():
      return False
    if not force and step % self.save_interval_steps:
      return False
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(encode_iterator_state(data_iterator)),
        config=ocp.args.JsonSave(config_to_json(self.model_config)))
    return self._manager.save(step, args=args, force=True)

  def restore(self, abstract_state: TrainState, step: int | None = None,
              data_iterator=None) -> TrainState:
    """The state at `step` (latest if None); sets `data_iterator`'s state.

    Raises FileNotFoundError when there is no such checkpoint and ValueError
    naming the key when the saved params do not match `abstract_state`.
    """
    steps = self.all_steps()
    if step is None:
      step = steps[-1] if steps else None
    if step is None or step not in steps:
      raise FileNotFoundError(
          f'no checkpoint for step {step} in {self.directory} (available: '
          f'{steps}); pass a workdir that holds a checkpoint')
    self._check_compatible(step, abstract_state)
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore())
    try:
      restored = self._manager.restore(step, args=args)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
          f'checkpoint {self.directory}/{step} does not match the train state '
          f'(did the optimizer settings or trainable params change?): {e}'
      ) from e
    self._compare_config(step, restored['config'])
    data = restored['data']
    if data_iterator is not None and data['kind'] != 'none':
      data_iterator.set_state(decode_iterator_state(data))
    elif data_iterator is not None and hasattr(data_iterator, 'set_state'):
      logging.warning('checkpoint %s/%d has no iterator state; the data '
                      'iterator starts from its beginning', self.directory,
                      step)
    return restored['state']

  def _check_compatible(self, step: int, abstract_state: TrainState) -> None:
    metadata = self._manager.item_metadata(step)
    saved = metadata['state']
    saved = getattr(saved, 'tree', saved)
    saved_params = _flat_shapes(saved['params'])
    want_params = _flat_shapes(abstract_state.params)
    for key in sorted(set(saved_params) | set(want_params)):
      if key not in saved_params:
        raise ValueError(f'checkpoint {self.directory}/{step} has no param '
                         f'{key!r} that the model needs; it was written for a '
                         'different model config')
      if key not in want_params:
        raise ValueError(f'checkpoint {self.directory}/{step} has param '
                         f'{key!r} that the model does not have; it was '
                         'written for a different model config')
      if saved_params[key] != want_params[key]:
        raise ValueError(f'param {key!r} has shape {saved_params[key]} in '
                         f'checkpoint {self.directory}/{step} but '
                         f'{want_params[key]} in the model')

  def _compare_config(self, step: int, saved_config) -> None:
    if self.model_config is None or not saved_config:
      return
    diff = _diff_dicts(saved_config, config_to_json(self.model_config))
    if diff:
      logging.warning('model config differs from checkpoint %s/%d: %s',
                      self.directory, step, '; '.join(diff))

  def wait(self) -> None:
    """Blocks until pending (async) saves are committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def restore_or_init(manager: CheckpointManager,
                    init_fn: Callable[[], TrainState],
                    data_iterator=None, shardings=None
                    ) -> tuple[TrainState, int | None]:
  """(state, restored step) from the latest checkpoint, else (init_fn(), None).

  `init_fn` is traced with jax.eval_shape for the restore target and only
  run when there is nothing to restore. `shardings` (a tree of
  NamedShardings like the state) restores each array straight into its
  shards (orbax reads only what each process owns).
  """
  step = manager.latest_step()
  if step is None:
    return init_fn(), None
  abstract = jax.eval_shape(init_fn)
  if shardings is not None:
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, shardings)
  return manager.restore(abstract, step, data_iterator), step


def _checkpoints_dir(path: str | os.PathLike) -> str:
  """`path` itself when it holds step directories, else path/checkpoints."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f'checkpoint path {path} does not exist')
  sub = os.path.join(path, 'checkpoints')
  return sub if os.path.isdir(sub) else path


def load_params(path: str | os.PathLike, step: int | None = None
                ) -> tuple[Any, dict, int]:
  """(params, model config dict, step) from a checkpoint of train.py or
  convert.py, without knowing the optimizer that wrote it.

  path: a run's workdir (holding checkpoints/) or its checkpoints directory;
  step: the latest when None. The model config is the JSON saved beside the
  state (build a ModelConfig with config.model_config_from).
  Raises FileNotFoundError when there is no such checkpoint and ValueError
  when the checkpoint holds no params or no model config.
  """
  directory = _checkpoints_dir(path)
  manager = ocp.CheckpointManager(directory, item_handlers={
      'state': ocp.StandardCheckpointHandler(),
      'config': ocp.JsonCheckpointHandler()})
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise FileNotFoundError(
          f'no checkpoint in {directory}: expected step directories written '
          'by train.py or convert.py')
    step = steps[-1] if step is None else int(step)
    if step not in steps:
      raise FileNotFoundError(f'no checkpoint for step {step} in {directory} '
                              f'(available: {steps})')
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), config=ocp.args.JsonRestore()))
  finally:
    manager.close()
  state, config = restored['state'], restored['config']
  if not isinstance(state, dict) or 'params' not in state:
    raise ValueError(f'checkpoint {directory}/{step} holds no params')
  if not config:
    raise ValueError(f'checkpoint {directory}/{step} has no model config; it '
                     'was not written by train.py or convert.py')
  return state['params'], config, step


def save_params(path: str | os.PathLike, params, model_config: ModelConfig,
                step: int = 0) -> str:
  """Writes `params` (no optimizer state) as a checkpoint `load_params`,
  eval.py and convert.py read: path/checkpoints/<step>. Returns the
  checkpoints directory."""
  directory = os.path.join(os.path.abspath(os.fspath(path)), 'checkpoints')
  manager = CheckpointManager(directory, max_to_keep=None,
                              model_config=model_config, async_save=False)
  try:
    state = TrainState.create(params, optax.identity()).replace(
        step=jnp.asarray(step, jnp.int32))
    manager.save(step, state, force=True)
    manager.wait()
  finally:
    manager.close()
  return directory
