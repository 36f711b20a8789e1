"""The kernel benchmark's cost model (benchmarks/kernels.py): the matmul
FLOPs each prefill executes, the compulsory memory traffic of prefill and
decode, and a rough peak-memory estimate used to skip sizes that cannot
fit. `s` is the benchmark's shape dict (batch, heads, kv_heads, head_dim,
feature_dim, window, chunk, dense_block)."""

import jax


def orthros_block_keys(n, window, chunk):
  """Keys per query in the chunked algorithm's block: (nb + 1) * C."""
  num_chunks = -(-n // chunk)
  nb = -(-(window - 1) // chunk) if window > 1 else 0
  return (min(nb, num_chunks - 1) + 1) * chunk


def prefill_flops(impl, n, s):
  """FLOPs per call (2 per multiply-add), matmul work only.

  dense causal (ideal): QK^T and PV over N^2/2 pairs:
    2 * 2 * B * H * (N^2 / 2) * D.
  dense blocked (executed): whole bq x bk blocks on and below the diagonal,
    nq (nq + 1) / 2 of them, nq = ceil(N / block):
    2 * 2 * B * H * D * block^2 * nq (nq + 1) / 2.
  orthros (executed by the chunked algorithm, S_blk = (nb + 1) * C keys per
    query, nb = ceil((W - 1) / C)):
    B * H * N * (2 * S_blk * (2 * D + F) + 4 * F * D)
    i.e. q.k (D), phi_q.phi_k (F) and w.v (D) over the block, plus phi_q S
    (read of the state) and phi_k v^T (fold into the state).
  """
  b, h, d, f = s['batch'], s['heads'], s['head_dim'], s['feature_dim']
  if impl.startswith('dense'):
    return 2 * 2 * b * h * (n * n / 2) * d
  s_blk = orthros_block_keys(n, s['window'], s['chunk'])
  return b * h * n * (2 * s_blk * (2 * d + f) + 4 * f * d)


def dense_blocked_executed_flops(n, s):
  nq = -(-n // min(s['dense_block'], n))
  blk = min(s['dense_block'], n)
  return 2 * 2 * s['batch'] * s['heads'] * s['head_dim'] * blk * blk * (
      nq * (nq + 1) / 2)


def prefill_bytes(impl, n, s, itemsize):
  """Compulsory HBM/DRAM traffic: read q, k, v (+ phi_q, phi_k), write y."""
  b, h, kh, d, f = (s['batch'], s['heads'], s['kv_heads'], s['head_dim'],
                    s['feature_dim'])
  qkvo = b * n * (2 * h * d + 2 * kh * d)
  phi = 2 * b * n * h * f if impl.startswith('orthros') else 0
  return (qkvo + phi) * itemsize


def prefill_memory(impl, n, s, itemsize):
  """Rough peak bytes, to skip sizes that cannot fit."""
  b, h, kh, d, f = (s['batch'], s['heads'], s['kv_heads'], s['head_dim'],
                    s['feature_dim'])
  io = prefill_bytes('orthros', n, s, itemsize)
  if impl == 'orthros_xla':  # float32 copies, chunked copies, stacked ys
    return io + 3 * 4 * b * n * (2 * h * d + 2 * kh * d + 2 * h * f)
  if impl == 'dense_xla':  # padded/moved k, v copies, f32 out, block scores
    blk = min(s['dense_block'], n)
    return io + 4 * b * n * (h * d + 2 * kh * d) * 2 + 4 * 4 * b * h * blk**2
  if impl == 'orthros_pallas' and jax.default_backend() == 'gpu':
    # the chunk-parallel schedule's float32 chunk states and prefix sums
    return 2 * io + 3 * 4 * b * h * -(-n // s['chunk']) * f * (d + 1)
  return 2 * io  # kernels: inputs, outputs, small per-block scratch


def decode_bytes(lengths, s, itemsize):
  """K and V cache bytes read for the valid keys: sum_b L_b * 2 * K * D."""
  return int(sum(lengths)) * 2 * s['kv_heads'] * s['head_dim'] * itemsize
