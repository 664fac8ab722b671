# Quick start: `make demo` and `make test` each create .venv, install, and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

# `make bench`: every bench, ~2 GB state (bench/run_all.py); `make bench QUICK=1`: 0.25 GB, a few minutes
bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) runs bench/out
