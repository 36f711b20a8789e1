"""Tests for the Hugging Face importer (orthros_jax.checkpoints.hf).

Tiny random Llama / Mistral / Qwen2 models are built with transformers, saved
with save_pretrained into pytest's tmp dirs (nothing is downloaded), loaded with
`load_hf` and compared with transformers itself: forward logits within 1e-4 and
32 greedy tokens token-for-token.
"""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from orthros_jax.checkpoints import config_from_hf  # pylint: disable=g-import-not-at-top
from orthros_jax.checkpoints import load_hf
from orthros_jax.checkpoints import load_hf_config
from orthros_jax.config import AttentionConfig
from orthros_jax.config import RopeScaling

# Mistral's default sliding_window (4096) triggers a warning; it is checked in
# test_mistral_sliding_window_warns and irrelevant to the ~70-token tests.
# CPU cannot donate buffers; generate's donation warning is noise here.
pytestmark = [
    pytest.mark.filterwarnings('ignore:config.json sets sliding_window'),
    pytest.mark.filterwarnings('ignore:Some donated buffers were not usable'),
]

SIZES = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12,
             intermediate_size=80, initializer_range=0.15, rms_norm_eps=1e-5)
LLAMA3_ROPE = {'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 8.0,
               'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
               # Small, so scaling changes positions of a ~40-token prompt.
               'original_max_position_embeddings': 16}
LINEAR_ROPE = {'rope_type': 'linear', 'rope_theta': 20000.0, 'factor': 3.0}

# name -> (config class name, config overrides, save_pretrained max_shard_size)
VARIANTS = {
    'llama': ('LlamaConfig', {}, None),
    'llama_tied': ('LlamaConfig', {'tie_word_embeddings': True}, None),
    'llama3_rope': ('LlamaConfig', {'rope_parameters': LLAMA3_ROPE}, None),
    # head_dim 16 != hidden_size / heads exercises the explicit head_dim.
    'llama_bias_linear_rope': ('LlamaConfig', {
        'attention_bias': True, 'head_dim': 16,
        'rope_parameters': LINEAR_ROPE}, None),
    'llama_sharded': ('LlamaConfig', {}, '40KB'),
    'mistral': ('MistralConfig', {}, None),
    'qwen2': ('Qwen2Config', {}, None),
}
# Different weights per architecture; llama_sharded must equal llama.
SEEDS = {'mistral': 1, 'qwen2': 2}
NEW_TOKENS = 32
PROMPT_LENGTHS = (40, 23)


def _build(name, tmp_path_factory, torch_dtype=None):
  cls_name, overrides, shard = VARIANTS[name]
  hf_config = getattr(transformers, cls_name)(**{**SIZES, **overrides})
  torch.manual_seed(SEEDS.get(name, 0))
  model_cls = {'LlamaConfig': transformers.LlamaForCausalLM,
               'MistralConfig': transformers.MistralForCausalLM,
               'Qwen2Config': transformers.Qwen2ForCausalLM}[cls_name]
  model = model_cls(hf_config).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith('.bias'):  # HF initialises biases to zero.
        torch.nn.init.normal_(p, std=0.2)
      if pname.endswith('norm.weight'):  # ... and norm weights to one.
        p.add_(0.1 * torch.randn_like(p))
  # With an EOS id, min_new_tokens masks that token's logit, which is no longer
  # plain greedy; orthros generate with eos_id=None never masks it.
  model.generation_config.eos_token_id = None
  if torch_dtype is not None:
    model = model.to(torch_dtype)
  path = tmp_path_factory.mktemp(name)
  kwargs = {} if shard is None else {'max_shard_size': shard}
  model.save_pretrained(path, **kwargs)
  return path, model


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  """name -> (saved dir, HF model); each variant is built once per module."""
  cache = {}

  def get(name):
    if name not in cache:
      cache[name] = _build(name, tmp_path_factory)
    return cache[name]

  return get


def _prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, SIZES['vocab_size'], n).tolist()
          for n in PROMPT_LENGTHS]


def _copy(src, tmp_path):
  dst = tmp_path / 'ckpt'
  shutil.copytree(src, dst)
  return dst


def _edit_config(path, **updates):
  with open(path / 'config.json') as f:
    cfg = json.load(f)
  cfg.update(updates)
  with open(path / 'config.json', 'w') as f:
    json.dump(cfg, f)
  return cfg


# ---------------------------------------------------------------- parity


def _check_forward(name, checkpoints):
  """Loads variant `name`; asserts forward logits match HF within 1e-4."""
  from orthros_jax.model import Transformer  # pylint: disable=g-import-not-at-top
  path, hf_model = checkpoints(name)
  config, params = load_hf(path)
  tokens = np.array(_prompts()[0])[None]  # [1, T]
  logits, _ = Transformer(config).apply({'params': params}, jnp.asarray(tokens),
                                        phase='forward')
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits.numpy()  # [1, T, V]
  assert logits.shape == want.shape
  np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)
  return config, params, hf_model


@pytest.mark.parametrize('name', ['llama', 'llama_tied', 'llama3_rope',
                                  'mistral', 'qwen2'])
def test_forward_and_greedy_match_transformers(name, checkpoints):
  from orthros_jax.generate import generate  # pylint: disable=g-import-not-at-top
  config, params, hf_model = _check_forward(name, checkpoints)
  prompts = _prompts()  # ragged: one batch here, one HF call per prompt
  out = generate(config, params, prompts, max_new_tokens=NEW_TOKENS)
  got = np.asarray(out.tokens)
  assert got.shape == (len(prompts), NEW_TOKENS)
  for b, prompt in enumerate(prompts):
    with torch.no_grad():
      ref = hf_model.generate(
          torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                           dtype=torch.long),
          do_sample=False, max_new_tokens=NEW_TOKENS,
          min_new_tokens=NEW_TOKENS, pad_token_id=0)
    np.testing.assert_array_equal(got[b], ref[0, len(prompt):].numpy(),
                                  err_msg=f'prompt {b}')


def test_forward_matches_transformers_with_biases_and_linear_rope(checkpoints):
  # Forward only: generation adds no loader coverage beyond the tests above.
  config, _, _ = _check_forward('llama_bias_linear_rope', checkpoints)
  assert config.out_bias and config.rope_scaling.kind == 'linear'


# ---------------------------------------------------------------- config


def test_config_mapping(checkpoints):
  config, _ = load_hf(checkpoints('llama3_rope')[0])
  assert (config.vocab_size, config.num_layers, config.embed_dim,
          config.num_heads, config.num_kv_heads, config.head_dim,
          config.mlp_dim) == (97, 2, 48, 4, 2, 12, 80)
  assert config.norm_eps == 1e-5
  assert config.rope_theta == 500000.0
  assert config.rope_scaling == RopeScaling(
      kind='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_len=16)
  assert (config.qkv_bias, config.out_bias, config.tie_embeddings) == (
      False, False, False)
  assert (config.dtype, config.param_dtype) == ('float32', 'float32')
  assert config.attention == AttentionConfig()

  config, _ = load_hf(checkpoints('llama_bias_linear_rope')[0])
  assert (config.qkv_bias, config.out_bias) == (True, True)
  assert config.head_dim == 16
  assert config.rope_theta == 20000.0
  assert config.rope_scaling == RopeScaling(kind='linear', factor=3.0)
  config, _ = load_hf(checkpoints('qwen2')[0])
  assert (config.qkv_bias, config.out_bias) == (True, False)
  assert config.rope_scaling is None
  config, params = load_hf(checkpoints('llama_tied')[0])
  assert config.tie_embeddings and 'lm_head' not in params


def test_dtype_and_attention_arguments(checkpoints):
  path = checkpoints('llama')[0]
  config, params = load_hf(path, AttentionConfig(window=5), dtype='bfloat16',
                           param_dtype=jnp.bfloat16)
  assert (config.dtype, config.param_dtype) == ('bfloat16', 'bfloat16')
  assert config.attention.window == 5
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype('bfloat16')}
  with pytest.raises(ValueError, match='windw'):
    load_hf(path, {'windw': 3})


def test_mistral_sliding_window_warns(checkpoints):
  with pytest.warns(UserWarning, match='sliding_window=4096'):
    load_hf(checkpoints('mistral')[0])


def _to_old_style(new_cfg, type_key):
  """transformers-5 `rope_parameters` -> top-level rope_theta + rope_scaling."""
  cfg = dict(new_cfg)
  rope = dict(cfg.pop('rope_parameters'))
  cfg['rope_theta'] = rope.pop('rope_theta')
  kind = rope.pop('rope_type', None) or rope.pop('type', None)
  rope.pop('type', None)
  cfg['rope_scaling'] = None if kind == 'default' else {type_key: kind, **rope}
  return cfg


@pytest.mark.parametrize('type_key', ['rope_type', 'type'])
@pytest.mark.parametrize('name', ['llama', 'llama3_rope',
                                  'llama_bias_linear_rope', 'qwen2'])
def test_old_and_new_rope_conventions_agree(name, type_key, checkpoints,
                                            tmp_path):
  src = checkpoints(name)[0]
  new_cfg = load_hf_config(src)
  assert 'rope_parameters' in new_cfg and 'rope_scaling' not in new_cfg
  old_cfg = _to_old_style(new_cfg, type_key)
  path = _copy(src, tmp_path)
  with open(path / 'config.json', 'w') as f:
    json.dump(old_cfg, f)
  old, _ = load_hf(path)
  new, _ = load_hf(src)
  assert old == new
  assert config_from_hf(old_cfg) == config_from_hf(new_cfg)


# ---------------------------------------------------------------- params


def test_param_tree_contract(checkpoints):
  e, h, k, d, m, v = 48, 4, 2, 16, 80, 97
  _, params = load_hf(checkpoints('llama_bias_linear_rope')[0])
  layer = {
      'input_norm': {'scale': (e,)},
      'attn': {'q_proj': {'kernel': (e, h, d), 'bias': (h, d)},
               'k_proj': {'kernel': (e, k, d), 'bias': (k, d)},
               'v_proj': {'kernel': (e, k, d), 'bias': (k, d)},
               'o_proj': {'kernel': (h, d, e), 'bias': (e,)}},
      'post_attn_norm': {'scale': (e,)},
      'mlp': {'gate_proj': {'kernel': (e, m)}, 'up_proj': {'kernel': (e, m)},
              'down_proj': {'kernel': (m, e)}}}
  want = {'embed': {'embedding': (v, e)}, 'layers_0': layer,
          'layers_1': layer, 'final_norm': {'scale': (e,)},
          'lm_head': {'kernel': (e, v)}}
  shapes = jax.tree.map(lambda x: tuple(x.shape), params)
  assert shapes == want
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype('float32')}


def test_sharded_equals_single_file(checkpoints):
  sharded = checkpoints('llama_sharded')[0]
  assert (sharded / 'model.safetensors.index.json').is_file()
  assert len(list(sharded.glob('*.safetensors'))) > 1
  # Same seed and config: the sharded save holds the same weights.
  _, a = load_hf(sharded)
  _, b = load_hf(checkpoints('llama')[0])
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_bfloat16_checkpoint(checkpoints, tmp_path_factory):
  bf16_path, _ = _build('llama', tmp_path_factory, torch_dtype=torch.bfloat16)
  _, f32 = load_hf(checkpoints('llama')[0])
  _, from_bf16 = load_hf(bf16_path)
  want = jax.tree.map(
      lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
      f32)
  assert {x.dtype for x in jax.tree.leaves(from_bf16)} == {
      jnp.dtype('float32')}
  jax.tree.map(np.testing.assert_array_equal, from_bf16, want)
  _, as_bf16 = load_hf(bf16_path, param_dtype='bfloat16')
  assert {x.dtype for x in jax.tree.leaves(as_bf16)} == {
      jnp.dtype('bfloat16')}


def test_orthros_attention_adds_fresh_params(checkpoints):
  path = checkpoints('llama')[0]
  _, dense = load_hf(path)
  config, params = load_hf(path, attention={'kind': 'orthros', 'window': 8,
                                            'chunk_size': 4})
  assert config.attention.kind == 'orthros'
  assert (config.attention.window, config.attention.chunk_size) == (8, 4)
  for i in range(config.num_layers):
    attn = params[f'layers_{i}']['attn']
    for key in ('phi_q', 'phi_k', 'window_logit'):
      assert key in attn, f'layers_{i}/attn/{key} missing'
    extra = {k: v for k, v in attn.items() if k not in dense[f'layers_{i}'][
        'attn']}
    assert set(extra) >= {'phi_q', 'phi_k', 'window_logit'}
    # Freshly initialised, not zeros copied from nowhere.
    assert all(np.all(np.isfinite(np.asarray(x)))
               for x in jax.tree.leaves(extra))
  # Every dense weight is exactly the dense load's.
  for key, sub in dense.items():
    if key.startswith('layers_'):
      for part, leaves in sub.items():
        got = params[key][part]
        if part == 'attn':
          got = {k: got[k] for k in leaves}
        jax.tree.map(np.testing.assert_array_equal, got, leaves)
    else:
      jax.tree.map(np.testing.assert_array_equal, params[key], sub)


def test_orthros_with_full_window_matches_transformers(checkpoints):
  # A window covering the whole prompt makes the Orthros prefill exact softmax
  # (docs/ARCHITECTURE.md section 3), so the converted model must match HF.
  from orthros_jax.model import Transformer  # pylint: disable=g-import-not-at-top
  path, hf_model = checkpoints('llama')
  tokens = np.array(_prompts()[0])[None]  # [1, T]
  config, params = load_hf(path, attention={
      'kind': 'orthros', 'window': tokens.shape[1], 'chunk_size': 8})
  forward = jax.jit(lambda p, x: Transformer(config).apply(
      {'params': p}, x, phase='forward')[0])
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(forward(params, tokens)), want,
                             atol=1e-4, rtol=0)


# ---------------------------------------------------------------- errors


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match='no_such_ckpt'):
    load_hf(tmp_path / 'no_such_ckpt')


def test_missing_config(checkpoints, tmp_path):
  path = _copy(checkpoints('llama')[0], tmp_path)
  (path / 'config.json').unlink()
  with pytest.raises(FileNotFoundError, match='config.json'):
    load_hf(path)


def test_missing_weights(checkpoints, tmp_path):
  path = _copy(checkpoints('llama')[0], tmp_path)
  (path / 'model.safetensors').unlink()
  with pytest.raises(FileNotFoundError, match=r'model\.safetensors'):
    load_hf(path)


def test_corrupt_files_name_the_file(checkpoints, tmp_path):
  """A config.json that does not parse and a truncated safetensors file
  (single or one shard) are ValueErrors naming the file, not bare
  JSONDecodeError / SafetensorError."""
  path = _copy(checkpoints('llama')[0], tmp_path)
  config = (path / 'config.json').read_text()
  (path / 'config.json').write_text(config[:len(config) // 2])
  with pytest.raises(ValueError, match=r'config\.json is not valid JSON'):
    load_hf(path)
  (path / 'config.json').write_text(config)
  weights = path / 'model.safetensors'
  data = weights.read_bytes()
  for cut in (len(data) // 2, 40):  # tensor data cut, header cut
    weights.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r'model\.safetensors.*truncated'):
      load_hf(path)
  sharded = _copy(checkpoints('llama_sharded')[0], tmp_path / 'sharded')
  shard = sorted(sharded.glob('model-*.safetensors'))[-1]
  shard.write_bytes(shard.read_bytes()[:100])
  with pytest.raises(ValueError, match=re.escape(shard.name)):
    load_hf(sharded)
  index = sharded / 'model.safetensors.index.json'
  index.write_text('{"weight_map": ')
  with pytest.raises(ValueError, match=r'index\.json is not valid JSON'):
    load_hf(sharded)


def test_missing_shard(checkpoints, tmp_path):
  path = _copy(checkpoints('llama_sharded')[0], tmp_path)
  shard = sorted(path.glob('model-*.safetensors'))[-1]
  shard.unlink()
  with pytest.raises(FileNotFoundError, match=re.escape(shard.name)):
    load_hf(path)


def test_unknown_model_type(checkpoints, tmp_path):
  path = _copy(checkpoints('llama')[0], tmp_path)
  _edit_config(path, model_type='gpt2')
  with pytest.raises(ValueError, match=r"'gpt2'.*'llama', 'mistral', 'qwen2'"):
    load_hf(path)


@pytest.mark.parametrize('updates,key', [
    ({'mlp_bias': True}, 'mlp_bias'),
    ({'hidden_act': 'gelu'}, 'hidden_act'),
    ({'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 1e4,
                          'factor': 4.0}}, 'rope_type'),
    ({'rope_parameters': None, 'rope_theta': 1e4,
      'rope_scaling': {'type': 'dynamic', 'factor': 2.0}}, 'rope_type'),
    ({'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 1e4,
                          'factor': 8.0}}, 'low_freq_factor'),
])
def test_unsupported_features(updates, key, checkpoints, tmp_path):
  path = _copy(checkpoints('llama')[0], tmp_path)
  _edit_config(path, **updates)
  with pytest.raises(ValueError, match=key):
    load_hf(path)


def _rewrite_tensors(path, fn):
  file = path / 'model.safetensors'
  tensors = safetensors.numpy.load_file(file)
  fn(tensors)
  safetensors.numpy.save_file(tensors, file, metadata={'format': 'pt'})


def test_wrong_shape(checkpoints, tmp_path):
  path = _copy(checkpoints('llama')[0], tmp_path)
  name = 'model.layers.1.self_attn.k_proj.weight'

  def shrink(tensors):
    tensors[name] = tensors[name][:20]

  _rewrite_tensors(path, shrink)
  with pytest.raises(ValueError, match=re.escape(
      f"'{name}' has shape (20, 48) but config.json implies (24, 48)")):
    load_hf(path)


def test_missing_tensor(checkpoints, tmp_path):
  path = _copy(checkpoints('llama')[0], tmp_path)
  names = ['model.layers.0.mlp.up_proj.weight', 'model.norm.weight']
  _rewrite_tensors(path, lambda t: [t.pop(n) for n in names])
  with pytest.raises(ValueError, match='missing') as e:
    load_hf(path)
  for n in names:
    assert n in str(e.value)


def test_config_disagreeing_with_weights(checkpoints, tmp_path):
  path = _copy(checkpoints('llama')[0], tmp_path)
  _edit_config(path, num_hidden_layers=1)  # weights still hold two layers
  with pytest.raises(ValueError, match=r'model\.layers\.1\.'):
    load_hf(path)


def test_ignores_rotary_buffers_and_tied_lm_head(checkpoints, tmp_path):
  path = _copy(checkpoints('llama_tied')[0], tmp_path)

  def add(tensors):
    tensors['model.layers.0.self_attn.rotary_emb.inv_freq'] = np.ones(
        6, np.float32)
    tensors['lm_head.weight'] = np.zeros((97, 48), np.float32)

  _rewrite_tensors(path, add)
  config, params = load_hf(path)
  assert config.tie_embeddings and 'lm_head' not in params
