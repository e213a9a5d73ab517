"""The studies: one module (or package) each, holding its configuration, what it runs, the rows
of its results file, and the tables and figures drawn from that file.

  study.py          what a study is to the CLI (`Study`) and the option checks they share
  trials.py         vmapped trials of jaxpar's step (batch-size and hparam studies)
  batch_size.py, bounds.py, hparam/, pipeline/, scaling/, strategies/, time_to_accuracy/,
  network/, machine/   one per study; in a package: study.py (config, run), tables.py (the
                    docs' tables and OUT/summary.md), figures.py (PNGs), rows.py (results ->
                    rows) where it has them

A study's tables and figures are registered where `report` and `figures` read them:
`TABLES` in its tables module, `FIGURES` in its figures module (experiments/publish/).
"""
