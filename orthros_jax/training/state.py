"""The train state: step, params and optimizer state in one pytree.

The optimizer (`tx`) is a static field, so the state can be donated to the
jitted step and saved/restored by orbax as a plain pytree of arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct


class TrainState(struct.PyTreeNode):
  step: jax.Array          # int32 scalar: batches consumed (micro-batches
                           # when accumulating gradients)
  params: Any
  opt_state: optax.OptState
  tx: optax.GradientTransformation = struct.field(pytree_node=False)

  @classmethod
  def create(cls, params, tx: optax.GradientTransformation) -> 'TrainState':
    params = nn.meta.unbox(params)  # drop LogicallyPartitioned boxes
    return cls(step=jnp.zeros((), jnp.int32), params=params,
               opt_state=tx.init(params), tx=tx)

  def apply_gradients(self, grads) -> 'TrainState':
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1,
                        params=optax.apply_updates(self.params, updates),
                        opt_state=opt_state)


def init_fn(params_init: Callable[[], Any] | Any,
            tx: optax.GradientTransformation) -> Callable[[], TrainState]:
  """A zero-argument function building the initial state, as
  `checkpoint.restore_or_init` wants it. `params_init` is a params pytree or a
  zero-argument function returning one (called only when no checkpoint
  exists, so a resumed run never pays for initialization)."""
  def init() -> TrainState:
    if callable(params_init):
      params = params_init()
    else:  # the train step donates the state: never hand it the caller's
      params = jax.tree.map(jnp.copy, params_init)  # arrays
    return TrainState.create(params, tx)
  return init
