"""Tiny CPU config: a byte-level model on the synthetic retrieval mix.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python train.py --config=configs/tiny.py:smoke --workdir=/tmp/tiny_smoke

`arg` is a comma-separated list of options: 'smoke' shrinks everything to a
few steps (tests, quick checks); 'niah' adds the needle-in-a-haystack task (a
needle in Python's own documentation prose) to the mix; 'varlen' draws the
passkey and needle prompts at uniform lengths in [256, seq_len] instead of
all at seq_len (so the model sees more than one context length). The
committed demo teacher (assets/tiny_teacher) is 2000 steps of the default mix
continued with 'niah' (an older needle template) and then warm-started
(`init_from`) for 1200 steps of 'niah,varlen' (commands in
assets/tiny_teacher/README.md).
"""

import ml_collections


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  options = set(arg.split(',')) - {''}
  unknown = options - {'smoke', 'niah', 'varlen'}
  if unknown:
    raise ValueError(f'configs/tiny.py: unknown option(s) {sorted(unknown)} in '
                     f"{arg!r} (expected a comma-separated subset of 'smoke', "
                     "'niah', 'varlen')")
  smoke = 'smoke' in options
  c = ml_collections.ConfigDict()
  c.model = dict(
      vocab_size=259, num_layers=2 if smoke else 4,
      embed_dim=32 if smoke else 128, num_heads=4, num_kv_heads=2,
      head_dim=8 if smoke else 32, mlp_dim=64 if smoke else 384,
      attention=dict(kind='dense', feature_map='hedgehog', feature_dim=16,
                     window=32, chunk_size=32, exact_tail=1))
  seq_len = 96 if smoke else 384
  tasks = {'mqar': 1.0} if smoke else {'passkey': 1.0, 'mqar': 1.0,
                                       'filler': 0.5}
  if 'niah' in options:
    tasks = dict(tasks, niah=1.0)
  task_options = {}
  if 'varlen' in options:
    task_options = {t: {'min_tokens': min(256, seq_len)}
                    for t in ('passkey', 'niah') if t in tasks}
  # Local text instead: --config.data.source=text
  # --config.data.paths=/path/to/corpus (.txt/.jsonl files, directories or
  # globs; text_field: the jsonl field); tasks apply to synthetic data only.
  c.data = dict(source='synthetic', seq_len=seq_len,
                batch_size=4 if smoke else 16, seed=0, tasks=tasks,
                task_options=task_options, paths='', text_field='text')
  c.eval_data = dict(source='synthetic', seq_len=seq_len,
                     batch_size=4 if smoke else 16, seed=1, tasks=tasks,
                     num_examples=8 if smoke else 128, num_epochs=1)
  c.eval_batches = 2 if smoke else 8
  # split_mode (Orthros models, --config.model.attention.kind=orthros; see
  # orthros_jax/training/step.py): 'prompt' splits a row with a prompt at
  # the inference boundary and a row without one (filler, text) at a random
  # P in [W + 1, T], so every row trains the prefill formula; 'random'
  # draws such a P for every row; 'none' runs the prefill formula
  # everywhere. Dense models ignore it.
  c.train = dict(num_steps=4 if smoke else 3000,
                 learning_rate=3e-3 if smoke else 1e-3,
                 warmup_steps=1 if smoke else 200, weight_decay=0.01,
                 split_mode='prompt', log_every=1 if smoke else 50,
                 eval_every=0 if smoke else 500,
                 checkpoint_every=2 if smoke else 500, progress=not smoke)
  # Device mesh (orthros_jax/sharding/): all 1 = one device. Scale out
  # from the command line, e.g. --config.mesh.shape.data=-1 (every device,
  # data parallel) or --config.mesh.shape.fsdp=4 --config.mesh.shape.tensor=2.
  c.mesh = dict(shape=dict(data=1, fsdp=1, tensor=1, sequence=1), rules=())
  # Warm start: params of another run (a train.py workdir or a params
  # checkpoint such as assets/tiny_teacher) with the same model; the
  # optimizer and learning-rate schedule start fresh. Only for a new
  # workdir: one holding a checkpoint resumes from it.
  c.init_from = ''
  return c
