"""An Orthros adapter: what a LoRA conversion adds to a dense model, alone.

A conversion with LoRA (stage2.lora_rank > 0) changes a dense teacher in
three ways: new feature maps (phi_q, phi_k), new window weights
(window_logit), and low-rank deltas on q/k/v/o. Those are a few MB where the
model is hundreds; the adapter holds just them, so a converted model can be
shipped as `base weights (from their own source) + adapter`:

    write_adapter(out_dir, config, base_params, lora, alpha=16.0)   # convert
    config, params = apply_adapter(out_dir, base_config, base_params)

A conversion can start from an adapter: `stage1_from_adapter` (a stage-1
adapter stands for stage 1) and `stage2_from_adapter` (a finished LoRA
adapter's factors are where a second stage 2 starts); convert.py's
`stage1.from_adapter` / `stage2.from_adapter`.

Files (safetensors, never pickle): out_dir/adapter.safetensors with keys
  layers_{i}.attn.phi_q.proj, layers_{i}.attn.phi_k.proj   [H, D, P]
  layers_{i}.attn.window_logit                             [H]
  layers_{i}.attn.length_exponent                          [H]  (length_scale)
  layers_{i}.attn.{q,k,v,o}_proj.lora_a / .lora_b          [in, r], [r, out]
and out_dir/adapter_config.json: the converted ModelConfig, lora_alpha,
lora_rank, a fingerprint of the base weights (every layer's shapes and a
sha256 of the q/k/v/o kernels it must be applied to) and free-form
provenance. `apply_adapter` refuses a base whose shapes or digest differ,
naming the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from orthros_jax.checkpoints.tensor_dir import read_tensor_dir
from orthros_jax.checkpoints.tensor_dir import write_tensor_dir
from orthros_jax.checkpoints.hf import read_json
from orthros_jax.config import ModelConfig
from orthros_jax.config import model_config_from
from orthros_jax.conversion import teacher as teacher_lib
from orthros_jax.conversion.lora import DEFAULT_TARGETS
from orthros_jax.conversion.lora import merge_lora
from orthros_jax.conversion.transfer import TRANSFER_PARAMS
from orthros_jax.layer_layout import stack_layers
from orthros_jax.layer_layout import unstack_layers
from orthros_jax.training import checkpoint as ckpt_lib

WEIGHTS = 'adapter.safetensors'
CONFIG = 'adapter_config.json'


def is_adapter(path: str | os.PathLike) -> bool:
  return os.path.isfile(os.path.join(os.fspath(path), CONFIG))


def base_fingerprint(config: ModelConfig, base_params: dict) -> dict:
  """The base model's shape and the sha256 of the q/k/v/o kernels the
  adapter modifies (as float32 bytes); either layer layout."""
  base_params = unstack_layers(base_params)
  digest = hashlib.sha256()
  for i in range(config.num_layers):
    attn = base_params[f'layers_{i}']['attn']
    for name in DEFAULT_TARGETS:
      digest.update(np.ascontiguousarray(
          np.asarray(attn[name]['kernel'], np.float32)).tobytes())
  keys = ('vocab_size', 'num_layers', 'embed_dim', 'num_heads',
          'num_kv_heads', 'head_dim', 'mlp_dim')
  return {'shape': {k: getattr(config, k) for k in keys},
          'attn_sha256': digest.hexdigest()}


def write_adapter(out_dir: str | os.PathLike, config: ModelConfig,
                  base_params: dict, params: dict, lora: dict, *,
                  alpha: float, provenance: dict | None = None) -> str:
  """Writes the adapter of a LoRA conversion atomically; returns out_dir.

  config: the converted (Orthros) config; base_params: the dense teacher's
  params the adapter applies to; params: the unmerged Orthros params (base
  weights + feature maps + window weights); lora: {layer: {proj: {a, b}}}
  ({} for an adapter of feature maps and windows only: after stage 1).
  """
  if not config.is_orthros:
    raise ValueError('write_adapter needs the converted Orthros config')
  # Stored unrolled whatever layout trained it (scan_layers, remat).
  config = config.replace(scan_layers=False, remat='none')
  params, lora = unstack_layers(params), unstack_layers(lora)
  tensors = {}
  for i in range(config.num_layers):
    layer = f'layers_{i}'
    attn = params[layer]['attn']
    for name in ('phi_q', 'phi_k'):
      tensors[f'{layer}.attn.{name}.proj'] = np.asarray(attn[name]['proj'],
                                                        np.float32)
    for name in ('window_logit', 'length_exponent'):
      if name in attn:  # length_exponent: attention.length_scale only
        tensors[f'{layer}.attn.{name}'] = np.asarray(attn[name], np.float32)
    for proj, ab in lora.get(layer, {}).items():
      tensors[f'{layer}.attn.{proj}.lora_a'] = np.asarray(ab['a'], np.float32)
      tensors[f'{layer}.attn.{proj}.lora_b'] = np.asarray(ab['b'], np.float32)
  ranks = {int(ab['a'].shape[1]) for layer in lora.values()
           for ab in layer.values()}
  if len(ranks) > 1:
    raise ValueError(f'LoRA factors of several ranks {sorted(ranks)}')
  meta = {'model_config': dataclasses.asdict(config),
          'lora_alpha': float(alpha),
          'lora_rank': ranks.pop() if ranks else 0,
          'base': base_fingerprint(config, base_params),
          'provenance': provenance or {}}
  return write_tensor_dir(out_dir, tensors, WEIGHTS, CONFIG, meta)


def read_adapter(path: str | os.PathLike) -> tuple[dict, dict[str, Any]]:
  """(meta, tensors) of an adapter directory; clear errors naming files
  (the reader of exported models, orthros_jax/checkpoints/export.py)."""
  return read_tensor_dir(path, WEIGHTS, CONFIG,
                         ('model_config', 'lora_alpha', 'base'))


def apply_adapter(path: str | os.PathLike, base_config: ModelConfig,
                  base_params: dict) -> tuple[ModelConfig, dict]:
  """(Orthros config, merged params) of an adapter applied to a dense base."""
  config, params, lora, meta = adapter_parts(path, base_config, base_params)
  return config, merge_lora(params, lora, alpha=float(meta['lora_alpha']))


def adapter_parts(path: str | os.PathLike, base_config: ModelConfig,
                  base_params: dict) -> tuple[ModelConfig, dict, dict, dict]:
  """(Orthros config, unmerged params, lora, meta) of an adapter on a dense
  base: the base weights with the adapter's feature maps and window
  weights, and its LoRA factors {layer: {proj: {'a', 'b'}}} ({} for a
  stage-1 adapter), unmerged so that training can continue them. The
  adapter is stored unrolled; a scan_layers base gets config, params and
  lora in its stacked layout."""
  meta, tensors = read_adapter(path)
  config = model_config_from(meta['model_config'])
  base_params = unstack_layers(base_params)
  where = os.path.join(os.fspath(path), CONFIG)
  fingerprint = base_fingerprint(base_config, base_params)
  if fingerprint['shape'] != meta['base']['shape']:
    raise ValueError(f'{where} was made for a base of shape '
                     f"{meta['base']['shape']}, not {fingerprint['shape']}")
  if fingerprint['attn_sha256'] != meta['base'].get('attn_sha256'):
    raise ValueError(f'{where} was made for other base weights (the sha256 '
                     'of their q/k/v/o kernels differs); apply it to the '
                     'model it was converted from')
  params = {k: v for k, v in base_params.items()}
  lora: dict = {}
  for i in range(config.num_layers):
    layer = f'layers_{i}'
    attn = dict(params[layer]['attn'])
    for name in TRANSFER_PARAMS:
      if name == 'length_exponent' and not config.attention.length_scale:
        continue
      if name in ('window_logit', 'length_exponent'):
        key = f'{layer}.attn.{name}'
        if key not in tensors:
          raise ValueError(f'{os.path.join(os.fspath(path), WEIGHTS)} has no '
                           f'{key} (its config {where} asks for it)')
        attn[name] = jnp.asarray(tensors[key])
      else:
        attn[name] = {'proj': jnp.asarray(tensors[f'{layer}.attn.{name}.proj'])}
    params[layer] = dict(params[layer], attn=attn)
    for proj in DEFAULT_TARGETS:
      key = f'{layer}.attn.{proj}.lora_a'
      if key in tensors:
        lora.setdefault(layer, {})[proj] = {
            'a': jnp.asarray(tensors[key]),
            'b': jnp.asarray(tensors[f'{layer}.attn.{proj}.lora_b'])}
  if base_config.scan_layers:
    config = config.replace(scan_layers=True, remat=base_config.remat)
    params = stack_layers(params)
    lora = stack_layers(lora) if lora else lora
  return config, params, lora, meta


# ---------------------------------------------- conversions from an adapter


def stage1_from_adapter(path: str, student: ModelConfig,
                        teacher: ModelConfig, teacher_params: dict
                        ) -> tuple[dict, dict]:
  """(stage-1 params, summary) from a stage-1 adapter: the teacher's
  weights with the adapter's feature maps and window weights, in place of
  running stage 1. The adapter must hold no LoRA factors (a stage-2
  adapter is a finished conversion), be made for these teacher weights
  (apply_adapter checks the digest) and for this exact attention config.
  The summary carries the stage's steps and tokens from the adapter's
  provenance (None when it does not say), so reports count them."""
  where = os.path.join(path, CONFIG)
  meta, _ = read_adapter(path)
  if int(meta.get('lora_rank', 0)):
    raise ValueError(f'{where} holds LoRA factors (rank '
                     f"{meta['lora_rank']}): stage1.from_adapter takes a "
                     'stage-1 adapter (feature maps and windows only)')
  _check_adapter_attention(meta, student, where)
  config, params = apply_adapter(path, teacher, teacher_params)
  del config
  prov = meta.get('provenance') or {}
  stage1 = (prov.get('conversion_config') or {}).get('stage1') or {}
  data = (prov.get('conversion_config') or {}).get('data') or {}
  steps = prov.get('step')
  tokens = None
  if steps is not None and data.get('batch_size') and data.get('seq_len'):
    tokens = int(steps) * int(data['batch_size']) * int(data['seq_len'])
  elif stage1.get('tokens'):
    tokens = int(stage1['tokens'])
  return params, {'steps': int(steps) if steps is not None else 0,
                  'tokens': tokens, 'from_adapter': os.path.abspath(path),
                  'workdir': prov.get('conversion_workdir')}



def _check_adapter_attention(meta: dict, student: ModelConfig,
                             where: str) -> None:
  got = dict(meta['model_config'].get('attention') or {})
  want = dataclasses.asdict(student.attention)
  # exact_tail and impl are inference settings: training never reads them.
  diff = {k: (got.get(k), v) for k, v in want.items()
          if got.get(k) != v and k not in ('exact_tail', 'impl')}
  if diff:
    raise ValueError(f'{where} was made for another attention config; '
                     f'(adapter, this conversion) differ in {diff}')


def stage2_from_adapter(path: str, student: ModelConfig,
                        teacher: ModelConfig, teacher_params: dict, *,
                        rank: int, alpha: float, targets: Sequence[str]
                        ) -> tuple[dict, dict, dict]:
  """(stage-1 params, LoRA factors, summary) of a finished LoRA adapter, to
  continue its stage 2 (on longer rows, say): its feature maps and window
  weights stand for stage 1 (not run), its LoRA factors are where stage 2
  starts. The adapter must be of these teacher weights, this attention
  config, and this LoRA rank, alpha and target set. The summary carries
  the adapter's own stage-1 and stage-2 steps and tokens from its
  provenance (None where it does not say)."""
  where = os.path.join(path, CONFIG)
  config, params, lora, meta = adapter_parts(
      path, teacher, teacher_params)
  del config
  if not lora:
    raise ValueError(f'{where} holds no LoRA factors: stage2.from_adapter '
                     'continues a finished LoRA conversion (a stage-1 '
                     'adapter goes to stage1.from_adapter)')
  _check_adapter_attention(meta, student, where)
  got = (int(meta.get('lora_rank', 0)), float(meta['lora_alpha']),
         sorted({p for layer in lora.values() for p in layer}))
  want = (rank, alpha, sorted(targets))
  if got != want:
    raise ValueError(f'{where} has LoRA (rank, alpha, targets) {got}; this '
                     f'conversion asks for {want}')
  prov = meta.get('provenance') or {}
  s1 = dict(prov.get('stage1') or prov.get('stage1_from_adapter') or {})
  prior = dict(prov.get('stage2_from_adapter') or {})
  steps2 = prov.get('stage2_step')
  tokens2 = prov.get('stage2_tokens')
  return params, lora, {
      'from_adapter': os.path.abspath(path),
      'stage1': {'steps': int(s1.get('steps') or 0),
                 'tokens': s1.get('tokens')},
      # Every stage-2 run before this one: the adapter's own, and what it
      # continued in turn.
      'steps': int(steps2 or 0) + int(prior.get('steps') or 0),
      'tokens': (None if tokens2 is None or (prior and prior.get('tokens')
                                              is None)
                 else int(tokens2) + int(prior.get('tokens') or 0)),
      'workdir': prov.get('conversion_workdir')}


def export_from_conversion(workdir: str | os.PathLike,
                           out_dir: str | os.PathLike,
                           stage: str = 'stage2') -> str:
  """The adapter of a finished (or stopped) LoRA conversion in `workdir`,
  applied to the teacher named in its config.json: from the latest stage-2
  checkpoint, its base's feature maps and windows and its LoRA factors; with
  stage='stage1', the feature maps and windows of the latest stage-1
  checkpoint alone (no LoRA: attention transfer only)."""
  if stage not in ('stage1', 'stage2'):
    raise ValueError(f"stage={stage!r}: expected 'stage1' or 'stage2'")
  workdir = os.path.abspath(os.fspath(workdir))
  config_file = os.path.join(workdir, 'config.json')
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f'{config_file} is missing: pass a convert.py '
                            'workdir')
  cfg = read_json(config_file)
  stage_dir = os.path.join(workdir, stage)
  params, model_cfg, step = ckpt_lib.load_params(stage_dir)
  del model_cfg
  if stage == 'stage1':
    lora = {}
  elif not params.get('lora'):
    raise ValueError(f'{stage_dir} holds a full finetune (no LoRA): it has '
                     'no adapter; ship its params instead')
  else:
    params, lora = params['base'], params['lora']
  teacher, teacher_params, info = teacher_lib.load_teacher(cfg['teacher'])
  config = teacher_lib.orthros_config(teacher, cfg['attention'])
  alpha = float(cfg['stage2'].get('lora_alpha', 16.0))
  return write_adapter(
      out_dir, config, teacher_params, params, lora, alpha=alpha,
      provenance={'conversion_workdir': workdir, 'stage': stage,
                  'step': step, 'teacher': info, 'conversion_config': cfg})


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      description='Write the Orthros adapter (feature maps, window weights, '
      'LoRA factors) of a convert.py workdir.')
  parser.add_argument('workdir')
  parser.add_argument('out_dir')
  parser.add_argument('--stage', default='stage2',
                      choices=('stage1', 'stage2'))
  args = parser.parse_args(argv)
  print(export_from_conversion(args.workdir, args.out_dir, args.stage))


if __name__ == '__main__':
  main()
