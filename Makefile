# Quick start: `make demo` (set up, pull the default model pair, one speculative generation) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines take the CPU build of torch (a plain `torch` requirement pulls a multi-GB CUDA build).
# GPU users: `make setup TORCH=torch` keeps whatever CUDA build pip picks.
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PROMPT ?= Write a Python function that checks whether a string is a palindrome, with a docstring and tests.

.PHONY: setup dev demo test lint clean browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .

dev: setup
	$(BIN)/pip install -q -e ".[dev]"

demo: setup
	$(BIN)/specdecode models pull qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(BIN)/specdecode generate --chat --method hybrid "$(PROMPT)"

# Debian's chromium for the playground's browser test. Never fails: without root or apt-get the test skips, saying why.
browser:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
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
