#!/usr/bin/env bash
# Measure a lent node that has a GPU with the machine command twice: its GPU, then its CPU cores
# (one simulated device per core, JAX_PLATFORMS=cpu), from a source checkout on top of what is
# installed. The node has no network: what it lacks (oneDNN's wheels; MPICH and mpi4jax's
# sources) comes in the carried folder that `python -m experiments.infra.node_carry prepare` made
# here (docs/machines.md, "Measuring a lent node").
#
#   bash experiments/infra/measure_node.sh NAME GPU_BUDGET_S CPU_BUDGET_S OUT_DIR [machine options]
#
# Before measuring anything it installs the carry (pip --no-deps, from its files alone) and
# checks that `--conv-impl auto` resolves to oneDNN on the node's CPU; otherwise it exits 2
# naming the fix, OUT_DIR untouched. Then it writes OUT_DIR/NAME-gpu and OUT_DIR/NAME-cpu (copy
# them to figures/data/machines/, then `report` and `figures`). Each run is bounded: its
# --budget plus a minute for the probe. CARRY (default .node-carry) names the carried folder.
set -u
if [ $# -lt 4 ]; then
    echo "usage: bash experiments/infra/measure_node.sh NAME GPU_BUDGET_S CPU_BUDGET_S OUT_DIR [machine options]" >&2
    exit 2
fi
name=$1 gpu_s=$2 cpu_s=$3 out=$4
shift 4
py=${PYTHON:-python3}
carry=${CARRY:-.node-carry}
export PYTHONUNBUFFERED=1
# The checkout itself, for this process and every point's (no install: nothing to build).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$py" -m experiments.infra.node_carry install --carry "$carry" || exit 2
JAX_PLATFORMS=cpu "$py" -m experiments.infra.node_carry check || exit 2
"$py" -m pip list 2>/dev/null \
    | grep -iE '^(jax|jaxlib|jax-cuda1[23]-plugin|flax|optax|numpy|torch|mpi4py|mpi4jax|mpich|onednn-cpu-gomp) '
command -v nvidia-smi >/dev/null && nvidia-smi -L
nproc
timeout $((gpu_s + 60)) "$py" -m experiments machine --budget "$gpu_s" --out "$out/$name-gpu" "$@"
echo "gpu run: rc $?"
JAX_PLATFORMS=cpu timeout $((cpu_s + 60)) "$py" -m experiments machine --budget "$cpu_s" \
    --out "$out/$name-cpu" "$@"
echo "cpu run: rc $?"
