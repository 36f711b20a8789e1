"""Feature maps phi: R^D -> R^F for the linear part of Orthros attention.

Einsum legend: H query heads, D head dim, P projection width, F feature dim.

Every map first applies a learned per-head projection u = x W_h, W [H, D, P]
(initialised to the identity-like eye(D, P)), then a fixed nonlinearity:
  hedgehog  [softmax(u), softmax(-u)]                        F = 2P  (LoLCATs)
  elu       elu(u) + 1                                        F = P
  relu      relu(u)                                           F = P
  taylor    [1, u / P^(1/4), vec(u u^T) / sqrt(2 P)]          F = 1 + P + P^2
            so phi(a).phi(b) = 1 + a.b/sqrt(P) + (a.b)^2/(2P)  (Based)
Queries and keys get separate maps (separate W). Maps are evaluated in float32.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def output_dim(name: str, proj_dim: int) -> int:
  """F for a map with projection width P."""
  p = proj_dim
  dims = {'hedgehog': 2 * p, 'elu': p, 'relu': p, 'taylor': 1 + p + p * p}
  if name not in dims:
    raise ValueError(f'feature_map={name!r} is unknown: expected one of '
                     f'{tuple(dims)}')
  return dims[name]


def feature_map(name: str, x: Array, w: Array) -> Array:
  """phi(x) per head. x: [..., H, D]; w: [H, D, P] -> [..., H, F] float32."""
  u = jnp.einsum('...hd,hdp->...hp', x.astype(jnp.float32),
                 w.astype(jnp.float32))
  p = w.shape[-1]
  if name == 'hedgehog':
    return jnp.concatenate([jax.nn.softmax(u, axis=-1),
                            jax.nn.softmax(-u, axis=-1)], axis=-1)
  if name == 'elu':
    return jax.nn.elu(u) + 1.0
  if name == 'relu':
    return jax.nn.relu(u)
  if name == 'taylor':
    ones = jnp.ones(u.shape[:-1] + (1,), jnp.float32)
    outer = (u[..., :, None] * u[..., None, :]).reshape(*u.shape[:-1], p * p)
    return jnp.concatenate(
        [ones, u / p ** 0.25, outer / jnp.sqrt(2.0 * p)], axis=-1)
  output_dim(name, p)  # raises for an unknown name
  raise AssertionError(name)


def identity_init(key, shape, dtype=jnp.float32):
  """eye(D, P) for every head: phi starts from the raw (rotated) q or k."""
  del key
  h, d, p = shape
  return jnp.broadcast_to(jnp.eye(d, p, dtype=dtype), (h, d, p))


class FeatureMap(nn.Module):
  """A learned feature map for one of q or k; params: proj [H, D, P]."""
  name_: str
  num_heads: int
  head_dim: int
  proj_dim: int
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:  # [..., H, D] -> [..., H, F]
    w = self.param(
        'proj', nn.with_logical_partitioning(
            identity_init, ('heads', 'head_dim', 'features')),
        (self.num_heads, self.head_dim, self.proj_dim), self.param_dtype)
    return feature_map(self.name_, x, w)
