# `make demo` and `make test` set everything up themselves: the virtual
# environment, the packages, the native library (C++ build against the
# installed OpenVINO wheel), then run.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.numaov-installed
# Reinstall (and so rebuild the native library) when any of these change.
NATIVE_INPUTS := pyproject.toml CMakeLists.txt $(shell find numaov/custom_ops/csrc -type f)
PYTEST_ARGS ?=

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Build tools and OpenVINO go in first so the native build runs without
# isolation, against the very wheel that will load the library. flock keeps
# two concurrent `make` runs from installing into the venv at once.
$(STAMP): $(BIN)/python $(NATIVE_INPUTS)
	flock $(VENV)/.install.lock sh -c '\
	  $(BIN)/python -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" ninja "cmake>=3.21" \
	      "torch==2.13.0" "openvino>=2026.4,<2026.5" && \
	  $(BIN)/python -m pip install --quiet --no-build-isolation -e ".[dev]"'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m numaov.cli demo

test: $(STAMP)
	$(BIN)/python -m ruff check numaov tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything but the tests marked slow (exports, rank processes, notebooks): the target is 2 minutes.
test-fast: $(STAMP)
	$(BIN)/python -m ruff check numaov tests benchmarks
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# Each benchmark prints ratios and writes benchmarks/out/<name>.json; run them on a quiet machine.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet "deepspeed>=0.19"  # the `bench` extra: collectives' anchor
	$(BIN)/python benchmarks/fallback_ops.py
	$(BIN)/python benchmarks/collectives.py
	$(BIN)/python benchmarks/dit.py
	$(BIN)/python benchmarks/dit_pairs.py
	$(BIN)/python benchmarks/moe.py
	$(BIN)/python benchmarks/roofline.py  # the machine's limits and the MoE op's share of them
	$(BIN)/python benchmarks/wan_pipeline.py
	$(BIN)/python benchmarks/wan_i2v_encode.py
	$(BIN)/python benchmarks/lm_engine.py  # optimum-intel side by side: run benchmarks/optimum_venv.sh once
	$(BIN)/python benchmarks/weight_agreement.py
	$(BIN)/python -m pip install --quiet xgrammar  # structured outputs' competitor
	$(BIN)/python benchmarks/structured_output.py

# Runs notebooks/*.ipynb top to bottom and saves them with their outputs, in place (their
# exports go to out/notebooks); run it after the built-in models change.
.PHONY: notebooks
notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py

clean:
	rm -rf build $(VENV)
