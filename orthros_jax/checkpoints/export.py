"""A model as a self-describing directory: safetensors weights and a JSON
config that names every setting, the Orthros attention included.

    save_model(out_dir, config, params, tokenizer_dir=...)   # export
    config, params = load_model(out_dir)                     # anywhere

Files (never pickle):
  model.safetensors    every parameter, keyed by its Flax path joined by
                       '.' (layers_0.attn.phi_q.proj, embed.embedding, ...)
  orthros_model.json   {'format': 'orthros-jax-model', 'version': 1,
                        'model_config': the ModelConfig (attention: kind,
                        window, sinks, feature map, exact tail, ...),
                        'dtypes': {key: stored dtype}, 'provenance': {}}
  tokenizer.json, tokenizer_config.json, special_tokens_map.json,
  chat_template.jinja  copied from tokenizer_dir when given

`load_model` rebuilds the same model: the parameter tree is checked against
the config's own (`jax.eval_shape` of its init), and a missing, unexpected
or mis-shaped tensor is an error naming the file. The reading and atomic
writing of such directories (`checkpoints/tensor_dir.py`) is shared with
the Orthros adapter (orthros_jax/conversion/adapter.py).

Command line (the converted SmolLM2 as one directory):
  python -m orthros_jax.checkpoints.export results/smollm2_orthros_model \
      --teacher=results/smollm2/hf --adapter=assets/smollm2_orthros
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from orthros_jax.checkpoints.tensor_dir import read_tensor_dir
from orthros_jax.checkpoints.tensor_dir import write_tensor_dir
from orthros_jax.config import ModelConfig
from orthros_jax.config import model_config_from
from orthros_jax.conversion import adapter as adapter_lib
from orthros_jax.evaluation.loading import load_dense
from orthros_jax.model import Transformer
from orthros_jax.treepath import path_str

WEIGHTS = 'model.safetensors'
CONFIG = 'orthros_model.json'
FORMAT = 'orthros-jax-model'
VERSION = 1
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json',
                   'special_tokens_map.json', 'chat_template.jinja')
# numpy (and so safetensors.numpy) stores these as they are; anything else
# (bfloat16) is stored as float32 and cast back on load.
_NATIVE = ('float32', 'float16', 'float64', 'int32', 'int64')


def _flatten(params) -> dict[str, Any]:
  return {path_str(path, '.'): leaf for path, leaf
          in jax.tree_util.tree_flatten_with_path(params)[0]}


def _abstract_params(config: ModelConfig) -> dict:
  """The config's parameter tree as ShapeDtypeStructs (nothing allocated)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda: Transformer(config).init(
      jax.random.PRNGKey(0), tokens, phase='forward'))
  return flax.core.meta.unbox(shapes['params'])


def save_model(out_dir: str | os.PathLike, config: ModelConfig, params, *,
               tokenizer_dir: str | os.PathLike | None = None,
               provenance: dict | None = None) -> str:
  """Writes the model as a self-describing directory; returns out_dir.
  params must be the config's own tree (merged: no LoRA factors)."""
  want = _flatten(_abstract_params(config))
  got = _flatten(params)
  _check_tree(got, want, 'params')
  tensors, dtypes = {}, {}
  for key, leaf in got.items():
    arr = np.asarray(leaf)
    dtypes[key] = arr.dtype.name
    tensors[key] = arr if arr.dtype.name in _NATIVE else arr.astype(
        np.float32)
  copy = ()
  if tokenizer_dir is not None:
    copy = tuple(os.path.join(tokenizer_dir, n) for n in TOKENIZER_FILES
                 if os.path.isfile(os.path.join(tokenizer_dir, n)))
    if not copy:
      raise FileNotFoundError(f'{tokenizer_dir} holds none of '
                              f'{TOKENIZER_FILES}')
  meta = {'format': FORMAT, 'version': VERSION,
          'model_config': dataclasses.asdict(config), 'dtypes': dtypes,
          'provenance': provenance or {}}
  return write_tensor_dir(out_dir, tensors, WEIGHTS, CONFIG, meta,
                          copy_files=copy)


def is_model_dir(path: str | os.PathLike) -> bool:
  return os.path.isfile(os.path.join(os.fspath(path), CONFIG))


def load_model(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
  """(config, params) of a directory written by `save_model`: the same
  model (parameters bit-identical, in their saved dtypes)."""
  meta, tensors = read_tensor_dir(path, WEIGHTS, CONFIG,
                                  ('format', 'version', 'model_config'))
  where = os.path.join(os.fspath(path), CONFIG)
  if meta['format'] != FORMAT or meta['version'] != VERSION:
    raise ValueError(f"{where} is {meta['format']!r} version "
                     f"{meta['version']}, not {FORMAT!r} version {VERSION}")
  try:
    config = model_config_from(meta['model_config'])
  except (TypeError, ValueError) as e:
    raise ValueError(f'{where}: model_config is invalid ({e})') from e
  abstract = _abstract_params(config)
  _check_tree(tensors, _flatten(abstract),
              os.path.join(os.fspath(path), WEIGHTS))
  dtypes = meta.get('dtypes', {})

  def leaf(path_, spec):
    key = path_str(path_, '.')
    return jnp.asarray(tensors[key], dtypes.get(key, spec.dtype))

  return config, jax.tree_util.tree_map_with_path(leaf, abstract)


def _check_tree(got: Mapping[str, Any], want: Mapping[str, Any],
                where: str) -> None:
  missing = sorted(set(want) - set(got))
  extra = sorted(set(got) - set(want))
  shapes = sorted(k for k in set(got) & set(want)
                  if tuple(np.shape(got[k])) != tuple(want[k].shape))
  if missing or extra or shapes:
    detail = []
    if missing:
      detail.append(f'missing {missing[:4]}' + (' ...' if len(missing) > 4
                                                else ''))
    if extra:
      detail.append(f'unexpected {extra[:4]}' + (' ...' if len(extra) > 4
                                                 else ''))
    for k in shapes[:4]:
      detail.append(f'{k}: {tuple(np.shape(got[k]))} where the config has '
                    f'{tuple(want[k].shape)}')
    raise ValueError(f'{where} does not match the model config: '
                     + '; '.join(detail))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      description='Write a converted model as one self-describing directory '
      '(model.safetensors + orthros_model.json + tokenizer files).')
  parser.add_argument('out')
  parser.add_argument('--teacher', required=True,
                      help='the dense base: a Hugging Face directory (its '
                      'tokenizer files are copied) or a train.py checkpoint')
  parser.add_argument('--adapter', default=None,
                      help='an Orthros adapter to apply (LoRA merged); '
                      'without it the teacher is exported as it is')
  parser.add_argument('--exact_tail', type=int, default=-1,
                      help='store this exact_tail in the config (-1: as '
                      'converted)')
  args = parser.parse_args(argv)
  config, params, where = load_dense(args.teacher)
  provenance = {'teacher': where}
  if args.adapter:
    config, params = adapter_lib.apply_adapter(args.adapter, config, params)
    provenance['adapter'] = os.path.abspath(args.adapter)
  if args.exact_tail >= 0:
    config = config.replace(attention={'exact_tail': args.exact_tail})
  tok_dir = args.teacher if any(os.path.isfile(os.path.join(args.teacher, n))
                                for n in TOKENIZER_FILES) else None
  out = save_model(args.out, config, params, tokenizer_dir=tok_dir,
                   provenance=provenance)
  print(out)


if __name__ == '__main__':
  main()
