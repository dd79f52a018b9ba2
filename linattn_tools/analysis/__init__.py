"""``python -m linattn_tools.analysis``: the concentration instruments on a checkpoint or on Gaussian q, k."""
