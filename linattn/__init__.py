"""Linear-complexity attention in pure PyTorch (no fairseq): the ops, the method registry, the instruments.

``linattn.ops`` (tensor functions, each with its float64 reference), ``linattn.methods`` (every method
declared once), ``linattn.config`` (the options: ``AttentionConfig``), ``linattn.analysis`` (concentration
measures). The fairseq plugin ``fairseq_linattn``
builds on this package; nothing here imports fairseq (docs/design.md §9).
"""
