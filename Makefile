# Two entry points for a new user, each complete by itself:
#   make demo   create/reuse .venv, install, run the main job (GRPO on the bundled tiny model, CPU)
#   make test   create/reuse .venv, install, run the default test tier (about 10 minutes on 2 cores)
# and, for CI and before a landing:
#   make test-all   `make test`, then the rest of the suite (the `slow` tier: end-to-end runs, resumes, multi-node,
#                   recipes)
# Installs are the tested set: requirements/constraints-py311.txt pins every package's version
# (pip -c), so a fresh clone installs exactly what the tests passed with. Torch is installed first,
# from TORCH_SPEC (default: the lock's version), so pip never pulls a multi-GB CUDA build on a CPU
# machine; the lock then pins everything else. On a GPU machine:
#   make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
# Dependency upkeep (docs/dependencies.md):
#   make test-latest   a fresh .venv-latest with the newest versions setup.py allows; runs the default test tier
#   make lock          test-latest, then rewrite the lock from what it tested (only if the tests passed)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK ?= requirements/constraints-py311.txt
TORCH_SPEC ?= $(shell grep -m1 '^torch==' requirements/constraints-py311.txt)
PYTEST_ARGS ?=
# the default test tier (`make test`, `make test-latest`, `make lock`); `make test-all` runs every tier
DEFAULT_TIER ?= -m "not slow"
SLOW_TIER ?= -m slow
ALL_TIERS ?=
LATEST_VENV ?= .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python

.PHONY: install demo test test-all test-one-run test-slow test-latest lock lint format clean

# $(call pytest,PYTHON,SELECTION): pytest's exit status, except that "no test ran" (exit 5) fails too:
# a selection that matches nothing must not pass CI
define pytest
@$(1) -m pytest -q $(2) $(PYTEST_ARGS); rc=$$?; \
if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is empty or the selection matched nothing" >&2; exit 1; fi; \
exit $$rc
endef

# LOCK= (empty) installs setup.py's newest allowed versions instead of the tested ones.
$(VENV)/.installed: setup.py pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(LOCK),$(PY) scripts/dependency_lock.py check-python $(LOCK))
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(if $(LOCK),$(PY) scripts/dependency_lock.py constraints $(LOCK) --without torch > $(VENV)/constraints.txt)
	$(PY) -m pip install -q -e ".[test]" $(if $(LOCK),-c $(VENV)/constraints.txt)
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m verl.trainer.main_ppo --config-name=arith_demo

test: lint
	$(call pytest,$(PY),$(DEFAULT_TIER))

# the slow tier alone (what test-all adds to test)
test-slow: install
	$(call pytest,$(PY),$(SLOW_TIER))

# the whole suite, as CI runs it: both tiers, each test once, in two pytest processes (the default
# tier, then the slow one). One process would save a collection (~40 s idle) and a cluster start,
# but has not yet been run whole; `make test-one-run` runs it that way.
test-all: test test-slow

test-one-run: lint
	$(call pytest,$(PY),$(ALL_TIERS))

# Always a fresh virtualenv: a kept one would hold yesterday's newest versions.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q --upgrade pip
	$(LATEST_PY) -m pip install -q $(TORCH_SPEC)
	$(LATEST_PY) -m pip install -q -e ".[test]"
	$(LATEST_PY) scripts/dependency_lock.py diff $(LOCK)
	$(call pytest,$(LATEST_PY),$(DEFAULT_TIER))

lock: test-latest
	$(LATEST_PY) scripts/dependency_lock.py freeze > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	@echo "$(LOCK) rewritten from $(LATEST_VENV); review 'git diff $(LOCK)', run 'make test', commit"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(LATEST_VENV) build *.egg-info
