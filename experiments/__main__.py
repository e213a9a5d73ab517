"""`python -m experiments <command>`: parse, dispatch. Intentionally short; the work lives in
importable functions (`experiments.points.run.execute`, each study's `run(config)`, ...).

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

from experiments import demo
from experiments.cli import (BENCH, EXIT_USAGE, build_parser, cluster_arguments, config_from_args,
                             options_from_args)
from experiments.cost import predict
from experiments.cost import profile as profile_cmd
from experiments.infra import cluster
from experiments.options import BenchOptions
from experiments.peers import study as peers
from experiments.points.run import execute
from experiments.publish import figures
from experiments.publish import report as docs_report  # not `report`: jaxpar.bench's printout
from experiments.studies import batch_size, bounds
from experiments.studies.hparam import study as hparam
from experiments.studies.faults import study as faults
from experiments.studies.machine import study as machine
from experiments.studies.network import study as network
from experiments.studies.pipeline import study as pipeline_study
from experiments.studies.scaling import study as scaling
from experiments.studies.strategies import study as strategies
from experiments.studies.time_to_accuracy import study as time_to_accuracy
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

# Commands that are not runs or studies: (what runs it, given its options; its options dataclass).
TOOLS = {"figures": (figures.run, figures.FiguresOptions), "report": (docs_report.run, docs_report.ReportOptions),
         "demo": (demo.run, demo.DemoOptions), "profile": (profile_cmd.run, profile_cmd.ProfileOptions),
         "predict": (predict.predict_command, predict.PredictOptions),
         "plan": (predict.plan_command, predict.PlanOptions)}

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
            command, options = TOOLS[args.command]
            return 0 if command(options_from_args(args, options())) is not None else 1
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
