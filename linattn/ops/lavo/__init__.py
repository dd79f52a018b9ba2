"""LAVO: linear attention via orthogonal memory (LAVO §3; the exact definition is docs/design.md §6).

Self-attention output ``0.5 * (F_local + F_global)``:
- ``F_local``: softmax attention inside a window of ``w`` tokens with a learnable relative bias
  ``P`` (H, 2w-1), score ``q_t·k_j/sqrt(D) + P[j - t + w - 1]`` (LAVO §3.2 context dissection,
  §3.3 embedded position encoding). Causal: keys ``t-w+1 .. t``; non-causal: the tokens of the
  query's own window ``[m*w, (m+1)*w)``.
- ``F_global = softmax(q Xtil^T / sqrt(D)) Xtil`` on the orthogonal memory ``Xtil = B ⊙ H``
  (r vectors ``H_i * B_i``), ``H = mean_t (B x_t)`` over the local outputs ``x_t`` of the
  non-padded tokens of earlier windows (causal) or of the whole sequence (non-causal)
  (LAVO §3.1 eq. 3-4). With no such token (causal window 0) the output is ``F_local`` alone.

``bases`` B is (H, r, D) with r <= D (orthonormal rows, see ``lavo_init_bases``); ``v`` must have
the head dim D of ``q`` since the memory lives in value space and is scored against ``q``.
"""
from .autograd import lavo_attention
from .cross import lavo_cross_memory, lavo_cross_readout
from .decode import lavo_decode_step, lavo_init_state
from .inputs import lavo_init_bases
from .reference import (
                        lavo_attention_reference,
                        lavo_attention_weights,
                        lavo_cross_attention_reference,
                        lavo_token_mixing,
)
