"""One of two local processes (4 CPU devices each, gloo collectives) forming one 8-device mesh.

Run by tests/test_hf.py::test_two_processes_read_only_their_shards as
    python tests/hf_two_hosts.py PROCESS_ID PORT FIXTURE OUT_DIR
It loads FIXTURE into fsdp 2 x tensor 4 (one fsdp row per process), records every slice this
process read, checks the logits against transformers', exports to OUT_DIR, and prints one JSON
line with what it saw.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main():
  pid, port, fixture, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
  from jaxrl.io import hf
  from jaxrl.models import apply
  from jaxrl.parallel import make_mesh

  mesh = make_mesh(fsdp=2, tensor=4)
  reader = hf._Reader()
  cfg, graphdef, params = hf.load_hf(fixture, mesh, "learner", reader=reader)
  maps = hf.tensor_map(cfg)
  full = {m.hf_name: int(np.prod(m.hf_shape)) for m in maps.values()}
  read = {}
  for name, shape in reader.reads:
    read[name] = read.get(name, 0) + int(np.prod(shape))

  ref = np.load(os.path.join(fixture, "reference.npz"))
  tokens = ref["tokens"].astype(np.int32)
  tokens = jax.make_array_from_callback(tokens.shape, NamedSharding(mesh, P()),
                                        lambda ix: tokens[ix])
  logits, _ = jax.jit(apply, static_argnums=0)(graphdef, params, tokens)
  logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
  files = hf.save_hf(out, cfg, params, max_shard_bytes=200_000)
  print(json.dumps({
      "process": pid, "devices": jax.device_count(), "local": jax.local_device_count(),
      "read": read, "full": full,
      "max_logit_diff": float(np.abs(logits - ref["logits"]).max()), "files": files}),
      flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
