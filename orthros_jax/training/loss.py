"""Masked next-token cross-entropy.

B batch, T length, V vocab. Log-softmax in float32 whatever the logits' dtype;
the loss is sum(w * nll) / max(sum(w), 1), so an all-zero-weight batch gives 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy(logits: Array, targets: Array,
                  weights: Array) -> tuple[Array, dict[str, Array]]:
  """logits [B, T, V], targets [B, T] int, weights [B, T] -> (loss, metrics).

  metrics: 'loss', 'tokens' (sum of weights), 'accuracy' (weighted share of
  positions whose argmax is the target).
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
  nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32),
                             axis=-1)[..., 0]  # [B, T]
  w = weights.astype(jnp.float32)
  tokens = jnp.sum(w)
  denom = jnp.maximum(tokens, 1.0)
  loss = jnp.sum(w * nll) / denom
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  accuracy = jnp.sum(w * correct) / denom
  return loss, {'loss': loss, 'tokens': tokens, 'accuracy': accuracy}


def next_token_loss(logits: Array, batch) -> tuple[Array, dict[str, Array]]:
  """The default `loss_fn(logits, batch)` of the train step."""
  return cross_entropy(logits, batch['targets'], batch['weights'])
