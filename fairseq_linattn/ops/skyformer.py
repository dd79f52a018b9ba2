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
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._checks import Rows, autocast_off, check_key_padding_mask, check_positive_int, check_qkv, select_rows
from .kernelized import _prepare, check_non_causal, gaussian_kernel, kernelized_attention_reference

MODES = ("stratified", "uniform")
GAMMA = 0.1  # ridge added to kappa(L, L) (Skyformer §4.4)
NEWTON_STEPS = 6
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
        device = generator.device if generator is not None else valid.device
        scores = torch.rand(b, r, generator=generator, device=device).to(valid.device)
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


def newton_schulz_inverse(m_hat: Tensor, steps: int = NEWTON_STEPS) -> Tensor:
    """Approximate inverse of (...,d,d) m_hat by Z <- Z(13I - AZ(15I - AZ(7I - AZ)))/4 (Skyformer §4.4).

    Z0 = A^T / (max column sum of |A|), one scalar per matrix.
    """
    eye = torch.eye(m_hat.shape[-1], dtype=m_hat.dtype, device=m_hat.device)
    z = m_hat.transpose(-1, -2) / m_hat.abs().sum(-2).amax(-1)[..., None, None]
    for _ in range(steps):
        az = m_hat @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def _nystrom_factors(q, k, key_padding_mask, num_landmarks, mode, generator, exact_inverse, training, gamma):
    """C_Q (B,H,N,d), M^-1 (B,H,d,d), C_K (B,H,N,d) in the compute dtype (padded key rows of C_K zero)."""
    b, h, n, dim = q.shape
    qs, ks, _ = _prepare(q, k, k, key_padding_mask)
    if key_padding_mask is None:
        valid = torch.ones(b, n, dtype=torch.bool, device=q.device)
    else:
        valid = ~key_padding_mask
        qs = qs.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # unused landmark slots may point here
    idx, used = _landmark_indices(valid, num_landmarks, mode, generator, training)
    x = torch.cat([qs, ks], dim=2)  # X = [Q; K] (eq. 4)
    land = x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], dim))  # (B,H,d,D)
    used4 = used[:, None, None, :]  # unused slots get zero kernel columns
    c_q = gaussian_kernel(qs, land) * used4
    c_k = gaussian_kernel(ks, land) * used4
    if key_padding_mask is not None:
        c_k = c_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    eye = torch.eye(idx.shape[1], dtype=qs.dtype, device=q.device)
    keep = (used[:, :, None] & used[:, None, :])[:, None] | eye.bool()  # unused slots: inert identity block
    m = gaussian_kernel(land, land) * keep + gamma * eye  # M = kappa(L, L) + gamma I
    if exact_inverse:
        return c_q, torch.linalg.pinv(m, hermitian=True), c_k
    d_inv_sqrt = m.sum(-1).rsqrt()  # D_M = diag(M 1) > 0: every entry of M is positive
    m_hat = m * d_inv_sqrt[..., :, None] * d_inv_sqrt[..., None, :]
    m_inv = newton_schulz_inverse(m_hat) * d_inv_sqrt[..., :, None] * d_inv_sqrt[..., None, :]
    return c_q, m_inv, c_k


@autocast_off
def skyformer_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 128,
                        key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                        generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                        training: bool = True, causal: bool = False, gamma: float = GAMMA) -> Tensor:
    """out = C_Q ((C_K M^-1)^T V) (Skyformer eq. 6), never forming an N×N matrix.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). ``exact_inverse`` uses pinv(M) instead of the iteration.
    Half inputs compute in float32 (the iteration needs it) and return the input dtype.
    """
    key_padding_mask = _check_args(q, k, v, key_padding_mask, num_landmarks, mode, generator, causal, gamma)
    c_q, m_inv, c_k = _nystrom_factors(q, k, key_padding_mask, num_landmarks, mode, generator,
                                       exact_inverse, training, gamma)
    _, _, v = _prepare(q, k, v, key_padding_mask)
    # (C_K M^-1)^T V evaluated as M^-T (C_K^T V): O(N·d·Dv + d²·Dv) instead of O(N·d²)
    return (c_q @ (m_inv.transpose(-1, -2) @ (c_k.transpose(-1, -2) @ v))).to(q.dtype)


def skyformer_kernel_matrix(q: Tensor, k: Tensor, *, num_landmarks: int = 128,
                            key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                            generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                            training: bool = True, gamma: float = GAMMA, rows: Rows = None) -> Tensor:
    """Rows of the materialised C_approx = C_Q M^-1 C_K^T (B,H,R,N) in the compute dtype (analysis and tests).

    Same landmarks as ``skyformer_attention`` for the same arguments and generator state (chosen from
    all N tokens whatever ``rows``, which is as ``select_rows``).
    """
    key_padding_mask = _check_args(q, k, k, key_padding_mask, num_landmarks, mode, generator, False, gamma)
    c_q, m_inv, c_k = _nystrom_factors(q, k, key_padding_mask, num_landmarks, mode, generator,
                                       exact_inverse, training, gamma)
    return c_q[:, :, select_rows(rows, q.shape[2], q.device)] @ m_inv @ c_k.transpose(-1, -2)


def skyformer_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 128,
                                  key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                                  generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                                  training: bool = True, causal: bool = False, gamma: float = GAMMA) -> Tensor:
    """The exact kernelized attention C V that Skyformer approximates (arguments validated, then unused)."""
    key_padding_mask = _check_args(q, k, v, key_padding_mask, num_landmarks, mode, generator, causal, gamma)
    return kernelized_attention_reference(q, k, v, key_padding_mask=key_padding_mask)
