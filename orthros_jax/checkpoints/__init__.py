"""Checkpoint import and export: Hugging Face safetensors import (`load_hf`)."""

from orthros_jax.checkpoints.hf import config_from_hf
from orthros_jax.checkpoints.hf import load_hf
from orthros_jax.checkpoints.hf import load_hf_config
from orthros_jax.checkpoints.hf import load_hf_params

__all__ = ['config_from_hf', 'load_hf', 'load_hf_config', 'load_hf_params']
