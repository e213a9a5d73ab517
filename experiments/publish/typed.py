"""Numbers the docs may type in their prose, because they are not measurements: limits the
project sets, configuration, specifications, arithmetic on shapes, claims a test checks. Every
other number with a unit of measurement outside a generated block (`report`'s markers), a code
block or inline code is a typed measurement, which `report --check` refuses naming it: a
measured number is generated from the results files (a study's findings), never typed.

    typed_measurements(Path("."))   # ['docs/x.md:12: "41 ms" in ...', ...]
"""

from __future__ import annotations

import re
from pathlib import Path

# A number with a unit a measurement would carry: times, ratios, shares, rates, sizes.
MEASURED = re.compile(r"(?<![\w.\-/^])[-+]?\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?\s?"
                      r"(?:x\b|%|ms\b|s\b|images/s\b|MB\b|MiB\b|GB\b|GFLOP/s\b|TFLOP/s\b|us\b|minutes?\b)")

# (page, the phrase holding the number) -> why it is not a measurement
NOT_MEASURED = {
    ("docs/cost.md", "4 KB to 16 MB"): "the profile's message sizes",
    ("docs/cost.md", "4 KB to 2 MB"): "the profile's message sizes across hosts",
    ("docs/demo.md", "ink's box (5%)"): "the drawing's preprocessing, a setting",
    ("docs/machines.md", "about 8 minutes"): "the machine command's --budget",
    ("docs/machines.md", "budget of 8 minutes"): "the device tool's limit for one prepared script",
    ("docs/machines.md", "within 2 minutes"): "the install and check's timeouts, settings",
    ("docs/machines.md", "cut at 90 s"): "mpi4jax's build timeout, a setting",
    ("docs/multiprocess.md", "12.5 MB in about 0.1 s"): "a tested claim (the link carries its rate)",
    ("docs/multiprocess.md", "within 10%"): "a tested claim's tolerance",
    ("docs/multiprocess.md", "3 to 5 minutes"): "how long a test takes, not a result",
    ("docs/multiprocess.md", "for 2 minutes"): "a SLURM setting (BeginTime)",
    ("docs/multiprocess.md", "after 5 minutes"): "a timeout, a setting",
    ("docs/faults.md", "(default 30 s)"): "--collective-timeout's default, a setting",
    ("docs/faults.md", "ends itself 5 s later"): "the watchdog's grace, a setting",
    ("docs/faults.md", "three times the bound plus 10 s (100 s by default, JAX's own default; it was 10 s once)"): "the heartbeat's timeout, settings",
    ("docs/faults.md", "twice the bound plus 5 s"): "the backstop's former rule, a setting",
    ("docs/faults.md", "12-13 s after their link was cut (bound 12 s)"): "what a test saw (tests/experiments/infra/test_cluster.py), a fault's timing",
    ("docs/faults.md", "from 200 ms: after 0.2, 0.6, 1.4, 3.0, 6.2, 12.6, 25.4 s)"): "Linux's retransmission timer, a specification",
    ("docs/faults.md", "three times the bound plus 10 s"): "the backstop's rule, a setting",
    ("docs/faults.md", "survives a 3 s flap (tested, bound 12 s)"): "a test's settings",
    ("docs/faults.md", "bound (30 s)"): "--collective-timeout's default, a setting",
    ("docs/faults.md", "a 3 s flap then a cut link"): "the study's settings",
    ("docs/faults.md", "10 s and then 20 s flaps"): "the study's settings",
    ("docs/faults.md", "jax.distributed's own 30 s"): "jax.distributed's timeout, a setting",
    ("docs/multiprocess.md", "(default 30 s)"): "--collective-timeout's default, a setting",
    ("docs/multiprocess.md", "(a 3 s"): "a test's settings",
    ("docs/multiprocess.md", "(30 s start, 10 s shutdown"): "timeouts, settings",
    ("docs/multiprocess.md", "plus 10 s"): "the backstop's rule, a setting",
    ("docs/usage.md", "(default 30 s)"): "--collective-timeout's default, a setting",
    ("docs/strategies.md", "50% and 98% padding"): "arithmetic on the CNN's shapes (tested)",
    ("docs/strategies.md", "width 64 x 4 blocks"): "a model's shape",
    ("docs/strategies.md", "equal 2 x sub-blocks"): "a formula",
    ("docs/strategies.md", "50% more than the explicit"): "compiled bytes, a tested claim",
    ("docs/studies/batch-size.md", "within 1.25x"): "the regimes' threshold, a setting",
    ("docs/studies/batch-size.md", "falling by 10%"): "the regimes' threshold, a setting",
    ("docs/studies/batch-size.md", "than 1.25x the fewest"): "the regimes' threshold, a setting",
    ("docs/studies/bounds.md", "within 1.3x"): "the limits the project sets",
    ("docs/studies/bounds.md", "1.5x; on 4 devices each within 2x"): "the limits the project sets",
    ("docs/studies/cost-check.md", "±25%"): "the figure's band",
    ("docs/studies/cost-check.md", "103 GB of f32 state"): "arithmetic on the model's size",
    ("docs/studies/cost-check.md", "device of 80 GB"): "a specification",
    ("docs/studies/cost-check.md", "(8192 x 8192 matmuls)"): "a model's shape",
    ("docs/studies/network.md", "within 10%"): "a tested claim's tolerance",
    ("docs/studies/pipeline.md", "width 256 x 8 blocks"): "a model's shape",
    ("docs/studies/scaling.md", "about 90% efficiency"): "Horovod's paper, cited",
    ("docs/studies/strategies.md", "width 256 x 8 residual"): "a model's shape",
}


def prose(text: str) -> str:
    """`text` without its generated blocks, comments, code blocks and inline code (blanked, so
    that lines keep their numbers)."""
    blank = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    text = re.sub(r"<!-- report:([\w-]+) -->.*?<!-- /report:\1 -->", blank, text, flags=re.S)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.S)
    text = re.sub(r"^```.*?^```", blank, text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def allowed(page: str, line: str, match: re.Match) -> bool:
    """Whether the number `match` found in `line` of `page` is inside a phrase NOT_MEASURED lists."""
    for (where, phrase), _ in NOT_MEASURED.items():
        if where != page:
            continue
        flat = phrase.replace("\n", " ")
        for found in re.finditer(re.escape(flat), line):
            if found.start() <= match.start() and match.end() <= found.end():
                return True
    return False


def typed_measurements(root: Path, pages: list[Path]) -> list[str]:
    """'PAGE:LINE: "41 ms" in ...' for every typed number with a measurement's unit."""
    found = []
    for page in pages:
        name = page.relative_to(root).as_posix()
        lines = prose(page.read_text()).splitlines()
        for i, line in enumerate(lines, 1):
            joined = line if i == len(lines) else line + " " + lines[i].lstrip()  # a phrase may wrap
            for m in MEASURED.finditer(line):
                if not allowed(name, joined, m):
                    found.append(f"{name}:{i}: {m.group(0).strip()!r} in ...{line[max(0, m.start() - 40):m.end() + 20]}")
    return found
