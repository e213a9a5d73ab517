"""The study figures in `figures/` with their captions, for the demo's figures panel.

    python -c "from experiments.demo.captions import figures; print(figures())"

Captions are read from the documents that show the figures, so they are written once: the
study pages (`docs/studies.md` and the pages it links, in its order), then `README.md`; a
figure takes its caption from the first document that shows it. A figure there is an image
link `![alt](…/figures/NAME.png)` followed by a paragraph opening with `*figures/NAME.png* —`;
that paragraph (without its opening) is the caption. A figure no document shows is listed
after the others, captioned by its alt text or its file name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from experiments.demo.models import ROOT

STUDIES_INDEX = "docs/studies.md"   # it, then the study pages it links, hold the captions
FRONT_PAGE = "README.md"
SCREENSHOT = "demo.png"                      # the demo's own screenshot: not a study figure

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]*figures/([^)/\s]+\.png))\)")
_OPENING = re.compile(r"^\*[^*]*\.png\*\s*[—-]+\s*")


@dataclass(frozen=True)
class Figure:
    path: Path
    caption: str   # markdown
    source: str    # the document it came from ("" when none shows it)


def captions(text: str) -> dict[str, tuple[str, str]]:
    """{file name: (alt text, caption paragraph)} for every figure shown in markdown `text`."""
    out: dict[str, tuple[str, str]] = {}
    paragraphs = re.split(r"\n\s*\n", text)
    for i, para in enumerate(paragraphs):
        for alt, _, name in _IMAGE.findall(para):
            following = paragraphs[i + 1].strip() if i + 1 < len(paragraphs) else ""
            caption = _OPENING.sub("", following) if _OPENING.match(following) else ""
            out.setdefault(name, (alt, " ".join(caption.split())))
    return out


def caption_documents(root: Path = ROOT) -> list[str]:
    """The documents captions are read from, in order: the studies index, the study pages it
    links, the front page (those that exist, relative to `root`)."""
    found = [STUDIES_INDEX] if (root / STUDIES_INDEX).exists() else []
    if found:
        index = root / STUDIES_INDEX
        for link in re.findall(r"\]\(([^)#\s]+\.md)\)", index.read_text()):
            page = (index.parent / link).resolve()
            if page.is_file() and page.is_relative_to(root.resolve()):
                found.append(page.relative_to(root.resolve()).as_posix())
    return list(dict.fromkeys(found + ([FRONT_PAGE] if (root / FRONT_PAGE).exists() else [])))


def figures(root: Path = ROOT) -> list[Figure]:
    """Every PNG in `root/figures` (the screenshot aside), in the order the documents show
    them, each captioned by the first document that shows it."""
    shown: dict[str, tuple[str, str, str]] = {}
    for source in caption_documents(root):
        for name, (alt, caption) in captions((root / source).read_text()).items():
            shown.setdefault(name, (alt, caption, source))
    pngs = {p.name: p for p in sorted((root / "figures").glob("*.png")) if p.name != SCREENSHOT}
    ordered = [n for n in shown if n in pngs] + [n for n in pngs if n not in shown]
    out = []
    for name in ordered:
        alt, caption, source = shown.get(name, ("", "", ""))
        out.append(Figure(pngs[name], caption or alt or name, source))
    return out
