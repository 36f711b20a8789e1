"""lm-evaluation-harness bridge (orthros_jax/evaluation/lm_harness.py):
loglikelihood equals the project's inference-path scoring (and, for a dense
model, a float64 log-softmax of its forward logits), generate_until equals
`generate`, rolling log-likelihood equals one prefill per window, and
lm-eval's own evaluator runs local tasks (data files written here, no hub)
to the accuracies these scores imply."""

import json
import math
import re
import textwrap

import numpy as np
import pytest

pytest.importorskip('lm_eval')

from lm_eval.api.instance import Instance  # noqa: E402

import orthros_jax as oj  # noqa: E402
from orthros_jax.data.tokenizers import ByteTokenizer  # noqa: E402
from orthros_jax.evaluation import inference  # noqa: E402
from orthros_jax.evaluation import lm_harness  # noqa: E402
from orthros_jax.evaluation.inference import pure_linear  # noqa: E402

from test_model import init_params, make_config, run  # noqa: E402

TOK = ByteTokenizer()
PAIRS = [('The cat sat on', ' the mat'), ('A', ' longer answer here.'),
         ('Numbers: 1 2 3 4 5 6 7 8 9', ' 10'),
         ('Question? ', 'Answer.'), ('', 'no context at all')]


def _config(kind='orthros'):
  c = make_config(kind=kind, window=5, chunk=4, sinks=1, vocab_size=259)
  return c.replace(attention={'exact_tail': 2}) if kind == 'orthros' else c


@pytest.fixture(scope='module')
def orthros():
  c = _config()
  return c, init_params(c, seed=3)


@pytest.fixture(scope='module')
def dense():
  c = _config('dense')
  return c, init_params(c, seed=4)


def _ll(lm, pairs):
  return lm.loglikelihood([Instance('loglikelihood', {}, p, i)
                           for i, p in enumerate(pairs)], disable_tqdm=True)


def _one_batch(lm, ctx, cont):
  """The batch contract of orthros_jax/data/pipeline.py for one example."""
  whole = ctx + cont
  n = len(whole) - 1
  return {'inputs': np.asarray([whole[:-1]], np.int32),
          'targets': np.asarray([whole[1:]], np.int32),
          'weights': (np.arange(n) >= len(ctx) - 1)[None].astype(np.float32),
          'prompt_lengths': np.asarray([len(ctx)], np.int32)}


@pytest.mark.parametrize('batch_size', [1, 3])
def test_loglikelihood_equals_inference_path_scoring(orthros, batch_size):
  config, params = orthros
  lm = lm_harness.HarnessLM(config, params, TOK, batch_size=batch_size)
  got = _ll(lm, PAIRS)
  for (ctx, cont), (ll, greedy) in zip(PAIRS, got):
    if ctx:
      ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
    else:
      # An empty context gets the prefix token: bos, as lm-eval's HF model.
      ctx_ids, cont_ids = [TOK.bos_id], TOK.encode(cont)
    s = inference.score_batch(config, params, _one_batch(lm, ctx_ids,
                                                         cont_ids))
    assert ll == pytest.approx(-float(s['nll_sum'][0]), rel=1e-5, abs=1e-5)
    assert greedy == bool(s['exact'][0])
    assert ll < 0


def test_dense_loglikelihood_equals_float64_log_softmax(dense):
  config, params = dense
  lm = lm_harness.HarnessLM(config, params, TOK, batch_size=2)
  got = _ll(lm, PAIRS[:4])
  for (ctx, cont), (ll, greedy) in zip(PAIRS[:4], got):
    c_ids, k_ids = lm._encode_pair(ctx, cont)
    whole = np.asarray([c_ids + k_ids], np.int32)
    logits, _ = run(config, params, whole, phase='forward', all_logits=True)
    z = np.asarray(logits[0], np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    pos = np.arange(len(c_ids) - 1, whole.shape[1] - 1)
    want = logp[pos, whole[0, pos + 1]].sum()
    assert ll == pytest.approx(want, rel=1e-5)
    assert greedy == bool(np.all(z[pos].argmax(-1) == whole[0, pos + 1]))


def test_loglikelihood_cuts_long_contexts_from_the_left(orthros):
  config, params = orthros
  ctx, cont = 'x' * 40 + 'tail of the context', ' end'
  short = lm_harness.HarnessLM(config, params, TOK, max_length=24)
  (ll, _), = _ll(short, [(ctx, cont)])
  ids = TOK.encode(ctx + cont)[-25:]
  s = inference.score_batch(config, params,
                            _one_batch(short, ids[:-4], ids[-4:]))
  assert ll == pytest.approx(-float(s['nll_sum'][0]), rel=1e-5)


def test_generate_until_equals_generate(orthros):
  config, params = orthros
  lm = lm_harness.HarnessLM(config, params, TOK)
  prompts = ['Once upon a time', 'abc']
  got = lm.generate_until([Instance('generate_until', {},
                                    (p, {'max_gen_toks': 7, 'until': []}), i)
                           for i, p in enumerate(prompts)])
  for p, text in zip(prompts, got):
    out = oj.generate(config, params, [TOK.encode(p)], max_new_tokens=7)
    ids = [int(x) for x in out.tokens[0]]
    if TOK.eos_id in ids:
      ids = ids[:ids.index(TOK.eos_id)]
    assert text == TOK.decode(ids)
  # `until` cuts at the first stop string of the same generation.
  stop = got[0][2:4] if len(got[0]) >= 4 else None
  if stop:
    cut, = lm.generate_until([Instance(
        'generate_until', {}, (prompts[0], {'max_gen_toks': 7,
                                            'until': [stop]}), 0)])
    assert cut == got[0][:got[0].index(stop)]


def test_rolling_loglikelihood_is_one_prefill_per_window(orthros):
  config, params = orthros
  lm = lm_harness.HarnessLM(config, params, TOK, max_length=16)
  text = 'A document longer than one window, so it rolls over.'
  (got,) = lm.loglikelihood_rolling([Instance('loglikelihood_rolling', {},
                                              (text,), 0)])
  ids = TOK.encode(text)
  want, start = 0.0, 0
  while start < len(ids):  # disjoint windows of 16 predicted tokens
    end = min(start + 16, len(ids))
    pred = ids[start:end]
    # lm-eval's windows: the prefix token (bos) before the first; a later one reads the tokens
    # before it up to 16 + 1 in all (one for a full window, more for the
    # last, shorter one).
    ctx = [TOK.bos_id] if start == 0 else ids[min(start - 1, end - 17):start]
    whole = np.asarray([ctx + pred], np.int32)
    cache = oj.init_cache(config, 1, whole.shape[1])
    logits, _ = run(config, params, whole[:, :-1], phase='prefill',
                    cache=cache, lengths=np.asarray([whole.shape[1] - 1]),
                    all_logits=True)
    z = np.asarray(logits[0], np.float64)
    z -= z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    pos = np.arange(len(ctx) - 1, whole.shape[1] - 1)
    want += logp[pos, whole[0, pos + 1]].sum()
    start += 16
  assert len(ids) > 32 and len(ids) % 16  # several windows, the last short
  assert got == pytest.approx(want, rel=1e-5)


def test_bad_arguments_are_clear_errors(orthros):
  config, params = orthros
  with pytest.raises(ValueError, match='route='):
    lm_harness.HarnessLM(config, params, TOK, route='beam')
  with pytest.raises(ValueError, match='max_length must be >= 1'):
    lm_harness.HarnessLM(config, params, TOK, max_length=0)
  lm = lm_harness.HarnessLM(config, params, TOK)
  with pytest.raises(ValueError, match='empty continuation'):
    lm.score_tokens([([3, 4], [])])
  with pytest.raises(ValueError, match='only greedy'):
    lm.generate_until([Instance('generate_until', {},
                                ('hi', {'do_sample': True}), 0)])
  with pytest.raises(ValueError, match='does not fit max_length=8'):
    lm_harness.HarnessLM(config, params, TOK, max_length=8).score_tokens(
        [([3], list(range(3, 12)))])
  with pytest.raises(ValueError, match='name at least one task'):
    lm_harness.run_tasks({'orthros': (config, params, 'inference')}, (), TOK)
  with pytest.raises(ValueError, match=r"names tasks \['mmlu'\]"):
    lm_harness.run_tasks({'orthros': (config, params, 'inference')}, ('x',),
                         TOK, num_fewshot={'mmlu': 5})


def _write_tasks(tmp_path, mc_docs, gen_docs):
  data = tmp_path / 'data'
  data.mkdir()
  for name, docs in (('mc', mc_docs), ('gen', gen_docs)):
    with open(data / f'{name}.jsonl', 'w') as f:
      for d in docs:
        f.write(json.dumps(d) + '\n')
  cache = tmp_path / 'hf_cache'
  (tmp_path / 'tasks').mkdir()
  (tmp_path / 'tasks' / 'local_mc.yaml').write_text(textwrap.dedent(f"""\
      task: orthros_local_mc
      dataset_path: json
      dataset_kwargs:
        data_files:
          test: {data / 'mc.jsonl'}
        cache_dir: {cache}
      test_split: test
      output_type: multiple_choice
      doc_to_text: "{{{{question}}}}"
      doc_to_choice: "{{{{choices}}}}"
      doc_to_target: "{{{{label}}}}"
      metric_list:
        - metric: acc
      """))
  (tmp_path / 'tasks' / 'local_gen.yaml').write_text(textwrap.dedent(f"""\
      task: orthros_local_gen
      dataset_path: json
      dataset_kwargs:
        data_files:
          test: {data / 'gen.jsonl'}
        cache_dir: {cache}
      test_split: test
      output_type: generate_until
      doc_to_text: "{{{{question}}}}"
      doc_to_target: "{{{{answer}}}}"
      generation_kwargs:
        until: ["#"]
        max_gen_toks: 5
        do_sample: false
      metric_list:
        - metric: exact_match
      """))
  return str(tmp_path / 'tasks')


def test_evaluator_runs_local_tasks_to_the_bridge_scores(orthros, tmp_path):
  """lm-eval's evaluator on two local tasks reaches the accuracy that the
  bridge's own loglikelihoods and generations imply, for an Orthros row and
  the pure-linear row (path 'prefill')."""
  config, params = orthros
  rows = {'orthros': (config, params, 'inference'),
          'linear': (pure_linear(config), params, 'prefill')}
  questions = ['Is the sky blue?', 'Pick one:', 'Which letter?',
               'Last one.']
  choices = [' yes', ' no', ' maybe']
  gen_questions = ['Say something', 'More text']
  # Labels: the orthros row's best choice for the first three, another for
  # the last; targets: its own generation for the first, junk for the next.
  lm = lm_harness.HarnessLM(config, params, TOK, max_gen_toks=5)
  best = []
  for q in questions:
    # lm-eval joins context and choice with its target_delimiter, ' '.
    lls = [ll for ll, _ in _ll(lm, [(q, ' ' + c) for c in choices])]
    best.append(int(np.argmax(lls)))
  labels = best[:3] + [(best[3] + 1) % 3]
  gens = lm.generate_until([Instance('generate_until', {},
                                     (q, {'until': ['#'], 'max_gen_toks': 5}),
                                     i) for i, q in enumerate(gen_questions)])
  mc_docs = [{'question': q, 'choices': choices, 'label': lab}
             for q, lab in zip(questions, labels)]
  gen_docs = [{'question': gen_questions[0], 'answer': gens[0]},
              {'question': gen_questions[1], 'answer': gens[1] + 'zz'}]
  include = _write_tasks(tmp_path, mc_docs, gen_docs)
  res = lm_harness.run_tasks(rows, ['orthros_local_mc', 'orthros_local_gen'],
                             TOK, include_path=include, max_gen_toks=5)
  assert res['orthros']['orthros_local_mc']['acc'] == pytest.approx(0.75)
  assert res['orthros']['orthros_local_gen']['exact_match'] == (
      pytest.approx(0.5))
  # The linear row: its own scores through the prefill formula.
  lin = lm_harness.HarnessLM(pure_linear(config), params, TOK,
                             route='prefill')
  lin_best = [int(np.argmax([ll for ll, _ in _ll(lin, [(q, ' ' + c)
                                                       for c in choices])]))
              for q in questions]
  want = np.mean([b == lab for b, lab in zip(lin_best, labels)])
  assert res['linear']['orthros_local_mc']['acc'] == pytest.approx(want)
  table = lm_harness.table(res)
  assert re.search(r'\| orthros_local_mc \| acc \| 0\.7500 \|', table)
  assert math.isfinite(res['linear']['orthros_local_gen']['exact_match'])


def test_eval_section_writes_the_lm_eval_table(orthros, dense, tmp_path):
  """eval.py's `lm_eval` section: every row's results in results.json and
  the table in report.md, on a saved Orthros checkpoint and its teacher."""
  from ml_collections import ConfigDict
  from orthros_jax.evaluation import suite
  from orthros_jax.training import checkpoint as ckpt_lib
  config, params = orthros
  ckpt_lib.save_params(tmp_path / 'orthros', params, config, step=1)
  ckpt_lib.save_params(tmp_path / 'teacher', dense[1], dense[0], step=2)
  docs = [{'question': f'Q{i}?', 'choices': [' a', ' b'], 'label': i % 2}
          for i in range(3)]
  include = _write_tasks(tmp_path, docs, [{'question': 'x', 'answer': 'y'}])
  c = ConfigDict(dict(
      name='harness', checkpoint=str(tmp_path / 'orthros'),
      teacher=str(tmp_path / 'teacher'), tokenizer='byte',
      models=('teacher', 'orthros', 'linear'), progress=False,
      tasks={}, quality={}, speed={},
      lm_eval=dict(tasks=('orthros_local_mc',), include_path=include,
                   num_fewshot=-1, limit=0, max_length=64, batch_size=2,
                   max_gen_toks=4, seed=1)))
  out = tmp_path / 'out'
  suite.run(c, out)
  saved = json.loads((out / 'results.json').read_text())
  res = saved['lm_eval']['results']
  assert set(res) == {'teacher', 'orthros', 'linear'}
  # The orthros row's accuracy is what its own loglikelihoods give.
  lm = lm_harness.HarnessLM(config, params, TOK, max_length=64)
  want = np.mean([int(np.argmax([ll for ll, _ in _ll(lm, [(d['question'],
                                                          ' ' + ch)
                                                          for ch in
                                                          d['choices']])]))
                  == d['label'] for d in docs])
  assert res['orthros']['orthros_local_mc']['acc'] == pytest.approx(want)
  report = (out / 'report.md').read_text()
  assert '## lm-evaluation-harness' in report
  assert '| task | metric | teacher | orthros | linear |' in report
  c.lm_eval.unlocked = None  # an unknown key is an error naming it
  with pytest.raises(ValueError, match="unknown keys \\['unlocked'\\]"):
    suite.run(c, tmp_path / 'out2')
