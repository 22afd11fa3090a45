# The README's two commands. Both work on a fresh clone with only python3 (>= 3.10) installed.
#   make demo   creates .venv, installs Kiln, runs the attention demo (uses a GPU when present)
#   make test   creates .venv, installs Kiln with its dev extras, runs pytest (which runs lit too)
#               on every core, leaving out the `slow` tier; `make test-slow` runs that tier,
#               `make test-all` both at once. `.ci/run` runs `make test` then `make test-slow`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest-xdist workers: one per core (`make test WORKERS=0` runs in one process).
WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(WORKERS)

.PHONY: demo test test-slow test-all gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/attention_demo.py

test: $(VENV)/.installed
	$(PYTEST) -m 'not slow'

test-slow: $(VENV)/.installed
	$(PYTEST) -m slow

test-all: $(VENV)/.installed
	$(PYTEST)

# On a machine with a CUDA GPU: only the tests that launch kernels.
gpu-test: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
