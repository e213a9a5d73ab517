"""`predict` and `plan`: the cost model (`jaxpar.cost`) carried to machines this one cannot hold,
each prediction with how sure it is.

    python -m experiments predict --model cnn --strategy pipeline --devices 64 --link 10gbit
    python -m experiments plan --model cnn --devices 2          # this machine's simulated devices
    python -m experiments plan --model cnn --ranks 2            # 2 single-threaded processes
    python -m experiments plan --model stack-mlp --depth 16 --width 8192 --devices 64 \\
        --memory 80GB --link nvlink

The machine: `--device profiled` is the device `--profile` measured (this machine's CPU by
default; figures/data/cost-h100/profile.json is a measured H100): the profiled models' measured
step and layer times, others from their FLOPs at the profile's achieved rate per layer kind, as
if each device had the machine to itself; `--device h100` is an assumed H100
(jaxpar.cost.DEVICES), computing each layer kind at the fraction of its peak the profiled
machine reaches of its own matmul peak. `--link measured` prices collectives as the profile's
simulated devices measured them; 10gbit, 100gbit, nvlink are assumed links (jaxpar.cost.LINKS).

On this machine (`--device profiled --link measured`) a prediction takes the terms measured
from the committed points (`terms`: the formulations' cost, a pinned process's host time) and
carries an 80% interval (`uncertainty`), both fitted on the results under `--data`; `plan`
calls a choice a tie where the pick's interval and another's overlap, and names both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.cost import check, plan_bench, pricing, terms, uncertainty
from experiments.cost.pricing import DEFAULT_PROFILE, DEVICE_CHOICES, LINK_CHOICES, PROFILED
from experiments.options import option
from jaxpar import cost
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES


@dataclass(frozen=True)
class PredictOptions:
    model: str = option("cnn", "model (as train's --model)")
    depth: int = option(0, "depth, where the model takes it (0: its default)")
    width: int = option(0, "width, where the model takes it (0: its default)")
    strategy: str = option("single", "strategy (as train's --strategy)")
    devices: int = option(1, "devices (ranks for the MPI strategies)")
    ranks: int = option(0, "this many single-threaded processes on this machine instead of --devices "
                           "(MPI ranks, jax.distributed processes)")
    mesh: str = option("", "axis sizes, as train's --mesh (default: the strategy's)")
    batch_size: int = option(128, "global batch")
    microbatches: int = option(4, "pipeline micro-batches")
    schedule: str = option("gpipe", "pipeline schedule: gpipe | 1f1b")
    device: str = option(PROFILED, "profiled (the device --profile measured: this machine's CPU by "
                                   "default) | h100 (assumed)")
    link: str = option("measured", "measured (this machine's simulated devices) | 10gbit | 100gbit | nvlink")
    memory: str = option("", "memory per device, e.g. 16GB (default: the device's)")
    profile: str = option(DEFAULT_PROFILE, "the machine profile (`python -m experiments profile`)")
    data: str = option("", "the committed results the terms and intervals are fitted on (default: the "
                           "folder holding --profile as cost/profile.json; none there: the profile alone)")


@dataclass(frozen=True)
class PlanOptions(PredictOptions):
    devices: int = option(8, "devices to plan for")
    microbatches: int = option(0, "pipeline micro-batches (0: weigh 1, 2, 4, 8, 16)")
    schedule: str = option("", "pipeline schedule (empty: weigh every one)")
    bench_top: int = option(0, "then measure the first N configurations that fit on this machine, in rounds "
                               "(`bench`, one process per configuration and round), into --out")
    rounds: int = option(5, "--bench-top: rounds, each configuration once a round, the order rotated")
    out: str = option("", "--bench-top: the folder for plan.json and each configuration's rounds")


@dataclass(frozen=True)
class Fitted:
    """What the committed results give a prediction on this machine: its terms and spreads."""
    terms: terms.Terms | None
    sigmas: uncertainty.Sigmas
    source: str


def fitted_for(profile: dict, profile_path: str, data: str) -> Fitted:
    """The terms and spreads fitted on the results under `data` (default: the folder holding
    `profile_path` as cost/profile.json), or the profile's own noise alone where there are none."""
    folder = Path(data) if data else Path(profile_path).parent.parent
    if (folder / check.PROFILE_UNDER_DATA).is_file() and any(folder.glob(p) for _, p in check.CHECKED_STUDIES):
        rows = check.check_rows(folder)
        return Fitted(terms.fitted_terms(rows), uncertainty.sigmas(rows, profile), f"{len(rows)} points under {folder}")
    return Fitted(None, uncertainty.Sigmas(uncertainty.profile_sigma(profile), {}, 0.0, 0.0),
                  "the profile alone (no committed points beside it)")


def _check(args) -> tuple[dict, str]:
    if args.strategy not in STRATEGIES:
        raise ConfigError(f"--strategy {args.strategy}: choose one of {', '.join(STRATEGIES)}")
    if args.device not in DEVICE_CHOICES or args.link not in LINK_CHOICES:
        raise ConfigError(f"--device one of {', '.join(DEVICE_CHOICES)}; --link one of {', '.join(LINK_CHOICES)}")
    profile = pricing.load_profile(args.profile)
    if args.ranks and not pricing.on_this_machine(profile, args.device, args.link):
        raise ConfigError("--ranks: processes of this machine's CPU; drop --device and --link")
    return profile, pricing.model_key_of(args.model, args.depth or None, args.width or None)


def sigma_of(fitted: Fitted, pred: cost.Prediction, key: str, one_thread: bool, session: bool) -> float:
    share = pred.compute_s / pred.total_s if pred.total_s else 1.0
    return fitted.sigmas.for_plan(key, one_thread, share, session)


def predict_command(args: PredictOptions) -> cost.Prediction:
    """`python -m experiments predict`: one strategy's predicted step, printed."""
    profile, key = _check(args)
    memory = pricing.parse_bytes(args.memory) if args.memory else None
    local = pricing.on_this_machine(profile, args.device, args.link)
    fitted = fitted_for(profile, args.profile, args.data) if local else None
    pred = pricing.predict_one(profile, key, args.strategy, args.ranks or args.devices, args.batch_size, args.device,
                               args.link, memory, args.mesh, processes=bool(args.ranks),
                               fitted=fitted.terms if fitted else None, microbatches=args.microbatches,
                               schedule=args.schedule)
    where = f"{args.ranks} processes" if args.ranks else f"{args.devices} x {pricing.device_name(profile, args.device)}"
    print(f"{key} / {args.strategy} on {where} over {args.link}, batch {args.batch_size}")
    print("  " + pricing.describe(pred, memory))
    if fitted:
        one_thread = bool(args.ranks) or STRATEGIES[args.strategy].uses_mpi
        lo, hi = uncertainty.interval(1000 * pred.total_s, sigma_of(fitted, pred, key, one_thread, session=True))
        print(f"  80% interval {lo:.2f}-{hi:.2f} ms: the profile's noise, the model's own spread, one fresh "
              f"measurement's and the day's speed (fitted on {fitted.source})")
    else:
        print("  (no interval: no measurement of this machine to carry one from)")
    for note in pred.notes:
        print(f"  ({note})")
    return pred


def _best_per_strategy(rows: list[dict]) -> list[dict]:
    """The fastest row of each strategy and mesh (over its micro-batches and schedules)."""
    seen, out = set(), []
    for r in rows:
        if (r["strategy"], r["mesh"]) not in seen:
            seen.add((r["strategy"], r["mesh"]))
            out.append(r)
    return out


def mark_ties(rows: list[dict], fitted: Fitted | None, key: str, processes: bool) -> list[dict]:
    """Each row with its 80% interval (ms; without the day's speed, which moves every row
    alike) and `tie`: the pick's and its intervals overlap (the pick itself included)."""
    for r in rows:
        p = r["prediction"]
        if fitted is None:
            r["interval"] = None
            continue
        one_thread = processes and r["strategy"] != "single" or STRATEGIES[r["strategy"]].uses_mpi
        r["interval"] = uncertainty.interval(1000 * p.total_s, sigma_of(fitted, p, key, one_thread, session=False))
    fits = [r for r in rows if r["fits"]]
    pick = fits[0] if fits else None
    for r in rows:
        r["tie"] = bool(pick and r["fits"] and r["interval"] and pick["interval"]
                        and r["interval"][0] <= pick["interval"][1])
    return rows


def _configuration(r: dict) -> str:
    extra = [f"M={r['microbatches']}"] if "microbatches" in r else []
    extra += [r["schedule"]] if r.get("schedule") else []
    return r["mesh"] + (" " + " ".join(extra) if extra else "")


def plan_command(args: PlanOptions) -> list[dict]:
    """`python -m experiments plan`: every strategy and mesh (a pipeline at its best micro-batches
    and schedule), fastest first, each with its interval; the pick, or the tie."""
    profile, key = _check(args)
    memory = pricing.parse_bytes(args.memory) if args.memory else None
    local = pricing.on_this_machine(profile, args.device, args.link)
    fitted = fitted_for(profile, args.profile, args.data) if local else None
    fixed = {k: v for k, v in (("microbatches", args.microbatches), ("schedule", args.schedule)) if v}
    rows = pricing.plan_rows(profile, key, args.ranks or args.devices, args.batch_size, args.device, args.link,
                             memory, processes=bool(args.ranks), fitted=fitted.terms if fitted else None, **fixed)
    shown = mark_ties(_best_per_strategy(rows), fitted, key, bool(args.ranks))
    where = (f"{args.ranks} single-threaded processes (or one on every core)" if args.ranks
             else f"{args.devices} x {pricing.device_name(profile, args.device)} over {args.link}")
    print(f"{key} on {where}, batch {args.batch_size}, memory/device {args.memory or 'the device' + chr(39) + 's'}: "
          f"fastest first ({len(rows)} configurations weighed)")
    for r in shown:
        p, iv = r["prediction"], r["interval"]
        band = f"({iv[0]:.1f}-{iv[1]:.1f})" if iv else ""
        print(f"  {'  ' if r['fits'] else 'NO'} {'=' if r['tie'] else ' '} {r['strategy']:<17} {_configuration(r):<28} "
              f"{1000 * p.total_s:9.2f} ms {band:<14} {p.images_per_s:10,.0f} img/s {p.memory_bytes / 1e9:8.3f} GB"
              + ("" if r["fits"] else "  does not fit"))
    ties = [r for r in shown if r["tie"]]
    if len(ties) > 1:
        print(f"  a tie: {', '.join(r['strategy'] + ' ' + _configuration(r) for r in ties)} (their 80% intervals "
              f"overlap the pick's; measure them)")
    elif ties:
        print(f"  pick: {ties[0]['strategy']} {_configuration(ties[0])}")
    if fitted:
        print(f"  (intervals: 80%, fitted on {fitted.source}; the day's speed moves every row alike, "
              f"a further x{uncertainty.interval(1.0, fitted.sigmas.session)[0]:.2f}-"
              f"{uncertainty.interval(1.0, fitted.sigmas.session)[1]:.2f})")
    if args.bench_top:
        _bench(args, key, [r for r in shown if r["fits"]][:args.bench_top])
    return rows


def _bench(args: PlanOptions, key: str, top: list[dict]) -> None:
    """`--bench-top`: measure `top` in rounds and say which ran fastest."""
    if not args.out or not pricing.on_this_machine(pricing.load_profile(args.profile), args.device, args.link):
        raise ConfigError("--bench-top measures on this machine: give --out, and no --device or --link")
    cfg = pricing.model_config(key)
    question = {"model": cfg.model, "depth": cfg.depth, "width": cfg.width, "key": key,
                "devices": args.ranks or args.devices, "processes": bool(args.ranks), "batch": args.batch_size}
    found = plan_bench.bench_top(top, question, args.rounds, args.out)
    fastest = min(found, key=lambda f: f["measured_ms"])
    for f in found:
        print(f"  measured {f['folder']:<32} {f['measured_ms']:8.2f} ms (median of {len(f['rounds_ms'])} rounds; "
              f"predicted {f['predicted_ms']:.2f})")
    print(f"  plan's first, {found[0]['folder']}, {'ran fastest' if fastest is found[0] else 'did not run fastest'}"
          f" ({args.out}/{plan_bench.PLAN_FILE})")
