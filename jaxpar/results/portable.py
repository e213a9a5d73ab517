"""Paths as results record them: relative to named roots, so a result names no folder of the
machine that wrote it (docs/design.md, "Results and provenance").

    portable.path("/root/.cache/jaxpar/jaxpar_fashion_mnist/1.0.0")
        -> "<cache>/jaxpar_fashion_mnist/1.0.0"
    portable.value(result_dict)          # every string in it, paths inside messages too
    portable.resolve("<tmp>/m/x")        # -> "/tmp/m/x" on this machine (a point file's paths)

The roots, the longest folder that holds a path winning:

    (none)      the working folder: a plain relative path (figures/data/..., results/...)
    <cache>     jaxpar's cache ($JAXPAR_CACHE, else ~/.cache/jaxpar): prepared data, built code
    <tmp>       the temporary folder (tempfile.gettempdir())
    <venv>      the Python environment running (sys.prefix; <python> outside a virtual one)
    <home>      the user's home folder
    <deb:PKG>   a dataset's folder as a distribution package installs it (jaxpar.data.idx), e.g.
                <deb:dataset-fashion-mnist>/train-images-idx3-ubyte.gz
    <outside>   none of these: only the file's name is kept (its bytes' hash, where a result
                records one, still says which file it was)
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from jaxpar import data as datalib
from jaxpar.data.idx import SYSTEM_DIRS, source_root

OUTSIDE = "<outside>"
# A recorded path that starts at a named root: "<tmp>/m/x" -> ("tmp", "m/x").
_NAMED = re.compile(r"<([\w:.+\-]+)>(?:/(.*))?")
# Absolute paths (two parts at least: "/report:x" and "GB/s" are none) and paths that climb
# out of the working folder, where a message or a command line spells them.
_IN_TEXT = re.compile(r"(?<![\w.\-/:<>~])(?:/[\w.+\-@~]+(?:/[\w.+\-@~]*)+|(?:\.\./)+[\w.+\-@~/]*)")


@dataclass(frozen=True)
class Roots:
    """The working folder and the named folders (longest first) a path is written relative to."""

    cwd: str
    named: tuple[tuple[str, str], ...]  # (absolute folder, name); the working folder's name ""


def here(cwd: str | None = None) -> Roots:
    """The roots on this machine, now (the cache and the temporary folder follow the
    environment of the moment: tests move them)."""
    cwd = os.path.abspath(cwd or os.getcwd())
    venv = "<venv>" if sys.prefix != sys.base_prefix else "<python>"
    folders = {os.path.expanduser("~"): "<home>", sys.prefix: venv,
               tempfile.gettempdir(): "<tmp>", datalib.cache_root(): "<cache>"}
    folders.update({d: source_root(name) for name, dirs in SYSTEM_DIRS.items() for d in dirs})
    folders[cwd] = ""
    return make_roots(cwd, folders)


def make_roots(cwd: str, folders: dict[str, str]) -> Roots:
    """Roots from {folder: name}; "/" is never one (every path would be under it), and a
    folder reached through a link counts under both its spellings."""
    named = {}
    for folder, name in folders.items():
        for spelled in {os.path.abspath(folder), os.path.realpath(folder)}:
            if spelled != "/":
                named.setdefault(spelled, name)
    ordered = sorted(named.items(), key=lambda item: len(item[0]), reverse=True)
    return Roots(os.path.abspath(cwd), tuple(ordered))


def path(p: str | os.PathLike | None, roots: Roots | None = None) -> str | None:
    """`p` relative to the root that holds it (see the module's docstring); a path already
    written so is returned as it is."""
    if p is None:
        return None
    text = os.fspath(p)
    if _NAMED.fullmatch(text):
        return text
    roots = roots or here()
    full = os.path.normpath(os.path.join(roots.cwd, os.path.expanduser(text)))
    for folder, name in roots.named:
        if full == folder or full.startswith(folder + os.sep):
            rest = os.path.relpath(full, folder)
            if not name:
                return rest
            return name if rest == "." else f"{name}/{rest}"
    return f"{OUTSIDE}/{os.path.basename(full)}"


def text(s: str, roots: Roots | None = None) -> str:
    """`s` with every path in it written relative to its root: a path alone (a config's
    `out`) or inside a message or a command line."""
    roots = roots or here()
    if s.startswith(("/", "~/", "../")) and not any(c.isspace() for c in s):
        return path(s, roots)
    return _IN_TEXT.sub(lambda m: path(m.group(0), roots), s)


def value(obj: Any, roots: Roots | None = None) -> Any:
    """A copy of `obj` (JSON-like: dicts, lists, strings, numbers) with `text` applied to every
    string in it, keys included; numbers are untouched."""
    roots = roots or here()
    if isinstance(obj, str):
        return text(obj, roots) if ("/" in obj or obj.startswith("~")) else obj
    if isinstance(obj, dict):
        return {value(k, roots): value(v, roots) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [value(v, roots) for v in obj]
    return obj


def resolve(recorded: str | None, roots: Roots | None = None) -> str | None:
    """The path on this machine that `recorded` (as `path` wrote it) names.

    Raises:
      ValueError: it names a folder outside every root (`<outside>`), or a root unknown here.
    """
    if recorded is None:
        return None
    m = _NAMED.fullmatch(recorded)
    if m is None:
        return recorded  # relative to the working folder, or never made portable
    roots = roots or here()
    folder = next((f for f, name in roots.named if name == f"<{m.group(1)}>"), None)
    if folder is None:
        raise ValueError(f"{recorded!r} names a folder outside the roots a result can name "
                         f"(the working folder, {', '.join(sorted({n for _, n in roots.named if n}))})")
    return os.path.join(folder, m.group(2)) if m.group(2) else folder
