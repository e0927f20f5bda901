"""PyTorch's side of benchmarks/matmul.py: the same chained (x @ B) @ C products, fp32, on
the same shapes, with torch's default CPU threads. Run by matmul.py --torch-python PY."""

import statistics
import sys
import time

import torch

D, F = 256, 688


def main():
  repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
  torch.manual_seed(0)
  for shape, rows in {"decode": 64, "learner": 4032}.items():
    chain = 200 if rows < 1000 else 8
    x = torch.randn(rows, D)
    b, c = torch.randn(D, F) * D**-0.5, torch.randn(F, D) * F**-0.5

    def chained():
      y = x
      for _ in range(chain):
        y = (y @ b) @ c
      return y

    chained()
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      chained()
      times.append(time.perf_counter() - t)
    gflops = 2 * 2 * rows * D * F * chain / statistics.median(times) / 1e9
    label = f"{shape} [{rows}, {D}] x [{D}, {F}]"
    name = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    print(f"{label:36s} {name:33s} {gflops:6.0f}", flush=True)


if __name__ == "__main__":
  main()
