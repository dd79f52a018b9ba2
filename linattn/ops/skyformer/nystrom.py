"""Skyformer's Nyström pieces: landmark rows (B,d) of X = [Q; K], M^-1 (B,H,d,d), kernel rows against the
landmarks (B,H,rows,d) and their gradient."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..kernelized.kernel import check_non_causal, gaussian_kernel, kernel_scale
from ..precision import compute_dtype
from .inverse import kernel_inverse

MODES = ("stratified", "uniform")
GAMMA = 0.1  # ridge added to kappa(L, L) (Skyformer §4.4)
_WHAT = "Gaussian-kernel Nyström attention over the whole sequence"


def _check_args(q, k, v, key_padding_mask, num_landmarks, mode, generator, causal, gamma) -> Optional[Tensor]:
    check_non_causal("skyformer", _WHAT, causal)
    check_qkv(q, k, v)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    check_positive_int("num_landmarks", num_landmarks)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma < float("inf"):
        raise ValueError(f"gamma must be a finite float >= 0, got {gamma!r}")
    return key_padding_mask


def _pick_rows(valid: Tensor, count: int, generator: Optional[torch.Generator],
               training: bool) -> Tuple[Tensor, Tensor]:
    """Choose min(count, R) of the R rows per batch element among the valid ones, without replacement.

    valid (B,R) bool -> (idx (B,m) long, used (B,m) bool); a slot is unused when the element has fewer
    than m valid rows (its index then points at an arbitrary row).
    """
    b, r = valid.shape
    m = min(count, r)
    if training:
        # no generator keyword without a generator: torch.compile cannot trace rand(..., generator=None) at a
        # dynamic size (the modules' draws, under --attention-compile)
        scores = (torch.rand(b, r, device=valid.device) if generator is None
                  else torch.rand(b, r, generator=generator, device=generator.device).to(valid.device))
        top, idx = scores.masked_fill(~valid, -1.0).topk(m, dim=1)  # random keys: a uniform m-subset
        return idx, top >= 0
    n = valid.sum(1, keepdim=True)  # (B,1) valid rows per element
    valid_first = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)  # valid row positions, in order
    slot = torch.arange(m, device=valid.device)[None, :]
    rank = torch.where(n >= m, ((2 * slot + 1) * n) // (2 * m), slot)  # evenly spaced ranks, distinct when n >= m
    return valid_first.gather(1, rank.clamp_max(r - 1)), slot < n


def _landmark_indices(valid: Tensor, num_landmarks: int, mode: str, generator, training: bool):
    """Row indices into X = [Q; K] (B,m) and their used-flags (B,m); valid (B,N) marks non-padded tokens."""
    n = valid.shape[1]
    if mode == "uniform":
        return _pick_rows(torch.cat([valid, valid], dim=1), num_landmarks, generator, training)
    from_q = num_landmarks - num_landmarks // 2
    idx_q, used_q = _pick_rows(valid, from_q, generator, training)
    if num_landmarks // 2 == 0:
        return idx_q, used_q
    idx_k, used_k = _pick_rows(valid, num_landmarks // 2, generator, training)
    return torch.cat([idx_q, idx_k + n], dim=1), torch.cat([used_q, used_k], dim=1)


def _landmarks(q: Tensor, k: Tensor, idx: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Rows idx (B,m) of X = [Q; K] scaled by D^(-1/4) (eq. 4), gathered without forming X: (B,H,m,D).

    Padded rows count as 0 (an unused slot may point at one).
    """
    b, h, n, dim = q.shape
    m = idx.shape[1]
    pick = lambda x, i: x.gather(2, i[:, None, :, None].expand(b, h, m, dim))
    land = torch.where((idx < n)[:, None, :, None], pick(q, idx.clamp_max(n - 1)), pick(k, (idx - n).clamp_min(0)))
    land = land * kernel_scale(q)
    if key_padding_mask is not None:
        land = land.masked_fill(key_padding_mask.gather(1, idx % n)[:, None, :, None], 0.0)
    return land


def _kernel_inverse(land: Tensor, used: Tensor, gamma: float, exact_inverse: bool) -> Tensor:
    """M^-1 (B,H,d,d) for M = kappa(L, L) + gamma I (Skyformer §4.4); unused slots an inert identity block."""
    eye = torch.eye(used.shape[1], dtype=land.dtype, device=land.device)
    keep = (used[:, :, None] & used[:, None, :])[:, None] | eye.bool()
    if not exact_inverse:
        return kernel_inverse(land, keep, gamma)
    m = gaussian_kernel(land, land) * keep + gamma * eye  # M = kappa(L, L) + gamma I
    return torch.linalg.pinv(m, hermitian=True)


def _landmark_rows(q, key_padding_mask, num_landmarks, mode, generator, training) -> Tuple[Tensor, Tensor]:
    """(landmark rows idx (B,d) of [Q; K], used (B,d) bool) among the non-padded tokens."""
    b, _, n, _ = q.shape
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    return _landmark_indices(valid, num_landmarks, mode, generator, training)


def _landmark_setup(q, k, key_padding_mask, num_landmarks, mode, generator, training):
    """(q, k in the compute dtype (padded keys 0), landmark rows idx (B,d) of [Q; K], used (B,d) bool)."""
    idx, used = _landmark_rows(q, key_padding_mask, num_landmarks, mode, generator, training)
    ct = compute_dtype(q)
    q_, k_ = q.to(ct), k.to(ct)
    if key_padding_mask is not None:
        k_ = k_.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # whatever padded keys hold (even inf)
    return q_, k_, idx, used


def _kernel_rows(x: Tensor, scale: float, pad: Optional[Tensor], land: Tensor, used: Tensor, r0: int, r1: int,
                 zero_padded: bool = False, inplace: bool = True):
    """(x_s, C) for rows [r0, r1): x_s = x * D^(-1/4) (0 on padded rows), C = kappa(x_s, L) * used (B,H,rows,d),
    with zero rows for padded tokens if ``zero_padded`` (the keys). ``inplace=False`` where autograd records."""
    xs = x[:, :, r0:r1] * scale
    if pad is None:
        c = gaussian_kernel(xs, land)
        return xs, c.mul_(used) if inplace else c * used
    rows = pad[:, None, r0:r1, None]
    xs = xs.masked_fill_(rows, 0.0) if inplace else xs.masked_fill(rows, 0.0)
    c = gaussian_kernel(xs, land)
    c = c.mul_(used) if inplace else c * used
    if not zero_padded:
        return xs, c
    return xs, c.masked_fill_(rows, 0.0) if inplace else c.masked_fill(rows, 0.0)


def _kernel_input_grad(dc: Tensor, c: Tensor, xs: Tensor, land: Tensor, dland: Tensor) -> Tensor:
    """dL/dx_s from dL/dC, C = exp(x_s·L - |x_s|²/2 - |L|²/2) (Skyformer §4.1); adds dL/dL into dland.

    dE = dC ⊙ C; dx_s = dE L - rowsum(dE) x_s, dL = dE^T x_s - colsum(dE) L.
    """
    de = dc.mul_(c)
    dland += de.transpose(-1, -2) @ xs - de.sum(-2)[..., None] * land
    return (de @ land).sub_(de.sum(-1, keepdim=True) * xs)
