"""The demo's page (Gradio): train live, classify (test images, confusion, a drawing), figures.

    python -m experiments demo --port 7860

Every callback turns an error the person can fix (`UserError`) into a line on the page, so a
bad folder or a failed run never stops the app. Element ids (`elem_id`) name what the browser
test reads.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd
from PIL import Image

from experiments.demo import captions, drawing, live, views
from experiments.demo.models import BUNDLED, Models, candidates, check_offline
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


def train_tab(runs: live.LiveRuns, dataset: str) -> None:
    """The train panel: options, start/stop/resume, curves and a table read every TICK_S."""
    spec = live.RunSpec(dataset=dataset)
    with gr.Row():
        model = gr.Dropdown(list(MODELS), value=spec.model, label="model", elem_id="model")
        data = gr.Dropdown(list(DATASETS), value=spec.dataset, label="dataset", elem_id="dataset")
        devices = gr.Number(spec.devices, label="simulated devices per run", precision=0, minimum=1)
        steps = gr.Number(spec.steps, label="steps", precision=0, minimum=1, elem_id="steps")
        batch = gr.Number(spec.batch_size, label="global batch", precision=0, minimum=1)
        every = gr.Number(spec.eval_every, label="validate every", precision=0, minimum=1,
                          elem_id="eval-every")
    allowed = live.strategies_for(spec.model)
    strategies = gr.CheckboxGroup(allowed, value=[s for s in spec.strategies if s in allowed],
                                  label="strategies (one process each)", elem_id="strategies")
    with gr.Row():
        start, stop, resume = (gr.Button("Start", variant="primary", elem_id="start"),
                               gr.Button("Stop (checkpoint)", elem_id="stop"),
                               gr.Button("Resume", elem_id="resume"))
    status = gr.Markdown("Pick strategies and press Start.", elem_id="train-status")
    with gr.Row():
        loss = gr.LinePlot(_frame([], "loss"), x="seconds", y="loss", color="strategy",
                           title="training loss (running mean of the epoch)",
                           x_title="wall seconds since start", elem_id="loss-plot")
        accuracy = gr.LinePlot(_frame([], "val_accuracy"), x="seconds", y="val_accuracy",
                               color="strategy", title="validation accuracy", y_lim=[0, 1],
                               x_title="wall seconds since start", elem_id="accuracy-plot")
    table = gr.Dataframe(pd.DataFrame([]), label="runs", elem_id="run-table", interactive=False)
    seen = gr.State(None)

    def on_model(name, chosen):
        choices = live.strategies_for(name)
        return gr.update(choices=choices, value=[s for s in chosen if s in choices])

    def on_start(model, data, chosen, devices, steps, batch, every):
        if not chosen:
            return "Pick at least one strategy (two or more to compare)."
        try:
            check_offline(data)  # a run would download it otherwise
        except UserError as e:
            return f"**Not started:** {e}"
        run = live.RunSpec(model=model, dataset=data, strategies=tuple(chosen), devices=int(devices),
                           steps=int(steps), batch_size=int(batch), eval_every=int(every))
        return f"Started {len(chosen)} runs in `{runs.start(run)}`."

    def on_stop():
        runs.stop()
        return "Stopping: each run finishes its step, saves a checkpoint and exits."

    def on_resume():
        n = runs.resume()
        return f"Resumed {n} runs from their checkpoints." if n else "No stopped run to resume."

    def on_tick(last):
        statuses = runs.poll()
        signature = [(s.strategy, s.state, len(s.steps), len(s.validations)) for s in statuses]
        if signature == last:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        rows = live.curves(statuses, runs.started)
        states = ", ".join(f"{s.strategy}: {s.state}" for s in statuses)
        lines = [f"Runs in `{runs.group}`: {states}" if statuses else "No runs yet."]
        lines += [f"**{s.strategy} failed:** {s.error}" for s in statuses if s.state == "failed"]
        return (_plot(rows["loss"], "loss"), _plot(rows["accuracy"], "val_accuracy"),
                pd.DataFrame([live.summary_row(s) for s in statuses]), "\n\n".join(lines), signature)

    model.change(on_model, [model, strategies], strategies)
    start.click(on_start, [model, data, strategies, devices, steps, batch, every], status)
    stop.click(on_stop, None, status)
    resume.click(on_resume, None, status)
    gr.Timer(TICK_S).tick(on_tick, seen, [loss, accuracy, table, status, seen],
                          show_progress="hidden")


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


def classify_tab(models: Models, roots: list[Path], startup: list[str]):
    """The classify panel; returns its folder-list refresh and the outputs the page's own
    events (load, tab select) fill in."""
    with gr.Row():
        folder = gr.Dropdown([str(p) for p in candidates(roots)], value=None, allow_custom_value=True,
                             label="result folder or checkpoint (pick one or type a path)",
                             elem_id="folder", scale=4)
        load, refresh, clear = (gr.Button("Load", variant="primary", elem_id="load"),
                                gr.Button("Refresh list"), gr.Button("Unload all"))
    status = gr.Markdown("\n\n".join(startup), elem_id="classify-status")
    with gr.Row():
        canvas = gr.Sketchpad(canvas_size=(280, 280), type="numpy", image_mode="RGBA", layers=False,
                              transforms=(), label="draw an item (pick the brush)",
                              brush=gr.Brush(default_size=10, colors=["#000000"], color_mode="fixed"),
                              elem_id="canvas")
        seen = gr.Image(label="what the models see (28x28)", interactive=False, height=SHOWN_PX + 40,
                        elem_id="model-input")
        top3 = gr.Markdown(views.top3_markdown(models.loaded, None, []), elem_id="predictions",
                           min_width=420)
    shuffle = gr.Button("New test images", elem_id="shuffle")
    tests = gr.HTML(elem_id="test-images")
    matrix = gr.Plot(label="confusion matrices (test split)", elem_id="confusion")
    drawn = gr.State(None)

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
            return f"**Not loaded:** {e}", gr.skip(), gr.skip(), gr.skip()
        return (*evaluation_views(models, message), predictions(image))

    def on_clear():
        models.clear()
        return (*evaluation_views(models, "All models unloaded."), predictions(None))

    def folders():
        return gr.update(choices=[str(p) for p in candidates(roots)])

    def on_shuffle():
        models.next_sample()
        return evaluation_views(models)

    canvas.change(on_draw, canvas, [seen, top3, drawn], show_progress="hidden",
                  trigger_mode="always_last")
    load.click(on_load, [folder, drawn], [status, tests, matrix, top3])
    folder.select(on_load, [folder, drawn], [status, tests, matrix, top3])
    refresh.click(folders, None, folder)
    clear.click(on_clear, None, [status, tests, matrix, top3])
    shuffle.click(on_shuffle, None, [status, tests, matrix])
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


def build(dataset: str, runs_root: str | Path, preload: list[str] | None) -> tuple[gr.Blocks, live.LiveRuns]:
    """The page and the live runs behind it (the caller launches the page).

    Args:
      preload: folders to load at start; None: the committed models of `dataset`.
    """
    runs = live.LiveRuns(runs_root)
    models = Models(dataset)
    startup = models.preload(models.bundled() if preload is None else preload)
    roots = [Path(runs_root), Path("results"), BUNDLED]
    with gr.Blocks(title="jaxpar demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO)
        with gr.Tabs():
            with gr.Tab("Train live", elem_id="tab-train"):
                train_tab(runs, dataset)
            with gr.Tab("Classify", elem_id="tab-classify") as tab:
                folders, (status, tests, matrix, folder) = classify_tab(models, roots, startup)
            with gr.Tab("Figures", elem_id="tab-figures"):
                figures_tab()
        tab.select(folders, None, folder, js=PICK_BRUSH)  # runs finished since: in the list
        app.load(lambda: evaluation_views(models, "\n\n".join(startup)), None, [status, tests, matrix])
    return app, runs

