"""Test set-up: 8 fake CPU devices for the multi-device tests (must be set
before jax is imported anywhere), one XLA compilation cache shared by the
session's workers and subprocesses, and compiled programs freed after each
test module."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# Compilation is about two thirds of the suite's time on 2 cores, and the
# same programs recur: in another module (jax's in-memory caches are dropped
# after each module, below), in the other pytest-xdist worker, in the entry
# points the tests run as subprocesses. One on-disk cache for the whole run
# (made by the first process, here the xdist controller, and inherited by
# workers and subprocesses through the environment) compiles each once. It
# starts empty on every run, so the suite's time is a cold start's; set
# ORTHROS_TEST_JAX_CACHE to a directory of your own to keep it between runs.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _cache = os.environ.get('ORTHROS_TEST_JAX_CACHE')
  if not _cache:
    _cache = tempfile.mkdtemp(prefix='orthros-test-xla-')
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.05')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
  # A size limit turns on jax's file lock, so that two workers writing the
  # same entry never let a third read half of it.
  os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(8 << 30))

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

# The tiny teacher and conversion (session fixtures, shared by modules).
from tests.conversion_fixtures import converted  # noqa: E402,F401
from tests.conversion_fixtures import teacher_dir  # noqa: E402,F401


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
