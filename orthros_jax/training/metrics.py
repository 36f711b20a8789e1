"""Training metrics: workdir/metrics.jsonl, TensorBoard scalars, a progress bar.

Only process 0 writes (on other hosts every method is a no-op). TensorBoard
event files are written with tensorboardX, which needs no TensorFlow.
"""

from __future__ import annotations

import json
import math
import os
import time

import jax
import tqdm
from tensorboardX import SummaryWriter


class MetricsWriter:
  """Appends one JSON object per logged step to `workdir/metrics.jsonl` and
  the same scalars to TensorBoard events under `workdir/tensorboard`.

  resume_step: when resuming from a checkpoint, records logged after it (by
  the killed run) are dropped, so the file reads as one uninterrupted run.
  """

  def __init__(self, workdir: str | os.PathLike, *,
               resume_step: int | None = None, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.path = os.path.join(os.fspath(workdir), 'metrics.jsonl')
    self._file = self._tb = None
    if not self.enabled:
      return
    os.makedirs(os.fspath(workdir), exist_ok=True)
    self._truncate_after(0 if resume_step is None else resume_step)
    self._file = open(self.path, 'a', encoding='utf-8')
    self._tb = SummaryWriter(os.path.join(os.fspath(workdir), 'tensorboard'))

  def _truncate_after(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    with open(self.path, encoding='utf-8') as f:
      lines = [l for l in f if l.strip()]
    keep = []
    for line in lines:
      try:
        if json.loads(line)['step'] <= step:
          keep.append(line)
      except (ValueError, KeyError):
        pass  # a line torn by a kill mid-write
    with open(self.path, 'w', encoding='utf-8') as f:
      f.writelines(keep)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.enabled:
      return
    record = {'step': int(step)}
    for k, v in scalars.items():
      v = float(v)
      record[k] = v if math.isfinite(v) else repr(v)  # JSON has no NaN
      self._tb.add_scalar(k, v, int(step))
    self._file.write(json.dumps(record) + '\n')
    self._file.flush()
    self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._tb.close()
      self._file = self._tb = None


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
  """The records of `workdir/metrics.jsonl`, in order."""
  with open(os.path.join(os.fspath(workdir), 'metrics.jsonl'),
            encoding='utf-8') as f:
    return [json.loads(l) for l in f if l.strip()]


class ProgressBar:
  """tqdm over steps (process 0 only) showing the loss, `tok_s` (every
  input position the steps processed, padding included: B x T per step,
  the rate the hardware sees) and, when given, `loss_tok_s` (the positions
  the loss counts: every real next token of text, only the answer tokens
  of a synthetic task)."""

  def __init__(self, total: int, initial: int = 0, enabled: bool | None = None):
    enabled = jax.process_index() == 0 if enabled is None else enabled
    self._bar = tqdm.tqdm(total=total, initial=initial, disable=not enabled,
                          unit='step', dynamic_ncols=True)
    self._time = time.perf_counter()

  def update(self, steps: int, tokens: float, loss: float,
             loss_tokens: float | None = None) -> tuple[float, float]:
    """Advances the bar by `steps` that processed `tokens` input positions
    (and `loss_tokens` loss positions); returns (tokens/s, loss tokens/s)
    since the previous update, the second nan when not given."""
    now = time.perf_counter()
    elapsed = max(now - self._time, 1e-9)
    self._time = now
    rate = tokens / elapsed
    loss_rate = math.nan if loss_tokens is None else loss_tokens / elapsed
    self._bar.update(steps)
    post = dict(loss=f'{loss:.4f}', tok_s=f'{rate:,.0f}')
    if loss_tokens is not None:
      post['loss_tok_s'] = f'{loss_rate:,.0f}'
    self._bar.set_postfix(**post)
    return rate, loss_rate

  def close(self) -> None:
    self._bar.close()
