"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama).

The first and second halves of the head dim form the rotated pairs, so
weights from Hugging Face checkpoints (already permuted from Meta's
interleaved layout) load without any permutation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax.config import ModelConfig

Array = jax.Array


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
  """[D/2] float64 inverse frequencies, with the config's scaling applied."""
  d = config.head_dim
  inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  scaling = config.rope_scaling
  if scaling is None:
    return inv
  if scaling.kind == 'linear':
    return inv / scaling.factor
  # Llama 3.1: keep high frequencies, divide low ones by `factor`, and blend
  # smoothly in between.
  low_wavelen = scaling.original_max_len / scaling.low_freq_factor
  high_wavelen = scaling.original_max_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
  smooth = ((scaling.original_max_len / wavelen - scaling.low_freq_factor) /
            (scaling.high_freq_factor - scaling.low_freq_factor))
  blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, blended, scaled)


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
  """x: [B, T, N, D]; positions: [B, T] int -> rotated x in x.dtype."""
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(
      inv_freq, jnp.float32)  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
