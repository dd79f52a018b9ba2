"""Pure-PyTorch attention ops (no fairseq import). Tensors are (B, H, N, D); see docs/design.md §1.1.

Each fast op has a ``*_reference`` twin that materialises the N×N matrix from the paper's formula, built on
the op's row function (``*_weights``, ``lavo_token_mixing``, the kernel matrices): rows of that matrix for
given q, k, which the attention modules' ``attention_rows`` return for analysis. One subpackage per method:
``reference.py`` (the formula), ``looped.py`` (fast on CPUs), ``parallel.py`` (for GPUs, docs/design.md
§1.3), ``autograd.py`` (the op, choosing the implementation by ``impl``), ``decode.py``.
"""
from .block_softmax import block_softmax_attention, block_softmax_attention_reference, block_softmax_weights
from .inputs import check_key_padding_mask, check_positive_int
from .kernelized import (
                   kernel_attention_weights,
                   kernelized_attention,
                   kernelized_attention_reference,
                   kernelized_kernel_matrix,
)

# -- more ops are imported below, one line each --
from .lavo import (
                   lavo_attention,
                   lavo_attention_reference,
                   lavo_attention_weights,
                   lavo_cross_attention_reference,
                   lavo_cross_memory,
                   lavo_cross_readout,
                   lavo_decode_step,
                   lavo_init_bases,
                   lavo_init_state,
                   lavo_token_mixing,
)
from .lln import lln_attention, lln_attention_reference, lln_attention_weights, lln_decode_init, lln_decode_step
from .lln_diag import lln_diag_attention, lln_diag_attention_reference, lln_diag_attention_weights, mix_lln_diag
from .masking import Rows, masked_softmax, select_rows
from .moment_matching import exact_moment_table, fit_moment_constants, lln_alpha_beta
from .precision import compute_dtype
from .skyformer import skyformer_attention, skyformer_attention_reference, skyformer_kernel_matrix
from .softmax import softmax_attention, softmax_attention_reference, softmax_attention_weights
from .token_moments import token_moments
