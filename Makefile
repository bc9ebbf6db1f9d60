# Two entry points for a new user, each complete by itself:
#   make demo   create/reuse .venv, install, run the main job (GRPO on the bundled tiny model, CPU)
#   make test   create/reuse .venv, install, run the whole CPU test suite
# Torch is installed first and pinned (TORCH_SPEC) so pip never pulls a multi-GB CUDA build on a
# CPU machine. On a GPU machine: make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test lint format clean

$(VENV)/.installed: setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m verl.trainer.main_ppo

test: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is empty or every test was deselected" >&2; exit 1; fi; \
	exit $$rc

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info
