"""The tools that run beside training, each started as ``python -m linattn_tools.<tool>`` (or from a
``scripts/*.sh`` wrapper): data preparation and recipes' helpers (``recipes``), benchmarks
(``benchmark``), the reproduction ledger (``reproduce``), the analysis CLI (``analysis``), the GPU
self-test, moment-constant fitting and the CPU DDP launcher. The plugin never imports this package.
"""
