"""Materialised Skyformer (Skyformer eq. 6): rows of C_Q M^-1 C_K^T (B,H,R,N); its reference is the exact C V."""
from typing import Optional

import torch
from torch import Tensor

from ..kernelized.kernel import kernel_scale
from ..kernelized.reference import kernelized_attention_reference
from ..masking import Rows, select_rows
from .nystrom import (
                      GAMMA,
                      KernelColumns,
                      LandmarkChoice,
                      check_skyformer,
                      gather_landmarks,
                      kernel_rows,
                      landmark_inverse,
                      landmark_rows,
                      upcast_qk,
)


def _nystrom_factors(q, k, key_padding_mask, choice: LandmarkChoice, exact_inverse, gamma):
    """C_Q (B,H,N,d), M^-1 (B,H,d,d), C_K (B,H,N,d) in the compute dtype (padded key rows of C_K zero)."""
    idx, used = landmark_rows(q, key_padding_mask, choice)
    q_, k_ = upcast_qk(q, k, key_padding_mask)
    land = gather_landmarks(q_, k_, idx, key_padding_mask)
    m_inv = landmark_inverse(land, used, gamma, exact_inverse)
    cols = KernelColumns(kernel_scale(q), land, used[:, None, None, :], key_padding_mask)
    _, c_q = kernel_rows(q_, cols, 0, q.shape[2], inplace=False)
    _, c_k = kernel_rows(k_, cols, 0, q.shape[2], True, inplace=False)
    return c_q, m_inv, c_k


def skyformer_kernel_matrix(q: Tensor, k: Tensor, *, num_landmarks: int = 128,
                            key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                            generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                            training: bool = True, gamma: float = GAMMA, rows: Rows = None) -> Tensor:
    """Rows of the materialised C_approx = C_Q M^-1 C_K^T (B,H,R,N) in the compute dtype (analysis and tests).

    Same landmarks as ``skyformer_attention`` for the same arguments and generator state (chosen from
    all N tokens whatever ``rows``, which is as ``select_rows``).
    """
    choice = LandmarkChoice(num_landmarks, mode, generator, training)
    key_padding_mask = check_skyformer(q, k, k, key_padding_mask, choice, False, gamma)
    c_q, m_inv, c_k = _nystrom_factors(q, k, key_padding_mask, choice, exact_inverse, gamma)
    return c_q[:, :, select_rows(rows, q.shape[2], q.device)] @ m_inv @ c_k.transpose(-1, -2)


def skyformer_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 128,
                                  key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                                  generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                                  training: bool = True, causal: bool = False, gamma: float = GAMMA) -> Tensor:
    """The exact kernelized attention C V that Skyformer approximates (arguments validated, then unused)."""
    choice = LandmarkChoice(num_landmarks, mode, generator, training)
    key_padding_mask = check_skyformer(q, k, v, key_padding_mask, choice, causal, gamma)
    return kernelized_attention_reference(q, k, v, key_padding_mask=key_padding_mask)
