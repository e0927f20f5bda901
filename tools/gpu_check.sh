#!/usr/bin/env bash
# The prepared GPU check of issue 37 item 5, for the device tool's GPU machine (an H200 with
# this workplace's CUDA image: Python 3.12, jax 0.11.2 with CUDA 13, flax, optax, orbax, torch,
# transformers; no network). Run from the repository root:
#
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=560)
#
# At most about 9 minutes, each stage under its own timeout so one stuck stage cannot eat the
# rest (setup 2 x 60 s for pip, kernels 100 s, GRPO 110 s, decode 330 s of which HF generate
# 120 s: under the tool's 600 s with the machine's start; what a stage measured before its
# timeout is kept). First run on an H200 on 2026-12-04 (a lease of 15 minutes, two calls): the
# machine started in about 30 s; setup took 11 s, kernels 26 s (5 of 5 passed), grpo 24-32 s;
# decode's HF peer ~75 s for four batches (its time per call is flat over the batch size: the
# host, not the chip, bounds it), then 10-25 s of compile per (cache, batch) row, so 300 s
# held 4 of the 8 rows: a whole table takes two calls (DECODE_BATCHES=1,16 then 64,256).
#   1. setup: installs what the image lacks from the carried wheels, then `pip install
#      --no-deps -e .`; prints the GPU, jax's devices and the attention paths jaxrl picks;
#   2. kernels: tools/gpu_kernels.py, the GPU attention kernels compiled for the GPU against
#      XLA's attention there (tests/test_kernels.py and test_paged_kernels.py run them only in
#      Pallas's interpreter, on CPU: conftest pins JAX_PLATFORMS=cpu with 8 fake devices, and
#      they skip nothing off-GPU, so running them on the GPU machine would test the CPU again);
#   3. grpo: a few steps of configs/grpo_tiny.py:runlocal with the model in bfloat16;
#   4. decode: benchmarks/decode_gpu.py on the Qwen3-0.6B shape at batch 1, 16, 64, 256, dense
#      and paged caches, against the HBM roofline and HF generate (the image's python3);
#   5. grpo_step (only when STAGES names it): benchmarks/grpo_step.py's demo and anchor shapes
#      on the GPU, per phase (on 2026-12-04 demo ran, 0.02 s per step; the anchor did not finish
#      its compiles and 7 steps in the ~60 s left of an 84 s limit): give it a call of its own.
#   6. tune (only when STAGES names it; a call of its own: STAGES=tune, about 7 minutes):
#      tools/gpu_attention_time.py (the learner's Pallas, cuDNN and XLA attention, forward and
#      gradients, timed), then decode_gpu.py at batch 64 and 256 over page sizes 16, 64, 128
#      and XLA's gather path against the dense cache (its files under $OUT/tune);
# Everything is teed under $OUT (at most 8 files come back): summary.txt (each stage's exit
# status and seconds), setup.log, kernels.log, grpo.log, decode.log, decode_gpu.json and
# decode_gpu.md.
#
# The wheels (5.2 MB, not in git: /.whl/ is in .gitignore; name it in `carry`). The image lacks
# grain, ml-collections, math-verify and qwix and what they need beyond the image; build the
# folder here, on any machine with pip and the network, from the repository root:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     grain==0.2.18 array-record==0.8.6 dm-tree more-itertools portpicker \
#     ml-collections==1.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
#     antlr4-python3-runtime==4.13.2 qwix==0.1.8
#
# (versions as requirements.lock; the rest of grain's, math-verify's and qwix's needs are in
# the image). The tool sends the checkout the calling session was started in, so `.whl/` must
# sit in that checkout's root (a helper's worktree does not travel). Run it on the GPU machine
# only: setup installs into the python3 it finds.
set -u

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

# stage NAME SECONDS COMMAND...: runs COMMAND under a timeout, teed to $OUT/NAME.log; records
# its exit status (124: timed out) and wall time in summary.txt.
stage() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (limit ${limit} s) $(date -u +%H:%M:%S)" | tee -a "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$(($(date +%s) - start))" | tee -a "$SUMMARY"
  return "$rc"
}

setup() {
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no wheels in .whl/: build them as this script's header says and pass carry=[\".whl\"]"
    return 2
  fi
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || return 1
  # No network: no build isolation (setuptools is in the image). The stages run jaxrl from
  # PYTHONPATH=$PWD as well, so a failed editable install is reported, not fatal.
  timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e . ||
    echo "pip install -e . failed (above): the stages import jaxrl from PYTHONPATH=$PWD"
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi || true
  timeout 60 "$PY" -c "import jax, jaxrl.backends as b; print(jax.__version__, jax.devices()); \
print(b.describe())"
}

# setup's exports must reach the later stages, so it runs in this shell (no pipe), logged.
echo "=== setup $(date -u +%H:%M:%S)" >"$OUT/setup.log"
start=$(date +%s)
setup >>"$OUT/setup.log" 2>&1
rc=$?
cat "$OUT/setup.log"
echo "setup rc=$rc seconds=$(($(date +%s) - start))" | tee -a "$SUMMARY"
if [ "$rc" -ne 0 ]; then
  echo "setup failed: the other stages need it"
  exit 1
fi

# STAGES picks stages (default kernels grpo decode, run in this order); DECODE_BATCHES the decode stage's batches; the
# stage limits can be scaled down for a rerun in a short lease with LIMIT_PCT (percent).
STAGES=${STAGES:-kernels grpo decode}
DECODE_BATCHES=${DECODE_BATCHES:-1,16,64,256}
LIMIT_PCT=${LIMIT_PCT:-100}
want() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
lim() { echo $(($1 * LIMIT_PCT / 100)); }

if want kernels; then stage kernels "$(lim 100)" "$PY" tools/gpu_kernels.py; fi
if [ "$(cd /tmp && "$PY" -c 'import jax; print(jax.default_backend())')" != gpu ]; then
  echo "jax sees no GPU: the GRPO and decode stages are for the GPU machine"
  exit 1
fi

rm -rf /tmp/gpu_check_grpo
if want grpo; then
  stage grpo "$(lim 110)" "$PY" -m jaxrl grpo --config configs/grpo_tiny.py:runlocal \
    --config.model.dtype=bfloat16 --config.model.param_dtype=bfloat16 --config.train.steps=4 \
    --workdir /tmp/gpu_check_grpo
fi

if want decode; then
  stage decode "$(lim 330)" "$PY" benchmarks/decode_gpu.py --out "$OUT" --hf-python "$PY" \
    --hf-timeout "$(lim 120)" --batches "$DECODE_BATCHES" --caches dense,paged --prompt 512 \
    --new 256
fi

# 5. grpo_step: benchmarks/grpo_step.py's demo and anchor shapes (fp32) on the GPU, per phase.
if want grpo_step; then
  stage grpo_step "$(lim 120)" "$PY" benchmarks/grpo_step.py --shapes demo,anchor --steps 6
fi

# 6. tune: the learner's attention paths timed (Pallas, cuDNN, XLA: which one the learner
# should default to), then the decode at batch 64 and 256 over page sizes and XLA's gather
# path against the dense cache (the paged Triton kernel ran at 17.5% of the roofline at 64
# with pages of 16, the dense cache at 43.8%: docs/guides/kernels.md).
if want tune; then
  stage attention_time "$(lim 120)" "$PY" tools/gpu_attention_time.py \
    --out "$OUT/attention_time.json"
  mkdir -p "$OUT/tune"
  stage tune "$(lim 300)" "$PY" benchmarks/decode_gpu.py --out "$OUT/tune" --batches 64,256 \
    --caches dense,paged:16,paged:64,paged:128,paged-xla:64 --prompt 512 --new 256
fi

echo "=== done $(date -u +%H:%M:%S)"
cat "$SUMMARY"
