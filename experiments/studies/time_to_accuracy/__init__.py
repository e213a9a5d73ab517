"""The time_to_accuracy study: study.py (what it runs and writes), tables.py, figures.py."""
