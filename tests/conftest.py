"""Test set-up: 8 fake CPU devices for the multi-device tests (must be set
before jax is imported anywhere), and compiled programs freed after each
test module."""

import gc
import os

os.environ.setdefault('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope='module')
def _free_compiled_programs():
  """Every program XLA:CPU compiles maps its code into the process (three
  memory mappings a kernel, kept while jax's caches hold the executable). A
  pytest-xdist worker runs half the suite in one process and, without this,
  grew by 2-5 thousand mappings a minute (14,000 after 5 minutes of
  test_eval/test_convert), toward the kernel's limit of 65530
  (vm.max_map_count); the suite's workers died with a segmentation fault
  inside an XLA compile late in the run (CI, twice:
  test_sharding.py::test_generation_equals_single_device). Dropping jax's
  caches between modules frees the executables and their mappings (the
  same tests then peak at 11,400)."""
  yield
  jax.clear_caches()
  gc.collect()
