# `make train` and `make test` do all set-up on a fresh machine; `make .venv` does the set-up alone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
FASHION_MNIST_DIR := /usr/share/datasets/fashion-mnist
WORKDIR ?= runs/fashion_mnist
CONFIG ?= configs/fashion_mnist.py

.PHONY: .venv train test bench data clean

.venv: $(VENV)/.installed data

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

# The tests also prepare a tiny TFDS imagenet2012, which needs TensorFlow (the `prepare` extra).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

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

test: .venv $(VENV)/.installed-test
	$(PY) -m pytest -q tests

bench: .venv
	$(PY) benchmarks/train_step.py

clean:
	rm -rf runs .pytest_cache
