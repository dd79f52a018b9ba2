"""The papers' published figures as data (nothing is computed here), with their source and setting.

Papers: LLN = Nahshan, Kampeas, Haleva, "Linear Log-Normal Attention with Unbiased Concentration",
ICLR 2024 (arXiv 2311.13541); LAVO = Zhang et al., "Linear Attention via Orthogonal Memory"
(arXiv 2312.11135); Skyformer = Chen, Zeng, Ji, Yang, "Skyformer: Remodel Self-Attention with
Gaussian Kernel and Nyström Method", NeurIPS 2021.

Lookups (``method`` is one of our attention names -- softmax, lln, lln_diag, skyformer, kernelized,
lavo -- or a row of the paper's table by its label, case-insensitive, e.g. "Performer", "FA + RoPE").
Each returns a float, the string ``OOM`` where the paper reports out-of-memory, or None where the
paper has no figure for that cell (no row for the method, or a "-" in the table):

- ``glue(task, method)``: LLN Table 1, GLUE dev accuracy (%); task mnli, qnli, qqp, sst2 or avg.
- ``lln_speed(method, seq_len)``, ``lln_memory(method, seq_len)``: LLN Table 2 (s/iteration, GB).
- ``pg19_ppl(method, factor)``: LAVO Table 2 perplexity at ``factor`` (1, 1.5, 2) times the 8192-token
  training context; ``pg19_memory_mb`` and ``pg19_speedup`` the same table's other two columns.
- ``generation_speedup(method, factor)``: LAVO Table 10 (token-by-token generation, vs vanilla).
- ``lra(task, method, source="lavo")``: Long Range Arena accuracy (%) from LAVO Table 11
  (``source="skyformer"``: Skyformer Table 1; ``"lln"``: LLN Table 5); task text, listops,
  retrieval, pathfinder, image or avg.
- ``figure(table, method, column)``: the same cell as a ``Figure`` (value, source, setting, row,
  column, unit, note); ``TABLES`` holds every ``Table``; ``LAVO_TABLE1_LM`` LAVO's LM hyper-parameters.

Our methods map to rows as in each table's ``ours`` (softmax -> LLN's "SA baseline", LAVO Table 2's
"FlashAttention", the LRA tables' softmax row; lln -> "LLN Attention"; lln_diag -> "LLN+Diag
Attention"; lavo -> "LAVO"; skyformer, kernelized -> their LRA rows). A per-layer list such as
"softmax,lln" has no row.
"""
from typing import Dict, NamedTuple, Optional, Tuple, Union

OOM = "OOM"
Value = Union[float, str, None]

LLN = "LLN (Nahshan et al., ICLR 2024)"
LAVO = "LAVO (Zhang et al., arXiv 2312.11135)"
SKYFORMER = "Skyformer (Chen et al., NeurIPS 2021)"


class Figure(NamedTuple):
    value: Value
    source: str      # paper and table
    setting: str     # model, data, context, batch, steps, hardware as the paper states them
    row: str         # the paper's row label
    column: str
    unit: str
    note: str = ""


class Table(NamedTuple):
    source: str
    title: str
    unit: str
    setting: str
    columns: Tuple[str, ...]
    rows: Dict[str, Tuple[Value, ...]]     # the paper's row label -> one value per column
    ours: Dict[str, str]                   # our method -> the paper's row label
    notes: Dict[str, str] = {}             # row label -> remark on that row


_GLUE_SETTING = (
    "RoBERTa-base (fairseq roberta_base: 12 layers, 768-d, 12 heads) pretrained with masked LM on "
    "WikiText-103 and fine-tuned on each task with fairseq's default RoBERTa-base configuration and "
    "hyper-parameters (LLN §5, A.8.1; fairseq's examples/roberta README), FP16; dev-set accuracy. The "
    "paper names no GPU type, batch or step count beyond those defaults. Only the LLN and LLN+Diag "
    "rows are the paper's own runs: Nyströmformer's row is quoted from Xiong et al. 2021 (with the drop "
    "against its own baseline in the note), the other rows, SA baseline included, from Qin et al. 2022a. "
    "MNLI is one figure (matched or mismatched is not stated).")

_LLN_SPEED_SETTING = (
    "RoBERTa-base, batch size 1, training time per iteration and memory, on one GPU the paper calls a "
    "commodity GPU (no model named) (LLN §5.1).")

_PG19_SETTING = (
    "GPT-2 with a 12-layer decoder (768-d, 12 heads, FFN 3072), GPT-2 BPE (vocabulary 50,257), PG-19 "
    "(28,602 / 50 / 100 books train / valid / test); trained at context 8192 with 16 sequences "
    "(2^17 tokens) per step, 125K steps, 10K warm-up, peak lr 5e-4, inverse-sqrt schedule, AdamW "
    "(0.9, 0.999), weight decay 0.01, attention dropout 0.1 (LAVO Table 1, LM column; §4.1); token-level "
    "perplexity at test contexts 8192, 12288, 16384 (1x, 1.5x, 2x). LAVO: 64 orthogonal bases, no "
    "sinusoidal position embedding; local/LongShort window 16. Memory and speed-up measured on one "
    "A100 80GB; the training hardware is not stated.")

_LRA_SKYFORMER_SETTING = (
    "Long Range Arena test accuracy: 2-layer transformer, 64-d embeddings, 128-d FFN, 2 heads, mean "
    "pooling; 50k steps per task; batch 16 (Text, Retrieval), 32 (ListOps), 128 (Pathfinder), 256 "
    "(Image); lr 1e-4 (2e-4 Retrieval, Pathfinder); 128 features for every approximation; mean of "
    "3 seeds; one Tesla V100 16GB (Skyformer §5, Implementation Details).")

_LRA_LAVO_SETTING = (
    "Long Range Arena accuracy; LAVO with r = 32 bases and window w = 256 on every task (LAVO "
    "Appendix C). The rows other than LAVO repeat Skyformer Table 1 (vanilla Image 40.58 here, 40.57 "
    "there); the setting is not restated, presumably Skyformer's.")

_LRA_LLN_SETTING = (
    "Long Range Arena accuracy with Skyformer's code base; sequence lengths Text 4k, ListOps 2k, "
    "Retrieval 4k, Pathfinder 1k, Image 1k (LLN A.8.3). The softmax row is the paper's own run, not "
    "Skyformer's.")

_SOFTMAX_PG19_NOTE = ("our softmax is exact attention (torch SDPA: FlashAttention kernels on CUDA) with the "
                      "backbone's sinusoidal positions, which LAVO §4.1 removes only for LAVO; FA + RoPE "
                      "adds rotary positions instead")

TABLES: Dict[str, Table] = {
    "lln_table1": Table(
        source=f"{LLN}, Table 1", title="GLUE dev accuracy after WikiText-103 pretraining", unit="%",
        setting=_GLUE_SETTING, columns=("mnli", "qnli", "qqp", "sst2", "avg"),
        rows={
            "SA baseline": (80.3, 87.2, 89.9, 90.6, 87.0),
            "Reformer": (35.4, None, 63.2, 50.9, 49.8),
            "Performer": (58.8, 63.4, 79.1, 81.4, 70.6),
            "ELU": (74.8, 82.5, 86.9, 87.2, 82.8),
            "Longformer": (77.2, None, 85.5, 88.6, 83.7),
            "Transformer LS": (77.0, 84.8, 86.8, 90.2, 84.7),
            "TNN": (76.72, 85.06, 88.3, 90.6, 85.17),
            "T2": (77.28, 85.39, 88.56, 90.71, 85.48),
            "CosFormer": (76.7, None, 89.2, 91.0, 85.6),
            "T1": (79.06, 87.0, 88.61, 91.17, 86.46),
            "Flash": (79.45, 87.1, 88.83, 90.71, 86.52),
            "Nyströmformer": (80.9, 88.7, 86.3, 91.4, 86.8),
            "LLN Attention": (77.0, 85.1, 88.9, 90.6, 85.4),
            "LLN+Diag Attention": (80.0, 86.5, 89.7, 91.6, 86.9),
        },
        ours={"softmax": "SA baseline", "lln": "LLN Attention", "lln_diag": "LLN+Diag Attention"},
        notes={"Nyströmformer": "from Xiong et al. 2021; change vs its own SA baseline: MNLI -1.5, "
                                "QNLI -1.6, QQP -1.0, SST-2 +1.4, avg -0.7",
               "SA baseline": "quoted from Qin et al. 2022a"}),
    "lln_table2_time": Table(
        source=f"{LLN}, Table 2", title="training time per iteration vs sequence length", unit="s/it",
        setting=_LLN_SPEED_SETTING, columns=(512, 1024, 2048, 4096, 8192, 16384),
        rows={"Softmax Attention": (0.95, 1.05, 2.4, 6.8, OOM, OOM),
              "Nyströmformer": (1.8, 1.9, 2.6, 4.7, 8.8, 16.7),
              "LLN Attention": (1.0, 1.05, 1.6, 3.2, 6.1, 11.8),
              "LLN+Diag Attention": (1.2, 1.3, 1.9, 3.6, 6.9, 13.3)},
        ours={"softmax": "Softmax Attention", "lln": "LLN Attention", "lln_diag": "LLN+Diag Attention"}),
    "lln_table2_memory": Table(
        source=f"{LLN}, Table 2", title="training memory vs sequence length", unit="GB",
        setting=_LLN_SPEED_SETTING, columns=(512, 1024, 2048, 4096, 8192, 16384),
        rows={"Softmax Attention": (4.0, 5.5, 12.6, 32.1, OOM, OOM),
              "Nyströmformer": (4.0, 4.5, 5.5, 7.3, 11.6, 19.1),
              "LLN Attention": (4.1, 4.4, 5.7, 7.5, 12.0, 20.1),
              "LLN+Diag Attention": (4.1, 4.6, 6.1, 8.1, 13.4, 23.0)},
        ours={"softmax": "Softmax Attention", "lln": "LLN Attention", "lln_diag": "LLN+Diag Attention"}),
    "lln_table4_time": Table(
        source=f"{LLN}, Table 4", title="Long Range Arena running time", unit="s", setting=_LRA_LLN_SETTING,
        columns=("text", "listops", "retrieval", "pathfinder", "image"),
        rows={"Softmax": (21468, 5905, 21866, 6754, 13228), "Reformer": (4610, 2439, 4714, 4694, 8737),
              "Performer": (3456, 1966, 3761, 3553, 13169), "Skyformer": (4523, 2970, 5602, 5240, 9347),
              "LLN + Diag": (3043, 1774, 3135, 3042, 4053)},
        ours={"softmax": "Softmax", "skyformer": "Skyformer", "lln_diag": "LLN + Diag"}),
    "lln_table4_memory": Table(
        source=f"{LLN}, Table 4", title="Long Range Arena memory", unit="MB", setting=_LRA_LLN_SETTING,
        columns=("text", "listops", "retrieval", "pathfinder", "image"),
        rows={"Softmax": (17108, 4458, 8934, 4817, 9632), "Reformer": (3261, 1631, 3008, 3258, 6514),
              "Performer": (2176, 1122, 2178, 2180, 4353), "Skyformer": (3068, 1697, 2974, 4041, 8079),
              "LLN + Diag": (1641, 821, 1586, 1639, 3276)},
        ours={"softmax": "Softmax", "skyformer": "Skyformer", "lln_diag": "LLN + Diag"}),
    "lln_table5": Table(
        source=f"{LLN}, Table 5", title="Long Range Arena accuracy", unit="%", setting=_LRA_LLN_SETTING,
        columns=("text", "listops", "retrieval", "pathfinder", "image", "avg"),
        rows={"Softmax": (60.41, 38.05, 79.95, 71.3, 37.2, 57.38),
              "Reformer": (61.27, 37.05, 78.74, 67.23, 44.04, 57.67),
              "Performer": (57.85, 37.8, 80.5, 62.58, 37.56, 55.26),
              "Skyformer": (60.88, 39.36, 81.54, 70.23, 32.64, 56.93),
              "LLN + Diag": (60.72, 38.91, 81.21, 69.81, 38.65, 57.86)},
        ours={"softmax": "Softmax", "skyformer": "Skyformer", "lln_diag": "LLN + Diag"}),
    "lavo_table2_ppl": Table(
        source=f"{LAVO}, Table 2", title="PG-19 perplexity vs evaluation context", unit="ppl",
        setting=_PG19_SETTING, columns=(8192, 12288, 16384),
        rows={"vanilla": (OOM, OOM, OOM),
              "FlashAttention": (16.02, 40.33, 94.34),
              "FA + RoPE": (15.09, 20.11, 34.84),
              "LongShort": (15.52, 19.17, 26.06),
              "S4D": (15.78, 51.96, None),
              "ABC": (31.53, 86.78, 147.43),
              "local": (19.73, 21.24, 22.16),
              "LAVO": (19.43, 19.41, 19.40)},
        ours={"softmax": "FlashAttention", "lavo": "LAVO"},
        notes={"vanilla": "'-' in the table; the caption says vanilla attention runs out of memory",
               "S4D": "'-' at 16384 in the table (its memory and speed are given)",
               "FlashAttention": _SOFTMAX_PG19_NOTE}),
    "lavo_table2_memory": Table(
        source=f"{LAVO}, Table 2", title="PG-19 LM memory vs context (1x A100 80GB)", unit="MB",
        setting=_PG19_SETTING, columns=(8192, 12288, 16384),
        rows={"vanilla": (7107, 14023, 25747), "FlashAttention": (4627, 6847, 9133),
              "FA + RoPE": (4679, 6892, 9193), "LongShort": (5015, 7809, 10929),
              "S4D": (7975, 11751, 16111), "ABC": (6165, 9373, 12669), "local": (5673, 8759, 11909),
              "LAVO": (4688, 6904, 9337)},
        ours={"softmax": "FlashAttention", "lavo": "LAVO"}),
    "lavo_table2_speedup": Table(
        source=f"{LAVO}, Table 2", title="PG-19 LM speed-up over vanilla vs context (1x A100 80GB)",
        unit="x", setting=_PG19_SETTING, columns=(8192, 12288, 16384),
        rows={"vanilla": (1.0, 1.0, 1.0), "FlashAttention": (14.0, 16.1, 18.7),
              "FA + RoPE": (12.4, 14.5, 16.96), "LongShort": (3.5, 4.0, 5.7), "S4D": (1.3, 1.6, 2.3),
              "ABC": (2.2, 3.1, 4.1), "local": (5.0, 6.7, 9.1), "LAVO": (11.49, 16.3, 22.0)},
        ours={"softmax": "FlashAttention", "lavo": "LAVO"},
        notes={"LAVO": "the text of §4.1 says 20.3x at 16384; the table says 22.0x"}),
    "lavo_table10": Table(
        source=f"{LAVO}, Table 10", title="autoregressive generation speed-up over vanilla", unit="x",
        setting=("Simulated token-by-token generation on dummy sequences of 8192, 12288, 16384 tokens, each "
                 "step attending to every earlier token (LAVO Appendix B); hardware not stated, presumably "
                 "Table 2's A100. S4D is not measured."),
        columns=(8192, 12288, 16384),
        rows={"vanilla": (1.0, 1.0, 1.0), "ABC": (1.18, 2.29, 3.30), "local": (3.35, 6.86, 10.34),
              "LongShort": (0.70, 1.71, 2.94), "FlashAttention": (7.94, 13.10, 15.01),
              "FlashAttention+RoPE": (5.73, 10.28, 12.66), "LAVO": (3.71, 10.80, 20.81)},
        ours={"softmax": "FlashAttention", "lavo": "LAVO"}),
    "lavo_table11": Table(
        source=f"{LAVO}, Table 11", title="Long Range Arena accuracy", unit="%", setting=_LRA_LAVO_SETTING,
        columns=("text", "listops", "retrieval", "pathfinder", "image", "avg"),
        rows={"vanilla": (61.95, 38.37, 80.69, 65.26, 40.58, 57.37),
              "Kernelized Attention": (60.22, 38.78, 81.77, 70.73, 41.29, 58.56),
              "Nystromformer": (64.83, 38.51, 80.52, 69.48, 41.30, 58.93),
              "Linformer": (58.93, 37.45, 78.19, 60.93, 37.96, 54.69),
              "ProbSparse": (62.64, 32.53, 77.57, 57.83, 38.10, 53.73),
              "Performer": (64.19, 38.02, 80.04, 66.30, 41.43, 58.00),
              "Reformer": (62.93, 37.68, 78.99, 66.49, 48.87, 58.99),
              "BigBird": (63.86, 39.25, 80.28, 68.72, 43.16, 59.05),
              "Skyformer": (64.70, 38.69, 82.06, 70.73, 40.77, 59.39),
              "LAVO": (65.28, 40.57, 80.17, 72.14, 40.55, 59.74)},
        ours={"softmax": "vanilla", "kernelized": "Kernelized Attention", "skyformer": "Skyformer",
              "lavo": "LAVO"}),
    "skyformer_table1": Table(
        source=f"{SKYFORMER}, Table 1", title="Long Range Arena accuracy", unit="%",
        setting=_LRA_SKYFORMER_SETTING, columns=("text", "listops", "retrieval", "pathfinder", "image", "avg"),
        rows={"Self-Attention": (61.95, 38.37, 80.69, 65.26, 40.57, 57.37),
              "Kernelized Attention": (60.22, 38.78, 81.77, 70.73, 41.29, 58.56),
              "Nystromformer": (64.83, 38.51, 80.52, 69.48, 41.30, 58.93),
              "Linformer": (58.93, 37.45, 78.19, 60.93, 37.96, 54.69),
              "Informer": (62.64, 32.53, 77.57, 57.83, 38.10, 53.73),
              "Performer": (64.19, 38.02, 80.04, 66.30, 41.43, 58.00),
              "Reformer": (62.93, 37.68, 78.99, 66.49, 48.87, 58.99),
              "BigBird": (63.86, 39.25, 80.28, 68.72, 43.16, 59.05),
              "Skyformer": (64.70, 38.69, 82.06, 70.73, 40.77, 59.39)},
        ours={"softmax": "Self-Attention", "kernelized": "Kernelized Attention", "skyformer": "Skyformer"}),
    "skyformer_table2_time": Table(
        source=f"{SKYFORMER}, Table 2", title="Long Range Arena training time", unit="h",
        setting=_LRA_SKYFORMER_SETTING, columns=("text", "listops", "retrieval", "pathfinder", "image"),
        rows={"Self-Attention": (4.30, 2.24, 8.33, 2.57, 4.22), "KA": (3.91, 1.99, 7.46, 2.42, 4.05),
              "Nystromformer": (0.71, 0.71, 1.29, 1.49, 2.70), "Linformer": (0.65, 0.60, 1.13, 1.09, 2.19),
              "Informer": (1.60, 1.19, 2.91, 2.39, 3.90), "Performer": (0.77, 0.73, 1.41, 1.40, 2.55),
              "Reformer": (0.94, 0.85, 1.73, 1.70, 3.08), "BigBird": (2.00, 1.88, 3.81, 3.39, 6.53),
              "Skyformer": (1.02, 1.29, 1.86, 2.03, 3.40)},
        ours={"softmax": "Self-Attention", "kernelized": "KA", "skyformer": "Skyformer"}),
    "skyformer_table2_memory": Table(
        source=f"{SKYFORMER}, Table 2", title="Long Range Arena peak memory", unit="GB",
        setting=_LRA_SKYFORMER_SETTING, columns=("text", "listops", "retrieval", "pathfinder", "image"),
        rows={"Self-Attention": (10.37, 5.37, 10.77, 5.74, 11.47), "KA": (5.73, 5.94, 10.46, 6.38, 6.38),
              "Nystromformer": (1.21, 1.37, 2.39, 3.35, 6.71), "Linformer": (0.99, 0.99, 1.89, 1.97, 3.94),
              "Informer": (5.12, 4.85, 5.77, 4.75, 9.51), "Performer": (1.09, 1.09, 2.16, 2.20, 4.39),
              "Reformer": (1.61, 1.61, 2.98, 3.21, 6.42), "BigBird": (2.83, 2.71, 4.97, 4.97, 9.95),
              "Skyformer": (1.59, 1.75, 3.15, 4.13, 8.26)},
        ours={"softmax": "Self-Attention", "kernelized": "KA", "skyformer": "Skyformer"}),
}

# LAVO Table 1, LM (PG-19) column: the training hyper-parameters behind LAVO Table 2.
LAVO_TABLE1_LM = {
    "source": f"{LAVO}, Table 1 (LM column)",
    "batch_size": 16, "steps": 125_000, "warmup_steps": 10_000, "peak_lr": 5e-4, "scheduler": "inverse sqrt",
    "optimizer": "AdamW", "adam_betas": (0.9, 0.999), "clip_norm": 0.0, "attention_dropout": 0.1,
    "weight_decay": 0.01, "tokens_per_batch": 2 ** 17, "attention_heads": 12, "hidden_size": 768,
    "ffn_hidden_size": 3072, "decoder_layers": 12, "local_window": 16, "lavo_num_bases": 64,
}

PG19_TRAIN_CONTEXT = 8192  # LAVO Table 2
PG19_FACTORS = (1, 1.5, 2)


def _row(table: Table, method: str) -> Optional[str]:
    if method in table.ours:
        return table.ours[method]
    return next((label for label in table.rows if label.lower() == str(method).lower()), None)


def figure(table: str, method: str, column) -> Optional[Figure]:
    """The cell of ``TABLES[table]`` for ``method`` (ours or the paper's row label) and ``column``; None if absent."""
    t = TABLES[table]
    row = _row(t, method)
    if row is None or column not in t.columns:
        return None
    value = t.rows[row][t.columns.index(column)]
    if value is None:
        return None
    return Figure(value, t.source, t.setting, row, str(column), t.unit, t.notes.get(row, ""))


def _value(table: str, method: str, column) -> Value:
    cell = figure(table, method, column)
    return None if cell is None else cell.value


def _context(factor) -> Optional[int]:
    context = PG19_TRAIN_CONTEXT * float(factor)
    return int(context) if context.is_integer() else None


def glue(task: str, method: str) -> Value:
    """LLN Table 1: GLUE dev accuracy (%) of ``method`` on ``task`` (mnli, qnli, qqp, sst2, avg)."""
    return _value("lln_table1", method, str(task).lower().replace("-", ""))


def lln_speed(method: str, seq_len: int) -> Value:
    """LLN Table 2: RoBERTa-base training time per iteration (s) at ``seq_len``, batch 1."""
    return _value("lln_table2_time", method, seq_len)


def lln_memory(method: str, seq_len: int) -> Value:
    """LLN Table 2: RoBERTa-base training memory (GB) at ``seq_len``, batch 1."""
    return _value("lln_table2_memory", method, seq_len)


def pg19_ppl(method: str, factor) -> Value:
    """LAVO Table 2: PG-19 perplexity at ``factor`` x the 8192-token training context (1, 1.5, 2)."""
    return _value("lavo_table2_ppl", method, _context(factor))


def pg19_memory_mb(method: str, factor) -> Value:
    """LAVO Table 2: memory (MB) at ``factor`` x 8192 tokens."""
    return _value("lavo_table2_memory", method, _context(factor))


def pg19_speedup(method: str, factor) -> Value:
    """LAVO Table 2: speed-up over vanilla attention at ``factor`` x 8192 tokens."""
    return _value("lavo_table2_speedup", method, _context(factor))


def generation_speedup(method: str, factor) -> Value:
    """LAVO Table 10: token-by-token generation speed-up over vanilla at ``factor`` x 8192 tokens."""
    return _value("lavo_table10", method, _context(factor))


def lra(task: str, method: str, source: str = "lavo") -> Value:
    """Long Range Arena accuracy (%): LAVO Table 11, Skyformer Table 1 or LLN Table 5 (``source``)."""
    table = {"lavo": "lavo_table11", "skyformer": "skyformer_table1", "lln": "lln_table5"}[source]
    return _value(table, method, str(task).lower())
