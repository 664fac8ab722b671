# Quick start: `make demo` and `make test` each create .venv, install, and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# 2 workers, one test module each at a time (module fixtures built once): the multi-rank
# tests leave a core idle ~40% of the time (process starts, waits for peers and timeouts),
# so on CI's 2 cores the suite took 8:02 against 11:08-11:31 serially. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
# more pytest options, e.g. `make test PYTEST_ARGS="--durations=30"` or `PYTEST_ARGS="tests/test_cli.py"`
PYTEST_ARGS ?=

# (the fused quantizer kernels compile once, ~10 s, into numba's cache: here, not inside
# several test processes at once)
test: $(STAMP)
	$(BIN)/python -c "from unickpt.codecs.kernels import warm; warm()"
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope) $(PYTEST_ARGS)

# `make bench`: every bench, ~2 GB state (bench/run_all.py); `make bench QUICK=1`: 0.25 GB, a few minutes
bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(if $(QUICK),--quick)

# On a machine with a GPU (the device tool lends one to some tasks): the CUDA tests, then the
# GPU bench (async save of device state, staging behind compute, loads into GPU tensors), one
# command sized to fit a 10-minute device call; results in bench/results/
gpu-check: $(STAMP)
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	$(BIN)/python -m pytest -q -x -p no:cacheprovider tests/test_cuda.py
	$(BIN)/python bench/cuda_async.py --gb $(or $(GB),1) --repeats 3

clean:
	rm -rf $(VENV) runs bench/out
