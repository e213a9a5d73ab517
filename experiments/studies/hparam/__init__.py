"""The hparam study: study.py (what it runs and writes), tables.py, figures.py."""
