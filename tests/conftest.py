"""Test set-up: 8 fake CPU devices for the multi-device tests (must be set
before jax is imported anywhere)."""

import os

os.environ.setdefault('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
