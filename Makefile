# `make demo` and `make test` each set up .venv on first use, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.harpjax-installed
# Eight fake CPU devices stand in for GPUs (see README, the paragraph after `make test`).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

.PHONY: demo test test-slow bench venv clean

venv: $(STAMP)

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m harpjax.examples.demo

# Two test processes (pytest-xdist), each test file in one of them.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests

# The long cases (marked slow), which the fast suite leaves out.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow" -n $(TEST_WORKERS) --dist loadfile tests

bench: $(STAMP)
	$(PY) benchmarks/schedules.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
