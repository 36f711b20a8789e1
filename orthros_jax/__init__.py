"""orthros-jax: phase-aware Orthros attention for JAX/Flax.

One attention module, two computations chosen by a static `phase`: a hybrid
sliding-window softmax + linear attention for prefill (O(N) in the prompt),
exact softmax over the KV cache for decode.
"""

from orthros_jax import attention
from orthros_jax.cache import Cache
from orthros_jax.cache import LayerCache
from orthros_jax.cache import init_cache
from orthros_jax.checkpoints.hf import load_hf
from orthros_jax.config import AttentionConfig
from orthros_jax.config import ModelConfig
from orthros_jax.config import RopeScaling
from orthros_jax.generate import GenerateOutput
from orthros_jax.generate import generate
from orthros_jax.model import Transformer

__all__ = [
    'AttentionConfig', 'Cache', 'GenerateOutput', 'LayerCache', 'ModelConfig',
    'RopeScaling', 'Transformer', 'attention', 'generate', 'init_cache',
    'load_hf',
]
