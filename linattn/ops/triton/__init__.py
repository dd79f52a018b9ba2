"""Triton kernels of the ``fused`` implementation (docs/design.md §1.3, "the fused implementation"), one file per
kernel family, each registered as a PyTorch custom op (``linattn::*``) with a fake kernel, so that the op counter,
the meta device and ``torch.compile`` see one op. Importing a kernel file imports Triton: the methods' ``fused.py``
import them lazily (``import linattn`` does not need Triton).
"""
