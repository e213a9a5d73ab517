"""The demo's page (Gradio): train live, classify (test images, confusion, a drawing), figures.

    python -m experiments demo --port 7860

Every callback turns an error the person can fix (`UserError`) into a line on the page, so a
bad folder or a failed run never stops the app. Element ids (`elem_id`) name what the browser
test reads.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import numpy as np
import pandas as pd
from PIL import Image

from experiments.demo import captions, drawing, live, views
from experiments.demo.classify import shown
from experiments.demo.models import BUNDLED, Models, candidates, check_offline
from experiments.demo.safety import Limits
from jaxpar.data import DATASETS
from jaxpar.errors import UserError
from jaxpar.models import MODELS

TICK_S = 1.0    # how often the train panel reads the runs' events
SHOWN_PX = 224  # the model's 28x28 input, shown 8x
INTRO = ("**jaxpar live.** Train one model under several parallel strategies side by side, then "
         "draw an item and see what each trained model predicts. Every number comes from the "
         "runs themselves (their `--events` stream and `result.json`).")


def _frame(rows: list[dict], y: str) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["seconds", y, "strategy", "step"])


def _plot(rows: list[dict], y: str):
    """A line plot's new data. Its legend lists the runs drawn: a changed list redraws the
    plot with a colour per run (Gradio keeps the colours of the first data it drew otherwise)."""
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    return gr.update(value=_frame(rows, y), colors_in_legend=names)


def train_tab(runs: live.LiveRuns, dataset: str, limits: Limits, models: Models) -> None:
    """The train panel: options, start/stop/resume, curves and a table read every TICK_S; a
    run that finishes is loaded into `models` (the classify panel) by itself.

    The bounds are checked by `limits` on the values received, not by the fields (an API
    call skips the page), so the fields only say them in their labels.
    """
    ui = _train_controls(live.RunSpec(dataset=dataset), limits)
    seen = gr.State(None)
    classified: dict[Path, str] = {}  # finished run -> what loading it into Classify said

    def on_model(name, chosen):
        choices = live.strategies_for(name)
        return gr.update(choices=choices, value=[s for s in chosen if s in choices])

    def on_start(model, data, chosen, devices, steps, batch, every):
        try:  # everything checked before the previous runs stop or a process starts
            run = live.RunSpec(**limits.check(model, data, chosen, devices, steps, batch, every,
                                              models=list(MODELS), datasets=list(DATASETS),
                                              strategies_for=live.strategies_for))
            check_offline(data)  # a run would download it otherwise
        except UserError as e:
            return f"**Not started:** {e}"
        return f"Started {len(run.strategies)} runs in `{shown(runs.start(run))}`."

    def on_stop():
        runs.stop()
        return "Stopping: each run finishes its step, saves a checkpoint and exits."

    def on_resume():
        n = runs.resume()
        return f"Resumed {n} runs from their checkpoints." if n else "No stopped run to resume."

    ui.model.change(on_model, [ui.model, ui.strategies], ui.strategies)
    # Named endpoints: what the page's API (gradio_client) calls them; the tests call them so.
    ui.start.click(on_start, [ui.model, ui.data, ui.strategies, ui.devices, ui.steps, ui.batch, ui.every],
                   ui.status, api_name="start")
    ui.stop.click(on_stop, None, ui.status, api_name="stop")
    ui.resume.click(on_resume, None, ui.status, api_name="resume")
    gr.Timer(TICK_S).tick(lambda last: _tick(runs, models, classified, last), seen,
                          [ui.loss, ui.accuracy, ui.table, ui.status, seen], show_progress="hidden")


def _train_controls(spec: live.RunSpec, limits: Limits) -> SimpleNamespace:
    """The train panel's fields, buttons, status line, plots and table (laid out here)."""
    ui = SimpleNamespace()
    with gr.Row():
        ui.model = gr.Dropdown(list(MODELS), value=spec.model, label="model", elem_id="model")
        ui.data = gr.Dropdown(list(DATASETS), value=spec.dataset, label="dataset", elem_id="dataset")
        ui.devices = gr.Number(spec.devices, label=f"simulated devices per run (≤ {limits.max_devices})",
                               precision=0, elem_id="devices")
        ui.steps = gr.Number(spec.steps, label=f"steps (≤ {limits.max_steps})", precision=0,
                             elem_id="steps")
        ui.batch = gr.Number(spec.batch_size, label=f"global batch (≤ {limits.max_batch})", precision=0,
                             elem_id="batch")
        ui.every = gr.Number(spec.eval_every, label="validate every", precision=0, elem_id="eval-every")
    allowed = live.strategies_for(spec.model)
    ui.strategies = gr.CheckboxGroup(allowed, value=[s for s in spec.strategies if s in allowed],
                                     label=f"strategies (one process each, ≤ {limits.max_runs})",
                                     elem_id="strategies")
    with gr.Row():
        ui.start, ui.stop, ui.resume = (gr.Button("Start", variant="primary", elem_id="start"),
                                        gr.Button("Stop (checkpoint)", elem_id="stop"),
                                        gr.Button("Resume", elem_id="resume"))
    ui.status = gr.Markdown("Pick strategies and press Start.", elem_id="train-status")
    with gr.Row():
        ui.loss = gr.LinePlot(_frame([], "loss"), x="seconds", y="loss", color="strategy",
                              title="training loss (running mean of the epoch)",
                              x_title="wall seconds since start", elem_id="loss-plot")
        ui.accuracy = gr.LinePlot(_frame([], "val_accuracy"), x="seconds", y="val_accuracy",
                                  color="strategy", title="validation accuracy", y_lim=[0, 1],
                                  x_title="wall seconds since start", elem_id="accuracy-plot")
    ui.table = gr.Dataframe(pd.DataFrame([]), label="runs", elem_id="run-table", interactive=False)
    return ui


def _tick(runs: live.LiveRuns, models: Models, classified: dict, last):
    """What the train panel shows now: (loss plot, accuracy plot, table, status, signature);
    nothing redrawn while no run has moved since `last`."""
    statuses = runs.poll()
    signature = [(s.strategy, s.state, len(s.steps), len(s.validations)) for s in statuses]
    if signature == last:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
    rows = live.curves(statuses, runs.started)
    states = ", ".join(f"{s.strategy}: {s.state}" for s in statuses)
    lines = [f"Runs in `{shown(runs.group)}`: {states}" if statuses else "No runs yet."]
    lines += [f"**{s.strategy} failed:** {s.error}" for s in statuses if s.state == "failed"]
    lines += [_classify_finished(models, classified, s) for s in statuses if s.state == "finished"]
    return (_plot(rows["loss"], "loss"), _plot(rows["accuracy"], "val_accuracy"),
            pd.DataFrame([live.summary_row(s) for s in statuses]), "\n\n".join(lines), signature)


def _classify_finished(models: Models, classified: dict, s: live.Status) -> str:
    """Load a finished run into the classify panel (once); the line saying so."""
    if s.folder not in classified:
        try:
            models.load(s.folder, trusted=True)  # the demo's own run: appended last
            classified[s.folder] = f"**{s.strategy}** is in Classify as *{models.loaded[-1].name}*."
        except UserError as e:
            classified[s.folder] = f"**{s.strategy}** could not be loaded in Classify: {e}"
    return classified[s.folder]


def evaluation_views(models: Models, message: str = "") -> tuple:
    """(status, test images, confusion matrices) for the loaded models; the status says which
    are loaded, or why the test split cannot be shown."""
    loaded = ", ".join(m.name for m in models.loaded) or "none"
    message = "\n\n".join(filter(None, [message, f"Models loaded: {loaded}."]))
    if not models.loaded:
        return message, "", None
    try:
        probs = models.probabilities()
        images, labels = models.test_split()
    except UserError as e:
        return f"{message}\n\nTest images need the {models.dataset} test split: {e}", "", None
    idx = models.sample()
    shown = views.test_images_html(images[idx], labels[idx], {k: v[idx] for k, v in probs.items()},
                                   models.names)
    return message, shown, views.confusion_figure(labels, probs, models.names)


def _folder_row(roots: list[Path]):
    """The classify panel's first row: the folder to load, and Load, Refresh and Unload all."""
    with gr.Row():
        folder = gr.Dropdown([shown(p) for p in candidates(roots)], value=None, allow_custom_value=True,
                             label="result folder or checkpoint (pick one or type a path)",
                             elem_id="folder", scale=4)
        load, refresh, clear = (gr.Button("Load", variant="primary", elem_id="load"),
                                gr.Button("Refresh list"), gr.Button("Unload all"))
    return folder, load, refresh, clear


def _drawing_row(models: Models):
    """The canvas, what the models see of the drawing, and their top 3."""
    with gr.Row():
        canvas = gr.Sketchpad(canvas_size=(280, 280), type="numpy", image_mode="RGBA", layers=False,
                              transforms=(), label="draw an item (pick the brush)",
                              brush=gr.Brush(default_size=10, colors=["#000000"], color_mode="fixed"),
                              elem_id="canvas")
        seen = gr.Image(label="what the models see (28x28)", interactive=False, height=SHOWN_PX + 40,
                        elem_id="model-input")
        top3 = gr.Markdown(views.top3_markdown(models.loaded, None, []), elem_id="predictions",
                           min_width=420)
    return canvas, seen, top3


def classify_tab(models: Models, roots: list[Path], startup: list[str]):
    """The classify panel; returns its folder-list refresh and the outputs the page's own
    events (load, tab select) fill in."""
    folder, load, refresh, clear = _folder_row(roots)
    status = gr.Markdown("\n\n".join(startup), elem_id="classify-status")
    canvas, seen, top3 = _drawing_row(models)
    shuffle = gr.Button("New test images", elem_id="shuffle")
    tests = gr.HTML(elem_id="test-images")
    matrix = gr.Plot(label="confusion matrices (test split)", elem_id="confusion")
    drawn = gr.State(None)
    version = gr.State(models.version)  # of the models this page shows

    def predictions(image):
        return views.top3_markdown(models.loaded, image, models.names if models.loaded else [])

    def on_draw(value):
        image = drawing.to_input(value, models.dataset)
        big = None if image is None else np.asarray(Image.fromarray(image[..., 0]).resize(
            (SHOWN_PX, SHOWN_PX), Image.Resampling.NEAREST))  # its pixels, large
        return big, predictions(image), image

    def on_load(path, image):
        try:
            message = models.load(path)
        except UserError as e:
            return f"**Not loaded:** {e}", gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return (*evaluation_views(models, message), predictions(image), models.version)

    def on_clear(image):
        models.clear()
        return (*evaluation_views(models, "All models unloaded."), predictions(image), models.version)

    def on_models(seen, image):
        """Models loaded elsewhere (a run finished on the train panel): shown here too."""
        if seen == models.version:
            return (gr.skip(),) * 6
        return (*evaluation_views(models), predictions(image), folders(), models.version)

    def folders():
        return gr.update(choices=[shown(p) for p in candidates(roots)])

    def on_shuffle():
        models.next_sample()
        return evaluation_views(models)

    canvas.change(on_draw, canvas, [seen, top3, drawn], show_progress="hidden",
                  trigger_mode="always_last")
    shown_models = [status, tests, matrix, top3, version]
    load.click(on_load, [folder, drawn], shown_models, api_name="load")
    folder.select(on_load, [folder, drawn], shown_models)
    refresh.click(folders, None, folder)
    clear.click(on_clear, drawn, shown_models)
    shuffle.click(on_shuffle, None, [status, tests, matrix])
    gr.Timer(TICK_S).tick(on_models, [version, drawn], [status, tests, matrix, top3, folder, version],
                          show_progress="hidden")
    return folders, (status, tests, matrix, folder)


def figures_tab() -> None:
    """The study figures with their captions (`captions.figures`): the poster."""
    figures = captions.figures()
    for figure in figures:
        gr.Image(str(figure.path), label=figure.path.name, interactive=False, buttons=[])
        gr.Markdown(figure.caption)
    if not figures:
        gr.Markdown("No figures in figures/: `python -m experiments figures` draws them.")


# Selects the canvas's brush once the classify tab has drawn it: the editor starts with no
# tool ("select the draw tool to start"), a step a person at a poster should not need.
PICK_BRUSH = """() => { let tries = 0; const pick = () => {
  const b = document.querySelector('#canvas button[aria-label="Brush"]');
  if (b && b.offsetParent !== null) { b.click(); } else if (++tries < 50) { setTimeout(pick, 100); }
}; pick(); }"""


def build(dataset: str, runs_root: str | Path, preload: list[str] | None, limits: Limits = Limits(),
          load_anywhere: bool = False) -> tuple[gr.Blocks, live.LiveRuns]:
    """The page and the live runs behind it (the caller launches the page).

    Args:
      preload: folders to load at start; None: the committed models of `dataset`.
      limits: the most one Start may ask for.
      load_anywhere: the page may load any folder (else only under the runs, results/ and the
        committed models; `preload` is the operator's and may name any).
    """
    runs = live.LiveRuns(runs_root)
    roots = [Path(runs_root), Path("results"), BUNDLED]
    models = Models(dataset, None if load_anywhere else roots)
    startup = models.preload(models.bundled() if preload is None else preload)
    with gr.Blocks(title="jaxpar demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO)
        with gr.Tabs():
            with gr.Tab("Train live", elem_id="tab-train"):
                train_tab(runs, dataset, limits, models)
            with gr.Tab("Classify", elem_id="tab-classify") as tab:
                folders, (status, tests, matrix, folder) = classify_tab(models, roots, startup)
            with gr.Tab("Figures", elem_id="tab-figures"):
                figures_tab()
        tab.select(folders, None, folder, js=PICK_BRUSH)  # runs finished since: in the list
        app.load(lambda: evaluation_views(models, "\n\n".join(startup)), None, [status, tests, matrix])
    return app, runs

