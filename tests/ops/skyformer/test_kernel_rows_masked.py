"""Rows of the Gaussian-kernel matrices with a key padding mask (Kernelized's exact C, Skyformer's Nyström
C_Q M^-1 C_K^T), ops and modules, against matrices built here entry by entry from the formula (Skyformer §4.1-4.2).

The outputs C V cannot catch a kernel row that forgets the mask (the ops zero the padded values), so the rows
themselves are checked: padded keys' columns exactly 0, every other entry the formula's.
"""
import pytest
import torch
from helpers import padding_mask

from fairseq_linattn.modules import build_attention
from linattn import ops
from linattn.ops.skyformer.nystrom import GAMMA, _landmark_indices

B, H, D = 3, 2, 8


def _mask(gen, n):
    """(B, n): sequence 0 unpadded, 1 padded on the left, 2 on the right (random amounts < n)."""
    return torch.cat([padding_mask(2, n, "left", gen), padding_mask(2, n, "right", gen)[1:]])


def _kappa(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(-|a_i - b_j|² / 2) entry by entry, a (..., N, D), b (..., M, D), both already scaled by D^(-1/4)."""
    return torch.exp(-0.5 * ((a[..., :, None, :] - b[..., None, :, :]) ** 2).sum(-1))


def _exact_kernel(q, k, mask):
    """C_ij = kappa(q_i, k_j) after D^(-1/4) scaling, 0 for a padded key j (every query row, padded or not)."""
    s = D ** -0.25
    return _kappa(q * s, k * s).masked_fill(mask[:, None, None, :], 0.0)


def _nystrom_kernel(q, k, mask, landmarks):
    """C_Q (kappa(L, L) + gamma I)^-1 C_K^T with L = the rows ``landmarks[b]`` of the scaled [Q; K] (B, H, N, N),
    padded keys' columns 0."""
    s = D ** -0.25
    out = torch.zeros(B, H, q.shape[2], k.shape[2], dtype=q.dtype)
    for b in range(B):
        land = torch.cat([q[b], k[b]], 1)[:, landmarks[b]] * s
        m = _kappa(land, land) + GAMMA * torch.eye(land.shape[1], dtype=q.dtype)
        out[b] = _kappa(q[b] * s, land) @ torch.linalg.solve(m, _kappa(k[b] * s, land).transpose(-1, -2))
    return out.masked_fill(mask[:, None, None, :], 0.0)


def _qk(gen, n):
    return (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for _ in range(2))


@pytest.mark.parametrize("rows", [None, 4, "index"])
def test_kernelized_kernel_rows_with_mask_are_the_formula(gen, rows):
    n = 13
    q, k = _qk(gen, n)
    mask = _mask(gen, n)
    index = torch.tensor([0, 5, 12]) if rows == "index" else ops.select_rows(rows, n, q.device)
    want = _exact_kernel(q, k, mask)[:, :, index]
    got = ops.kernelized_kernel_matrix(q, k, key_padding_mask=mask, rows=index if rows == "index" else rows)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert (got.masked_select(mask[:, None, None, :]) == 0).all()
    module = build_attention("kernelized", H * D, H, causal=False)
    torch.testing.assert_close(module.kernel_rows(q, k, mask, rows=index), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["stratified", "uniform"])
def test_skyformer_kernel_rows_with_every_valid_row_a_landmark_are_the_nystrom_formula(gen, mode):
    n = 11
    q, k = _qk(gen, n)
    mask = _mask(gen, n)
    got = ops.skyformer_kernel_matrix(q, k, num_landmarks=2 * n, key_padding_mask=mask, mode=mode,
                                      exact_inverse=True, training=False)
    valid = [torch.cat([~mask[b], ~mask[b]]).nonzero()[:, 0] for b in range(B)]  # every real row of [Q; K]
    want = _nystrom_kernel(q, k, mask, valid)
    keep = ~mask[:, None, :, None]  # real query rows (a padded query's row is not compared)
    torch.testing.assert_close(got * keep, want * keep, rtol=1e-9, atol=1e-11)
    assert torch.isfinite(got).all() and (got.masked_select(mask[:, None, None, :]) == 0).all()
    config = dict(skyformer_landmarks=2 * n, skyformer_landmark_mode=mode, skyformer_exact_inverse=True)
    module = build_attention("skyformer", H * D, H, causal=False, config=config)
    torch.testing.assert_close(module.kernel_rows(q, k, mask) * keep, want * keep, rtol=1e-9, atol=1e-11)


def test_skyformer_kernel_rows_with_few_landmarks_are_the_nystrom_formula(gen):
    n, landmarks = 14, 5
    q, k = _qk(gen, n)
    mask = _mask(gen, n)
    mask[1:, :] = False
    mask[1, :4], mask[2, -6:] = True, True  # at least 8 real tokens: every landmark slot is used
    idx, used = _landmark_indices(~mask, landmarks, "stratified", None, False)
    assert used.all() and (~mask).gather(1, idx % n).all()  # landmarks only on real tokens
    got = ops.skyformer_kernel_matrix(q, k, num_landmarks=landmarks, key_padding_mask=mask, exact_inverse=True,
                                      training=False)
    want = _nystrom_kernel(q, k, mask, idx)
    keep = ~mask[:, None, :, None]
    torch.testing.assert_close(got * keep, want * keep, rtol=1e-9, atol=1e-11)
    assert (got.masked_select(mask[:, None, None, :]) == 0).all()
