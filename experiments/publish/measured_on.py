"""Where and when results were measured, in words: the machine of a result's `env`, and the
line under each study's table naming the machine, software, revision(s) and time of every
results file in its folder (`report`'s `machine-NAME` blocks).

    machine_line("pipeline", Path("figures/data"))   # '*Measured on:* 2-core x86_64 CPU (cpu), ...'
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from experiments.publish import sources
from jaxpar import results


def cpu_name(env: dict, cores: int) -> str:
    """'16-core x86_64 CPU' from a result's env."""
    arch = env.get("platform", "").split("-with")[0].rsplit("-", 1)[-1] or "?"
    return f"{cores}-core {arch} CPU"


def machine_name(env: dict, cores_key: str = "cores_available") -> str:
    """'16-core x86_64 CPU' or '1 x NVIDIA H100 80GB HBM3 (16-core x86_64 CPU)', from a
    result's env; `cores_key`: the cores the process could use, or (`cpu_cores`) the machine's
    (a pinned rank's env can use one)."""
    cpu = cpu_name(env, env[cores_key])
    if env["backend"] == "cpu":
        return cpu
    return f"{env['local_device_count']} x {env['device_kind']} ({cpu})"


def cpu_words(env: dict) -> str:
    """'2-core x86_64 CPU' from a result's env: the machine's cores."""
    return cpu_name(env, env["cpu_cores"])


def machine_words(env: dict) -> str:
    return f"{cpu_words(env)}, {env['device_count']} XLA {env['backend']} device(s), jax {env['jax']}"


def revision_words(env: dict) -> str:
    """'bb7280b', or 'bb7280b (uncommitted changes)': the revision a result started from."""
    rev = str(env.get("git_revision", "unknown"))
    dirty = env.get("git_dirty", rev.endswith("+dirty"))
    return rev.removesuffix("+dirty")[:7] + (" (uncommitted changes)" if dirty else "")


def machine_line(name: str, data_dir: Path) -> str:
    """Machine, software, revision(s) and when, over every results file of source `name`."""
    src = sources.path_of(data_dir, name)
    sources.load_source(data_dir, name)  # missing or damaged: the error names the command
    folder = src if src.is_dir() else src.parent
    envs = []
    for path in sorted(folder.rglob("*.json")):
        try:
            envs.append(results.load(path).env)
        except results.ResultsError:
            continue  # not a results file
    times = sorted(datetime.strptime(e["time"], "%Y-%m-%dT%H:%M:%S%z") for e in envs)
    span = times[0].strftime("%Y-%m-%d %H:%M")
    if times[-1].date() != times[0].date():
        span += times[-1].strftime(" to %Y-%m-%d %H:%M")
    elif times[-1] != times[0]:
        span += times[-1].strftime("-%H:%M")
    revisions = sorted({revision_words(e) for e in envs})
    machines = sorted({f"{machine_name(e, 'cpu_cores')} ({e['backend']}), jax {e['jax']}, "
                       f"flax {e.get('flax', '?')}" for e in envs})
    diffs = sorted({e["git_diff_file"] for e in envs if e.get("git_diff_file")})
    diff_note = f"; diffs beside the files: {', '.join(diffs)}" if diffs else (
        "; the diff was not recorded (written before results kept it)"
        if any("uncommitted" in r for r in revisions) else "")
    # Named by the results folder's last two parts (figures/data/...), however it was given.
    shown = Path(*Path(data_dir).resolve().parts[-2:]) / folder.relative_to(data_dir)
    return (f"*Measured on:* {'; '.join(machines)}. *Results:* {len(envs)} file(s) under "
            f"`{shown.as_posix()}/`, written {span} ({times[0].strftime('%z')}) from revision "
            f"{', '.join(revisions)}{diff_note}.{ran_words(envs)}")


def ran_words(envs: list[dict]) -> str:
    """' *Ran:* convolutions onednn, oneDNN 3.2.0 (avx2), XLA CPU threads per process 1 / 2,
    ...' from the files' env.ran and env.gpu (jaxpar/results/ran.py), each value the files hold once;
    files written before results recorded it are counted as not recorded. '' when no file
    records it (the line as before)."""
    recorded = [e["ran"] for e in envs if isinstance(e.get("ran"), dict)]
    if not recorded:
        return ""

    def seen(key: str) -> str:
        shown = {f"{v['version']} ({v['isa']})" if key == "onednn" else str(v)
                 for r in recorded if (v := r.get(key)) is not None}
        return " / ".join(sorted(shown, key=lambda v: (len(v), v)))  # 2 before 16

    parts = [f"{what} {seen(key)}" for what, key in (
        ("convolutions", "conv"), ("batch norm", "batch_norm"), ("oneDNN", "onednn"),
        ("XLA CPU threads per process", "xla_threads"), ("pipeline", "pipeline")) if seen(key)]
    gpus = sorted({f"{g['name']}, driver {g.get('driver') or 'not read'}" for e in envs
                   if isinstance(g := e.get("gpu"), dict)})
    parts += [f"GPU {' / '.join(gpus)}"] if gpus else []
    missing = len(envs) - len(recorded)
    return (f" *Ran:* {', '.join(parts) or 'nothing recorded'}"
            + (f"; {missing} file(s) not recorded" if missing else "") + ".")
