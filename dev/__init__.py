"""Tools for developing this repository, not shipped with the package (``setup.py`` installs ``linattn``,
``fairseq_linattn`` and ``linattn_tools`` only): the mutation check of the tests' strength and its list of mutants,
and the developer measurement tools (``perf``). Run from the repository's root: ``python -m dev.mutation_check --help``,
``python -m dev.perf.<tool> --help``."""
