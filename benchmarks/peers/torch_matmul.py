"""PyTorch's side of benchmarks/matmul.py: the same chained (x @ B) @ C products, fp32, on
the same shapes (given by matmul.py as JSON in argv[2]), with torch's default CPU threads and
then with each thread count in the spec's "threads" list. Run by matmul.py --torch-python PY."""

import json
import statistics
import sys
import time

import torch


def main():
  repeats, spec = int(sys.argv[1]), json.loads(sys.argv[2])
  D, F = spec["d"], spec["f"]
  for threads in [torch.get_num_threads(), *spec.get("threads", [])]:
    torch.set_num_threads(threads)
    time_shapes(spec["shapes"], D, F, repeats)


def time_shapes(shapes, D, F, repeats):
  torch.manual_seed(0)
  for shape, (rows, chain) in shapes.items():
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
    n = torch.get_num_threads()
    name = f"torch {torch.__version__}, {n} thread{'s' if n > 1 else ''}"
    print(f"{label:36s} {name:33s} {gflops:6.0f}", flush=True)


if __name__ == "__main__":
  main()
