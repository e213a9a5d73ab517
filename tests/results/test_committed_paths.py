"""Every committed file under figures/ names no folder of the machine that wrote it: no absolute
path and no path climbing out of the repository (docs/design.md, "Results and provenance";
results write theirs relative to named roots, jaxpar/results/portable.py).

    python -m pytest -q tests/results/test_committed_paths.py
"""

from __future__ import annotations

import functools
import posixpath
import re
import subprocess
from pathlib import Path

from conftest import ROOT

# An absolute path of two parts at least ("/report:x", "GB/s" and URLs are none), and a path
# that climbs (../), where a JSON string, a message or a table spells them.
ABSOLUTE = re.compile(r"(?<![\w.\-/:<>~])/[\w.+\-@~]+(?:/[\w.+\-@~]*)+")
CLIMBING = re.compile(r"(?<![\w.\-/:<>~])(?:\.\./)+[\w.+\-@~/]*")
# In a binary file (orbax's arrays, a PNG), the folders a machine's path starts with.
MACHINE_BYTES = re.compile(rb"/(?:tmp|root|home|work|usr|opt|var|mnt|scratch|Users|private)/[\w.\-]+")


def committed() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "figures"], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode()
    return [name for name in out.split("\0") if name]


@functools.lru_cache(maxsize=None)
def spelled_in_code(path: str) -> bool:
    """Whether the repository's code (outside figures/) spells `path` itself (a system folder
    it searches): a diff of that code carries the code's path, not the machine's."""
    found = subprocess.run(["git", "grep", "-q", "-F", "-e", path, "--", ".", ":(exclude)figures",
                            f":(exclude){Path(__file__).relative_to(ROOT)}"],  # its samples
                           cwd=ROOT, capture_output=True)
    return found.returncode == 0


def patch_paths(text: str) -> list[str]:
    """A recorded diff's machine paths: its `../` links resolve from the diffed file's folder
    (docs/x.md's ../figures/y.png stays inside the repository)."""
    found, folder = [], ""
    for line in text.splitlines():
        if line.startswith(("+++ b/", "--- a/")):
            folder = posixpath.dirname(line[6:])
            continue
        found += [p for p in CLIMBING.findall(line)
                  if posixpath.normpath(posixpath.join(folder, p)).startswith("..")]
        found += [p for p in ABSOLUTE.findall(line) if not spelled_in_code(p)]
    return found


def machine_paths(name: str, data: bytes) -> list[str]:
    """The absolute or climbing paths in the committed file `name` holding `data`."""
    if b"\0" in data:
        return [m.decode("latin-1") for m in MACHINE_BYTES.findall(data)]
    text = data.decode("utf-8")
    if name.endswith(".patch"):
        return patch_paths(text)
    return ABSOLUTE.findall(text) + CLIMBING.findall(text)


def test_no_committed_result_names_a_folder_of_the_machine():
    found = {}
    for name in committed():
        paths = machine_paths(name, (ROOT / name).read_bytes())
        if paths:
            found[name] = sorted(set(paths))
    assert not found, ("committed files name folders of the machine that wrote them (write them "
                       "through jaxpar.results.portable):\n" + "\n".join(
                           f"  {name}: {', '.join(paths[:3])}" for name, paths in sorted(found.items())))


def test_the_scan_finds_what_it_looks_for():
    assert machine_paths("r.json", b'{"out": "/tmp/m/x", "f": "../../root/.cache/y"}') == [
        "/tmp/m/x", "../../root/.cache/y"]
    assert machine_paths("s.md", b"needs /opt/torch/.venv/bin/mpiexec: 3.1 GB/s, <!-- /report:x -->") \
        == ["/opt/torch/.venv/bin/mpiexec"]
    assert machine_paths("r.json", b'{"out": "<tmp>/m/x", "url": "http://a.org/b/c"}') == []
    assert machine_paths("c/commit_success.txt", b"\0 written to /work/wt-demo/figures") == [
        "/work/wt-demo"]
    diff = (b"--- a/docs/cost.md\n+++ b/docs/cost.md\n+![x](../figures/cost.png)\n"
            b"+see ../../elsewhere/x and /home/someone/notes\n")
    assert machine_paths("git-diff-1.patch", diff) == ["../../elsewhere/x", "/home/someone/notes"]
