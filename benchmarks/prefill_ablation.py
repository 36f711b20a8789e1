r"""Which layers need exact attention during the prefill? A diagnostic for a
conversion that loses a retrieval task.

  python benchmarks/prefill_ablation.py --checkpoint results/demo/convert \
      --teacher assets/tiny_teacher --task passkey --length 384 \
      --out results/prefill_ablation

Two measurements on the same `--num_examples` examples of `--task`
(orthros_jax.evaluation.tasks, seeded):

1. Attention mass beyond the window, per layer and head: for every query
   t >= W of the prompt, the share of its attention weight on keys older
   than the window (j <= t - W), averaged over queries; for the dense
   teacher (its softmax on its own hidden states) and for the Orthros model
   (the linear part's share of the hybrid prefill's shared denominator, on
   the Orthros model's own hidden states). A layer where the teacher keeps
   most of its mass inside the window is one the hybrid can copy; a large
   teacher share that the hybrid does not reproduce points at the layers
   whose long-range prefill attention the task uses.
2. Teacher-forced exact match of the answer through the inference split
   (prompt minus the exact tail through the prefill formula, the rest exact,
   as `forward(split=...)` trains it) with the prefill of a set of layers
   replaced by exact causal softmax: no layer (the Orthros model), each
   layer alone, each prefix of layers, each suffix, and all layers (= the
   same weights with dense attention).

The exact-layer replacement is a diagnostic (flax method interception), not
a model option: a layer with exact prefill attention costs O(N^2). Writes
<out>/prefill_ablation.json and <out>/prefill_ablation.md and prints the
tables.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import sys

from absl import app
from absl import flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from orthros_jax.data import get_tokenizer  # noqa: E402
from orthros_jax.evaluation import tasks as tasks_lib  # noqa: E402
from orthros_jax.evaluation.loading import load_checkpoint  # noqa: E402
from orthros_jax.model import Attention  # noqa: E402
from orthros_jax.model import Transformer  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string('checkpoint', None, 'Orthros checkpoint (a convert.py '
                    'workdir or its orthros/ directory).')
flags.DEFINE_string('teacher', '', 'Dense teacher (a train.py workdir or '
                    'params checkpoint); default: the Orthros weights with '
                    'dense attention.')
flags.DEFINE_string('task', 'passkey', 'Task of orthros_jax.evaluation.tasks '
                    'with a single answer (passkey, niah, niah_single, ...).')
flags.DEFINE_integer('length', 384, 'Prompt + answer length in tokens.')
flags.DEFINE_integer('num_examples', 32, 'Examples (one batch).')
flags.DEFINE_integer('seed', 1234, 'Task seed.')
flags.DEFINE_string('tokenizer', 'byte', 'Tokenizer name.')
flags.DEFINE_string('out', 'results/prefill_ablation', 'Output folder.')


def _layer(module: Attention) -> int:
  return int(module.scope.path[-2].split('_')[-1])


def batch_of(examples) -> tuple[np.ndarray, np.ndarray, list]:
  """tokens [B, T] (prompt + target, right-padded), prompt lengths [B],
  targets."""
  width = max(len(e.prompt) + len(e.target) for e in examples)
  tokens = np.zeros((len(examples), width), np.int32)
  for i, e in enumerate(examples):
    tokens[i, :len(e.prompt) + len(e.target)] = list(e.prompt) + list(
        e.target)
  return (tokens, np.array([len(e.prompt) for e in examples], np.int32),
          [list(e.target) for e in examples])


def far_mass(config, params, tokens: np.ndarray, lengths: np.ndarray,
             window: int | None = None) -> np.ndarray:
  """[L, H] share of attention beyond the window (see module doc), over
  the prompt queries t >= W of every example. W: `window`, default the
  config's (give the Orthros model's window for a dense teacher: its
  config's window is whatever it was built with, unused by its attention)."""
  w = config.attention.window if window is None else window
  captured = {}

  def capture(next_fun, args, kwargs, context):
    if isinstance(context.module, Attention) and (
        context.method_name == '_forward'):
      q, k = args[0], args[1]
      b, t = q.shape[:2]
      positions = jnp.broadcast_to(jnp.arange(t), (b, t))
      extra = (context.module._orthros_inputs(q, k, positions)  # pylint: disable=protected-access
               if config.is_orthros else None)
      captured[_layer(context.module)] = (q, k, extra)
    return next_fun(*args, **kwargs)

  split = None if not config.is_orthros else jnp.asarray(lengths)
  with nn.intercept_methods(capture):
    Transformer(config).apply({'params': params}, jnp.asarray(tokens),
                              phase='forward', split=split)
  t = tokens.shape[1]
  pos = np.arange(t)
  older = pos[None, :] <= pos[:, None] - w             # [T, S]
  causal = pos[None, :] <= pos[:, None]
  queries = (pos[None, :] >= w) & (pos[None, :] < lengths[:, None])  # [B, T]
  out = np.zeros((config.num_layers, config.num_heads))
  for layer, (q, k, extra) in sorted(captured.items()):
    q = np.asarray(q, np.float64)
    k = np.repeat(np.asarray(k, np.float64), config.num_groups, axis=2)
    s = np.einsum('bthd,bshd->bhts', q, k) / np.sqrt(q.shape[-1])
    if extra is None:
      s = np.where(causal, s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      share = (p * older).sum(-1) / p.sum(-1)
    else:
      phi_q, phi_k, gamma = (np.asarray(x, np.float64) for x in extra)
      win = np.where(causal & ~older, s, -np.inf)
      ew = gamma[None, :, None, None] * np.exp(
          win - win.max(-1, keepdims=True))
      lin = np.einsum('bthf,bshf->bhts', phi_q, phi_k) * older
      share = lin.sum(-1) / (lin.sum(-1) + ew.sum(-1))
    weights = queries[:, None, :]                        # [B, 1, T]
    # No query at t >= W (a prompt within the window): nothing beyond it.
    out[layer] = (share * weights).sum((0, 2)) / max(weights.sum(), 1)
  return out


def exact_match(config, params, tokens, lengths, targets,
                exact_layers: frozenset[int]) -> float:
  """Teacher-forced exact match with the prefill of `exact_layers` exact."""

  def replace(next_fun, args, kwargs, context):
    if (isinstance(context.module, Attention) and
        context.method_name == '_forward' and
        _layer(context.module) in exact_layers):
      q, k, v = args[0], args[1], args[2]
      from orthros_jax.attention import softmax_attention  # pylint: disable=g-import-not-at-top
      return softmax_attention(q, k, v, causal=True)
    return next_fun(*args, **kwargs)

  split = jnp.asarray(np.maximum(lengths - config.attention.exact_tail, 0))
  with nn.intercept_methods(replace):
    logits, _ = Transformer(config).apply(
        {'params': params}, jnp.asarray(tokens), phase='forward', split=split)
  pred = np.asarray(jnp.argmax(logits, -1))
  ok = [all(pred[i, n - 1 + j] == a for j, a in enumerate(target))
        for i, (n, target) in enumerate(zip(lengths, targets))]
  return float(np.mean(ok))


def layer_sets(n: int) -> list[tuple[int, ...]]:
  sets = [()] + [(i,) for i in range(n)]
  sets += [tuple(range(i)) for i in range(2, n + 1)]      # prefixes
  sets += [tuple(range(i, n)) for i in range(1, n - 1)]   # suffixes
  seen, out = set(), []
  for s in sets:
    if s not in seen:
      seen.add(s)
      out.append(s)
  return out


def run(checkpoint: str, teacher: str, task: str, length: int,
        num_examples: int, seed: int, tokenizer_name: str) -> dict:
  student, params, step = load_checkpoint(checkpoint)
  if not student.is_orthros:
    raise ValueError(f'{checkpoint} is a dense model: give the Orthros '
                     'checkpoint a conversion wrote')
  if teacher:
    t_config, t_params, _ = load_checkpoint(teacher)
  else:
    t_config, t_params = student.replace(attention={'kind': 'dense'}), params
  tokenizer = get_tokenizer(tokenizer_name)
  examples = tasks_lib.make_examples(task, seed, tokenizer, length,
                                     num_examples)
  if any(len(e.answers) != 1 for e in examples):
    raise ValueError(f'task {task} has several answers per example: use a '
                     'single-answer task (passkey, niah, niah_single, ...)')
  tokens, lengths, targets = batch_of(examples)
  rows = []
  for layers in layer_sets(student.num_layers):
    acc = exact_match(student, params, tokens, lengths, targets,
                      frozenset(layers))
    rows.append({'exact_prefill_layers': list(layers), 'exact_match': acc})
    print(f'exact prefill in layers {list(layers) or "none"}: '
          f'{100 * acc:.1f}%', flush=True)
  teacher_acc = exact_match(t_config, t_params, tokens, lengths, targets,
                            frozenset())
  return {
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(),
      'backend': jax.default_backend(), 'jax': jax.__version__,
      'checkpoint': checkpoint, 'step': step, 'teacher': teacher or None,
      'task': task, 'length': length, 'num_examples': num_examples,
      'seed': seed, 'window': student.attention.window,
      'exact_tail': student.attention.exact_tail,
      'teacher_exact_match': teacher_acc,
      'ablation': rows,
      'far_mass': {
          'teacher': far_mass(t_config, t_params, tokens, lengths,
                              window=student.attention.window).tolist(),
          'orthros': far_mass(student, params, tokens, lengths).tolist()},
  }


def report(result: dict) -> str:
  lines = [f"# Prefill ablation: {result['task']} @ {result['length']} "
           'tokens', '',
           f"{result['checkpoint']} (step {result['step']}), window "
           f"{result['window']}, exact tail {result['exact_tail']}; "
           f"{result['num_examples']} examples (seed {result['seed']}); "
           f"{result['date']}, {result['backend']}, jax {result['jax']}.", '',
           '## Teacher-forced exact match with exact prefill in some layers',
           '', '| exact prefill layers | exact match % |', '|---|---|']
  for row in result['ablation']:
    layers = ', '.join(map(str, row['exact_prefill_layers'])) or 'none'
    lines.append(f"| {layers} | {100 * row['exact_match']:.1f} |")
  lines.append(f"| dense teacher | {100 * result['teacher_exact_match']:.1f}"
               ' |')
  lines += ['', '## Attention mass beyond the window (mean over prompt '
            'queries t >= W)', '', '| layer | teacher (per head) | orthros '
            '(per head) |', '|---|---|---|']
  for i, (t, o) in enumerate(zip(result['far_mass']['teacher'],
                                 result['far_mass']['orthros'])):
    fmt = lambda xs: ' '.join(f'{x:.2f}' for x in xs)
    lines.append(f'| {i} | {fmt(t)} | {fmt(o)} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  if not FLAGS.checkpoint:
    raise app.UsageError('--checkpoint is required')
  result = run(FLAGS.checkpoint, FLAGS.teacher, FLAGS.task, FLAGS.length,
               FLAGS.num_examples, FLAGS.seed, FLAGS.tokenizer)
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, 'prefill_ablation.json'), 'w') as f:
    json.dump(result, f, indent=1)
  text = report(result)
  with open(os.path.join(FLAGS.out, 'prefill_ablation.md'), 'w') as f:
    f.write(text)
  print(text)
  print(f'wrote {FLAGS.out}/prefill_ablation.json and prefill_ablation.md')


if __name__ == '__main__':
  app.run(main)
