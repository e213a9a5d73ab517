"""Publishing: figures and the docs' generated tables and findings, drawn and written only from
committed results files.

  sources.py      which results file each table and figure reads, and the command that writes it
  figures.py      `python -m experiments figures`: every study's FIGURES
  tables.py       every study's TABLES, and those of no one study (strategy list, main results)
  report.py       `python -m experiments report [--check]`: the tables between their markers
  measured_on.py  the machine, software, revision and time behind a results folder
  markdown.py     markdown tables and cells
  plotting.py     the house style every figure shares (matplotlib, Agg)
"""
