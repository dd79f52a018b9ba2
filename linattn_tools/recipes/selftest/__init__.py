"""The GPU self-test's stages (``python -m linattn_tools.recipes.gpu_selftest``), one module per stage group:
``env``, ``ops``, ``training`` (train, finetune, eval_lm), ``decode``, ``speed``, ``multi`` (multi_gpu); ``core``
holds the rows, the report and the work directory. Nothing here imports torch or fairseq at import time, so the
missing-CUDA exit comes at once.
"""
