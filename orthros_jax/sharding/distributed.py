"""Multi-host runs: jax.distributed set-up from the environment."""

from __future__ import annotations

import logging
import os
import re

import jax


def initialize_distributed(mode: str = 'auto') -> bool:
  """Calls `jax.distributed.initialize()` for a multi-process run.

  mode 'on' always initializes (TPU slices, SLURM and Open MPI are detected
  by JAX; elsewhere set JAX_COORDINATOR_ADDRESS=host:port plus
  JAX_NUM_PROCESSES and JAX_PROCESS_ID, which this function passes on);
  'off' never; 'auto' initializes on a multi-host TPU slice
  (TPU_WORKER_HOSTNAMES lists more than one host) or when
  JAX_COORDINATOR_ADDRESS is set. Returns whether it initialized. Call it
  before anything touches the devices.
  """
  if mode not in ('auto', 'on', 'off'):
    raise ValueError(f"distributed={mode!r} must be 'auto', 'on' or 'off'")
  if mode == 'off':
    return False
  if mode == 'auto':
    hosts = [h for h in re.split(r'[,\s]+',
                                 os.environ.get('TPU_WORKER_HOSTNAMES', ''))
             if h]
    if len(hosts) <= 1 and not os.environ.get('JAX_COORDINATOR_ADDRESS'):
      return False
  kwargs = {}
  for env, name in (('JAX_NUM_PROCESSES', 'num_processes'),
                    ('JAX_PROCESS_ID', 'process_id')):
    if os.environ.get(env):
      kwargs[name] = int(os.environ[env])
  jax.distributed.initialize(**kwargs)
  logging.info('jax.distributed: process %d of %d, %d local / %d global '
               'devices', jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return True
