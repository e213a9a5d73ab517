"""The cost model's commands (`jaxpar.cost` prices; these measure, predict and check).

  profile.py   `python -m experiments profile`: measure this machine once
  predict.py   `predict` and `plan`: a strategy's step and memory on N devices over a link
  check.py     every committed point predicted and compared with its measurement
  tables.py, figures.py   the check's tables and the cost figures
"""
