"""`python -m experiments <command>`: parse, set up devices, dispatch. Intentionally short;
the work lives in importable functions (`jaxpar.train.train`, `jaxpar.bench.benchmark`, ...).

    python -m experiments train --model cnn --epochs 3 --out results/run1
    python -m experiments bench --model mlp --batch-size 128
    python -m experiments prepare-data --dataset fashion_mnist
"""

from __future__ import annotations

import sys
import time

from experiments import (batch_size, demo, figures, hparam, pipeline_study, scaling, strategies,
                         time_to_accuracy)
from experiments.cli import BENCH, build_parser, config_from_args
from jaxpar import data, distributed, results
from jaxpar.bench import benchmark, report
from jaxpar.checkpoint import Interrupted
from jaxpar.distributed import launcher
from jaxpar.errors import ConfigError, UserError
from jaxpar.mesh import simulate_cpu_devices
from jaxpar.parallel import STRATEGIES
from jaxpar.train import train
from rich.console import Console


COMMANDS = {
    "train": {"help": "train one model with one strategy; writes OUT/result.json"},
    "bench": BENCH,
    "scaling": {"help": "data-parallel strategies over device counts (or MPI ranks: --ranks), "
                        "strong and weak scaling (one bench process per point); writes OUT/summary.md",
                "config": False, "extra": "scaling"},
    "pipeline": {"help": "pipeline bubble (schedule tables), throughput and memory per device "
                         "(one bench process per point) vs micro-batches, GPipe vs 1F1B; writes "
                         "OUT/pipeline.json",
                 "config": False, "extra": "pipeline"},
    "hparam": {"help": "lr/momentum/seed search as vmapped trials (sharded over --devices) vs one "
                       "by one, best by validation accuracy; writes OUT/hparam.json",
               "config": False, "extra": "hparam"},
    "batch-size": {"help": "steps to a target validation error vs batch size (Shallue et al. 2018), "
                           "lr x momentum grid as vmapped trials; writes OUT/result.json",
                   "config": False},
    "strategies": {"help": "one model under every strategy on the same devices: step time, images/s, "
                           "collective bytes, state and temp memory per device (one bench process "
                           "per strategy); writes OUT/strategies.json and OUT/summary.md",
                   "config": False},
    "time-to-accuracy": {"help": "wall time, steps and images/s to a target validation accuracy for MLP, "
                                 "CNN and ResNet per strategy (one train process per point); writes "
                                 "OUT/time_to_accuracy.json and OUT/summary.md",
                         "config": False},
    "figures": {"help": "redraw every figure from results files (--data) into --out",
                "config": False, "extra": "figures"},
    "prepare-data": {"help": "prepare a dataset ahead of time (for offline machines and clusters)",
                     "config": {"dataset", "data_dir", "cache_dir"}},
    "demo": {"help": "local web page: train strategies live side by side, classify drawings with "
                     "the trained models, the study figures (needs the `demo` extra)", "config": False},
}

STUDIES = {"batch-size": batch_size, "scaling": scaling, "pipeline": pipeline_study, "figures": figures,
           "hparam": hparam, "strategies": strategies, "time-to-accuracy": time_to_accuracy,
           "demo": demo}
for _name, _module in STUDIES.items():
    COMMANDS[_name]["extra"] = _module.add_flags

# Errors a user can fix: print the message alone (no traceback) and exit non-zero.
EXIT_USAGE = 2


# ValueError too: a model or optimizer constructor's message for an impossible option value.
USER_ERRORS = (UserError, ValueError)


def _distributed_mode(config) -> str:
    """mpi4jax strategies join ranks with MPI itself; the rest join them with jax.distributed."""
    cls = STRATEGIES[config.parallel.strategy]
    if cls.uses_mpi:
        return "none"
    mode = config.parallel.distributed
    many = mode in ("mpi", "slurm") or (mode == "auto" and launcher() is not None)
    if many and not cls.multiprocess:
        able = [n for n, c in STRATEGIES.items() if c.multiprocess or c.uses_mpi]
        raise ConfigError(f"--strategy {cls.name} cannot run across processes (not built or tested "
                          f"for one global mesh over ranks); launch one process, or pick one that "
                          f"can: {', '.join(able)}")
    return mode


def run(argv: list[str]) -> int:
    args = build_parser(COMMANDS).parse_args(argv)
    try:
        if args.command in STUDIES:
            return 0 if STUDIES[args.command].run(args) is not None else 1
        return _dispatch(args, config_from_args(args), Console(stderr=False))
    except Interrupted as e:  # SIGTERM / Ctrl-C after saving a checkpoint
        print(str(e), file=sys.stderr)
        return e.exit_code
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _dispatch(args, config, console) -> int:
    if args.command == "prepare-data":
        from jaxpar import tfds_idx  # TFDS takes seconds to import; only this command needs it

        if config.data.dataset == "synthetic":
            raise ValueError("--dataset synthetic is generated on the fly; nothing to prepare")
        start = time.perf_counter()
        tfds_idx.prepare(config.data.dataset, config.data.data_dir, data.cache_dir(config.data))
        console.print(f"{config.data.dataset} ready in {data.cache_dir(config.data)} "
                      f"({time.perf_counter() - start:.1f} s)")
        return 0

    out = config.out
    if args.command == "train" and out is None:
        out = f"results/{config.model.model}-{config.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out is not None:
        results.ensure_writable(out)  # fail before the work, not after it
    simulate_cpu_devices(config.parallel.devices)  # before JAX's backend starts
    distributed.setup(_distributed_mode(config), config.parallel.single_thread)
    main = distributed.is_main()  # only rank 0 prints and writes results

    if args.command == "train":
        result = train(config, console=console if main else None)
    else:
        result = benchmark(config, iters=args.iters, warmup=args.warmup,
                           matmul_peak=args.matmul_peak)
        if main:
            console.print(report(result))
    if out is not None and main:
        console.print(f"wrote {results.save(result, out)}")
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
