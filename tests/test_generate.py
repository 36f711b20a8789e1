"""Generation: greedy tokens equal an independent loop over `forward`, ragged
batches equal single prompts, EOS stopping, sampling filters, errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orthros_jax as oj
from orthros_jax import cache as cache_lib
from orthros_jax.generate import sample_logits
from orthros_jax.model import Transformer

import hlo_entry
from test_model import VOCAB, init_params, make_config

PROMPTS = [[5, 17, 3, 40, 22, 9, 61, 2, 33, 12, 7], [8, 1, 50, 23, 23, 4],
           list(range(30, 47))]


@functools.partial(jax.jit, static_argnames=('config',))
def _forward(config, params, x, split):
  return Transformer(config).apply({'params': params}, x, phase='forward',
                                   split=split)[0]


def reference_greedy(config, params, prompt, n, split_from_end):
  """Re-runs `forward` on the growing sequence: the prompt's last
  `split_from_end` tokens and every generated token are exact positions."""
  seq = list(prompt)
  split = len(prompt) - split_from_end
  width = 24  # one fixed shape: right padding cannot change causal outputs
  for _ in range(n):
    x = jnp.asarray([seq + [0] * (width - len(seq))])
    logits = _forward(config, params, x, split)
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


@pytest.mark.parametrize('kind,tail', [('dense', 0), ('orthros', 3),
                                       ('orthros', 0)])
def test_greedy_matches_forward_loop(kind, tail):
  config = make_config(kind=kind, window=4, chunk=4)
  config = config.replace(attention={'exact_tail': tail})
  params = init_params(config)
  out = oj.generate(config, params, PROMPTS, max_new_tokens=8)
  assert out.tokens.shape == (3, 8)
  np.testing.assert_array_equal(out.prompt_lengths, [11, 6, 17])
  np.testing.assert_array_equal(out.boundary, [11 - tail, 6 - tail, 17 - tail])
  for b, prompt in enumerate(PROMPTS):
    ref = reference_greedy(config, params, prompt, 8, tail)
    assert out.tokens[b].tolist() == ref
    # The returned cache holds the prompt and all but the last new token.
    assert int(out.cache[0].lengths[b]) == len(prompt) + 7


def test_ragged_batch_equals_single_prompts():
  config = make_config(window=4, chunk=4).replace(attention={'exact_tail': 2})
  params = init_params(config)
  batch = oj.generate(config, params, PROMPTS, max_new_tokens=6, max_len=40)
  for b, prompt in enumerate(PROMPTS):
    one = oj.generate(config, params, [prompt], max_new_tokens=6, max_len=40)
    np.testing.assert_array_equal(batch.tokens[b], one.tokens[0])


def test_exact_tail_is_per_prompt():
  """A tail longer than the shortest prompt is capped per prompt (6 -> 6
  exact, 11 -> 8, 17 -> 8), not at the batch's shortest: each prompt's
  boundary and tokens are those it gets alone and those of the forward
  loop with the same split."""
  config = make_config(window=4, chunk=4).replace(attention={'exact_tail': 8})
  params = init_params(config)
  out = oj.generate(config, params, PROMPTS, max_new_tokens=5, max_len=40)
  np.testing.assert_array_equal(out.boundary, [3, 0, 9])
  again = oj.generate(config, params, PROMPTS, max_new_tokens=5, max_len=40,
                      exact_tail=np.int64(8))
  np.testing.assert_array_equal(again.tokens, out.tokens)
  with pytest.raises(ValueError, match='exact_tail'):
    oj.generate(config, params, PROMPTS, max_new_tokens=5, exact_tail=2.5)
  for b, prompt in enumerate(PROMPTS):
    one = oj.generate(config, params, [prompt], max_new_tokens=5, max_len=40)
    assert one.boundary[0] == out.boundary[b]
    np.testing.assert_array_equal(out.tokens[b], one.tokens[0])
    ref = reference_greedy(config, params, prompt, 5, min(8, len(prompt)))
    assert out.tokens[b].tolist() == ref
    assert int(out.cache[0].lengths[b]) == len(prompt) + 4


def test_ragged_decode_equals_separate_calls():
  """phase='decode' with lengths appends each row's first lengths[b]
  tokens: logits and cache equal decoding each row alone, and so does a
  continued prefill after it (which folds what each row decoded, and only
  that)."""
  config = make_config(window=4, chunk=4)
  params = init_params(config)
  apply = jax.jit(Transformer(config).apply, static_argnames=('phase',))
  prompt = np.asarray([PROMPTS[0][:9], PROMPTS[2][:9]], np.int32)
  more = np.asarray([[4, 9, 13, 2], [7, 1, 0, 0]], np.int32)
  lengths = np.asarray([4, 2], np.int32)
  cache = oj.init_cache(config, 2, 24)
  _, cache = apply({'params': params}, prompt, phase='prefill', cache=cache)
  logits, got = apply({'params': params}, more, phase='decode', cache=cache,
                      lengths=lengths)
  after = np.asarray([[5, 8, 3, 11, 6], [2, 12, 9, 4, 1]], np.int32)
  logits2, got2 = apply({'params': params}, after, phase='prefill', cache=got)
  for b in range(2):
    one = oj.init_cache(config, 1, 24)
    _, one = apply({'params': params}, prompt[b:b + 1], phase='prefill',
                   cache=one)
    want, one = apply({'params': params}, more[b:b + 1, :lengths[b]],
                      phase='decode', cache=one)
    np.testing.assert_allclose(logits[b, :lengths[b]], want[0], rtol=1e-5,
                               atol=1e-5)
    for layer, ref in zip(got, one):
      n = int(ref.lengths[0])
      assert int(layer.lengths[b]) == n
      np.testing.assert_allclose(layer.k[b, :n], ref.k[0, :n], atol=1e-6)
      np.testing.assert_allclose(layer.S[b], ref.S[0], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(layer.z[b], ref.z[0], rtol=1e-5, atol=1e-6)
    want2, one = apply({'params': params}, after[b:b + 1], phase='prefill',
                       cache=one)
    np.testing.assert_allclose(logits2[b], want2[0], rtol=1e-5, atol=1e-5)
    for layer, ref in zip(got2, one):
      n = int(ref.lengths[0])
      assert int(layer.lengths[b]) == n and n == 9 + lengths[b] + 5
      assert int(layer.folded[b]) == int(ref.folded[0]) == n - 4
      np.testing.assert_allclose(layer.S[b], ref.S[0], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(layer.z[b], ref.z[0], rtol=1e-5, atol=1e-5)


def test_padded_array_input_with_lengths():
  config = make_config(window=4, chunk=4)
  params = init_params(config)
  arr = np.zeros((2, 11), np.int32)
  arr[0, :11], arr[1, :6] = PROMPTS[0], PROMPTS[1]
  a = oj.generate(config, params, arr, lengths=[11, 6], max_new_tokens=5)
  b = oj.generate(config, params, PROMPTS[:2], max_new_tokens=5)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_eos_stops_each_sequence():
  config = make_config(kind='dense')
  params = init_params(config)
  free = oj.generate(config, params, PROMPTS, max_new_tokens=10)
  eos = int(free.tokens[0, 3])
  out = oj.generate(config, params, PROMPTS, max_new_tokens=10, eos_id=eos,
                    pad_id=VOCAB - 1)
  for b in range(3):
    row = free.tokens[b].tolist()
    n = row.index(eos) + 1 if eos in row else 10
    assert out.lengths[b] == n
    assert out.tokens[b, :n].tolist() == row[:n]
    assert np.all(out.tokens[b, n:] == VOCAB - 1)


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
  config = make_config()
  params = init_params(config)
  kw = dict(max_new_tokens=6, temperature=1.3)
  a = oj.generate(config, params, PROMPTS, rng=jax.random.PRNGKey(1), **kw)
  b = oj.generate(config, params, PROMPTS, rng=jax.random.PRNGKey(1), **kw)
  c = oj.generate(config, params, PROMPTS, rng=jax.random.PRNGKey(2), **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  greedy = oj.generate(config, params, PROMPTS, max_new_tokens=6)
  top1 = oj.generate(config, params, PROMPTS, rng=jax.random.PRNGKey(3),
                     top_k=1, **kw)
  np.testing.assert_array_equal(top1.tokens, greedy.tokens)


def test_sample_logits_distribution_and_filters():
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.07, 0.03]]))
  logits = jnp.repeat(logits, 20000, axis=0)
  rng = jax.random.PRNGKey(0)
  draw = lambda **kw: np.asarray(sample_logits(logits, rng, **kw))
  freq = np.bincount(draw(temperature=1.0), minlength=5) / 20000
  # 5 sigma of a binomial with n = 20000 is < 0.018.
  np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.07, 0.03], atol=0.018)
  top2 = np.bincount(draw(temperature=1.0, top_k=2), minlength=5) / 20000
  np.testing.assert_allclose(top2, [2 / 3, 1 / 3, 0, 0, 0], atol=0.018)
  # top_p = 0.8: the smallest set with mass >= 0.8 is {0, 1, 2} (0.9).
  nucleus = np.bincount(draw(temperature=1.0, top_p=0.8), minlength=5) / 20000
  np.testing.assert_allclose(nucleus, np.array([0.5, 0.25, 0.15, 0, 0]) / 0.9,
                             atol=0.018)
  assert set(draw(temperature=1.0, top_p=0.3).tolist()) == {0}
  cold = np.bincount(draw(temperature=0.25), minlength=5) / 20000
  p = np.array([0.5, 0.25, 0.15, 0.07, 0.03]) ** 4
  np.testing.assert_allclose(cold, p / p.sum(), atol=0.018)
  assert np.all(draw(temperature=0.0) == 0)


@pytest.mark.parametrize('kwargs,match', [
    (dict(max_new_tokens=10, max_len=20), 'max_len'),
    (dict(max_new_tokens=0), 'max_new_tokens'),
    (dict(max_new_tokens=2, temperature=0.7), 'rng'),
    (dict(max_new_tokens=2, temperature=-1.0), 'temperature'),
    (dict(max_new_tokens=2, top_p=0.0), 'top_p'),
    (dict(max_new_tokens=2, top_k=0), 'top_k'),
    (dict(max_new_tokens=2, eos_id=VOCAB), 'eos_id'),
])
def test_generate_argument_errors(kwargs, match):
  config = make_config()
  with pytest.raises(ValueError, match=match):
    oj.generate(config, {}, PROMPTS, **kwargs)


def test_generate_input_errors():
  config = make_config()
  with pytest.raises(ValueError, match='vocab_size'):
    oj.generate(config, {}, [[1, 2, VOCAB]], max_new_tokens=2)
  with pytest.raises(ValueError, match='empty'):
    oj.generate(config, {}, [], max_new_tokens=2)
  with pytest.raises(ValueError, match='1..'):
    oj.generate(config, {}, [[1, 2], []], max_new_tokens=2)
  # Float token ids were truncated silently (apply rejects them).
  with pytest.raises(ValueError, match='integers'):
    oj.generate(config, {}, np.array([[1.7, 2.0, 3.2]]), max_new_tokens=2)
  with pytest.raises(ValueError, match='prompt 1 .*integers'):
    oj.generate(config, {}, [[1, 2], [3.5, 4]], max_new_tokens=2)
  with pytest.raises(ValueError, match='1..'):
    oj.generate(config, {}, np.zeros((2, 0), np.int32), max_new_tokens=2)


def test_garbage_past_prompt_lengths_is_ignored():
  """Ids past each prompt's length (even out of range) do not matter."""
  config = make_config(window=4, chunk=4)
  params = init_params(config)
  arr = np.full((2, 11), 10**6, np.int32)
  arr[0, :11], arr[1, :6] = PROMPTS[0], PROMPTS[1]
  a = oj.generate(config, params, arr, lengths=[11, 6], max_new_tokens=4)
  b = oj.generate(config, params, PROMPTS[:2], max_new_tokens=4)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  for layer_a, layer_b in zip(a.cache, b.cache):
    np.testing.assert_array_equal(layer_a.S, layer_b.S)
  with pytest.raises(ValueError, match='pad_id'):
    oj.generate(config, params, PROMPTS, max_new_tokens=2, pad_id=VOCAB)


@pytest.mark.parametrize('kind', ['orthros', 'dense'])
def test_decode_step_updates_cache_in_place(kind):
  """A decode step with the cache donated (as `generate` runs it) writes
  each layer's K and V in place and copies no cache: in the compiled
  program every cache-sized result is one of the 2 x layers in-place
  writes (a scatter or dynamic-update-slice fusion), never a copy or a
  transpose. (Written as [B, S, K, D], the update was duplicated into the
  attention's [B, S * K, D] view and the cache copied for it.) The entry
  computation only: the fallback branch that zeroes stale rows (taken
  when the cache holds NaN or inf) copies by design. CPU only (the
  cross-head path and the flat write are the CPU's)."""
  if jax.default_backend() != 'cpu':
    pytest.skip('the in-place decode path is the CPU\'s')
  # SmolLM2's attention shape and a 4K cache, compiled only: XLA's fusion
  # choices depend on the sizes (at a toy size no copy appears either way).
  config = make_config(kind=kind, num_layers=2, embed_dim=64, num_heads=9,
                       num_kv_heads=3, head_dim=64, mlp_dim=64)
  model = Transformer(config)
  params = jax.eval_shape(lambda: init_params(config))
  cache = jax.eval_shape(lambda: oj.init_cache(config, 1, 4097))
  step = lambda p, t, c: model.apply({'params': p}, t, phase='decode',
                                     cache=c, check_overflow=False)
  text = jax.jit(step, donate_argnums=2).lower(
      params, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache).compile(
      ).as_text()
  size = cache[0].k.size
  writes, others = [], []
  for name, op, largest in hlo_entry.entry_results(text):
    if largest >= size:
      write = op == 'fusion' and re.search(r'scatter|dynamic-update-slice',
                                           name)
      (writes if write else others).append(name)
  assert not others, others
  assert len(writes) == 2 * config.num_layers, writes


@pytest.mark.parametrize('flat_heads', [True, False])
def test_write_kv(flat_heads):
  """Both views write the same: each valid new token at lengths[b] + t,
  invalid ones and those past max_len dropped, everything else kept
  (ragged lengths, GQA, one row writing past the end)."""
  rng = np.random.default_rng(7)
  b, t, s, kh, d = 3, 4, 9, 2, 5
  old_k, old_v = rng.normal(size=(2, b, s, kh, d)).astype(np.float32)
  new_k, new_v = rng.normal(size=(2, b, t, kh, d)).astype(np.float32)
  lengths = np.array([0, 3, 7], np.int32)  # row 2: two tokens fit
  valid = np.array([[1, 1, 0, 1], [1, 1, 1, 0], [1, 1, 1, 1]], bool)
  layer = cache_lib.LayerCache(
      k=jnp.asarray(old_k), v=jnp.asarray(old_v), lengths=jnp.asarray(lengths),
      S=jnp.zeros((b, 1, 1, 1)), z=jnp.zeros((b, 1, 1)),
      folded=jnp.zeros((b,), jnp.int32))
  got = jax.jit(functools.partial(cache_lib.write_kv, flat_heads=flat_heads))(
      layer, jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(valid))
  want_k, want_v = old_k.copy(), old_v.copy()
  for i in range(b):
    for j in range(t):
      if valid[i, j] and lengths[i] + j < s:
        want_k[i, lengths[i] + j] = new_k[i, j]
        want_v[i, lengths[i] + j] = new_v[i, j]
  np.testing.assert_array_equal(got[0], want_k)
  np.testing.assert_array_equal(got[1], want_v)
