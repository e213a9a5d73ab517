"""Machines to run on: an emulated cluster (cluster.py: hosts as network namespaces joined by
rate-limited links), a single-node SLURM (slurm.py), and measure_node.sh (the machine command
on a lent GPU node)."""
