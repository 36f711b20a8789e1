"""How much of each query's attention goes to tokens older than the window?

Orthros' prefill gives a query at position t the weights
`gamma * exp(s_tj - m_t)` on its exact set (window and sinks) and
`phi_q(q_t) . phi_k(k_j)` on every older token, with one shared denominator
(docs/ARCHITECTURE.md section 3). The share of that denominator that the
older tokens take should follow the teacher's own softmax mass on the same
tokens. If the feature maps were fitted on shorter rows than they are used
on, the linear mass can grow with the prompt faster than the teacher's and
drown the window (or fall behind and lose the far past). This script
measures both shares on held-out text, layer by layer, at several prompt
lengths, on the teacher's own hidden states (stage 1's setting: every layer
sees the input the teacher gives it):

  python benchmarks/linear_share.py --checkpoint assets/smollm2_orthros \
      --teacher results/smollm2/hf --lengths 1024,2048,4096 --rows 2 \
      --out results/linear_share

`--checkpoint` takes several adapters or convert.py workdirs (comma
separated) to compare feature maps on the same rows. Shares are averaged
over the queries of the last quarter of each row (their older set is
large) and over heads and rows. Writes results.json, report.md and
linear_share.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import ml_collections  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from orthros_jax import rope  # pylint: disable=wrong-import-position
from orthros_jax.config import ModelConfig  # pylint: disable=wrong-import-position
from orthros_jax.conversion import transfer  # pylint: disable=wrong-import-position
from orthros_jax.data import get_tokenizer  # pylint: disable=wrong-import-position
from orthros_jax.data import make_dataset  # pylint: disable=wrong-import-position
from orthros_jax.evaluation import loading  # pylint: disable=wrong-import-position
from orthros_jax.model import Attention  # pylint: disable=wrong-import-position


def _qk_features(module: Attention, x, positions):
  q = rope.apply_rope(module.q_proj(x), positions, module.inv_freq)
  k = rope.apply_rope(module.k_proj(x), positions, module.inv_freq)
  phi_q, phi_k, gamma = module._orthros_inputs(q, k, positions)  # pylint: disable=protected-access
  return q, k, phi_q, phi_k, gamma


def layer_shares(config: ModelConfig, layer_params: dict, x: jax.Array,
                 first: int) -> tuple[jax.Array, jax.Array]:
  """(teacher share [B, H], Orthros share [B, H]) of one layer: the mean
  over queries t >= first of the attention mass on tokens older than the
  window and not sinks, for the dense softmax and for Orthros' prefill
  weights, from the layer's input x [B, T, E]."""
  a = config.attention
  t_len = x.shape[1]
  positions = jnp.broadcast_to(jnp.arange(t_len), x.shape[:2])
  q, k, phi_q, phi_k, gamma = Attention(config).apply(
      {'params': layer_params}, x, positions, method=_qk_features)
  k = jnp.repeat(k, config.num_groups, axis=2).astype(jnp.float32)
  q = q.astype(jnp.float32)
  s = jnp.einsum('bthd,bshd->bhts', q, k) / np.sqrt(config.head_dim)
  t = jnp.arange(t_len)[:, None]
  j = jnp.arange(t_len)[None, :]
  causal = j <= t
  exact = causal & ((j > t - a.window) | (j < a.sinks))
  older = causal & ~exact
  s_causal = jnp.where(causal, s, -jnp.inf)
  p = jax.nn.softmax(s_causal, axis=-1)
  teacher = jnp.sum(jnp.where(older, p, 0.0), axis=-1)  # [B, H, T]
  m = jnp.max(jnp.where(exact, s, -jnp.inf), axis=-1, keepdims=True)
  win = gamma[None, :, None] * jnp.sum(
      jnp.where(exact, jnp.exp(s - m), 0.0), axis=-1)
  lin_w = jnp.einsum('bthf,bshf->bhts', phi_q.astype(jnp.float32),
                     phi_k.astype(jnp.float32))
  lin = jnp.sum(jnp.where(older, lin_w, 0.0), axis=-1)
  orthros = lin / (win + lin)
  return (jnp.mean(teacher[..., first:], axis=-1),
          jnp.mean(orthros[..., first:], axis=-1))


def run(checkpoints, teacher: str, *, lengths, rows: int, seed: int,
        heldout: str, sinks: int, tokenizer: str | None = None) -> dict:
  tok = get_tokenizer(tokenizer or teacher)
  loaded = {}
  for path in checkpoints:
    cfg = ml_collections.ConfigDict(dict(checkpoint=path, teacher=teacher,
                                         models=('teacher', 'orthros'),
                                         sinks=sinks))
    models, _ = loading.load_models(cfg)
    loaded[path] = models['orthros'][:2]
    teacher_model = models['teacher'][:2]
  t_cfg, t_params = teacher_model
  out = {'settings': dict(checkpoints=list(checkpoints), teacher=teacher,
                          lengths=list(lengths), rows=rows, seed=seed,
                          heldout=heldout, queries='last quarter of each row'),
         'results': []}
  for length in lengths:
    batch = next(iter(make_dataset(
        'text', seq_len=length, batch_size=rows, seed=seed, paths=heldout,
        tokenizer=tok, num_epochs=1)))
    tokens = jnp.asarray(batch['inputs'])
    inputs, _ = jax.jit(transfer.teacher_attention_io, static_argnums=0)(
        t_cfg, t_params, tokens)
    first = 3 * length // 4
    for path, (cfg, params) in loaded.items():
      fn = jax.jit(lambda p, x, c=cfg: layer_shares(c, p, x, first))
      teach, orth = [], []
      for layer in range(cfg.num_layers):
        # One row at a time: [H, T, T] float32 score matrices per row.
        t_s, o_s = zip(*[fn(params[f'layers_{layer}']['attn'],
                            inputs[layer, b:b + 1]) for b in range(rows)])
        teach.append(float(np.mean(t_s)))
        orth.append(float(np.mean(o_s)))
      row = dict(checkpoint=path, length=length, teacher=teach, orthros=orth,
                 teacher_mean=float(np.mean(teach)),
                 orthros_mean=float(np.mean(orth)))
      out['results'].append(row)
      print(f"{length} tokens, {path}: older-token share, mean over layers: "
            f"teacher {row['teacher_mean']:.3f}, Orthros "
            f"{row['orthros_mean']:.3f}", flush=True)
  return out


def table(res: dict) -> str:
  lines = ['| checkpoint | length | teacher | Orthros | Orthros / teacher |'
           ' layers where Orthros > 2x teacher |',
           '|---|---|---|---|---|---|']
  for r in res['results']:
    over = sum(o > 2 * t for t, o in zip(r['teacher'], r['orthros']))
    lines.append(f"| {r['checkpoint']} | {r['length']} | "
                 f"{r['teacher_mean']:.3f} | {r['orthros_mean']:.3f} | "
                 f"{r['orthros_mean'] / r['teacher_mean']:.2f} | "
                 f"{over} of {len(r['teacher'])} |")
  return '\n'.join(lines)


def plot(res: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  lengths = res['settings']['lengths']
  fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6),
                           sharey=True, squeeze=False)
  for ax, length in zip(axes[0], lengths):
    rows = [r for r in res['results'] if r['length'] == length]
    ax.plot(rows[0]['teacher'], 'k-', lw=2, label='teacher (softmax)')
    for r in rows:
      ax.plot(r['orthros'], '--', label=f"Orthros: {r['checkpoint']}")
    ax.set_title(f'{length} tokens')
    ax.set_xlabel('layer')
  axes[0][0].set_ylabel('attention mass on tokens older than the window')
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--checkpoint', default='assets/smollm2_orthros',
                 help='adapters or convert.py workdirs, comma separated')
  p.add_argument('--teacher', default='results/smollm2/hf')
  p.add_argument('--tokenizer', default=None,
                 help="default: the teacher's directory; 'byte' for the "
                 'tiny models')
  p.add_argument('--heldout', default='results/corpus_pydoc/heldout.jsonl')
  p.add_argument('--lengths', default='1024,2048,4096')
  p.add_argument('--rows', type=int, default=2)
  p.add_argument('--seed', type=int, default=1)
  p.add_argument('--sinks', type=int, default=4)
  p.add_argument('--out', default='results/linear_share')
  args = p.parse_args(argv)
  lengths = [int(n) for n in args.lengths.split(',')]
  if min(lengths) < 1 or args.rows < 1:
    raise ValueError(f'lengths {lengths} and rows {args.rows} must be >= 1')
  res = run(args.checkpoint.split(','), args.teacher, lengths=lengths,
            rows=args.rows, seed=args.seed, heldout=args.heldout,
            sinks=args.sinks, tokenizer=args.tokenizer)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(res, f, indent=1)
  plot(res, os.path.join(args.out, 'linear_share.png'))
  md = ['# Attention mass on tokens older than the window', '',
        f"Settings: {json.dumps(res['settings'])}", '', table(res), '',
        '![linear_share.png](linear_share.png)']
  with open(os.path.join(args.out, 'report.md'), 'w') as f:
    f.write('\n'.join(md) + '\n')
  print(table(res))


if __name__ == '__main__':
  main()
