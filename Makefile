# The two commands of the README, each installing what it needs into .venv:
#   make demo   runs the main job on the embedded default (CPU, no downloads)
#   make test   runs the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# torch==2.13.0 resolves to the local CPU build; only the append benchmark's baseline needs it.
$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

.PHONY: demo test bench clean
demo: $(VENV)/.installed
	rm -rf walkthrough-store
	$(VENV)/bin/trajstore walkthrough --store walkthrough-store

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.bench
	$(PY) benchmarks/append.py
	$(PY) benchmarks/shard.py

clean:
	rm -rf $(VENV) walkthrough-store .pytest_cache
