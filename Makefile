# Quick start: `make demo` (set up, pull the default model pair, one speculative generation) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch: on Linux with no GPU, the CPU build from PyTorch's CPU index (PyPI's Linux x86 torch is the CUDA build, with
# multi-GB CUDA libraries); `make setup TORCH=cuda` takes PyPI's build instead (and keeps an installed one), and any
# other value is a pip requirement of its own (`TORCH=torch==2.12.0`). Only torch itself is looked up on that index,
# with a short timeout: an index that cannot be reached costs seconds (~12 s if it hangs), not minutes per dependency.
# Then the CPU build comes from pip's usual indexes and links if they hold it, else PyPI's build is installed.
TORCH ?= $(shell [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo cpu || echo cuda)
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# `make test INSTALL_BROWSER=0`: no apt-get of chromium as root; the playground's browser test then skips.
INSTALL_BROWSER ?= 1
# `make demo METHOD=none`: the same prompt as plain decoding, the baseline to judge the demo's tok/s by.
METHOD = hybrid
PROMPT ?= Write a Python function that checks whether a string is a palindrome, with a docstring and tests.

.PHONY: setup dev demo test lint clean browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python
	@case "$(TORCH)" in \
	  cpu) echo "make setup: torch $(TORCH_VERSION), CPU build ($(TORCH_CPU_INDEX)); TORCH=cuda for PyPI's CUDA build"; \
	    $(BIN)/pip install -q --no-deps --timeout 5 --retries 1 --extra-index-url "$(TORCH_CPU_INDEX)" \
	      "torch==$(TORCH_VERSION)+cpu" && $(BIN)/pip install -q "torch==$(TORCH_VERSION)+cpu" || { \
	    echo "make setup: no CPU build of torch $(TORCH_VERSION) found; installing PyPI's (on Linux x86 the CUDA build)"; \
	    $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; } ;; \
	  cuda) $(BIN)/pip install -q torch ;; \
	  *) $(BIN)/pip install -q "$(TORCH)" ;; \
	esac
	$(BIN)/pip install -q -e .

dev: setup
	$(BIN)/pip install -q -e ".[dev]"

demo: setup
	$(BIN)/specdecode models pull qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(BIN)/specdecode generate --chat --method $(METHOD) "$(PROMPT)"

# Debian's chromium for the playground's browser test. Never fails: without root or apt-get the test skips, saying why.
browser:
	@[ "$(INSTALL_BROWSER)" = 1 ] || { echo "make browser: skipped (INSTALL_BROWSER=$(INSTALL_BROWSER))"; exit 0; }; \
	test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "make browser: chromium not installed (needs root and apt-get); the playground test will skip"

# Test files spread over the CPUs (each file on one worker, so a module's loaded models are loaded once): most
# tests are single-threaded Python over toy models, and on 2 cores the suite took 5 min instead of 13.
test: dev browser lint
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=20

lint: dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
