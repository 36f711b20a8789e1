"""A Llama-3.2-1B-shaped model for accelerators (about 1.2B parameters).

  python train.py --config=configs/llama_1b.py \
      --config.data.tokenizer=/path/to/tokenizer.json \
      --config.data.paths=/data/text/ --workdir=gs://bucket/run1

Set model.vocab_size to the tokenizer's vocabulary (128256 for Llama 3) and
`--config.model.attention.kind=orthros` for an Orthros model trained with the
phase-aware objective from scratch. By default every device is one FSDP
shard (params, gradients and Adam state split 1/N per device); on a TPU
v5e-16 slice, say, --config.mesh.shape.fsdp=8 --config.mesh.shape.tensor=2.
The same command runs on every host of a pod slice (see README, At scale).
"""

import ml_collections


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.model = dict(
      vocab_size=128256, num_layers=16, embed_dim=2048, num_heads=32,
      num_kv_heads=8, head_dim=64, mlp_dim=8192, rope_theta=500000.0,
      tie_embeddings=True, dtype='bfloat16', param_dtype='float32',
      attention=dict(kind='dense', feature_map='hedgehog', feature_dim=64,
                     window=64, chunk_size=64, exact_tail=1))
  # paths: .txt/.jsonl files, directories or globs; text_field: the jsonl
  # field holding the text.
  c.data = dict(source='text', seq_len=4096, batch_size=256, seed=0,
                tokenizer='tokenizer.json', paths='data/', text_field='text')
  c.eval_data = None
  c.eval_batches = 16
  # split_mode 'random' (Orthros only): every row, all plain text, splits
  # at a P uniform in [W + 1, T], so the prefill formula always trains;
  # 'prompt' is the same on text (no row has a prompt). See
  # orthros_jax/training/step.py.
  c.train = dict(num_steps=100_000, learning_rate=3e-4, warmup_steps=2000,
                 weight_decay=0.1, split_mode='random', log_every=100,
                 eval_every=0, checkpoint_every=1000, keep_checkpoints=3)
  c.mesh = dict(shape=dict(data=1, fsdp=-1, tensor=1, sequence=1), rules=())
  return c
