# `make train` and `make test` do all set-up on a fresh machine; `make .venv` does the set-up alone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
FASHION_MNIST_DIR := /usr/share/datasets/fashion-mnist
WORKDIR ?= runs/fashion_mnist
CONFIG ?= configs/fashion_mnist.py

.PHONY: .venv python-deps train test test-all lint format bench time-to-accuracy large-batch tune data jpeg-build-deps gpu-wheels clean

.venv: $(VENV)/.installed data

$(VENV)/.installed: pyproject.toml setup.py light_jax/data/_jpeg_region.c
	@# Kept: a venv of Python 3.11 or newer with pip. Made anew: none, a half-made one (no ensurepip), an older one.
	@$(PY) -c 'import sys, pip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  $(MAKE) --no-print-directory python-deps && rm -rf $(VENV) && echo "$(PYTHON) -m venv $(VENV)" \
	  && $(PYTHON) -m venv $(VENV); }
	@$(MAKE) --no-print-directory jpeg-build-deps
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

# The tests also prepare a tiny TFDS imagenet2012, which needs TensorFlow (the `test` extra has it, as `prepare` does).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# $(PYTHON) to make the venv with: 3.11 or newer (jax 0.10, flax, grain and orbax ask for it), with its venv module
# (Debian and Ubuntu ship it apart, as python3.X-venv).
PY_VERSION = $$($(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
python-deps:
	@version=$(call PY_VERSION,$(PYTHON)); \
	if ! $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
	  echo "error: $(PYTHON) is not Python 3.11 or newer ($${version:-not found}), which jax 0.10 needs: install one" \
	       "and run  make PYTHON=python3.11 ..." >&2; exit 1; \
	elif $(PYTHON) -c 'import ensurepip, venv' 2>/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing python$$version-venv with apt-get (to create .venv)"; \
	  (apt-get install -y -qq python$$version-venv \
	    || (apt-get update -qq && apt-get install -y -qq python$$version-venv)) >/dev/null; \
	else \
	  echo "error: $(PYTHON) cannot create a venv (no ensurepip): run  sudo apt-get install -y python$$version-venv" \
	       "then make again" >&2; exit 1; \
	fi

# The JPEG region decoder (light_jax/data/_jpeg_region.c) is compiled against libjpeg(-turbo) and the headers of the
# venv's Python: it needs a C compiler and both headers. Without them the install still works and decodes whole
# JPEGs (slower).
jpeg-build-deps:
	@py=$$([ -x $(PY) ] && echo $(PY) || echo $(PYTHON)); version=$(call PY_VERSION,$$py); \
	packages="gcc libjpeg-dev python$$version-dev"; \
	if printf '#include <stdio.h>\n#include <jpeglib.h>\n#include <Python.h>\n' \
	     | cc -E -I"$$($$py -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" - >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $$packages with apt-get (for the JPEG region decoder)"; \
	  (apt-get install -y -qq $$packages || (apt-get update -qq && apt-get install -y -qq $$packages)) >/dev/null \
	    || echo "warning: apt-get could not install $$packages: the JPEG region decoder will not be built" >&2; \
	else \
	  echo "warning: no C compiler, libjpeg headers or Python headers: the JPEG region decoder will not be built" \
	       "(whole JPEGs are decoded, slower). To build it: sudo apt-get install -y $$packages, then make again." >&2; \
	fi

# Fashion-MNIST from Debian's dataset-fashion-mnist package (IDX files in $(FASHION_MNIST_DIR)).
data:
	@if [ -f $(FASHION_MNIST_DIR)/train-images-idx3-ubyte.gz ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing dataset-fashion-mnist with apt-get"; \
	  (apt-get install -y -qq dataset-fashion-mnist || (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist)) >/dev/null; \
	else \
	  echo "Fashion-MNIST is missing: run  sudo apt-get install -y dataset-fashion-mnist  then make again" >&2; exit 1; \
	fi

train: .venv
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR)

# Two pytest-xdist workers, one per core here (TEST_WORKERS=0 runs the tests in one process); a test file stays on
# one worker (--dist loadfile), so the tests that share a module-scoped fixture build it once; files are handed out
# in collection order, the slowest first (tests/conftest.py), not by their number of tests (--no-loadscope-reorder).
TEST_WORKERS ?= 2
test: .venv $(VENV)/.installed-test
	$(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# Also the tests marked slow (pyproject.toml): the fault drills on the emulated cluster, every strategy across
# two processes, the prepared GPU check at toy size.
test-all: .venv $(VENV)/.installed-test
	$(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "" tests

# ruff's formatter (check only) and linter, configured in pyproject.toml; `make format` applies the formatter.
$(VENV)/.installed-lint: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[lint]'
	touch $@

lint: $(VENV)/.installed-lint
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(VENV)/.installed-lint
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: .venv
	$(PY) benchmarks/train_step.py

# Light's claim in miniature (README "Mesh lab"): 2 emulated machines x 4 devices on 50 Mbit/s links, whole
# Fashion-MNIST runs per strategy, test top-1 against training time. Needs root; about 40 minutes on 2 cores.
time-to-accuracy: .venv
	$(PY) benchmarks/time_to_accuracy.py --nodes 2 --local 4 --bandwidth 50mbit \
	  --strategies hierarchical,hitopk@0.01,hitopk@0.001,gtopk@0.01 --target 0.92 --plot docs/time_to_accuracy.png

# The large-batch study (README "Large batch"): whole runs, one after the other, about 40 hours in all on
# these 2 cores (a 28-epoch run at batch 4,096 takes 16-18 minutes), so ONLY=LABEL,LABEL picks some runs
# (`python benchmarks/large_batch.py --help` lists them), e.g. make large-batch ONLY=sgd_256,sgd_4096.
ONLY ?=
large-batch: .venv
	$(PY) benchmarks/large_batch.py --workdir runs/large_batch --plot docs/large_batch.png $(if $(ONLY),--only $(ONLY))

# The AutoML study behind configs/fashion_mnist.py:large_batch_lars (16 trials of 3 epochs; resumable), as it
# ran: with poly decay, the variant's decay then (docs/measurements.md, "Large batch").
tune: .venv
	$(PY) scripts/tune.py --config configs/fashion_mnist.py:large_batch_lars --study_dir runs/tune --trials 16 \
	  --startup_trials 4 --config.num_epochs=3 --config.optimizer.decay=poly

# The wheels a GPU machine without network lacks (this workplace's device machines: Python 3.12, JAX with CUDA,
# flax, optax, orbax there; not these), at the versions installed here, for `bash benchmarks/gpu_check.sh OUT
# --wheels .whl` (README "The prepared GPU check"). About 5 MB.
GPU_WHEELS := grain array_record simplejpeg ml_collections jmp tensorboardX portpicker
GPU_PYTHON ?= 3.12
gpu-wheels: $(VENV)/.installed
	@pins=$$($(PY) -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
	  $(GPU_WHEELS)) || { echo "error: a package of GPU_WHEELS is not installed in $(VENV): make .venv first" >&2; exit 1; }; \
	rm -rf .whl && mkdir .whl && echo "downloading $$pins for Python $(GPU_PYTHON)" && \
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64) \
	  -d .whl $$pins
	@ls .whl

clean:
	rm -rf runs .pytest_cache
