"""docs/library.md's worked example, run as a user would paste it (a fresh process, so its
`devices=2` applies): it trains, writes its result where it says, and learns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- example: run by tests/test_library_doc.py -->"


def example() -> str:
    """The python block right after MARKER in docs/library.md."""
    text = (ROOT / "docs" / "library.md").read_text()
    found = re.search(re.escape(MARKER) + r"\s*```python\n(.*?)```", text, re.S)
    assert found, f"docs/library.md has no ```python block after {MARKER}"
    return found.group(1)


def test_the_worked_example_runs_and_learns(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", proc.stdout).group(1))
    assert accuracy > 0.9, proc.stdout  # 5 classes: chance is 0.2
    result = json.loads((tmp_path / "results" / "my-shapes" / "result.json").read_text())
    assert result["strategy"]["strategy"] == "fsdp" and result["strategy"]["devices"] == 2
    assert result["config"]["out"] == "results/my-shapes"
    assert result["env"]["data_source"]["image_shape"] == [32, 32, 3]
