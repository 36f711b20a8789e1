"""Import a local Hugging Face checkpoint (Llama, Mistral, Qwen2) as Flax params.

`load_hf(path)` reads `config.json` plus `model.safetensors` (or the shards
named by `model.safetensors.index.json`) from a local directory and returns
`(ModelConfig, params)`, where `params` is the Flax param tree that
`orthros_jax.Transformer(config)` expects. Nothing is downloaded, torch is not
needed and nothing is unpickled: tensors are read with `safetensors` into numpy
(bfloat16 through ml_dtypes).

Einsum letters: V vocab, E embed, H query heads, K kv heads, D head dim,
M mlp width.

HF `nn.Linear` weights are stored [out, in]; Flax kernels are [in, out], split
per head:
  q_proj.weight [H*D, E] -> kernel [E, H, D]     q_proj.bias [H*D] -> [H, D]
  k/v_proj.weight [K*D, E] -> kernel [E, K, D]   k/v_proj.bias [K*D] -> [K, D]
  o_proj.weight [E, H*D] -> kernel [H, D, E]     o_proj.bias [E]
  gate/up_proj.weight [M, E] -> kernel [E, M]    down_proj.weight [E, M] -> [M, E]
  lm_head.weight [V, E] -> kernel [E, V]         embed_tokens.weight [V, E] as is
RMSNorm weights map directly to `scale` (HF: x * rsqrt(mean(x^2) + eps) * w).

No permutation of q/k rows is needed: HF Llama-family checkpoints were already
permuted, when converted from Meta's interleaved-pair RoPE layout, into the
rotate-half layout (pairs are (i, i + D/2) within a head), and the model applies
RoPE in that same rotate-half convention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from safetensors import safe_open

from orthros_jax.config import AttentionConfig, ModelConfig, RopeScaling
from orthros_jax.model import init_orthros_params

SUPPORTED_MODEL_TYPES = ('llama', 'mistral', 'qwen2')
SUPPORTED_ROPE_TYPES = ('default', 'linear', 'llama3')

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
WEIGHTS_INDEX_FILE = 'model.safetensors.index.json'

# Non-parameter buffers some exports include; they are recomputed by the model.
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)
_MAX_LISTED = 20

Params = dict[str, Any]


# ---------------------------------------------------------------- config


def load_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The parsed `config.json` of a local HF checkpoint directory."""
  path = pathlib.Path(path)
  if not path.is_dir():
    raise FileNotFoundError(
        f'HF checkpoint directory {str(path)!r} does not exist: pass the local '
        f'directory written by save_pretrained (holding {CONFIG_FILE} and '
        f'{WEIGHTS_FILE}).')
  config_file = path / CONFIG_FILE
  if not config_file.is_file():
    raise FileNotFoundError(
        f'{CONFIG_FILE} is missing from HF checkpoint directory {str(path)!r}: '
        'the directory must hold the config.json written by save_pretrained.')
  return read_json(config_file)


def read_json(file: str | os.PathLike) -> Any:
  """A JSON file's content; a file that does not parse is a ValueError
  naming it (every JSON file a checkpoint, adapter or tokenizer directory
  holds is read through here)."""
  try:
    with open(file, encoding='utf-8') as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f'{file} is not valid JSON ({e}); re-export or copy the '
                     'checkpoint again') from e


@contextlib.contextmanager
def _open_safetensors(file: pathlib.Path):
  """safe_open(file) with a truncated or corrupt file (safetensors' own
  error types) reported as a ValueError naming it."""
  try:
    handle = safe_open(file, framework='numpy')
  except Exception as e:  # SafetensorError and OSError variants
    raise ValueError(f'{file} is not a readable safetensors file ({e}); it '
                     'may be truncated: copy it again') from e
  with handle as f:
    yield f


def config_from_hf(hf_config: Mapping[str, Any],
                   attention: AttentionConfig | Mapping[str, Any] | None = None,
                   *,
                   dtype: Any = None,
                   param_dtype: Any = None) -> ModelConfig:
  """Maps an HF config dict (old or transformers-5 RoPE keys) to ModelConfig.

  Raises ValueError naming the key for unsupported model types or features.
  """
  model_type = hf_config.get('model_type')
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f'model_type={model_type!r} in {CONFIG_FILE} is not supported: '
        f'load_hf reads one of {SUPPORTED_MODEL_TYPES}.')

  def required(key):
    if hf_config.get(key) is None:
      raise ValueError(f'{CONFIG_FILE} has no {key!r}, which a {model_type} '
                       'config must set.')
    return hf_config[key]

  hidden_act = hf_config.get('hidden_act', 'silu')
  if hidden_act != 'silu':
    raise ValueError(f'hidden_act={hidden_act!r} in {CONFIG_FILE} is not '
                     "supported: the model's MLP is SwiGLU with 'silu'.")
  if hf_config.get('mlp_bias', False):
    raise ValueError(f'mlp_bias=True in {CONFIG_FILE} is not supported: the '
                     'model has no MLP biases.')
  _warn_sliding_window(hf_config, model_type)

  embed_dim = required('hidden_size')
  num_heads = required('num_attention_heads')
  num_kv_heads = hf_config.get('num_key_value_heads') or num_heads
  head_dim = hf_config.get('head_dim') or embed_dim // num_heads
  if model_type == 'qwen2':
    qkv_bias, out_bias = True, False  # Qwen2: q/k/v biases, none on o_proj.
  else:
    # Llama's attention_bias puts biases on q, k, v and o; Mistral has none.
    qkv_bias = out_bias = bool(hf_config.get('attention_bias', False))
  rope_theta, rope_scaling = _rope_from_hf(hf_config)

  return ModelConfig(
      vocab_size=required('vocab_size'),
      num_layers=required('num_hidden_layers'),
      embed_dim=embed_dim,
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      mlp_dim=required('intermediate_size'),
      norm_eps=float(hf_config.get('rms_norm_eps', 1e-6)),
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      qkv_bias=qkv_bias,
      out_bias=out_bias,
      tie_embeddings=bool(hf_config.get('tie_word_embeddings', False)),
      dtype=_dtype_name(dtype, 'dtype'),
      param_dtype=_dtype_name(param_dtype, 'param_dtype'),
      attention=_attention_config(attention),
  )


def _rope_from_hf(hf_config: Mapping[str, Any]
                  ) -> tuple[float, RopeScaling | None]:
  """RoPE theta and scaling from either config convention.

  transformers >= 5: `rope_parameters` = {rope_theta, rope_type, scaling keys}.
  Older: top-level `rope_theta` plus `rope_scaling` = {rope_type | type,
  scaling keys} or null.
  """
  if hf_config.get('rope_parameters') is not None:
    key = 'rope_parameters'
    params = dict(hf_config['rope_parameters'])
    theta = params.get('rope_theta', hf_config.get('rope_theta', 10000.0))
  else:
    key = 'rope_scaling'
    params = dict(hf_config.get('rope_scaling') or {})
    theta = hf_config.get('rope_theta', 10000.0)
  if not isinstance(theta, (int, float)):
    raise ValueError(f'{key}: rope_theta={theta!r} is not a number; this '
                     'usually means per-layer-type RoPE, which no supported '
                     'model_type uses.')
  rope_type = params.get('rope_type', params.get('type')) or 'default'
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f'{key}.rope_type={rope_type!r} in {CONFIG_FILE} is not '
                     f'supported: use one of {SUPPORTED_ROPE_TYPES}.')
  partial = params.get('partial_rotary_factor', 1.0)
  if partial != 1.0:
    raise ValueError(f'{key}.partial_rotary_factor={partial!r} is not '
                     'supported: the model rotates the whole head dim (1.0).')
  if rope_type == 'default':
    return float(theta), None

  def scaling_key(name):
    if params.get(name) is None:
      raise ValueError(f'{key} has rope_type={rope_type!r} but no {name!r}; '
                       f'add {name!r} to {key} in {CONFIG_FILE}.')
    return params[name]

  if rope_type == 'linear':
    scaling = RopeScaling(kind='linear', factor=float(scaling_key('factor')))
  else:
    scaling = RopeScaling(
        kind='llama3',
        factor=float(scaling_key('factor')),
        low_freq_factor=float(scaling_key('low_freq_factor')),
        high_freq_factor=float(scaling_key('high_freq_factor')),
        original_max_len=int(scaling_key('original_max_position_embeddings')))
  return float(theta), scaling


def _warn_sliding_window(hf_config: Mapping[str, Any], model_type: str):
  window = hf_config.get('sliding_window')
  if model_type == 'qwen2' and not hf_config.get('use_sliding_window', False):
    window = None
  max_len = hf_config.get('max_position_embeddings')
  if window is not None and (max_len is None or window < max_len):
    warnings.warn(
        f'{CONFIG_FILE} sets sliding_window={window}; the imported model uses '
        f'full attention, so it matches the {model_type} reference only on '
        f'sequences of at most {window} tokens.', stacklevel=3)


def _dtype_name(dtype: Any, field: str) -> str:
  if dtype is None:
    return 'float32'
  try:
    return jnp.dtype(dtype).name
  except TypeError as e:
    raise ValueError(f"{field}={dtype!r} is not a dtype: pass e.g. 'float32' "
                     "or 'bfloat16'.") from e


def _attention_config(attention: Any) -> AttentionConfig:
  if attention is None:
    return AttentionConfig()
  if isinstance(attention, AttentionConfig):
    return attention
  if isinstance(attention, Mapping):
    fields = {f.name for f in dataclasses.fields(AttentionConfig)}
    unknown = sorted(set(attention) - fields)
    if unknown:
      raise ValueError(f'attention has unknown keys {unknown}: valid '
                       f'AttentionConfig fields are {sorted(fields)}.')
    return AttentionConfig(**attention)
  raise ValueError(f'attention={attention!r} is invalid: pass None (dense), '
                   'an AttentionConfig or a dict of its fields.')


# ---------------------------------------------------------------- tensors


@dataclasses.dataclass(frozen=True)
class _Spec:
  """One HF tensor and where it lands in the Flax tree."""
  hf_name: str
  hf_shape: tuple[int, ...]
  path: tuple[str, ...]
  shape: tuple[int, ...]   # Flax shape, reached by reshape after transpose
  transpose: bool          # HF Linear [out, in] -> Flax [in, out]


def _param_specs(config: ModelConfig) -> list[_Spec]:
  e, h, k, d, m, v = (config.embed_dim, config.num_heads, config.num_kv_heads,
                      config.head_dim, config.mlp_dim, config.vocab_size)
  specs = [_Spec('model.embed_tokens.weight', (v, e), ('embed', 'embedding'),
                 (v, e), False)]
  for i in range(config.num_layers):
    hf, fx = f'model.layers.{i}.', f'layers_{i}'
    attn = hf + 'self_attn.'
    specs += [
        _Spec(hf + 'input_layernorm.weight', (e,), (fx, 'input_norm', 'scale'),
              (e,), False),
        _Spec(attn + 'q_proj.weight', (h * d, e),
              (fx, 'attn', 'q_proj', 'kernel'), (e, h, d), True),
        _Spec(attn + 'k_proj.weight', (k * d, e),
              (fx, 'attn', 'k_proj', 'kernel'), (e, k, d), True),
        _Spec(attn + 'v_proj.weight', (k * d, e),
              (fx, 'attn', 'v_proj', 'kernel'), (e, k, d), True),
        _Spec(attn + 'o_proj.weight', (e, h * d),
              (fx, 'attn', 'o_proj', 'kernel'), (h, d, e), True),
        _Spec(hf + 'post_attention_layernorm.weight', (e,),
              (fx, 'post_attn_norm', 'scale'), (e,), False),
        _Spec(hf + 'mlp.gate_proj.weight', (m, e),
              (fx, 'mlp', 'gate_proj', 'kernel'), (e, m), True),
        _Spec(hf + 'mlp.up_proj.weight', (m, e),
              (fx, 'mlp', 'up_proj', 'kernel'), (e, m), True),
        _Spec(hf + 'mlp.down_proj.weight', (e, m),
              (fx, 'mlp', 'down_proj', 'kernel'), (m, e), True),
    ]
    if config.qkv_bias:
      specs += [
          _Spec(attn + 'q_proj.bias', (h * d,), (fx, 'attn', 'q_proj', 'bias'),
                (h, d), False),
          _Spec(attn + 'k_proj.bias', (k * d,), (fx, 'attn', 'k_proj', 'bias'),
                (k, d), False),
          _Spec(attn + 'v_proj.bias', (k * d,), (fx, 'attn', 'v_proj', 'bias'),
                (k, d), False),
      ]
    if config.out_bias:
      specs.append(_Spec(attn + 'o_proj.bias', (e,),
                         (fx, 'attn', 'o_proj', 'bias'), (e,), False))
  specs.append(_Spec('model.norm.weight', (e,), ('final_norm', 'scale'), (e,),
                     False))
  if not config.tie_embeddings:
    specs.append(_Spec('lm_head.weight', (v, e), ('lm_head', 'kernel'), (e, v),
                       True))
  return specs


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> the safetensors file holding it."""
  single, index = path / WEIGHTS_FILE, path / WEIGHTS_INDEX_FILE
  if index.is_file():
    index_json = read_json(index)
    weight_map = (index_json.get('weight_map')
                  if isinstance(index_json, dict) else None)
    if not isinstance(weight_map, dict):
      raise ValueError(f'{WEIGHTS_INDEX_FILE} in {str(path)!r} has no '
                       "'weight_map' dict of tensor name -> shard file.")
    files = {name: path / shard for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
      if not shard.is_file():
        raise FileNotFoundError(
            f'shard {shard.name!r} listed in {WEIGHTS_INDEX_FILE} is missing '
            f'from {str(path)!r}: copy every shard of the checkpoint.')
    return files
  if single.is_file():
    with _open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  raise FileNotFoundError(
      f'no weights in {str(path)!r}: expected {WEIGHTS_FILE} or '
      f'{WEIGHTS_INDEX_FILE} with its shards (save with save_pretrained and '
      'safe_serialization; .bin pickles are not read).')


def _listing(names: list[str]) -> str:
  shown = ', '.join(names[:_MAX_LISTED])
  more = len(names) - _MAX_LISTED
  return shown + (f' ... and {more} more' if more > 0 else '')


def _set_path(tree: Params, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _merge(tree: Params, extra: Mapping[str, Any], where: str = '') -> None:
  """Adds `extra`'s leaves to `tree` in place; refuses to overwrite."""
  for key, value in extra.items():
    if isinstance(value, Mapping):
      _merge(tree.setdefault(key, {}), value, f'{where}{key}/')
    elif key in tree:
      raise ValueError(f'init_orthros_params returned {where}{key}, which the '
                       'HF checkpoint already provides.')
    else:
      tree[key] = value


def load_hf_params(path: str | os.PathLike, config: ModelConfig) -> Params:
  """Reads and converts the dense weights of an HF checkpoint for `config`."""
  path = pathlib.Path(path)
  files = _weight_files(path)
  specs = _param_specs(config)
  wanted = {s.hf_name for s in specs}
  missing = [s.hf_name for s in specs if s.hf_name not in files]
  if missing:
    raise ValueError(
        f'{len(missing)} tensor(s) that the config requires are missing from '
        f'{str(path)!r}: {_listing(missing)}. Check that config.json matches '
        'the weights.')
  ignored = set() if not config.tie_embeddings else {'lm_head.weight'}
  unexpected = sorted(
      n for n in files if n not in wanted and n not in ignored
      and not n.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    raise ValueError(
        f'{len(unexpected)} tensor(s) in {str(path)!r} have no place in a '
        f'{config.num_layers}-layer model: {_listing(unexpected)}. Check '
        'num_hidden_layers, attention_bias and mlp_bias in config.json.')

  with contextlib.ExitStack() as stack:
    handles = {}

    def read(name):
      file = files[name]
      if file not in handles:
        handles[file] = stack.enter_context(_open_safetensors(file))
      return handles[file]

    def tensor(name):
      try:
        return read(name).get_tensor(name)
      except Exception as e:  # a truncated file fails here, not at open
        raise ValueError(f'{files[name]}: tensor {name!r} cannot be read '
                         f'({e}); the file may be truncated: copy it '
                         'again') from e

    return params_from_tensors(
        config, shape_of=lambda n: tuple(read(n).get_slice(n).get_shape()),
        read=tensor, source='config.json')


def tensor_names(config: ModelConfig) -> list[str]:
  """The HF tensor names a checkpoint for `config` must provide."""
  return [s.hf_name for s in _param_specs(config)]


def params_from_tensors(config: ModelConfig, *, shape_of, read,
                        source: str) -> Params:
  """The Flax param tree for `config` from HF-named tensors.

  `shape_of(name)` and `read(name)` give one tensor's shape and value
  (numpy); `source` names what the config came from, for the error when a
  shape disagrees with it. Shared by the safetensors and GGUF importers.
  """
  param_dtype = jnp.dtype(config.param_dtype)
  params: Params = {}
  for spec in _param_specs(config):
    shape = shape_of(spec.hf_name)
    if shape != spec.hf_shape:
      raise ValueError(
          f'tensor {spec.hf_name!r} has shape {shape} but {source} '
          f'implies {spec.hf_shape}: the weights and {source} disagree.')
    x = read(spec.hf_name)
    if spec.transpose:
      x = x.T
    x = x.reshape(spec.shape).astype(param_dtype)
    _set_path(params, spec.path, jnp.asarray(x))
  return params


def load_hf(path: str | os.PathLike,
            attention: AttentionConfig | Mapping[str, Any] | None = None,
            *,
            dtype: Any = None,
            param_dtype: Any = None,
            rng: jax.Array | None = None) -> tuple[ModelConfig, Params]:
  """Loads a local HF Llama/Mistral/Qwen2 checkpoint.

  Args:
    path: directory with config.json and model.safetensors (or
      model.safetensors.index.json and its shards).
    attention: None (dense), an AttentionConfig, or a dict of its fields.
    dtype: activation dtype of the returned config (default float32).
    param_dtype: dtype of the returned params (default float32).
    rng: key for the new Orthros feature-map and window params (default
      PRNGKey(0)); unused for dense attention.

  Returns:
    (config, params) for `orthros_jax.Transformer(config).apply(
    {'params': params}, ...)`.
  """
  hf_config = load_hf_config(path)
  config = config_from_hf(hf_config, attention, dtype=dtype,
                          param_dtype=param_dtype)
  params = load_hf_params(path, config)
  return config, add_orthros_params(config, params, rng)


def add_orthros_params(config: ModelConfig, params: Params,
                       rng: jax.Array | None = None) -> Params:
  """`params` plus fresh feature-map and window params when `config` is an
  Orthros model (key `rng`, default PRNGKey(0)); dense params as they are."""
  if config.is_orthros:
    rng = jax.random.PRNGKey(0) if rng is None else rng
    _merge(params, init_orthros_params(config, rng))
  return params
