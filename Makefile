# Every target builds its own environment first: a fresh clone needs only
# Python 3.11+ (pyproject.toml's requires-python, what jax needs) and access to PyPI.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-long test-accelerator lint typecheck notebooks docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,notebooks,docs]'
	touch $(STAMP)

## demo: the main job, a side-by-side run of whole batch vs accumulation.
demo: $(STAMP)
	$(PY) -m optax_accum.demo $(ARGS)

## test: lint, type check, then the whole suite (doctests and notebooks too).
test: lint typecheck
	$(PY) -m pytest -n 2 --cpu-durations=15

## test-accelerator: the suite on a GPU beside the 8 simulated CPU devices (float32
## matmuls at "highest"; tests/conftest.py, docs/accelerators.md). Needs a jax with
## CUDA in $(VENV) (JAX's installation guide); OPTAX_ACCUM_TEST_PLATFORM=tpu,cpu on a TPU.
## pytest-benchmark, if installed, is left out: it cannot time under xdist.
test-accelerator: $(STAMP)
	OPTAX_ACCUM_TEST_PLATFORM=$${OPTAX_ACCUM_TEST_PLATFORM:-cuda,cpu} $(PY) -m pytest -p no:benchmark -n 2 --cpu-durations=15

## test-long: the suite with 2,000 float64 reference examples (CI runs 48).
test-long: $(STAMP)
	OPTAX_ACCUM_REFERENCE_EXAMPLES=2000 $(PY) -m pytest -n 2 --cpu-durations=15

lint: $(STAMP)
	$(PY) -m ruff check optax_accum tests benchmarks examples docs/conf.py docs/mathtext_svg.py
	$(PY) -m ruff format --check optax_accum tests benchmarks examples docs/conf.py docs/mathtext_svg.py

typecheck: $(STAMP)
	$(PY) -m mypy

## docs: the documentation site in docs/_build/html (warnings are errors).
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

## bench: side-by-side timings and XLA cost/memory analysis (about half an hour on 2 CPU cores).
bench: $(STAMP)
	$(PY) -m benchmarks.accumulation $(ARGS)
	$(PY) -m benchmarks.data_parallel
	$(PY) -m benchmarks.lm
	$(PY) -m benchmarks.accelerator
	$(PY) -m benchmarks.loss_terms
	$(PY) -m benchmarks.coupled
	$(PY) -m benchmarks.noise_scale
	$(PY) -m benchmarks.batch_ramp
	$(PY) -m benchmarks.compile

## notebooks: re-execute the notebooks in place, so their committed outputs are current.
notebooks: $(STAMP)
	$(VENV)/bin/jupyter-execute --inplace notebooks/*.ipynb

clean:
	rm -rf $(VENV) docs/_build .pytest_cache .mypy_cache .ruff_cache .hypothesis
