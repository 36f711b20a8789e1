"""Tiny CPU config: a byte-level model on the synthetic retrieval mix.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python train.py --config=configs/tiny.py:smoke --workdir=/tmp/tiny_smoke

`arg` 'smoke' shrinks everything to a few steps (tests, quick checks);
'niah' adds the needle-in-a-haystack task (a needle in Python's own
documentation prose) to the mix. The committed demo teacher
(assets/tiny_teacher) is 2000 steps of the default mix continued to 2800
steps with 'niah' (commands in assets/tiny_teacher/README.md).
"""

import ml_collections


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  smoke = arg == 'smoke'
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
  if arg == 'niah':
    tasks = dict(tasks, niah=1.0)
  elif arg not in ('', 'smoke'):
    raise ValueError(f"configs/tiny.py: unknown arg {arg!r} (expected '', "
                     "'smoke' or 'niah')")
  c.data = dict(source='synthetic', seq_len=seq_len,
                batch_size=4 if smoke else 16, seed=0, tasks=tasks)
  c.eval_data = dict(source='synthetic', seq_len=seq_len,
                     batch_size=4 if smoke else 16, seed=1, tasks=tasks,
                     num_examples=8 if smoke else 128, num_epochs=1)
  c.eval_batches = 2 if smoke else 8
  c.train = dict(num_steps=4 if smoke else 3000,
                 learning_rate=3e-3 if smoke else 1e-3,
                 warmup_steps=1 if smoke else 200, weight_decay=0.01,
                 split_mode='prompt', log_every=1 if smoke else 50,
                 eval_every=0 if smoke else 500,
                 checkpoint_every=2 if smoke else 500, progress=not smoke)
  return c
