"""Host-side agreement across processes (jaxrl.parallel.distributed: process_zero_value,
any_process) on 2 real processes sharing jax.distributed's coordination service. No device
program is involved, so this runs in seconds."""

import json
import subprocess
import sys

from conftest import subprocess_env

CHILD = r"""
import json, sys
import jax
pid, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jaxrl.parallel import distributed
stop = distributed.any_process("stop_request")
other = distributed.any_process("stop_request")  # a second channel of the same name
agree = distributed.process_zero_value("rollout_version")
out = {
    # Only process 1 raises its flag, at call 3 of 6: both must see True there alone.
    "any": [stop(pid == 1 and n == 3) for n in range(6)],
    # The second channel's keys are its own: process 0 raises call 0 only.
    "other": [other(pid == 0 and n == 0) for n in range(3)],
    # Each process offers its own value; all must get process 0's.
    "agree": [agree(100 * pid + n) for n in range(5)],
}
print("RESULT " + json.dumps(out), flush=True)
"""


def test_two_processes_agree_through_the_store(free_port):
  procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(i), str(free_port)],
                            env=subprocess_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  results = []
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
    results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
  for r in results:
    assert r["any"] == [False, False, False, True, False, False]
    assert r["other"] == [True, False, False]
    assert r["agree"] == [0, 1, 2, 3, 4]  # process 0's values on both
