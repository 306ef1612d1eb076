# Two commands, both self-installing into .venv under the repo:
#   make quickstart   set up and run the end-to-end quickstart experiment (local Ray, ./local_store)
#   make test         set up, lint (ruff) and run the test suite (what .ci/run calls)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PREFIX ?= $(CURDIR)/local_store

.PHONY: setup quickstart test test-slow bench clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
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

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	for b in benchmarks/*_bench.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) local_store
