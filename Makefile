# The two commands of README.md. Each does all set-up on a fresh machine:
#   make run    train the default CNN on real Fashion-MNIST (creates .venv, installs, prepares data)
#   make test   run the test suite (creates .venv, installs the test and mpi extras)
# ARGS passes options through: make run ARGS="--model mlp --epochs 5"

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
DEBIAN_FASHION := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: run test data install clean

$(VENV)/.installed-%: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "jaxpar needs Python >= 3.11 (set PYTHON=python3.11)"'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$*]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(VENV)/.installed-test

# Real data: Debian's dataset-fashion-mnist when we may install it (root), else the IDX files
# in --data-dir, else TFDS's download (online). prepare-data says exactly what to do if all fail.
data: install
	@if [ ! -f $(DEBIAN_FASHION) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's dataset-fashion-mnist (the real Fashion-MNIST IDX files)"; \
	  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)) || \
	  echo "apt-get could not install dataset-fashion-mnist; trying other sources"; \
	fi
	$(PY) -m experiments prepare-data

run: data
	$(PY) -m experiments train $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
