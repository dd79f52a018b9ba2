"""Kernelized attention's looped implementation (for CPUs): C V in blocks of query rows, under plain autograd."""
import torch
from torch import Tensor

from .kernel import KernelizedInputs, masked_kernel, scaled_inputs


def forward(x: KernelizedInputs) -> Tensor:
    """out = C V (B,H,N,Dv) in q's dtype, ``chunk_size`` query rows at a time: the forward holds at most chunk_size×S
    kernel entries (autograd keeps every block's for backward)."""
    qs, ks, v = scaled_inputs(x.q, x.k, x.v, x.pad)
    out = [masked_kernel(qc, ks, x.pad) @ v for qc in qs.split(x.chunk_size, dim=2)]
    return torch.cat(out, dim=2).to(x.q.dtype)
