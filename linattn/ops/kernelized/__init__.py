"""Kernelized attention: the exact Gaussian-kernel form Skyformer approximates (Skyformer §4.1; docs/design.md §5).

Non-causal only. No row normalisation: ``out = C V`` with C the (unnormalised) Gaussian kernel matrix.
"""
from .autograd import kernelized_attention
from .kernel import kernelized_kernel_matrix
from .reference import kernel_attention_weights, kernelized_attention_reference
