"""The paged cache's XLA gather path (jaxrl.models.attention.xla_paged_decode_attention) on CPU,
in the pool layout [K, N, P, H] against the [N, K, P, H] it replaced, one layer's decode call,
alternating (docs/guides/kernels.md, "One layout").

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/paged_gather_cpu.py

The bench preset's attention shape (K = 2, G = 2, H = 64), 64 slots, tables of 12 pages of 16,
every slot at position 150; prints the median milliseconds per call of each layout.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import attention

B, K, G, H, P, n = 64, 2, 2, 64, 16, 12


def old_layout(q, keys_nkph, values_nkph, pages_bn, pos_b):
  idx = jnp.maximum(pages_bn, 0)

  def view(pool):  # [B, n, K, P, H] -> [B, K, n * P, H]
    return pool[idx].transpose(0, 2, 1, 3, 4).reshape(B, K, n * P, H)

  return attention.xla_decode_attention(q, view(keys_nkph), view(values_nkph), pos_b)


def median_ms(fn, *args, reps=30):
  fn(*args).block_until_ready()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def main():
  r = np.random.default_rng(0)
  q = jnp.asarray(r.normal(size=(B, K, G, H)), jnp.float32)
  pool_knph = jnp.asarray(r.normal(size=(K, B * n, P, H)), jnp.float32)
  pool_nkph = jnp.transpose(pool_knph, (1, 0, 2, 3))
  pages = jnp.asarray(r.permutation(B * n).reshape(B, n).astype(np.int32))
  pos = jnp.full((B,), 150, jnp.int32)
  old, new = jax.jit(old_layout), jax.jit(attention.xla_paged_decode_attention)
  np.testing.assert_allclose(old(q, pool_nkph, pool_nkph, pages, pos),
                             new(q, pool_knph, pool_knph, pages, pos), atol=1e-5)
  res = {"[N, K, P, H]": [], "[K, N, P, H]": []}
  for _ in range(5):
    res["[N, K, P, H]"].append(median_ms(old, q, pool_nkph, pool_nkph, pages, pos))
    res["[K, N, P, H]"].append(median_ms(new, q, pool_knph, pool_knph, pages, pos))
  for name, ms in res.items():
    print(f"{name}: {np.median(ms):.2f} ms per call (medians {', '.join(f'{m:.2f}' for m in ms)})")


if __name__ == "__main__":
  main()
