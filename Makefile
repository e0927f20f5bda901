# Two commands do everything on a fresh machine:
#   make demo   set up .venv and run the embedded default job
#   make test   set up .venv and run the test suite
.PHONY: setup demo test test-fast lock clean
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

# Re-pin requirements.lock from the current .venv (run after changing pyproject ranges).
lock: setup
	$(PY) -m pip freeze --exclude-editable | grep -v '^-e ' > requirements.lock

clean:
	rm -rf .venv .pytest_cache
