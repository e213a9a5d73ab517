"""The fault study: study.py (what it runs and writes), tables.py."""
