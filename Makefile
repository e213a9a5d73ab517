# The two commands of README.md. Each does all set-up on a fresh machine:
#   make run    train the default CNN on real Fashion-MNIST (creates .venv, installs, prepares data)
#   make test   run the test suite (creates .venv, installs the test, mpi and demo extras
#               and, as root, Debian's chromium for the demo's browser test and slurm-wlm,
#               munge and iproute2 for the emulated cluster's and SLURM's tests)
# ARGS passes options through: make run ARGS="--model mlp --epochs 5"

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
DEBIAN_FASHION := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: run test test-setup system-tools data install browser cluster-tools clean

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

# The `mpi` extra: pip's MPICH (no apt) first, then mpi4jax built from source against THAT
# MPI (its mpicc pinned, so a system MPI cannot sneak in). mpi4jax has no CPU-only switch:
# CUDA_PATH must name an existing empty folder or its setup.py picks up a stray nvcc. The
# build (half a minute of compiling) writes a wheel, not the venv, so it runs beside the
# demo's install; the wheel goes in after that, one pip installing into the venv at a time.
$(VENV)/.mpi-deps: $(VENV)/.installed-test
	$(PY) -m pip install -q mpi4py mpich nanobind setuptools wheel
	@touch $@

$(VENV)/.mpi4jax-wheel: $(VENV)/.mpi-deps
	rm -rf $(VENV)/mpi4jax-wheel && mkdir -p $(VENV)/no-cuda
	MPI4JAX_BUILD_MPICC=$(abspath $(VENV))/bin/mpicc CUDA_PATH=$(abspath $(VENV))/no-cuda \
	  $(PY) -m pip wheel -q --no-deps --no-cache-dir --no-build-isolation -w $(VENV)/mpi4jax-wheel mpi4jax
	@touch $@

$(VENV)/.mpi-installed: $(VENV)/.mpi4jax-wheel | $(VENV)/.demo-installed
	$(PY) -m pip install -q --no-deps --no-index $(VENV)/mpi4jax-wheel/mpi4jax-*.whl
	@touch $@

# The `demo` extra (Gradio, selenium) for the demo's tests, beside the test extra (which
# `make run` shares, so the demo stays out of it).
$(VENV)/.demo-installed: $(VENV)/.mpi-deps
	$(PY) -m pip install -q -e '.[demo]'
	@touch $@

# The demo's browser test drives Debian's chromium with its chromedriver: installed when we
# may (root, apt-get), else that test is skipped and says how to install them.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's chromium and chromium-driver (the demo's browser test)"; \
	    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || \
	    echo "apt-get could not install chromium; the browser test will be skipped"; \
	  else \
	    echo "no chromium/chromedriver: the browser test will be skipped (sudo apt-get install chromium chromium-driver)"; \
	  fi; \
	fi

# The emulated cluster's and SLURM's tests (tests/experiments/infra/test_cluster.py and
# test_slurm.py) need iproute2 (ip, tc) and Debian's slurm-wlm and munge: installed when we
# may (root, apt-get), else those tests are skipped and say what is missing.
cluster-tools:
	@if ! command -v tc >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing iproute2, slurm-wlm and munge (the emulated cluster's and SLURM's tests)"; \
	    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 slurm-wlm munge >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 slurm-wlm munge >/dev/null 2>&1)) || \
	    echo "apt-get could not install them; the cluster and SLURM tests will be skipped"; \
	  else \
	    echo "no tc/slurmctld/munged: the cluster and SLURM tests will be skipped (as root: apt-get install iproute2 slurm-wlm munge)"; \
	  fi; \
	fi

# tests/mpi runs under mpiexec from inside the suite (tests/test_mpi_launch.py: 2 ranks; test_mpi_worlds.py
# 4, and 2 of 2 devices each), beside the other worker's files; the workers take files longest
# first, a file that mostly waits beside one that computes (tests/scheduling.py); --durations:
# the log names the slowest tests (the whole run, installs included, is to stay under 20
# minutes: 25-29 minutes in November 2026, 23:44 from a clean clone on 2026-11-28; on
# 2026-11-29, a faster day, 13:53, the tests 13:00, against 13:44 for the tests at 3566bf4;
# 12:56 at b5700d7 the same evening, the tests 12:09; CI took 849 s at 5ddbcbe; 14:23 at
# b3b9b0d, the tests 13:34, 1014 passed).
# Two workers, not three: a third (a lane for the files that mostly wait) took the same suite
# from 24:16 to 30:30 here, the simulated devices' programs and the MPI ranks slowing each
# other more than the idle fifth of the cores it filled was worth (again on 2026-11-29, with
# the waiting files kept apart: 13:08 -> 13:29, 1257 -> 1374 CPU seconds).
test: test-setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 $(ARGS)

# The tests' set-up, run side by side where nothing is shared: apt's installs (browser, then
# cluster-tools: one dpkg lock; on a fresh machine chromium's download is most of it) beside
# pip's, and mpi4jax's build beside the demo's install (`.mpi-installed` waits for it).
test-setup:
	@$(MAKE) --no-print-directory -j3 install $(VENV)/.mpi-installed system-tools

system-tools:
	@$(MAKE) --no-print-directory browser && $(MAKE) --no-print-directory cluster-tools

clean:
	rm -rf $(VENV) build *.egg-info

# The `peer` extra: PyTorch 2.13.0 (CPU wheel) for `python -m experiments peers`. Never part of
# `make test` (any other torch spec pulls gigabytes of CUDA).
.PHONY: peer
peer: install
	$(PY) -m pip install -q -e '.[peer]'
