"""The reproduction ledger: which of the LLN, LAVO and Skyformer papers' quantitative claims hold here.

One module per group of claims measures what this machine can check and writes one JSON file in
``docs/reproduction/`` (``lln_distribution``, ``lln_cost``, ``quickstart``, ``skyformer_error``,
``skyformer_fig1``, ``decoding``; ``fig1_approximations`` holds the approximations Skyformer's Fig. 1
compares); ``gpu_speed`` reads a committed GPU benchmark JSON for the speed claims measured on GPUs;
``claims`` states every claim with the paper's figure and a test computed from that JSON; ``ledger``
renders ``docs/reproduction.md``. Command line: ``python -m linattn_tools.reproduce``
(``scripts/reproduce.sh`` wraps it).
"""
