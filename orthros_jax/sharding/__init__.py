"""Device meshes and logical-axis rules: how the model is laid out on chips.

One `Partitioner` holds a mesh with the axes

  data      pure data parallelism (params replicated);
  fsdp      data parallelism with params, gradients and optimizer state
            sharded (ZeRO-3 / FSDP: XLA all-gathers a layer's weights when
            it needs them);
  tensor    Megatron-style tensor parallelism over heads and the MLP width;
  sequence  context parallelism: a long prompt's tokens and the KV cache
            split by position (see orthros_jax/attention/context_parallel.py);

and the rules mapping the model's logical axis names (model.py: batch,
length, embed, heads, kv_heads, head_dim, mlp, vocab, features; cache_length
for the KV cache) to mesh axes. Everything goes through JAX's own SPMD
runtime: `jax.jit` with NamedShardings, `with_sharding_constraint` inside
the model (flax's logical constraints) and `shard_map` for the kernels and
the context-parallel attention.

  partitioner = Partitioner.create({'data': 2, 'fsdp': 4})
  params = partitioner.init_params(model_config, rng, seq_len=512)
  model = partitioner.model(model_config)  # attention backend of this mesh
  with partitioner.activate():
    ...  # jitted model calls see the mesh and the rules

A dimension whose size the mesh axes do not divide is left unsharded (with a
one-time log line), so the byte-level tiny model (vocab 259) still runs on
any mesh.
"""

from orthros_jax.sharding.distributed import initialize_distributed
from orthros_jax.sharding.memory import bytes_per_device
from orthros_jax.sharding.mesh import MESH_AXES
from orthros_jax.sharding.mesh import make_mesh
from orthros_jax.sharding.partitioner import Partitioner
from orthros_jax.sharding.rules import DEFAULT_RULES

__all__ = ['DEFAULT_RULES', 'MESH_AXES', 'Partitioner', 'bytes_per_device',
           'initialize_distributed', 'make_mesh']
