"""The row-stochastic attention matrix of one of our attention modules on its input, for analysis only.

Given an attention module of ``fairseq_linattn.modules`` and its (T, B, C) self-attention input, q and k
are projected with the module's own ``q_proj`` / ``k_proj`` and the module's ``attention_rows`` gives
the matrix P with out = P V where exact (V the ``v_proj`` output, before ``out_proj``): O(R N) memory
for R query rows. What P is per method is the module's to say (its ``attention_rows`` docstring and
``rows_note`` in ``linattn_tools.methods_extra``); the rows themselves come from the ops (``ops.*_weights``,
docs/design.md §8).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from linattn.ops import Rows


def projected_qk(module, query: Tensor) -> Tuple[Tensor, Tensor]:
    """The module's q, k (B, H, N, D) for a (T, B, C) self-attention input."""
    from ..modules import ATTENTION_CLASSES, AttentionBase

    if not isinstance(module, AttentionBase):
        raise ValueError(f"module must be a fairseq_linattn attention module ({', '.join(ATTENTION_CLASSES)}), "
                         f"got {type(module).__name__}")
    if not isinstance(query, Tensor) or query.dim() != 3 or query.shape[-1] != module.embed_dim:
        raise ValueError(f"query must be a (T, B, C = {module.embed_dim}) tensor, got "
                         f"{tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__}")
    return module._heads(module.q_proj(query)), module._heads(module.k_proj(query))


def module_attention_matrix(module, query: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                            rows: Rows = None) -> Tensor:
    """P (B, H, R, N) of ``module`` on its (T, B, C) self-attention input: ``module.attention_rows``.

    No state of the module changes (LLN's moment matcher runs in eval mode).
    """
    with torch.no_grad():
        q, k = projected_qk(module, query)
    return module.attention_rows(q, k, key_padding_mask=key_padding_mask, rows=rows)
