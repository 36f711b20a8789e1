"""Shared pieces of the training tests (test_training.py,
test_checkpoints.py and the SIGKILL script): a tiny model, its params, a
deterministic learnable batch stream with checkpointable position, and a
quick TrainConfig."""

import json

import jax
import jax.numpy as jnp
import numpy as np

import orthros_jax as oj
from orthros_jax import training as tr

B, T, V = 4, 32, 64


def tiny_config(kind='dense'):
  return oj.ModelConfig(
      vocab_size=V, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
      head_dim=8, mlp_dim=64,
      attention=oj.AttentionConfig(kind=kind, feature_dim=8, window=8,
                                   chunk_size=8, exact_tail=1))


def init_params(config, seed=0):
  params = oj.Transformer(config).init(
      jax.random.PRNGKey(seed), jnp.zeros((1, T), jnp.int32),
      phase='forward')['params']
  return jax.tree.map(jnp.asarray, jax.device_get(
      __import__('flax').linen.meta.unbox(params)))


class PatternBatches:
  """Deterministic batch stream: x_{t+1} = perm[x_t] from a random start (a
  learnable bigram). Batch i depends only on (seed, i); get_state/set_state
  hold the index. prompt=True gives random prompt lengths and loss weights
  on the answer only."""

  def __init__(self, seed=0, batch=B, prompt=False, state_bytes=False):
    self.seed, self.batch, self.prompt = seed, batch, prompt
    self.state_bytes = state_bytes
    self.index = 0
    self.perm = np.random.default_rng(1234).permutation(V)

  def __iter__(self):
    return self

  def __next__(self):
    rng = np.random.default_rng((self.seed, self.index))
    self.index += 1
    seq = np.zeros((self.batch, T + 1), np.int32)
    seq[:, 0] = rng.integers(0, V, self.batch)
    for t in range(T):
      seq[:, t + 1] = self.perm[seq[:, t]]
    if self.prompt:
      prompt = rng.integers(4, T // 2, self.batch).astype(np.int32)
      weights = (np.arange(T)[None] >= prompt[:, None] - 1).astype(np.float32)
    else:
      prompt = np.zeros(self.batch, np.int32)
      weights = np.ones((self.batch, T), np.float32)
    return {'inputs': seq[:, :-1], 'targets': seq[:, 1:], 'weights': weights,
            'prompt_lengths': prompt}

  def get_state(self):
    if self.state_bytes:
      return json.dumps({'index': self.index}).encode()
    return {'index': self.index}

  def set_state(self, state):
    if isinstance(state, bytes):
      state = json.loads(state)
    self.index = state['index']


def quick_config(**kw):
  base = dict(num_steps=30, learning_rate=1e-2, warmup_steps=2,
              weight_decay=0.0, log_every=5, checkpoint_every=100,
              progress=False, async_checkpoint=False)
  base.update(kw)
  return tr.TrainConfig(**base)
