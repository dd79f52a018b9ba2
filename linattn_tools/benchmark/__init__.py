"""Benchmark helpers shared by ``linattn_tools/benchmark/attention.py`` and ``linattn_tools/benchmark/model.py``.

- ``measure``: wall-clock time (median of repeats after warm-up), peak memory, matmul rate, machine
- ``flops``: matmul FLOPs of each attention, from the algorithm
- ``sweep``: runs one method over growing sizes and stops it at a time/memory budget
- ``report``: scaling exponents, markdown tables, log-log plots, the results section of the docs
"""
