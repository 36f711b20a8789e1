"""The two conversion stages as training objectives for the shared loop
(`orthros_jax.training.loop.train` with `make_objective_step`).

Stage 1, attention transfer: params are the Orthros params (teacher weights
plus feature maps and window weights); the teacher's attention inputs and
outputs are recomputed from the same (frozen) weights with dense attention,
and only `TRANSFER_PARAMS` train (TrainConfig.trainable).

Stage 2, phase-aware finetune: params are {'base': Orthros params, 'lora':
adapters}; the forward pass uses `merge_lora(base, lora)` with the
per-example split of `split_mode`, so inference's prefill/decode hand-off is
what trains. With TrainConfig.trainable=('lora',) the base stays frozen;
with ('base',) (or None when there is no teacher copy) everything but a
frozen teacher copy trains (a full finetune). Optional terms pull the
student towards the dense teacher: a KL on the exact positions'
distribution, and the MSE of every layer's attention input over the whole
sequence (what the KV cache is projected from), summed over layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orthros_jax.config import ModelConfig
from orthros_jax.conversion.lora import merge_lora
from orthros_jax.conversion.transfer import capture_layers
from orthros_jax.conversion.transfer import teacher_attention_io
from orthros_jax.conversion.transfer import transfer_loss
from orthros_jax.model import transformer
from orthros_jax.training import loss as loss_lib
from orthros_jax.training.step import make_split


def real_tokens(weights: jax.Array) -> jax.Array:
  """[B, T] float32, 1 on every real token: everything up to the last
  weighted target of each row; right padding (after it) is 0."""
  return (jnp.cumsum(weights[:, ::-1], axis=1)[:, ::-1] > 0).astype(
      jnp.float32)


def transfer_objective(config: ModelConfig, placement=None):
  """Stage 1: (params, batch, rng) -> (sum of per-layer MSEs, metrics).
  placement: the mesh of a sharded run (`Partitioner.placement`)."""
  teacher = config.replace(attention={'kind': 'dense'})

  def objective(params, batch, rng):
    del rng
    tokens = batch['inputs']
    inputs, outputs = teacher_attention_io(
        teacher, jax.lax.stop_gradient(params), tokens, placement)
    valid = real_tokens(batch['weights'])
    loss, per_layer = transfer_loss(params, config, inputs, outputs, valid,
                                    placement)
    metrics = {f'mse/layer_{i}': per_layer[i]
               for i in range(config.num_layers)}
    return loss, dict(metrics, tokens=jnp.sum(valid))

  return objective


def _attention_inputs(config: ModelConfig, params, tokens, split=None,
                      placement=None):
  """(logits, [L, B, T, E] float32): each layer's attention input (the
  normed residual stream its q/k/v projections read) and the logits."""
  logits, io = capture_layers(config, params, tokens, ('input_norm',), split,
                              placement)
  return logits, io['input_norm']


def finetune_objective(config: ModelConfig, *, split_mode: str = 'prompt',
                       lora_alpha: float = 16.0, kl_weight: float = 0.0,
                       hidden_weight: float = 0.0, placement=None):
  """Stage 2: (params {'base', 'lora'[, 'teacher']}, batch, rng) ->
  (loss, metrics).

  Next-token loss on the weighted (answer) positions with the split of
  `split_mode`; plus kl_weight * KL(teacher || student) on the same
  positions; plus hidden_weight * the sum over layers of the mean squared
  error between the layer's attention input in the student (through the split: the prefill
  part is what fills the KV cache) and in the teacher, over every real
  token. The last term is what decode depends on: the cache holds K and V
  projected from exactly these inputs, and the answer-only loss reaches
  them through a handful of tokens per example.

  The teacher is the dense model with params['teacher'] when present (a
  frozen copy, for a full finetune, where 'base' moves), else with 'base'
  (frozen under LoRA); no gradient flows into it either way.
  """
  teacher = config.replace(attention={'kind': 'dense'})

  def objective(params, batch, rng):
    merged = merge_lora(params['base'], params['lora'], alpha=lora_alpha)
    split = make_split(config, split_mode, batch, rng)
    tokens = batch['inputs']
    teacher_params = jax.lax.stop_gradient(
        params.get('teacher', params['base']))
    if hidden_weight > 0:
      logits, hidden = _attention_inputs(config, merged, tokens, split,
                                         placement)
    else:
      logits, _ = transformer(config, placement).apply(
          {'params': merged}, tokens, phase='forward', split=split)
    loss, metrics = loss_lib.cross_entropy(logits, batch['targets'],
                                           batch['weights'])
    if kl_weight > 0 or hidden_weight > 0:
      t_logits, t_hidden = _attention_inputs(teacher, teacher_params, tokens,
                                             placement=placement)
    if kl_weight > 0:
      t_logp = jax.nn.log_softmax(t_logits)
      kl = jnp.sum(jnp.exp(t_logp) * (t_logp - jax.nn.log_softmax(logits)),
                   axis=-1)
      w = batch['weights']
      kl = jnp.sum(kl * w) / jnp.maximum(jnp.sum(w), 1.0)
      loss = loss + kl_weight * kl
      metrics = dict(metrics, kl=kl)
    if hidden_weight > 0:
      valid = real_tokens(batch['weights'])
      err = jnp.mean(jnp.square(hidden - t_hidden), axis=-1)  # [L, B, T]
      per_layer = (jnp.sum(err * valid, axis=(1, 2))
                   / jnp.maximum(jnp.sum(valid), 1.0))
      hidden_mse = jnp.sum(per_layer)
      loss = loss + hidden_weight * hidden_mse
      metrics = dict(metrics, hidden_mse=hidden_mse)
    return loss, metrics

  return objective
