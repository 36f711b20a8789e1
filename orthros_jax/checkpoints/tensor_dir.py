"""A directory of safetensors tensors and a JSON description, written
atomically: the format of exported models (checkpoints/export.py) and of
Orthros adapters (conversion/adapter.py). Never pickle."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from orthros_jax.checkpoints.hf import read_json


def write_tensor_dir(out_dir: str | os.PathLike, tensors: Mapping[str, Any],
                     weights_name: str, config_name: str, meta: dict, *,
                     copy_files: tuple[str, ...] = ()) -> str:
  """Writes tensors (safetensors) and meta (JSON) into out_dir atomically
  (a temporary directory renamed into place: a killed write leaves the old
  directory or none); copy_files are copied in beside them."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  if (os.path.isdir(out_dir) and os.listdir(out_dir)
      and not os.path.isfile(os.path.join(out_dir, config_name))):
    raise FileExistsError(
        f'{out_dir} exists and is not a directory this writer made (no '
        f'{config_name}): choose another path; nothing was changed')
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}-', dir=parent)
  os.chmod(tmp, 0o755)
  try:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(tmp, weights_name))
    with open(os.path.join(tmp, config_name), 'w') as f:
      json.dump(meta, f, indent=1)
    for file in copy_files:
      shutil.copy(file, os.path.join(tmp, os.path.basename(file)))
    old = None
    if os.path.isdir(out_dir):  # moved aside whole, then replaced
      old = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}-old-',
                             dir=parent)
      os.replace(out_dir, os.path.join(old, 'previous'))
    os.replace(tmp, out_dir)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def read_tensor_dir(path: str | os.PathLike, weights_name: str,
                    config_name: str, required: tuple[str, ...] = ()
                    ) -> tuple[dict, dict[str, np.ndarray]]:
  """(meta, tensors) of a directory written by `write_tensor_dir`; a
  missing file, a config without the `required` keys or a file that does
  not parse is an error naming the file."""

  path = os.fspath(path)
  config_file = os.path.join(path, config_name)
  weights_file = os.path.join(path, weights_name)
  for f in (config_file, weights_file):
    if not os.path.isfile(f):
      raise FileNotFoundError(f'{f} is missing: the directory must hold '
                              f'{config_name} and {weights_name}')
  meta = read_json(config_file)
  missing = [k for k in required if not isinstance(meta, dict) or k not in meta]
  if missing:
    raise ValueError(f'{config_file} is not a valid config: it lacks '
                     f'{missing}')
  try:
    tensors = load_file(weights_file)
  except Exception as e:  # safetensors raises its own error types
    raise ValueError(f'{weights_file} is not a readable safetensors file '
                     f'({e}); it may be truncated: copy it again') from e
  return meta, tensors
