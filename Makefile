# Two commands do everything on a fresh machine:
#   make demo   set up .venv and run the embedded default job
#   make test   set up .venv and run the test suite
.PHONY: setup demo test test-fast test-isa lock clean
PY := .venv/bin/python
# Eight fake CPU devices, so the demo shows a real sharded mesh on a laptop.
# On GPU/TPU this flag only touches the host platform and changes nothing.
DEMO_XLA_FLAGS ?= --xla_force_host_platform_device_count=8

setup:
	@bash tools/setup.sh

demo: setup
	XLA_FLAGS="$${XLA_FLAGS:-$(DEMO_XLA_FLAGS)}" .venv/bin/jaxrl demo

# pytest runs on tcmalloc when the machine has it, as the jaxrl command does
# (jaxrl/backends/cpu/allocator.py).
test: setup
	$(PY) -m jaxrl.backends.cpu.allocator $(PY) -m pytest -q -n 2 --dist worksteal --durations=40

test-fast: setup
	$(PY) -m jaxrl.backends.cpu.allocator $(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

# The learning tests (slow, with bars) under XLA capped at AVX2, near the float rounding of an
# AVX2-only CPU (auto dots then choose Eigen, as such a CPU does); not in CI. Over every ISA,
# dot kernel and seed: tools/learning_sweep.py.
test-isa: setup
	XLA_FLAGS="--xla_cpu_max_isa=AVX2 $${XLA_FLAGS:-}" $(PY) -m jaxrl.backends.cpu.allocator \
	  $(PY) -m pytest -q -n 2 --dist worksteal -m learning --durations=20

# Re-pin requirements.lock from the current .venv (run after changing pyproject ranges).
lock: setup
	$(PY) -m pip freeze --exclude-editable | grep -v '^-e ' > requirements.lock

clean:
	rm -rf .venv .pytest_cache
