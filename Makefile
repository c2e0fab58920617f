# kvhandoff — two commands for a new user: `make demo` and `make test`.
# Everything installs into .venv; torch comes first, pinned, so pip does not pull a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-long lint typecheck bench plan clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/engines-nodeps.txt requirements/engines-deps.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	@# the nixl transport (one-sided writes; NIXL bundles a UCX with verbs): nixl-cu12 wheels
	@# exist for x86_64/aarch64 Linux; elsewhere its tests skip with the reason
	$(BIN)/pip install -q -e ".[nixl]" \
	  || echo "note: nixl-cu12 not installed; the nixl transport and its tests are unavailable"
	@# optional: the shm transport's native copy helper (needs a C compiler; else Python copies)
	@$(BIN)/python -m kvhandoff.transfer.transports._native || true
	@# the engines (SGLang, vLLM) for tests/integrations: no deps, then their light import deps
	$(BIN)/pip install -q -r requirements/engines-deps.txt
	$(BIN)/pip install -q --no-deps -r requirements/engines-nodeps.txt
	@# systemd-analyze (Debian package systemd) lets tests/deploy verify the systemd unit;
	@# installed only as root with apt, else those checks skip with a stated reason
	@command -v systemd-analyze >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
	  && apt-get install -y -qq --no-install-recommends systemd >/dev/null; } \
	  || echo "note: systemd-analyze not installed; tests/deploy skips its systemd-analyze checks"
	@touch $(STAMP)

demo: setup
	$(BIN)/kvhandoff demo

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/mypy

typecheck: lint

test: setup lint
	$(BIN)/python -m pytest -q -m "not long"

test-long: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/kvhandoff bench

plan: setup
	$(BIN)/kvhandoff plan

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
