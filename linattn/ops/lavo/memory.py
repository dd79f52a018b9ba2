"""LAVO's orthogonal memory (LAVO eq. 3-4): H = mean of B x_t, (B,H,nw,r) causal or (B,H,r), and its read-out."""
import torch
import torch.nn.functional as F
from torch import Tensor


def per_head(x: Tensor, weights: Tensor) -> Tensor:
    """x (B,H,M,K) @ weights (H,K,J) per head -> (B,H,M,J) in x's dtype, multiplied in float64: a batched product's
    summation order changes with the batch (an einsum over "bhmk,hkj" multiplies (H, B*M, K) matrices), and in
    float64 that reaches no float32 rounding, so a sequence's numbers do not depend on the others in its batch."""
    return (x.double() @ weights.double()).to(x.dtype)


def memory_readout(qb: Tensor, mean: Tensor, bases: Tensor, scale: float, out_scale: float = 1.0) -> Tensor:
    """softmax(q Xtil^T * scale) Xtil * out_scale with Xtil_i = mean_i * B_i (LAVO eq. 4), never forming Xtil.

    qb = q B^T (B,H,...,r), mean (broadcastable to qb), bases (H,r,D) -> (B,H,...,D).
    Uses q·Xtil_i = mean_i (q·B_i) and sum_i p_i Xtil_i = (p * mean) B; a zero mean gives 0.
    """
    p = torch.softmax(qb * (mean * scale), -1)
    w = (p * (mean * out_scale)).flatten(2, -2)  # (B,H,M,r)
    out = torch.einsum("bhmr,hrd->bhmd", w, bases)
    return out.view(*qb.shape[:-1], bases.shape[-1])


def memory_mean(win: Tensor, bases: Tensor, tokw: Tensor, causal: bool):
    """H = mean of B x_t over the memory tokens (LAVO eq. 3): (mean, coef of F_local, window sums B·x).

    causal: per window over the windows before it, mean (B,H,nw,r), coef (B,nw); else mean (B,H,r), coef (B,).
    """
    wsum = per_head(win, bases.mT)
    cnt = tokw.sum(2)  # (B,nw)
    if causal:
        mem = F.pad(wsum.cumsum(2), (0, 0, 1, 0))[:, :, :-1]  # windows < m
        mem_cnt = F.pad(cnt.cumsum(1), (1, 0))[:, :-1]
        mean = mem / mem_cnt.clamp_min(1)[:, None, :, None]
        return mean, torch.where(mem_cnt > 0, 0.5, 1.0).to(win.dtype), win
    total = cnt.sum(1)
    return wsum.sum(2) / total.clamp_min(1)[:, None, None], torch.where(total > 0, 0.5, 1.0).to(win.dtype), win


def memory_mean_grad(dmean: Tensor, win: Tensor, bases: Tensor, dbases: Tensor, tokw: Tensor, causal: bool):
    """dL/d(per-window sums of x) (B,H,nw,D) causal or (B,H,D), from dL/dH; adds the bases' share to dbases."""
    cnt = tokw.sum(2)
    if causal:
        mem_cnt = F.pad(cnt.cumsum(1), (1, 0))[:, :-1]
        dmem = dmean / mem_cnt.clamp_min(1)[:, None, :, None]
        # window m's sum enters the memory of every later window: a reverse exclusive cumulative sum
        dws = F.pad(dmem.flip(2).cumsum(2).flip(2), (0, 0, 0, 1))[:, :, 1:]
        dbases += torch.einsum("bhmr,bhmd->hrd", dws, win)
        return per_head(dws, bases)
    dws = dmean / cnt.sum(1).clamp_min(1)[:, None, None]
    dbases += torch.einsum("bhr,bhd->hrd", dws, win.sum(2))
    return per_head(dws[:, :, None], bases)[:, :, 0]
