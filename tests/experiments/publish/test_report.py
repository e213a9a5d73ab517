"""The docs' results tables equal what the committed results give (`python -m experiments
report --check`); a stale table, an unknown marker or missing results fail naming them; the
README is a front page that links only to files in the repository."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import ROOT
from experiments.__main__ import run
from experiments.publish.report import documents, report
from experiments.publish.tables import TABLES
from jaxpar.errors import ResultsError

DATA = ROOT / "figures" / "data"


def test_every_committed_table_equals_what_the_results_give():
    stale = report(ROOT, DATA, check=True)
    assert stale == [], "regenerate with `python -m experiments report`: " + ", ".join(stale)


def test_every_table_is_published_somewhere():
    text = "\n".join(p.read_text() for p in documents(ROOT))
    # Unpublished only while its results are not committed (`report` could not write it):
    # the peers study's, until a machine with PyTorch runs it.
    for name in [n for n in TABLES if f"<!-- report:{n} -->" not in text]:
        with pytest.raises(ResultsError):
            TABLES[name](DATA)


@pytest.fixture
def docs_copy(tmp_path):
    """README.md and docs/ copied to a scratch root, to spoil."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


@pytest.mark.parametrize("old,new,name", [
    ("| 18,391 |", "| 29,265 |", "batch-size"),                # a hand-typed number in a table
    ("from batch 32 to 128", "from batch 32 to 256", "batch-size-findings"),  # in a finding
])
def test_check_names_the_stale_table_and_report_rewrites_it(docs_copy, capsys, old, new, name):
    page = docs_copy / "docs" / "studies" / "batch-size.md"
    text = page.read_text()
    spoiled = text.replace(old, new, 1)
    assert spoiled != text
    page.write_text(spoiled)
    args = ["report", "--root", str(docs_copy), "--data", str(DATA)]
    assert run([*args, "--check"]) == 1
    assert f"docs/studies/batch-size.md: report:{name}" in capsys.readouterr().err
    assert page.read_text() == spoiled  # --check writes nothing
    assert run(args) == 0 and page.read_text() == text
    assert run([*args, "--check"]) == 0


def test_a_measured_number_typed_into_the_prose_fails_naming_it(docs_copy, capsys):
    """A measurement typed beside the generated blocks fails `report` and `report --check`;
    the numbers that are no measurement (experiments/publish/typed.py) pass."""
    page = docs_copy / "docs" / "studies" / "bounds.md"
    text = page.read_text()
    args = ["report", "--root", str(docs_copy), "--data", str(DATA)]
    assert run([*args, "--check"]) == 0  # its limits (1.3x, 1.5x, 2x) are listed as settings
    page.write_text(text.replace("## Findings", "GPipe ran 1.33x `single`'s step.\n\n## Findings"))
    assert run([*args, "--check"]) == 1
    assert "docs/studies/bounds.md" in (err := capsys.readouterr().err) and "'1.33x'" in err
    assert run(args) == 1  # nothing to regenerate it from: it must be generated or removed


def test_missing_results_exit_2_naming_the_file_and_the_command(docs_copy, tmp_path, capsys):
    partial = tmp_path / "data"
    shutil.copytree(DATA, partial)
    shutil.rmtree(partial / "pipeline")
    before = {p: p.read_text() for p in documents(docs_copy)}
    assert run(["report", "--root", str(docs_copy), "--data", str(partial)]) == 2
    err = capsys.readouterr().err
    assert "pipeline/pipeline.json" in err and "python -m experiments pipeline --out" in err
    assert {p: p.read_text() for p in documents(docs_copy)} == before  # nothing written


@pytest.mark.parametrize("text,needle", [
    ("<!-- report:no-such-table -->\n<!-- /report:no-such-table -->\n", "names no table"),
    ("<!-- report:hparam -->\n| x |\n", "no closing"),
])
def test_bad_markers_exit_2(tmp_path, capsys, text, needle):
    (tmp_path / "README.md").write_text(text)
    assert run(["report", "--root", str(tmp_path), "--data", str(DATA)]) == 2
    assert needle in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == text


def test_a_marker_quoted_in_a_sentence_is_not_a_marker(tmp_path):
    (tmp_path / "README.md").write_text("Tables sit between `<!-- report:NAME -->` markers.\n")
    assert run(["report", "--root", str(tmp_path), "--data", str(DATA), "--check"]) == 0


def anchors(page) -> set[str]:
    """GitHub's anchors for a markdown page's headings."""
    titles = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}


def test_readme_is_a_front_page_linking_only_inside_the_repository():
    """README.md stays a front page (<= 200 lines); every relative link and anchor in it and
    in docs/ resolves (a page's own anchors too), and none points outside the repository."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make run" in readme and "make test" in readme
    for page in documents(ROOT):
        text = page.read_text()
        shown = re.sub(r"<!--.*?-->", "", text, flags=re.S)  # placeholders may name pages to come
        shown = re.sub(r"^```.*?^```", "", shown, flags=re.S | re.M)  # code is not a link
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", shown):
            if "://" in target:
                continue
            linked = page.parent / target if target else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
            if anchor:
                assert anchor in anchors(linked), f"{page.relative_to(ROOT)}: no #{anchor} in {target or 'itself'}"
        for outside in ("shared folder", "DESIGN.md", "STYLE.md", "DEVELOPERS.md", "/work/"):
            assert outside not in text, f"{page.relative_to(ROOT)} refers to {outside!r} outside the repository"


def test_the_bounds_verdict_names_the_misses_and_when_most_miss_what_is_within():
    from experiments.publish.tables import bounds_verdict

    row = lambda label, met, ratio=1.2: {"label": label, "devices": 2, "met": met, "ratio": ratio, "limit": 1.3}  # noqa: E731
    assert bounds_verdict([row("single", None), row("a", True), row("b", True)]) == "every strategy within its limit"
    few = bounds_verdict([row("a", True), row("b", True), row("c", False, 1.4)])
    assert few == "every strategy within its limit but c on 2 (1.40x against 1.3x)"
    most = bounds_verdict([row("a", True), row("b", False, 1.4), row("c", False, 1.5)])
    assert most == "2 of 3 over their limits: b on 2 (1.40x against 1.3x), c on 2 (1.50x against 1.3x); within: a on 2"
