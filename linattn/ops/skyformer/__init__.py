"""Skyformer: Nyström approximation of kernelized attention (Skyformer §4.2, eq. 4–6, §4.4; docs/design.md §5).

Non-causal self-attention only. With X = [Q; K] (2N rows, scaled by D^(-1/4)) and d landmark rows L of X:
``C ≈ C_Q M^-1 C_K^T`` with C_Q = kappa(Q, L), C_K = kappa(K, L), M = kappa(L, L) + gamma I, and M^-1
from a Newton–Schulz-type iteration on the degree-normalised M. Cost O(N·d·(D + Dv) + d³).

Landmarks (decisions where the paper is silent):
- per batch element, shared by all heads; only non-padded rows of X are candidates;
- without replacement; when a batch element has fewer valid rows than requested, *all* of its valid
  rows are landmarks and the spare slots are inert (zero columns in C_Q, C_K and an identity block in
  M, decoupled from the rest), so the result is the Nyström form over exactly those rows;
- ``stratified``: ceil(d/2) from the Q rows and floor(d/2) from the K rows; ``uniform``: d over all 2N;
- training: a uniform random subset from ``generator`` (or torch's global RNG), redrawn each call;
  eval (``training=False``): evenly spaced valid rows (deterministic; ``generator`` unused).
"""
from .autograd import skyformer_attention
from .inverse import NEWTON_STEPS
from .nystrom import GAMMA, MODES
from .reference import skyformer_attention_reference, skyformer_kernel_matrix
