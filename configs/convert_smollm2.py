"""SmolLM2-135M-Instruct (a real pretrained model) -> Orthros, W = 64.

  make smollm2 corpus    # the teacher (GGUF -> results/smollm2/hf) and the
                         # conversion text (results/corpus_pydoc), offline
  python convert.py --config=configs/convert_smollm2.py \
      --workdir=results/smollm2/convert

`arg` (combine with commas):
  'linear'  the trained pure-linear floor: the same recipe and budget with
            window 0, no sinks, and stage 2 through the prefill formula at
            every position (split_mode 'none'), as the floor is evaluated;
  'long'    a second stage 2 on rows of 4096 tokens (batch 1,
            STAGE2_LONG_STEPS steps) continuing the committed 1K adapter
            (assets/smollm2_orthros; stage2.from_adapter);
  'rows4k'  the whole recipe on rows of 4096 tokens, batch 1, with the same
            token budgets (80 + 80 steps);
  'lscale'  adds attention.length_scale (a learned per-head power of each
            prefill query's count of older tokens scales its linear weights;
            docs/ARCHITECTURE.md section 3), fitted by stage 1;
  'smoke'   every stage a few steps.
Why each exists and what it measured: benchmarks/RESULTS.md
("SmolLM2-135M-Instruct").

Conversion data: docstrings of Python's standard library
(orthros_jax/data/corpus.py), generic English prose about software, built
offline; documents containing any sentence of the evaluation's templates or
haystacks are dropped, so every retrieval score is zero-shot.

Recipe (LoLCATs where it is the reference): stage 1 trains the feature maps
and window weights to match each layer's attention output (per-layer MSE,
lr 1e-2); stage 2 trains LoRA r=8 (alpha 16) on q/k/v/o at lr 1e-4 with
next-token loss through a random prefill/decode split of every text row.
Sinks: the first 4 tokens stay exact in every prefill query (StreamingLLM);
pretrained models park attention on their first tokens. Budget: 160 + 160 steps of 1024 x 2 tokens
(0.33M + 0.33M tokens); wall time on a 2-core CPU in benchmarks/RESULTS.md.
convert.py resumes a killed run where it stopped (a workdir started before
the recipe scanned its layers, 401db81, resumes with
--config.model.scan_layers=False --config.model.remat=none).
"""

import ml_collections

TEACHER = 'results/smollm2/hf'
CORPUS = 'results/corpus_pydoc'
ADAPTER_1K = 'assets/smollm2_orthros'
STAGE2_LONG_STEPS = 24


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  args = set(filter(None, arg.split(',')))
  unknown = args - {'smoke', 'linear', 'long', 'rows4k', 'lscale'}
  if unknown:
    raise ValueError(f'unknown config args {sorted(unknown)}: use smoke, '
                     'linear, long, rows4k, lscale')
  smoke, linear, long = 'smoke' in args, 'linear' in args, 'long' in args
  rows4k, lscale = 'rows4k' in args, 'lscale' in args
  if lscale and (linear or long):
    raise ValueError("'lscale' needs a window (not 'linear') and a fresh "
                     "stage 1 (not 'long', which continues the plain maps)")
  if long and rows4k:
    raise ValueError("'long' continues the 1K conversion, 'rows4k' is a new "
                     'one: use one')
  c = ml_collections.ConfigDict()
  c.teacher = dict(checkpoint='', hf_dir=TEACHER, step=-1,
                   # SmolLM2-135M's pretraining: 2T tokens (its model card).
                   train_tokens=2_000_000_000_000)
  c.attention = dict(kind='orthros', feature_map='hedgehog', feature_dim=64,
                     window=0 if linear else 64, chunk_size=64,
                     exact_tail=0 if linear else 1, window_init=0.1,
                     sinks=0 if linear else 4, length_scale=lscale)
  seq_len = 128 if smoke else (4096 if long or rows4k else 1024)
  batch = 1 if long or rows4k else 2
  c.data = dict(source='text', seq_len=seq_len, batch_size=batch, seed=2,
                tokenizer=TEACHER, paths=f'{CORPUS}/train.jsonl',
                text_field='text')
  steps1, steps2 = (3, 3) if smoke else (160, 160)
  if long:
    # Stages 1 and 2 of the 1K recipe are the adapter's; this run is a
    # second stage 2 of STAGE2_LONG_STEPS x 4096 tokens (stage1.tokens, the
    # 1K recipe's budget, is not used: no stage 1 runs).
    steps1, steps2 = 80, STAGE2_LONG_STEPS
  elif rows4k and not smoke:
    steps1, steps2 = 80, 80  # 327,680 + 327,680 tokens, as at 1K x 2
  # window_logit at 30x: gamma must move from 0.1 to where the teacher's
  # local share puts it within a short stage (configs/convert_tiny.py).
  # --config.stage1.from_adapter=assets/smollm2_orthros_stage1 skips the
  # stage: its committed result (this recipe's stage 1, 160 steps).
  c.stage1 = dict(tokens=steps1 * batch * seq_len, from_adapter='',
                  learning_rate=1e-2,
                  lr_multipliers={'window_logit': 30.0,
                                  **({'length_exponent': 10.0}
                                     if lscale else {})},
                  warmup_steps=1 if smoke else 8, weight_decay=0.0,
                  log_every=1 if smoke else (2 if rows4k else 5),
                  checkpoint_every=2 if smoke else (4 if rows4k else 10),
                  progress=not smoke)
  # 'prompt' split: text rows have no prompt, so every row splits at a
  # random P and the prefill formula trains (orthros_jax/training/step.py).
  # The linear floor trains as it is evaluated, every position through the
  # prefill formula ('none': a pure linear-attention model has no exact
  # decode to fall back on).
  c.stage2 = dict(tokens=steps2 * batch * seq_len, learning_rate=1e-4,
                  from_adapter=ADAPTER_1K if long else '',
                  warmup_steps=1 if smoke else (2 if long else 8),
                  weight_decay=0.0,
                  split_mode='none' if linear else 'prompt', lora_rank=8,
                  lora_alpha=16.0,
                  kl_weight=0.0, hidden_weight=0.0,
                  log_every=1 if smoke else (2 if long or rows4k else 5),
                  checkpoint_every=2 if smoke else (4 if long or rows4k
                                                    else 10),
                  progress=not smoke)
  # Held-out perplexity through the inference path (held-out stdlib files).
  c.eval = dict(seq_len=seq_len if smoke else (4096 if long or rows4k
                                               else 2048),
                batch_size=1, seed=1,
                num_examples=2,
                sets={'heldout_text': {'source': 'text',
                                       'paths': f'{CORPUS}/heldout.jsonl'}},
                after_stage1=not (smoke or long))
  c.seed = 0
  c.progress = not smoke
  c.mesh = dict(shape=dict(data=1, fsdp=1, tensor=1, sequence=1), rules=())
  # configs/convert_tiny.py explains these. Scanned: one block compiled,
  # and the stage-2 gradient step 1.40x faster at 2 x 1024 tokens on a
  # 2-core CPU (benchmarks/RESULTS.md, "Layers scanned"); on 4096-token
  # rows remat keeps stage 2's memory at 5.5 GB instead of 14.8 GB.
  c.model = dict(scan_layers=True,
                 remat='dots_no_batch' if seq_len >= 4096 else 'none')
  return c
