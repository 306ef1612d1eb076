# Two commands, both self-installing into .venv under the repo:
#   make quickstart   set up and run the end-to-end quickstart experiment (local Ray, ./local_store)
#   make test         set up, lint (ruff) and run the test suite (what .ci/run calls)
# Python 3.12: `python3.12` where it runs, else the newest 3.12 that pyenv installed (its shim answers
# only where 3.12 is selected); `make PYTHON=/path/to/python3.12 ...` overrides both.
PY_VERSION := 3.12
PYTHON ?= $(shell for p in python$(PY_VERSION) $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(PY_VERSION).*/bin/python$(PY_VERSION) 2>/dev/null | sort -V | tail -n 1); do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(PY_VERSION))))' 2>/dev/null && { echo "$$p"; break; }; done)
comma := ,
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PREFIX ?= $(CURDIR)/local_store

.PHONY: setup quickstart test test-slow bench clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" && "$(PYTHON)" -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(PY_VERSION))))' 2>/dev/null || { echo "error: Python $(PY_VERSION) not found$(if $(PYTHON), ($(PYTHON) is not $(PY_VERSION))); install it (pyenv install $(PY_VERSION)) or run 'make PYTHON=/path/to/python$(PY_VERSION) ...'"; exit 1; }
	@# a virtual environment of another Python (an older checkout's 3.11) is rebuilt, not patched
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(PY_VERSION))))' 2>/dev/null || { rm -rf $(VENV); echo "$(PYTHON) -m venv $(VENV)"; "$(PYTHON)" -m venv $(VENV); }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all,test]'
	touch $(STAMP)

setup: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/marin run experiments/quickstart.py --prefix $(PREFIX)

# Two pytest workers (pytest-xdist), one per core of the 2-core CI machine; a test file stays on one
# worker, so its module fixtures are built once. Three workers were slower there (docs/performance.md).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The slow set (end-to-end runs: pools, clusters of simulated nodes, whole ladders) on the same two
# workers; not part of `make test` or CI: its time and why are in docs/contributing.md.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	for b in benchmarks/*_bench.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) local_store
