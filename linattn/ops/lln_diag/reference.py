"""Materialised LLN+Diag (LLN §4.2): rows (B,H,R,N) of the mixed matrix, and both parts' N×N outputs mixed."""
from typing import Optional

from torch import Tensor

from ..block_softmax.reference import block_softmax_attention_reference, block_softmax_weights
from ..inputs import check_positive_int
from ..lln.reference import lln_attention_reference, lln_attention_weights
from ..masking import Rows
from ..real_tokens import in_real_first_order, rows_in_real_first_order
from .mixing import MIX_MODES, mix_lln_diag


def lln_diag_attention_reference(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, block_size: int = 64,
                                 causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                                 chunk_size: int = 64, mix: str = "average", r: Optional[Tensor] = None,
                                 p: Optional[Tensor] = None) -> Tensor:
    """Both parts materialised as N×N matrices (chunk_size checked, unused: a reference has no chunks), over each
    row's real-first order with a key padding mask (``real_tokens``; the blocks count the row's real tokens)."""
    check_positive_int("chunk_size", chunk_size)

    def mixed(q, k, v, key_padding_mask):
        lln = lln_attention_reference(q, k, v, alpha, beta, causal=causal, key_padding_mask=key_padding_mask)
        diag = block_softmax_attention_reference(q, k, v, block_size=block_size, causal=causal,
                                                 key_padding_mask=key_padding_mask)
        return mix_lln_diag(lln, diag, mix, r, p)
    return in_real_first_order(mixed, q, k, v, key_padding_mask)


def lln_diag_attention_weights(q: Tensor, k: Tensor, alpha, beta, *, block_size: int = 64, causal: bool = False,
                               key_padding_mask: Optional[Tensor] = None, mix: str = "average",
                               r: Optional[Tensor] = None, p: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Rows of the row-stochastic LLN+Diag matrix (LLN §4.2): q, k (B,H,N,D) -> (B,H,R,N), compute dtype.

    ``average``: 0.5 P_lln + 0.5 P_diag, exact (P V is the output). The learnable mixes weigh each value
    channel c separately (r, p of shape (H, Dv)), so P uses each head's mean weights r̄, p̄:
    ``learnable_ratio`` r̄ P_lln + (1 - r̄) P_diag, ``learnable_scale`` (r̄ P_lln + p̄ P_diag) / (r̄ + p̄);
    exact when the weights are constant over a head's channels (for ``learnable_scale`` the output is
    then (r̄ + p̄) P V). With a key padding mask: the matrix over each row's real-first order, as the op's.
    """
    if mix not in MIX_MODES:
        raise ValueError(f"mix must be one of {MIX_MODES}, got {mix!r}")
    return rows_in_real_first_order(_weights, q, k, key_padding_mask, rows, alpha, beta, block_size, causal, mix, r,
                                    p)


def _weights(q, k, key_padding_mask, rows, alpha, beta, block_size, causal, mix, r, p) -> Tensor:
    """``lln_diag_attention_weights`` over the tokens in their order."""
    lln = lln_attention_weights(q, k, alpha, beta, causal=causal, key_padding_mask=key_padding_mask, rows=rows)
    diag = block_softmax_weights(q, k, block_size=block_size, causal=causal, key_padding_mask=key_padding_mask,
                                 rows=rows)
    if mix == "average":
        return 0.5 * lln + 0.5 * diag
    for name, t in (("r", r), ("p", p if mix == "learnable_scale" else r)):
        if t is None or t.dim() != 2 or t.shape[0] != q.shape[1]:
            raise ValueError(f"mix={mix!r} needs {name} of shape (H, Dv) with H = {q.shape[1]}, "
                             f"got {None if t is None else tuple(t.shape)}")
    r_mean = r.to(lln.dtype).mean(-1)[None, :, None, None]
    if mix == "learnable_ratio":
        return r_mean * lln + (1 - r_mean) * diag
    p_mean = p.to(lln.dtype).mean(-1)[None, :, None, None]
    if not bool(((r_mean >= 0) & (p_mean >= 0) & (r_mean + p_mean > 0)).all()):  # sync ok: the reference
        raise ValueError("lln_diag mix 'learnable_scale' with negative mean weights r, p has no "
                         "row-stochastic attention matrix")
    return (r_mean * lln + p_mean * diag) / (r_mean + p_mean)
