"""Recipes: data preparation for the papers' experiments and the CPU quick-start report.

Modules (each also a command, ``python -m linattn_tools.recipes.<name> --help``):
``prepare_wikitext103``, ``prepare_glue``, ``prepare_pg19`` (through HuggingFace ``datasets``, then
GPT-2 BPE or SentencePiece, then ``fairseq-preprocess``), ``prepare_samples`` (the three on the
shipped ``data/`` samples), ``make_samples`` (how ``data/`` was made), ``config`` (``configs/*.yaml``
to fairseq-train options) and ``report`` (the quick-start's REPORT.md and plots).
Helpers: ``steps`` (completion markers), ``sources`` (hub or local datasets), ``bpe``, ``binarize``.
"""
