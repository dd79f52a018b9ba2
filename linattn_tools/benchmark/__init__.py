"""Benchmarks, each a tool: ``python -m linattn_tools.benchmark.attention`` (every op), ``.model`` (whole
models) and ``.compare_ops`` (the ops of an earlier commit against this tree's); their shared helpers:

- ``measure``: wall-clock time (median of repeats after warm-up), peak memory, matmul rate, machine
- ``flops``: matmul FLOPs of each attention, from the algorithm
- ``sweep``: runs one method over growing sizes and stops it at a time/memory budget
- ``report``: scaling exponents, markdown tables, log-log plots, the results section of the docs
"""
