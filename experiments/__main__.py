"""`python -m experiments <command>`: parse, dispatch. Intentionally short; the work lives in
importable functions (`experiments.run.execute`, each study's `run(config)`, ...).

    python -m experiments train --model cnn --epochs 3 --out results/run1
    python -m experiments bench --model mlp --batch-size 128
    python -m experiments scaling --quick --out /tmp/scaling
    python -m experiments machine --out figures/data/machines/NAME   # measure this machine
    python -m experiments prepare-data --dataset fashion_mnist
"""

from __future__ import annotations

import sys
import time

import jax
from rich.console import Console

from experiments import (batch_size, bounds, cluster, demo, faults, figures, hparam, machine,
                         network, peers, pipeline_study, predict, profile_cmd, scaling, strategies,
                         time_to_accuracy)
from experiments import report as docs_report  # not `report`: jaxpar.bench's printout
from experiments.cli import (BENCH, build_parser, cluster_arguments, config_from_args,
                             options_from_args)
from experiments.options import BenchOptions
from experiments.run import execute
from jaxpar import data, results
from jaxpar.runtime import distributed
from jaxpar.checkpoint import Interrupted
from jaxpar.errors import Diverged, UserError

# Every study: a config dataclass (its flags), a quick preset and a run function.
STUDIES = {s.name: s for s in (scaling.STUDY, pipeline_study.STUDY, hparam.STUDY, batch_size.STUDY,
                                strategies.STUDY, time_to_accuracy.STUDY, peers.STUDY, bounds.STUDY,
                                machine.STUDY, network.STUDY, faults.STUDY)}

COMMANDS = {
    "train": {"help": "train one model with one strategy; writes OUT/result.json"},
    "bench": BENCH,
    **{name: {"help": s.help, "config": False, "options": s.config, "quick": s.quick}
       for name, s in STUDIES.items()},
    "figures": {"help": "redraw every figure from results files (--data) into --out",
                "config": False, "options": figures.FiguresOptions},
    "report": {"help": "write every results table in README.md and docs/ from results files "
                       "(--data); --check fails naming stale tables", "config": False,
               "options": docs_report.ReportOptions},
    "prepare-data": {"help": "prepare a dataset ahead of time (for offline machines and clusters)",
                     "config": {"dataset", "data_dir", "cache_dir"}},
    "profile": {"help": "measure this machine once for the cost model (step and layer times, "
                        "collectives); writes OUT/profile.json", "config": False,
                "options": profile_cmd.ProfileOptions},
    "predict": {"help": "predicted step time (compute, communication, bubble) and memory of one "
                        "strategy on N devices over a link", "config": False,
                "options": predict.PredictOptions},
    "plan": {"help": "rank every strategy and mesh for a model, N devices, a memory per device "
                     "and a link, marking what does not fit", "config": False,
             "options": predict.PlanOptions},
    "cluster": {"help": "an emulated cluster on this machine (root): hosts as network namespaces "
                        "joined by rate-limited links; run and launch commands on them",
                "config": False, "extra": cluster_arguments},
    "demo": {"help": "local web page: train strategies live side by side, classify drawings with "
                     "the trained models, the study figures (needs the `demo` extra)", "config": False,
             "options": demo.DemoOptions},
}

# Commands that are not runs or studies: (module, its options dataclass).
TOOLS = {"figures": (figures, figures.FiguresOptions), "report": (docs_report, docs_report.ReportOptions),
         "demo": (demo, demo.DemoOptions), "profile": (profile_cmd, profile_cmd.ProfileOptions),
         "predict": (predict.PredictCommand, predict.PredictOptions),
         "plan": (predict.PlanCommand, predict.PlanOptions)}

# Errors a user can fix: print the message alone (no traceback) and exit non-zero.
EXIT_USAGE = 2

# ValueError too: a model or optimizer constructor's message for an impossible option value.
USER_ERRORS = (UserError, ValueError)


def run(argv: list[str]) -> int:
    results.capture_provenance()  # the revision every command and study starts from
    args = build_parser(COMMANDS).parse_args(argv) if argv[:1] != ["cluster"] else None
    try:
        if args is None:  # its own parser: the command after -- passes through untouched
            return cluster.main(argv[1:])
        if args.command in STUDIES:
            study = STUDIES[args.command]
            config = options_from_args(args, study.quick if args.quick else study.config())
            return 0 if study.run(config) is not None else 1
        if args.command in TOOLS:  # figures, report, demo: options, then their run()
            tool, options = TOOLS[args.command]
            return 0 if tool.run(options_from_args(args, options())) is not None else 1
        return _dispatch(args, Console(stderr=False))
    except Interrupted as e:  # SIGTERM / Ctrl-C after saving a checkpoint
        print(str(e), file=sys.stderr)
        return e.exit_code
    except Diverged as e:  # a non-finite loss: the result says so; exit 3
        distributed.report_user_error(str(e), e.exit_code)
        return e.exit_code
    except USER_ERRORS as e:
        distributed.report_user_error(str(e), EXIT_USAGE)  # once per job under mpiexec
        return EXIT_USAGE
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        distributed.report_user_error(
            f"the run ran out of device memory ({str(e).splitlines()[0][:200]}); lower "
            "--batch-size, --eval-batch-size, --width or --depth, or spread the model over more "
            "devices (--strategy fsdp, tensor, pipeline)", EXIT_USAGE)
        return EXIT_USAGE


def _dispatch(args, console) -> int:
    config = config_from_args(args)
    if args.command == "prepare-data":
        if config.data.dataset == "synthetic":
            raise ValueError("--dataset synthetic is generated on the fly; nothing to prepare")
        from jaxpar.data import tfds_idx  # TFDS takes seconds to import; only this command needs it

        start = time.perf_counter()
        tfds_idx.prepare(config.data.dataset, config.data.data_dir, data.cache_dir(config.data))
        console.print(f"{config.data.dataset} ready in {data.cache_dir(config.data)} "
                      f"({time.perf_counter() - start:.1f} s)")
        return 0
    bench = options_from_args(args, BenchOptions()) if args.command == "bench" else None
    execute(config, bench, console)
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
