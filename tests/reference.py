"""Float64 numpy references for the attention math (docs/ARCHITECTURE.md section 3).

Written from the formulas, not from the implementation: explicit loops over
batch, head and query, one weight vector per query. Slow, but only used on
small sizes (and on a handful of rows for the long-sequence test).

Einsum letters: B batch, T query length, S key length, H query heads,
K kv heads, D head dim, F feature dim, P feature-map projection width.
"""

from __future__ import annotations

import numpy as np


def _f64(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


# ----------------------------------------------------------------------------
# Feature maps.
# ----------------------------------------------------------------------------


def _softmax_last(u: np.ndarray) -> np.ndarray:
  e = np.exp(u - u.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def feature_map(name: str, x, w) -> np.ndarray:
  """phi(x): x [..., H, D], w [H, D, P] -> [..., H, F]."""
  x, w = _f64(x), _f64(w)
  n_heads, _, p = w.shape
  assert x.shape[-2] == n_heads
  # u[..., h, :] = x[..., h, :] @ w[h], one head at a time.
  u = np.stack([x[..., h, :] @ w[h] for h in range(n_heads)], axis=-2)
  if name == 'hedgehog':
    return np.concatenate([_softmax_last(u), _softmax_last(-u)], axis=-1)
  if name == 'elu':
    return np.where(u > 0, u, np.expm1(u)) + 1.0
  if name == 'relu':
    return np.maximum(u, 0.0)
  if name == 'taylor':
    ones = np.ones(u.shape[:-1] + (1,))
    outer = u[..., :, None] * u[..., None, :]  # [..., H, P, P]
    second = outer.reshape(u.shape[:-1] + (p * p,))  # row-major: index a*P+b
    return np.concatenate(
        [ones, u / p**0.25, second / (np.sqrt(2.0) * np.sqrt(p))], axis=-1)
  raise ValueError(name)


def feature_dim(name: str, p: int) -> int:
  return {'hedgehog': 2 * p, 'elu': p, 'relu': p, 'taylor': 1 + p + p * p}[name]


# ----------------------------------------------------------------------------
# Exact softmax attention.
# ----------------------------------------------------------------------------


def _softmax_row(q_row, k_rows, v_rows) -> np.ndarray:
  """One query over a set of keys: q [D], k/v [N, D] -> [D]."""
  s = k_rows @ q_row / np.sqrt(q_row.shape[-1])
  p = np.exp(s - s.max())
  return (p @ v_rows) / p.sum()


def softmax_attention(q, k, v, *, causal=True, rows=None) -> np.ndarray:
  """q [B,T,H,D], k/v [B,S,K,D] -> [B,T,H,D].

  Query i sits at absolute position S - T + i; causal: it sees keys j <= that.
  `rows`: optional list of query indices to compute (others left as NaN).
  """
  q, k, v = _f64(q), _f64(k), _f64(v)
  b_, t_, h_, _ = q.shape
  s_, k_heads = k.shape[1], k.shape[2]
  group = h_ // k_heads
  out = np.full(q.shape, np.nan)
  for b in range(b_):
    for h in range(h_):
      kh = h // group
      for i in (range(t_) if rows is None else rows):
        last = s_ - t_ + i if causal else s_ - 1
        out[b, i, h] = _softmax_row(q[b, i, h], k[b, :last + 1, kh],
                                    v[b, :last + 1, kh])
  return out


def decode_attention(q, k_cache, v_cache, lengths) -> np.ndarray:
  """q [B,Tq,H,D], cache [B,Smax,K,D], lengths [B] -> [B,Tq,H,D].

  Query i of example b is at position lengths[b] - Tq + i and sees keys
  j <= that position; cache entries j >= lengths[b] are never read.
  """
  q, k, v = _f64(q), _f64(k_cache), _f64(v_cache)
  b_, tq, h_, _ = q.shape
  group = h_ // k.shape[2]
  out = np.zeros(q.shape)
  for b in range(b_):
    for h in range(h_):
      kh = h // group
      for i in range(tq):
        pos = int(lengths[b]) - tq + i
        out[b, i, h] = _softmax_row(q[b, i, h], k[b, :pos + 1, kh],
                                    v[b, :pos + 1, kh])
  return out


def attention_vjp(q, k, v, dout, q_pos, kv_len):
  """The gradient of sum(dout * attention(q, k, v)) for exact attention:
  (dq [B,T,H,D], dk, dv [B,S,K,D]). Query i of example b sits at q_pos[b, i]
  and sees keys j <= q_pos[b, i] with j < kv_len[b] (q_pos = S - 1
  everywhere for non-causal attention); a query that sees no key has
  output 0 and no gradient. From the softmax Jacobian, one query at a
  time: p = softmax(s), o = p V; dV += p dout, dp = V dout,
  ds = p (dp - p . dp), dq = ds K / sqrt(D), dK += ds q / sqrt(D)."""
  q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
  b_, t_, h_, d_ = q.shape
  group = h_ // k.shape[2]
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  for b in range(b_):
    for h in range(h_):
      kh = h // group
      for i in range(t_):
        n = min(int(q_pos[b, i]) + 1, int(kv_len[b]))
        if n <= 0:
          continue
        keys, vals = k[b, :n, kh], v[b, :n, kh]
        s = keys @ q[b, i, h] / np.sqrt(d_)
        p = np.exp(s - s.max())
        p /= p.sum()
        dv[b, :n, kh] += p[:, None] * dout[b, i, h][None, :]
        dp = vals @ dout[b, i, h]
        ds = p * (dp - p @ dp) / np.sqrt(d_)
        dq[b, i, h] = ds @ keys
        dk[b, :n, kh] += ds[:, None] * q[b, i, h][None, :]
  return dq, dk, dv


# ----------------------------------------------------------------------------
# Orthros prefill: sliding-window softmax + linear attention on older keys.
# ----------------------------------------------------------------------------


def orthros_prefill(q, k, v, phi_q, phi_k, gamma, *, window, lengths=None,
                    sinks=0, length_exponent=None):
  """Section 3 prefill formula, one weight per (query, key).

  q [B,T,H,D], k/v [B,T,K,D], phi_q/phi_k [B,T,H,F], gamma [H].
  Returns (y [B,T,H,D], S [B,H,F,D], z [B,H,F]). Example b uses only its first
  L = lengths[b] tokens (T if None); y at t >= L is left as NaN. Keys
  j < sinks join every query's exact (window) set and never the linear part
  or the state. length_exponent [H] (attention.length_scale): the linear
  weights of query t times (max(1, t + 1 - W - sinks) / max(W, 1)) ** -a_h.
  """
  q, k, v = _f64(q), _f64(k), _f64(v)
  phi_q, phi_k, gamma = _f64(phi_q), _f64(phi_k), _f64(gamma)
  b_, t_, h_, d_ = q.shape
  f_ = phi_q.shape[-1]
  group = h_ // k.shape[2]
  lengths = [t_] * b_ if lengths is None else [int(n) for n in lengths]
  y = np.full(q.shape, np.nan)
  state_s = np.zeros((b_, h_, f_, d_))
  state_z = np.zeros((b_, h_, f_))
  for b in range(b_):
    n = lengths[b]
    for h in range(h_):
      kh = h // group
      for t in range(n):
        keys = np.arange(t + 1)  # causal: j <= t
        in_window = (keys > t - window) | (keys < sinks)
        weights = np.zeros(t + 1)
        scores = k[b, :t + 1, kh] @ q[b, t, h] / np.sqrt(d_)
        if in_window.any():
          m = scores[in_window].max()
          weights[in_window] = gamma[h] * np.exp(scores[in_window] - m)
        older = ~in_window
        weights[older] = phi_k[b, keys[older], h] @ phi_q[b, t, h]
        if length_exponent is not None:
          n_old = max(1, t + 1 - window - sinks)
          weights[older] *= (n_old / max(window, 1)) ** -float(
              length_exponent[h])
        den = weights.sum()
        y[b, t, h] = 0.0 if den == 0.0 else (weights @ v[b, :t + 1, kh]) / den
      for j in range(sinks, max(n - window, 0)):  # sinks <= j < L - W
        state_s[b, h] += np.outer(phi_k[b, j, h], v[b, j, kh])
        state_z[b, h] += phi_k[b, j, h]
  return y, state_s, state_z


def causal_linear_attention(v, phi_q, phi_k, *, n_kv_heads) -> np.ndarray:
  """Plain causal linear attention y_t = sum_{j<=t} a_tj v_j / sum_j a_tj.

  a_tj = phi_q(t).phi_k(j); an all-zero denominator gives output 0.
  v [B,T,K,D], phi_q/phi_k [B,T,H,F].
  """
  v, phi_q, phi_k = _f64(v), _f64(phi_q), _f64(phi_k)
  b_, t_, h_, _ = phi_q.shape
  group = h_ // n_kv_heads
  y = np.zeros((b_, t_, h_, v.shape[-1]))
  for b in range(b_):
    for h in range(h_):
      for t in range(t_):
        a = phi_k[b, :t + 1, h] @ phi_q[b, t, h]
        den = a.sum()
        if den != 0.0:
          y[b, t, h] = a @ v[b, :t + 1, h // group] / den
  return y
