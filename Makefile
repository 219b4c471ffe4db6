# Two commands: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test-packages test lint typecheck unit demo wire-demo bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned CPU torch first: an unpinned `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Debian packages the tests need and the demo does not (root only): Chromium for the
# dashboard's browser test, iproute2 for the two-host test.
test-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver) \
		|| echo "chromium not installed: tests/e2e/test_dashboard_browser.py will skip"; fi
	@# iproute2's `ip` for the two-host test in network namespaces (it skips without).
	@if [ "$$(id -u)" = 0 ] && ! command -v ip >/dev/null; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2) \
		|| echo "iproute2 not installed: tests/e2e/test_netns.py will skip"; fi

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The suite on two workers (pytest-xdist): on the 2-core CI machine two keep both cores busy,
# three only add contention. --dist loadgroup hands tests out one at a time in the order
# tests/conftest.py sets, the longest first, and keeps an xdist_group (tests sharing one
# costly fixture) on one worker. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

unit: $(STAMP) test-packages
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=20

test: lint typecheck unit

# Four ranks train an MLP on scikit-learn's digits; rank 3 is made 2.5x slower; the summary
# ends with the time to quality against lock-step DDP (estimated from the run's own step times,
# docs/running.md "summary.json"). Each demo writes a new folder under runs/ (runs/latest
# points at the newest), so earlier ones stay.
demo: $(STAMP)
	$(BIN)/flodl run --report --nproc 4 examples/digits.py --slow 3:2.5 --epochs 100

wire-demo: $(STAMP)
	$(BIN)/python examples/wire_demo.py

bench: $(STAMP)
	$(BIN)/python bench/wire_bench.py
	$(BIN)/python -m bench.scale

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
