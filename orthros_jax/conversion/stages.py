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
with None everything trains (a full finetune); an optional KL term pulls the
exact positions' distribution towards the teacher's (the base weights with
dense attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from orthros_jax.config import ModelConfig
from orthros_jax.conversion.lora import merge_lora
from orthros_jax.conversion.transfer import teacher_attention_io
from orthros_jax.conversion.transfer import transfer_loss
from orthros_jax.model import Transformer
from orthros_jax.training import loss as loss_lib
from orthros_jax.training.step import make_split


def transfer_objective(config: ModelConfig):
  """Stage 1: (params, batch, rng) -> (sum of per-layer MSEs, metrics)."""
  teacher = config.replace(attention={'kind': 'dense'})

  def objective(params, batch, rng):
    del rng
    tokens = batch['inputs']
    inputs, outputs = teacher_attention_io(
        teacher, jax.lax.stop_gradient(params), tokens)
    # Every real token counts; right padding (id 0 after the last weighted
    # target) is excluded through the loss weights' extent.
    valid = (jnp.cumsum(batch['weights'][:, ::-1], axis=1)[:, ::-1] > 0)
    loss, per_layer = transfer_loss(params, config, inputs, outputs,
                                    valid.astype(jnp.float32))
    metrics = {f'mse/layer_{i}': per_layer[i]
               for i in range(config.num_layers)}
    return loss, dict(metrics, tokens=jnp.sum(valid))

  return objective


def finetune_objective(config: ModelConfig, *, split_mode: str = 'prompt',
                       lora_alpha: float = 16.0, kl_weight: float = 0.0):
  """Stage 2: (params {'base', 'lora'}, batch, rng) -> (loss, metrics).

  Next-token loss on the weighted (answer) positions with the split of
  `split_mode`; plus kl_weight * KL(teacher || student) on the same
  positions when kl_weight > 0.
  """
  teacher = config.replace(attention={'kind': 'dense'})

  def objective(params, batch, rng):
    merged = merge_lora(params['base'], params['lora'], alpha=lora_alpha)
    split = make_split(config, split_mode, batch, rng)
    logits, _ = Transformer(config).apply(
        {'params': merged}, batch['inputs'], phase='forward', split=split)
    loss, metrics = loss_lib.cross_entropy(logits, batch['targets'],
                                           batch['weights'])
    if kl_weight > 0:
      t_logits, _ = Transformer(teacher).apply(
          {'params': jax.lax.stop_gradient(params['base'])}, batch['inputs'],
          phase='forward')
      t_logp = jax.nn.log_softmax(t_logits)
      kl = jnp.sum(jnp.exp(t_logp) * (t_logp - jax.nn.log_softmax(logits)),
                   axis=-1)
      w = batch['weights']
      kl = jnp.sum(kl * w) / jnp.maximum(jnp.sum(w), 1.0)
      loss = loss + kl_weight * kl
      metrics = dict(metrics, kl=kl)
    return loss, metrics

  return objective
