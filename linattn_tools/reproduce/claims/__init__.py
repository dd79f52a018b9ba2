"""The papers' quantitative claims that this machine can check, each with a test computed from our JSON.

A claim names its paper and where the paper states it, the paper's figure (table cells come from
``recipes.paper_results``; figures and statements that are not table cells are written beside the
claim), and an ``evaluate`` function that reads the result records (``ledger.load_results``) and
returns a ``Verdict``: our figure, whether the claim holds here (None: the row is for information,
the paper states nothing to test), the test applied, and the likely cause when it does not hold.
Nothing here holds a measured number or a fact of the measuring machine: every "ours", every "holds"
and every machine fact (cores, memory budget, which run) is read from the records.

One module per result group: ``lln_distribution``, ``lln_cost``, ``quickstart``, ``decoding``,
``skyformer``; this package lists the claims in ledger order.
"""
from typing import Dict, List, Optional, Tuple

from .decoding import lln_generation, table10_magnitude, table10_trend
from .gpu import lavo_generation_gpu, lavo_speed_gpu, lln_speed_gpu
from .lln_cost import memory_fit, power_exponent, table2_diag_memory, table2_longest, table2_speed, table2_time_linear
from .lln_distribution import fig2_entropy, fig2_gap, fig5b_exact, fig5b_fit, fig5b_paper, fig5b_unmatched, prop31
from .quickstart import lavo_flat, lln_context, softmax_degrades, table1_finetune, table1_mlm
from .skyformer import fig1_landmarks, fig1_length, fig1_op, fig1_others, sky_landmarks, sky_length
from .verdict import Claim, Verdict

__all__ = ["CLAIMS", "Claim", "Verdict", "evaluate_all", "memory_fit", "power_exponent"]

CLAIMS: List[Claim] = [
    Claim("lln-prop31", "LLN", "Prop. 3.1, App. A.5, Fig. 5a",
          "softmax's ln P is normal with mean −ln N − σ_sm²/2 and variance σ_sm² = σ_q²σ_k²",
          "lln_distribution", prop31),
    Claim("lln-fig5b-paper", "LLN", "Fig. 5b, §4.1, eq. 10",
          "moment matching (published constants) gives LLN softmax's var ln P", "lln_distribution", fig5b_paper),
    Claim("lln-fig5b-fit", "LLN", "Fig. 5b, App. A.7",
          "moment matching with a, b fitted as App. A.7 describes gives softmax's var ln P",
          "lln_distribution", fig5b_fit),
    Claim("lln-fig5b-exact", "LLN", "Fig. 5b",
          "moment matching by the exact variance table gives softmax's var ln P", "lln_distribution", fig5b_exact),
    Claim("lln-fig5b-unmatched", "LLN", "Fig. 5b, App. A.7",
          "without moment matching LLN's var ln P is much smaller than softmax's", "lln_distribution", fig5b_unmatched),
    Claim("lln-fig2-entropy", "LLN", "Fig. 2 (left), §4.1",
          "moment-matched LLN's entropy follows softmax's across the temperature", "lln_distribution", fig2_entropy),
    Claim("lln-fig2-gap", "LLN", "Fig. 2 (right), §4.1",
          "moment-matched LLN's spectral gap follows softmax's across the temperature", "lln_distribution", fig2_gap),
    Claim("lln-table2-linear", "LLN", "Table 2, §5.1",
          "LLN's training time grows linearly with N", "lln_cost", table2_time_linear),
    Claim("lln-table2-speed", "LLN", "Table 2",
          "LLN+Diag (and LLN) train faster than softmax at long N, increasingly so (CPU)", "lln_cost",
          table2_speed),
    Claim("lln-table2-speed-gpu", "LLN", "Table 2",
          "LLN trains faster than softmax at N = 4096 … 16384, increasingly so (GPU)", "gpu_benchmark",
          lln_speed_gpu),
    Claim("lln-table2-longest", "LLN", "Table 2, §5.1",
          "LLN handles at least 4× longer sequences than softmax (softmax as trained: attention dropout 0.1)",
          "lln_cost", table2_longest("lln", 0.1)),
    Claim("lln-table2-longest-diag", "LLN", "Table 2",
          "LLN+Diag, too, handles at least 4× longer sequences than softmax (attention dropout 0.1)",
          "lln_cost", table2_longest("lln_diag", 0.1)),
    Claim("lln-table2-longest-flash", "LLN", "Table 2, §5.1",
          "the same claim against a fused softmax kernel (attention dropout 0)",
          "lln_cost", table2_longest("lln", 0.0)),
    Claim("lln-table2-diag-memory", "LLN", "§5.1, Table 2",
          "LLN+Diag adds about 10 % memory over LLN", "lln_cost", table2_diag_memory),
    Claim("lln-table1-mlm", "LLN", "Table 1 (analogue)",
          "LLN+Diag is about as good as softmax, LLN clearly below (masked-LM loss)", "quickstart", table1_mlm),
    Claim("lln-table1-finetune", "LLN", "Table 1 (analogue)",
          "LLN+Diag is about as good as softmax, LLN clearly below (fine-tuning accuracy)",
          "quickstart", table1_finetune),
    Claim("lavo-table2-flat", "LAVO", "Table 2, §4.1",
          "LAVO's perplexity does not rise beyond its training context", "quickstart", lavo_flat),
    Claim("lavo-table2-softmax", "LAVO", "Table 2",
          "softmax with sinusoidal positions degrades beyond its training context", "quickstart", softmax_degrades),
    Claim("lavo-table2-lln", "LAVO", "Table 2 (not in it)",
          "LLN beyond its training context", "quickstart", lln_context),
    Claim("lavo-table10-trend", "LAVO", "Table 10, App. B",
          "LAVO generates token by token faster than softmax, increasingly with L (CPU)", "decoding",
          table10_trend),
    Claim("lavo-table10-8k", "LAVO", "Table 10",
          "LAVO's generation speed-up at 8192 tokens (CPU)", "decoding", table10_magnitude),
    Claim("lavo-table10-gpu", "LAVO", "Table 10",
          "LAVO's generation speed-up over softmax, at 8192 tokens and growing with L (GPU)", "gpu_benchmark",
          lavo_generation_gpu),
    Claim("lavo-table2-speed-gpu", "LAVO", "Table 2",
          "LAVO trains faster than softmax (FlashAttention) at 16K tokens (GPU)", "gpu_benchmark", lavo_speed_gpu),
    Claim("lavo-table10-lln", "LAVO", "Table 10 (not in it)",
          "LLN's generation speed-up", "decoding", lln_generation),
    Claim("sky-fig1-landmarks", "Skyformer", "Fig. 1, §4.5",
          "Skyformer's approximation of softmax attention improves markedly with more features",
          "skyformer_fig1", fig1_landmarks),
    Claim("sky-fig1-others", "Skyformer", "Fig. 1, §4.5",
          "the other approximations gain little from more features", "skyformer_fig1", fig1_others),
    Claim("sky-fig1-length", "Skyformer", "Fig. 1, §5 (Limitations)",
          "Skyformer approximates better with longer sequences at a fixed number of features",
          "skyformer_fig1", fig1_length),
    Claim("sky-fig1-op", "Skyformer", "Fig. 1 (not in it)",
          "our Skyformer op in Fig. 1's setting", "skyformer_fig1", fig1_op),
    Claim("sky-op-synthetic-landmarks", "Skyformer", "§4.3 (not a figure)",
          "our Skyformer op against exact kernelized attention, synthetic inputs, against d",
          "skyformer_error", sky_landmarks),
    Claim("sky-op-synthetic-length", "Skyformer", "§4.3 (not a figure)",
          "our Skyformer op against exact kernelized attention, synthetic inputs, against N",
          "skyformer_error", sky_length),
]


def evaluate_all(records: Dict[str, Dict]) -> List[Tuple[Claim, Optional[Verdict]]]:
    """Every claim with its verdict, or None when its result file is missing."""
    return [(c, c.evaluate(records[c.group]) if c.group in records else None) for c in CLAIMS]
