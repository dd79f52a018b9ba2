"""Developer measurement tools, not shipped (``setup.py`` installs ``linattn``, ``fairseq_linattn`` and
``linattn_tools``): each fused kernel's registers and spills (``kernel_resources``), the Triton launch tuner
(``tune_fused``) and the ops it runs (``fused_ops``), an earlier commit's ops against this tree's (``compare_ops``),
a step's ATen ops, host syncs and bytes saved for backward (``gpu_shape``, ``saved``), the host's time to issue a
step (``host_time``), ``--attention-compile`` against eager (``compile``), a step's memory traffic and byte floors
(``traffic``) and the profiler's kernel table of a step (``profile_step``). Each is run from the repository's root
as ``python -m dev.perf.<tool>``; what users run (the attention and model benchmarks, the targets the self-test
checks) is ``linattn_tools.benchmark``, which these build on.
"""
