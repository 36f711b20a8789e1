"""Stage 1 of the conversion: attention transfer.

The dense teacher runs once over a batch; for every layer we keep the input
of its attention (the normed residual stream) and the attention's output.
Each layer's Orthros attention, with the teacher's q/k/v/o weights frozen,
is then trained so that its prefill output on the teacher's own input matches
the teacher's output: the per-layer mean squared error over valid tokens,
summed over layers (LoLCATs). Layers are independent given the teacher's
hidden states, so all of them train at once in one loss. Only the feature
maps, window weights and length exponents (`TRANSFER_PARAMS`, the
stage's `TrainConfig.trainable`) receive gradients.

Einsum legend: L layers, B batch, T tokens, E embed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orthros_jax.attention.backend import AttentionBackend
from orthros_jax.config import ModelConfig
from orthros_jax.model import Attention
from orthros_jax.model import transformer

Array = jax.Array
TRANSFER_PARAMS = ('phi_q', 'phi_k', 'window_logit', 'length_exponent')


def capture_layers(config: ModelConfig, params: dict, tokens: Array,
                   names: tuple[str, ...], split=None, placement=None
                   ) -> tuple[Array, dict]:
  """(logits, {name: [L, B, T, E] float32}): the output of each layer's
  submodule `name` ('input_norm': the attention input, 'attn': the
  attention output) in one forward pass with the given prefill/decode
  split; placement: the mesh of a sharded run (`Partitioner.placement`)."""
  (logits, _), state = transformer(config, placement).apply(
      {'params': params}, tokens, phase='forward', split=split,
      capture_intermediates=lambda mdl, _: mdl.name in names,
      mutable=['intermediates'])
  inter = state['intermediates']
  out = {}
  for name in names:
    # Attention returns (y, cache): keep y.
    first = lambda x: x[0] if isinstance(x, tuple) else x
    if config.scan_layers:  # already stacked over layers
      x = first(inter['layers'][name]['__call__'][0])
    else:
      x = jnp.stack([first(inter[f'layers_{i}'][name]['__call__'][0])
                     for i in range(config.num_layers)])
    out[name] = x.astype(jnp.float32)
  return logits, out


def teacher_attention_io(teacher: ModelConfig, params: dict,
                         tokens: Array, placement=None
                         ) -> tuple[Array, Array]:
  """Each layer's attention input and output in the dense teacher.

  Returns (inputs [L, B, T, E], outputs [L, B, T, E]) in float32.
  """
  if teacher.is_orthros:
    teacher = teacher.replace(attention={'kind': 'dense'})
  _, io = capture_layers(teacher, params, tokens, ('input_norm', 'attn'),
                         placement=placement)
  return io['input_norm'], io['attn']


def transfer_loss(params: dict, config: ModelConfig, inputs: Array,
                  outputs: Array, weights: Array | None = None,
                  placement=None) -> tuple[Array, Array]:
  """Sum over layers of the MSE between the Orthros prefill output and the
  teacher output. inputs/outputs: [L, B, T, E]; weights: [B, T] (1 = valid
  token; default all); placement: the mesh of a sharded run
  (`Partitioner.placement`: the prefill kernel runs under its shard_map).
  Returns (loss, per-layer MSE [L])."""
  if not config.is_orthros:
    raise ValueError('attention transfer needs an Orthros config '
                     "(attention.kind='orthros')")
  _, b, t, _ = inputs.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  weights = jnp.ones((b, t), jnp.float32) if weights is None else weights
  denom = jnp.maximum(jnp.sum(weights), 1.0) * inputs.shape[-1]
  backend = (None if placement is None
             else AttentionBackend.for_model(config, placement))
  def layer_mse(attn_params, x, target):
    y, _ = Attention(config, backend).apply(
        {'params': attn_params}, x.astype(config.dtype), positions,
        phase='forward')
    err = jnp.square(y.astype(jnp.float32) - target)
    return jnp.sum(err * weights[..., None]) / denom

  if config.scan_layers:  # one layer's program, scanned over the stack
    per_layer = jax.lax.map(lambda a: layer_mse(*a), (
        params['layers']['attn'], inputs, outputs))
  else:
    per_layer = jnp.stack([
        layer_mse(params[f'layers_{i}']['attn'], inputs[i], outputs[i])
        for i in range(config.num_layers)])
  return jnp.sum(per_layer), per_layer
