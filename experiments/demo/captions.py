"""The study figures in `figures/` with their captions, for the demo's figures panel.

    python -c "from experiments.demo.captions import figures; print(figures())"

Captions are read from the documents that show the figures, so they are written once:
`docs/studies.md` when it exists, else `README.md`. A figure there is an image link
`![alt](…/figures/NAME.png)` followed by a paragraph opening with `*figures/NAME.png* —`;
that paragraph (without its opening) is the caption. A figure no document shows is listed
after the others, captioned by its alt text or its file name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from experiments.demo.models import ROOT

CAPTION_DOCUMENTS = ("docs/studies.md", "README.md")   # the first that exists holds the captions
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


def figures(root: Path = ROOT) -> list[Figure]:
    """Every PNG in `root/figures` (the screenshot aside), in the order the document shows them."""
    source = next((s for s in CAPTION_DOCUMENTS if (root / s).exists()), "")
    shown = captions((root / source).read_text()) if source else {}
    pngs = {p.name: p for p in sorted((root / "figures").glob("*.png")) if p.name != SCREENSHOT}
    ordered = [n for n in shown if n in pngs] + [n for n in pngs if n not in shown]
    out = []
    for name in ordered:
        alt, caption = shown.get(name, ("", ""))
        out.append(Figure(pngs[name], caption or alt or name, source if name in shown else ""))
    return out
