"""`python -m experiments demo`: a local web page that trains strategies live side by side,
classifies with the trained models (a drawing canvas included) and shows the study figures.

    python -m experiments demo [--port 7860] [--dataset fashion_mnist] [--load FOLDER,...]
    JAXPAR_DEMO_PASSWORD=... python -m experiments demo --host 0.0.0.0   # others log in

Needs the optional `demo` extra (`pip install -e '.[demo]'`, Gradio). Served on 127.0.0.1
only unless --host says otherwise, and then only with a password (`safety`); nothing is fetched from the internet (Gradio's analytics
and version check are off, its fonts and scripts come from the installed package). See
docs/demo.md for what each panel shows.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from experiments.demo.safety import PASSWORD_ENV, Limits, auth_for, password_from
from experiments.options import option
from jaxpar.errors import ConfigError
from jaxpar.runtime.optional import require

DEFAULT_PORT = 7860  # Gradio's own default, so its documentation applies
PORTS_TRIED = 20     # a port in use: the next free one of this many is used instead
# Set before Gradio (and huggingface_hub, which it imports) first load.
OFFLINE_ENV = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_SSR_MODE": "False"}


@dataclass(frozen=True)
class DemoOptions:
    port: int = option(DEFAULT_PORT, "port to serve on; if it is in use, the next free one")
    host: str = option("127.0.0.1", "address to bind (127.0.0.1: this machine only; 0.0.0.0 lets "
                                    "other machines in, and needs a password)")
    password: str | None = option(None, "the password visitors log in with (any user name); "
                                        f"needed beyond 127.0.0.1; better: ${PASSWORD_ENV}, out of "
                                        "ps and shell histories. No default")
    dataset: str = option("fashion_mnist", "what the classify panel and the canvas take (mnist: "
                                           "digits) and the train panel's first choice")
    runs_dir: str = option("results/demo", "where live runs write their results, checkpoints and events")
    load: tuple[str, ...] | None = option(None, "result folders or checkpoints to load at start, "
                                                "comma-separated (default: the committed models of "
                                                "--dataset under figures/data/demo)")
    load_anywhere: bool = option(False, "let the page load models from any folder on this machine "
                                        "(default: only under --runs-dir, results/ and "
                                        "figures/data/demo)")
    max_steps: int = option(Limits.max_steps, "the most steps one Start may ask for")
    max_devices: int = option(Limits.max_devices, "the most simulated devices per run")
    max_batch: int = option(Limits.max_batch, "the largest global batch one Start may ask for")
    max_runs: int = option(Limits.max_runs, "the most strategies (training processes at once) "
                                            "one Start may ask for")


def import_gradio():
    """Gradio, imported with its network features off; UserError naming the install if absent."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    return require("gradio", "the demo (the `demo` extra; `make test` installs it)")


def free_port(host: str, port: int) -> int:
    """`port` if nothing listens there, else the next free one (ConfigError when none is)."""
    for candidate in range(port, port + PORTS_TRIED):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As the server binds (uvicorn): a port left in TIME_WAIT by a closed demo is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, candidate))
            except OSError:
                continue
        return candidate
    raise ConfigError(f"ports {port}-{port + PORTS_TRIED - 1} on {host} are all in use (other demos "
                      "still running?); stop them or pass --port with a free port")


def run(args: DemoOptions) -> int:
    """Serve the demo until Ctrl-C; live runs still going are stopped (with a checkpoint)."""
    auth = auth_for(args.host, password_from(args.password))  # before anything is loaded
    limits = Limits(args.max_steps, args.max_devices, args.max_batch, args.max_runs)
    if min(vars(limits).values()) < 1:
        raise ConfigError("--max-steps, --max-devices, --max-batch and --max-runs must be at least 1")
    gr = import_gradio()
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    port = free_port(args.host, args.port)
    if port != args.port:
        print(f"port {args.port} on {args.host} is in use; serving on {port} instead "
              "(pass --port to choose)")
    # Here, not at the top: the page imports gradio (the `demo` extra), which the checks
    # above (host, password, bounds) and `--help` must not need.
    from experiments.demo.app import build

    app, runs = build(args.dataset, args.runs_dir, args.load, limits, args.load_anywhere)
    try:
        app.launch(server_name=args.host, server_port=port, share=False, inbrowser=False, auth=auth,
                   auth_message="jaxpar demo: any user name, and the password you were given",
                   show_error=True, footer_links=[], ssr_mode=False, mcp_server=False,
                   theme=gr.themes.Default())
    finally:
        runs.kill()
    return 0
