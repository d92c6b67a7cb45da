# Every target builds its own environment first: a fresh clone needs only
# Python 3.10+ and access to PyPI.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint typecheck notebooks clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,notebooks]'
	touch $(STAMP)

## demo: the main job, a side-by-side run of whole batch vs accumulation.
demo: $(STAMP)
	$(PY) -m optax_accum.demo $(ARGS)

## test: lint, type check, then the whole suite (doctests and notebooks too).
test: lint typecheck
	$(PY) -m pytest -n 2

lint: $(STAMP)
	$(PY) -m ruff check optax_accum tests
	$(PY) -m ruff format --check optax_accum tests

typecheck: $(STAMP)
	$(PY) -m mypy

## notebooks: re-execute the notebooks in place, so their committed outputs are current.
notebooks: $(STAMP)
	$(VENV)/bin/jupyter-execute --inplace notebooks/*.ipynb

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
