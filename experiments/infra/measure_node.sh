#!/usr/bin/env bash
# Measure a node that has a GPU with the machine command twice: its GPU, then its CPU cores (one
# simulated device per core, JAX_PLATFORMS=cpu), from a source checkout on top of what is
# installed (no network: pip's --no-build-isolation uses the setuptools already there).
#
#   bash experiments/infra/measure_node.sh NAME GPU_BUDGET_S CPU_BUDGET_S OUT_DIR [machine options]
#
# writes OUT_DIR/NAME-gpu and OUT_DIR/NAME-cpu (copy them to figures/data/machines/, then
# `report` and `figures`). Each run is bounded: its --budget plus a minute for the probe.
set -u
name=$1 gpu_s=$2 cpu_s=$3 out=$4
shift 4
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
"$py" -m pip install -q --no-deps --no-build-isolation -e . \
    || { echo "pip install -e . failed: PYTHONPATH instead"; export PYTHONPATH=$PWD; }
"$py" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda13-plugin|flax|optax|numpy|torch|mpi4py) '
command -v nvidia-smi >/dev/null && nvidia-smi -L
nproc
timeout $((gpu_s + 60)) "$py" -m experiments machine --budget "$gpu_s" --out "$out/$name-gpu" "$@"
echo "gpu run: rc $?"
JAX_PLATFORMS=cpu timeout $((cpu_s + 60)) "$py" -m experiments machine --budget "$cpu_s" \
    --out "$out/$name-cpu" "$@"
echo "cpu run: rc $?"
