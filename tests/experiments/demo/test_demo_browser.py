"""The demo in a real browser (Debian's chromium, headless, driven by selenium): start a short
two-strategy run and see both curves appear; on the classify panel the two models just trained
are there without a path typed (beside the committed ones), a bad folder gives its message, and
the drawing is classified by every model, those trained on the page included; nothing is
fetched from off the machine. Screenshots of each step go to the test's tmp folder.

    python -m pytest -q tests/experiments/demo/test_demo_browser.py
    python tests/experiments/demo/test_demo_browser.py --dataset fashion_mnist --steps 300 --out figures/demo.png

The second command takes the screenshot in docs/demo.md (train panel above, classify below).
Skipped, with the install command, without chromium and chromedriver or the demo extra.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT
from demo_server import demo_server, skip_without_gradio
from experiments.demo.models import check_offline
from jaxpar.errors import DataError

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install chromium chromium-driver; pip install -e '.[demo]' (make test does both)"
# Headless and quiet: no GPU, no QUIC, no first-run, sync, update or background traffic of its
# own, so every request the log shows is the page's. Software WebGL draws the canvas.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-unsafe-swiftshader", "--window-size=1400,1100")
WAIT_S = 240  # two training processes on shared CPUs
PAIR = ("single", "dp-shard-map")  # the train panel's default strategies


def browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def until(check, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def set_field(driver, elem_id: str, value) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input")
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(str(value), Keys.ENTER)


def text(driver, elem_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, elem_id).text


def series(driver, elem_id: str) -> set[str]:
    """The strategies a vega line plot draws a line for (legend entries with a line mark)."""
    lines = driver.execute_script(f"return document.querySelectorAll('#{elem_id} g.mark-line path').length")
    legend = driver.execute_script(
        f"return Array.from(document.querySelectorAll('#{elem_id} g.role-legend-label text'))"
        ".map(t => t.textContent)")
    return set(legend) if lines >= len(legend) else set()


def train_two(driver, shots: Path, dataset: str, steps: int, every: int) -> None:
    """Start single and dp-shard-map (the panel's default pair); both curves must appear."""
    set_field(driver, "dataset", dataset)
    set_field(driver, "steps", steps)
    set_field(driver, "eval-every", every)
    driver.save_screenshot(str(shots / "1-start.png"))
    driver.find_element("id", "start").click()
    pair = set(PAIR)
    until(lambda: series(driver, "loss-plot") >= pair, "both loss curves")
    driver.save_screenshot(str(shots / "2-both-curves.png"))
    until(lambda: text(driver, "train-status").count("finished") == 2 or "failed" in text(driver, "train-status"),
          "both runs to finish")
    assert "failed" not in text(driver, "train-status"), text(driver, "train-status")
    until(lambda: series(driver, "accuracy-plot") >= pair, "both accuracy curves", 30)
    time.sleep(1.5)  # the last tick's redraw
    driver.save_screenshot(str(shots / "3-finished.png"))


def draw_trousers(driver) -> None:
    """Two legs joined at the waist, in three strokes on the canvas."""
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = until(lambda: [c for c in driver.find_elements("css selector", "#canvas canvas")
                            if c.size["width"] > 0], "the canvas", 30)[0]
    for (x, y), moves in [((-30, -90), [(0, 90), (0, 90)]), ((30, -90), [(0, 90), (0, 90)]),
                          ((-30, -90), [(30, 0), (30, 0)])]:
        chain = ActionChains(driver).move_to_element_with_offset(canvas, x, y).click_and_hold()
        for dx, dy in moves:
            chain = chain.move_by_offset(dx, dy)
        chain.release().perform()


def classify(driver, shots: Path, bad_folder: Path | None, trained: list[str],
             committed: list[str]) -> list[tuple[str, str]]:
    """See the models `trained` on the page and the `committed` ones listed (no path typed),
    load `bad_folder` (the message must show), draw trousers; (model, first class) rows."""
    driver.find_element("id", "tab-classify-button").click()
    until(lambda: all(name in text(driver, "classify-status") for name in trained + committed),
          f"{trained + committed} on the classify panel", 60)
    if bad_folder is not None:
        set_field(driver, "folder", str(bad_folder))
        driver.find_element("id", "load").click()
        until(lambda: "Not loaded" in text(driver, "classify-status"), "the bad folder's message", 30)
        assert "holds no jaxpar result" in text(driver, "classify-status")
        driver.save_screenshot(str(shots / "4-bad-folder.png"))
    draw_trousers(driver)
    # Each stroke sends the drawing; wait for the prediction of all three (the committed MLP's
    # Trouser), not the first leg's, by every model.
    expected = len(trained) + len(committed)

    def whole_drawing():
        rows = top1(driver)
        mlp = [first for model, first in rows if "fashion-mlp" in model]
        return len(rows) == expected and all("Trouser" in first for first in mlp) and rows

    best = until(whole_drawing, "the top 3 of the whole drawing by every model", 30)
    driver.save_screenshot(str(shots / "5-drawn.png"))
    return best


def top1(driver) -> list[tuple[str, str]]:
    """(model, its first class) for each row of the top-3 table (empty before a drawing)."""
    cells = driver.execute_script(
        "return Array.from(document.querySelectorAll('#predictions tbody tr'))"
        ".map(r => Array.from(r.querySelectorAll('td')).map(c => c.textContent))")
    return [(row[0], row[1]) for row in cells if len(row) >= 2]


def remote_requests(driver) -> list[str]:
    urls = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.add(message["params"]["request"]["url"])
    return sorted(u for u in urls if u.startswith(("http:", "https:", "ws:", "wss:"))
                  and not u.split("//", 1)[1].startswith(("127.0.0.1", "localhost")))


def skip_without_browser() -> None:
    skip_without_gradio()
    pytest.importorskip("selenium", reason=f"selenium is not installed: {INSTALL}")
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"needs Debian's chromium and chromedriver: {INSTALL}")


def fashion_on_this_machine() -> bool:
    try:
        check_offline("fashion_mnist")
        return True
    except DataError:
        return False


def test_the_demo_in_a_browser(tmp_path):
    """Fashion-MNIST's demo (its committed CNN and MLP) when the dataset is on this machine,
    else the synthetic dataset's (no committed model): either way the models trained on the
    page classify the drawing."""
    skip_without_browser()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    dataset = "fashion_mnist" if fashion_on_this_machine() else "synthetic"
    committed = ["fashion-cnn: single cnn", "fashion-mlp: single mlp"] if dataset == "fashion_mnist" else []
    empty = tmp_path / "runs" / "no-result-here"  # where the page may load from, holding nothing
    empty.mkdir(parents=True)
    with demo_server(tmp_path, "--dataset", dataset) as server:
        driver = browser(tmp_path / "profile")
        try:
            driver.get(server.url)
            until(lambda: driver.find_elements("id", "start"), "the page", 60)
            train_two(driver, shots, dataset, steps=60, every=20)
            shown = [text(driver, "train-status")]
            trained = [f"{strategy} mlp, step 60" for strategy in PAIR]
            best = classify(driver, shots, empty, trained, committed)
            for name in trained + committed:  # each model classified the drawing
                assert sum(name in model for model, _ in best) == 1, (name, best)
            shown.append(text(driver, "classify-status"))
            for absolute in (ROOT, tmp_path):  # paths relative to where the demo started
                assert not re.search(rf"(^|[\s`'(]){re.escape(str(absolute))}", "\n".join(shown)), shown
            assert remote_requests(driver) == []
        finally:
            driver.quit()
    assert sorted(p.name for p in shots.iterdir()) == [
        "1-start.png", "2-both-curves.png", "3-finished.png", "4-bad-folder.png", "5-drawn.png"]


def screenshot(dataset: str, steps: int, out: Path) -> None:
    """The docs' screenshot: the finished train panel above the classify panel after a drawing."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # The runs where a person's would go (the default --runs-dir), so the page shows
        # the paths a person sees.
        with demo_server(tmp, "--dataset", dataset, "--runs-dir", "results/demo") as server:
            driver = browser(tmp / "profile")
            try:
                driver.get(server.url)
                until(lambda: driver.find_elements("id", "start"), "the page", 60)
                train_two(driver, tmp, dataset, steps=steps, every=max(1, steps // 8))
                classify(driver, tmp, None, [f"{strategy} mlp, step {steps}" for strategy in PAIR],
                         ["fashion-cnn", "fashion-mlp"])
            finally:
                driver.quit()
        top = Image.open(tmp / "3-finished.png")
        bottom = Image.open(tmp / "5-drawn.png")
        page = Image.new("RGB", (top.width, top.height + bottom.height), "white")
        page.paste(top, (0, 0))
        page.paste(bottom, (0, top.height))
        page.save(out, optimize=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="take the demo screenshot of docs/demo.md")
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("figures/demo.png"))
    args = parser.parse_args()
    screenshot(args.dataset, args.steps, args.out)
    print(f"wrote {args.out}")
