"""The implementations' names: what an op's ``impl`` and ``--attention-impl`` accept. Pure Python (the options read
them: ``linattn.config``); what each one runs, what it declares it takes and which one a call runs are
``linattn.ops.impls``'s (docs/design.md §1.3)."""

IMPLS = ("auto", "parallel", "looped", "fused")
