"""Skyformer Fig. 1 (§4.5) as the paper ran it, within what this machine has (no model hub).

The paper embeds WikiText-2 text with ``bert-base-cased``, applies one attention layer's W_Q, W_K,
W_V, either freshly initialised or pretrained, and compares the spectral norm of the difference
between softmax self-attention's output and each approximation's, for d = 2^4 ... 2^8 features and
several sequence lengths. Here (``fig1_approximations`` holds the approximations):

- text: the shipped WikiText-format sample ``data/wikitext_kjv/wiki.train.raw``, tokenised with the
  quick-start's SentencePiece model and dictionary (``data-bin/samples/wikitext/spm``, made by
  ``python -m linattn_tools.recipes.prepare_samples``); each seed takes a window of N tokens at
  another offset;
- encoders ("arms"):
  ``initialised``: BERT-base's embedding and first attention layer's shapes (768 wide, 12 heads of 64,
  learned positions extended to N) with BERT's initialisation (normal, std 0.02; LayerNorm 1, 0;
  biases 0), built here, over our tokenizer's vocabulary instead of bert-base-cased's;
  ``initialised_tiny``: the same initialisation at the quick-start RoBERTa's shapes (64 wide, 2 heads
  of 32), the untrained twin of the next two;
  ``trained_<U>``: the first layer of a softmax ``linattn_roberta_tiny`` we pretrained for U updates
  on the KJV sample (U = 600 is the quick-start's pretraining; its positions, 128 learned, are
  repeated beyond 128 tokens);
- X = LayerNorm(token + position embeddings), Q, K, V = X W^T + b split into heads (fairseq's
  q_proj output, before its 1/sqrt(p) scaling); the target is softmax(Q K^T / sqrt(p)) V per head;
- the error of one head is ||Y_approx - Y||_2 / ||Y||_2 (relative, so that lengths and arms compare);
  the record keeps it averaged over heads, per seed. ``skyformer_op_vs_kernelized`` measures our op
  against its own target, exact kernelized attention (Skyformer §4.1), on the same q, k, v.
"""
import math
import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from linattn.ops import kernelized_attention, skyformer_attention

from . import fig1_approximations as fa
from .common import ROOT, torch_threads

RUN_DIR = ROOT / "runs" / "reproduction" / "skyformer_fig1"
SAMPLE_DATA = ROOT / "data-bin" / "samples"
TEXT = "data/wikitext_kjv/wiki.train.raw"
PLOT = ROOT / "docs" / "reproduction" / "skyformer_fig1.png"
METHODS = ("skyformer", "skyformer_op", "performer", "nystromformer", "linformer", "skyformer_op_vs_kernelized")
TITLES = {"skyformer": "Skyformer (Fig. 1 caption: Eq. (5) on A, then D)",
          "skyformer_op": "our skyformer_attention op (Gaussian kernel)",
          "performer": "Performer (positive orthogonal random features)",
          "nystromformer": "Nyströmformer (segment-mean landmarks, 6 iterations of its Eq. (15))",
          "linformer": "Linformer-style random projection",
          "skyformer_op_vs_kernelized": "our skyformer_attention op against its own target, kernelized attention"}
BERT = {"width": 768, "heads": 12, "std": 0.02, "ln_eps": 1e-12}
TINY = {"width": 64, "heads": 2, "std": 0.02, "ln_eps": 1e-5}

DEFAULTS = {"seq_lens": (512, 1024, 2048, 4096), "features": (16, 32, 64, 128, 256), "seeds": 3,
            "arms": ("initialised", "initialised_tiny", "trained_600", "trained_6000"),
            "methods": METHODS, "text": TEXT, "threads": 1}
QUICK = {"seq_lens": (64, 128), "features": (8, 32), "seeds": 1, "arms": ("initialised_tiny",),
         "methods": METHODS, "text": TEXT, "threads": 1}


def checkpoint_path(updates: int, run_dir: Path = RUN_DIR) -> Path:
    return Path(run_dir) / f"encoder_{updates}" / "checkpoint_last.pt"


def train_encoder(updates: int, run_dir: Path = RUN_DIR, seed: int = 1) -> Path:
    """Pretrain a softmax linattn_roberta_tiny for ``updates`` on the KJV sample, as the quick-start's
    pretraining step does (its schedule: warm-up a tenth, polynomial decay to ``updates``)."""
    out = Path(run_dir) / f"encoder_{updates}"
    env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "SAMPLE": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    cmd = ["bash", str(ROOT / "scripts" / "pretrain_wikitext103.sh"), "softmax", "--max-update", str(updates),
           "--warmup-updates", str(updates // 10 + 1), "--seed", str(seed), "--total-num-update", str(updates)]
    print(f"[skyformer_fig1] OUT={out} " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return checkpoint_path(updates, run_dir)


def _spm_dir() -> Path:
    spm = SAMPLE_DATA / "wikitext" / "spm"
    if not (spm / "spm.model").is_file():
        subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "linattn_tools.recipes.prepare_samples",
                        "--out", str(SAMPLE_DATA)], check=True, cwd=ROOT)
    return spm


def token_ids(text: str = TEXT, max_tokens: Optional[int] = None) -> torch.Tensor:
    """The text's token ids in the quick-start's dictionary, line after line, each line ended by </s>."""
    import sentencepiece
    from fairseq.data import Dictionary

    spm = _spm_dir()
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm / "spm.model"))
    vocab = Dictionary.load(str(spm / "dict.txt"))
    ids: List[int] = []
    for line in (ROOT / text).read_text().splitlines():
        if line.strip():
            ids += [vocab.index(piece) for piece in sp.encode(line.strip(), out_type=str)] + [vocab.eos()]
            if max_tokens and len(ids) >= max_tokens:
                break
    return torch.tensor(ids)


class Encoder:
    """Embedding, LayerNorm and one attention layer's q/k/v projections (float64), as tensors."""

    def __init__(self, tokens, positions, ln, qkv, heads, position_offset=0, position_period=None):
        self.tokens, self.positions, self.ln, self.qkv = tokens, positions, ln, qkv
        self.heads, self.position_offset, self.position_period = heads, position_offset, position_period

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def qkv_heads(self, ids: torch.Tensor):
        """q, k, v (1, H, N, width / H) of the token ids (N,)."""
        n = ids.shape[0]
        pos = torch.arange(n)
        if self.position_period:
            pos = pos % self.position_period
        x = self.tokens[ids] + self.positions[pos + self.position_offset]
        x = torch.nn.functional.layer_norm(x, (self.width,), self.ln[0], self.ln[1], self.ln[2])
        out = []
        for w, b in self.qkv:
            y = x @ w.T + b
            out.append(y.reshape(n, self.heads, -1).transpose(0, 1).unsqueeze(0).contiguous())
        return tuple(out)


def initialised_encoder(shape: Dict, vocab: int, max_len: int, seed: int) -> Encoder:
    """BERT's initialisation (normal std, LayerNorm weight 1 and bias 0, linear biases 0) at ``shape``;
    the token-type embedding (one type) is folded into the position table (a constant row added)."""
    gen = torch.Generator().manual_seed(seed)
    width, std = shape["width"], shape["std"]
    draw = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * std
    tokens, positions, token_type = draw(vocab, width), draw(max_len, width), draw(1, width)
    ln = (torch.ones(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64), shape["ln_eps"])
    qkv = [(draw(width, width), torch.zeros(width, dtype=torch.float64)) for _ in range(3)]
    return Encoder(tokens, positions + token_type, ln, qkv, shape["heads"])


def trained_encoder(path: Path) -> Encoder:
    """The embedding and first layer of a fairseq linattn_roberta checkpoint (learned positions from
    index padding_idx + 1 = 2, repeated beyond max_positions)."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    sd = {k: v.double() for k, v in ck["model"].items() if v.is_floating_point()}
    pre = "encoder.sentence_encoder."
    heads = ck["cfg"]["model"].encoder_attention_heads
    ln = (sd[pre + "layernorm_embedding.weight"], sd[pre + "layernorm_embedding.bias"], 1e-5)
    qkv = [(sd[f"{pre}layers.0.self_attn.{n}_proj.weight"], sd[f"{pre}layers.0.self_attn.{n}_proj.bias"])
           for n in "qkv"]
    positions = sd[pre + "embed_positions.weight"]
    return Encoder(sd[pre + "embed_tokens.weight"], positions, ln, qkv, heads, position_offset=2,
                   position_period=positions.shape[0] - 2)


def build_encoder(arm: str, vocab: int, max_len: int, run_dir: Path = RUN_DIR) -> Encoder:
    if arm == "initialised":
        return initialised_encoder(BERT, vocab, max_len, seed=0)
    if arm == "initialised_tiny":
        return initialised_encoder(TINY, vocab, max_len, seed=0)
    if arm.startswith("trained_"):
        updates = int(arm.split("_", 1)[1])
        path = checkpoint_path(updates, run_dir)
        if not path.is_file():
            train_encoder(updates, run_dir)
        return trained_encoder(path)
    raise ValueError(f"unknown arm {arm!r}")


def _per_head(fn):
    """Apply a (N, p) -> (N, Dv) approximation head by head (its random draws differ between heads)."""
    return lambda q, k, v, d, gen: torch.stack([fn(q[:, h], k[:, h], v[:, h], d, gen) for h in range(q.shape[1])], 1)


def _our_op(q, k, v, d, gen):
    return skyformer_attention(q, k, v, num_landmarks=d, training=True, generator=gen)


# the experiment's approximations (fig1_approximations), not the registry's attention methods
APPROXIMATIONS = {
    "skyformer": _per_head(fa.skyformer_caption_output),
    "skyformer_op": _our_op,
    "performer": _per_head(fa.performer_output),
    "nystromformer": lambda q, k, v, d, gen: fa.nystromformer_output(q, k, v, d),
    "linformer": _per_head(fa.linformer_output),
    "skyformer_op_vs_kernelized": _our_op,
}


def approximate(method: str, q, k, v, d: int, gen: torch.Generator) -> torch.Tensor:
    """``method``'s approximation of softmax attention (B, H, N, Dv) with d features."""
    if method not in APPROXIMATIONS:
        raise ValueError(f"unknown method {method!r}")
    return APPROXIMATIONS[method](q, k, v, d, gen)


def _attention_stats(q, k) -> Dict[str, float]:
    """Spread of the scaled scores and the softmax rows' entropy over ln N (1: uniform attention)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logp = torch.log_softmax(scores, -1)
    entropy = -(logp.exp() * logp).sum(-1).mean().item()
    return {"score_std": scores.std(dim=-1).mean().item(), "entropy_over_ln_n": entropy / math.log(q.shape[2])}


def measure(*, seq_lens: Sequence[int], features: Sequence[int], seeds: int, arms: Sequence[str],
            methods: Sequence[str], text: str, threads: int, run_dir: Path = RUN_DIR,
            plot: Optional[Path] = PLOT) -> Dict:
    """{"arms": {arm: {"width", "heads", "stats": {N: {...}}, "errors": {method: {N: {d: [per seed]}}}}},
    "tokens": tokens of text read}; the plot written to ``plot``."""
    with torch_threads(threads):
        res = _measure(seq_lens, features, seeds, arms, methods, text, Path(run_dir))
    if plot:
        write_plot(res, Path(plot))
    return res


@torch.no_grad()
def _measure(seq_lens, features, seeds, arms, methods, text, run_dir) -> Dict:
    n_max = max(seq_lens)
    ids = token_ids(text)
    if len(ids) < n_max * 2:
        raise ValueError(f"{text} has {len(ids)} tokens, fewer than twice the longest N = {n_max}")
    vocab = int(ids.max()) + 1
    out = {"tokens": len(ids), "arms": {}}
    for arm in arms:
        enc = build_encoder(arm, max(vocab, 2002), n_max, run_dir)
        rec = {"width": enc.width, "heads": enc.heads, "stats": {},
               "errors": {m: {} for m in methods}}
        for n in seq_lens:
            stats: List[Dict[str, float]] = []
            errs = {m: {d: [] for d in features} for m in methods}
            for seed in range(seeds):
                gen = torch.Generator().manual_seed(1000 * seed + n)
                start = int(torch.randint(0, len(ids) - n + 1, (1,), generator=gen))
                q, k, v = enc.qkv_heads(ids[start:start + n])
                exact = fa.softmax_output(q, k, v)
                kernelized = kernelized_attention(q, k, v) if "skyformer_op_vs_kernelized" in methods else None
                stats.append(_attention_stats(q, k))
                for m in methods:
                    for d in features:
                        target = kernelized if m == "skyformer_op_vs_kernelized" else exact
                        approx = approximate(m, q, k, v, d, gen)
                        errs[m][d].append((fa.spectral_error(approx, target)
                                           / torch.linalg.matrix_norm(target, ord=2)).mean().item())
            rec["stats"][str(n)] = {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}
            for m in methods:
                rec["errors"][m][str(n)] = {str(d): e for d, e in errs[m].items()}
            mean = lambda xs: sum(xs) / len(xs)
            print(f"[skyformer_fig1] {arm} N={n} " + "; ".join(
                f"{m}: " + " ".join(f"{mean(errs[m][d]):.3f}" for d in features) for m in methods), flush=True)
        out["arms"][arm] = rec
    return out


def write_plot(res: Dict, path: Path) -> None:
    """One panel per arm and N: mean relative spectral error against d, one line per method."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(res["arms"])
    ns = sorted({int(n) for a in arms for per_n in res["arms"][a]["errors"].values() for n in per_n})
    fig, axes = plt.subplots(len(arms), len(ns), figsize=(3.2 * len(ns), 2.6 * len(arms)), squeeze=False,
                             sharey="row")
    for i, arm in enumerate(arms):
        rec = res["arms"][arm]
        for j, n in enumerate(ns):
            ax = axes[i][j]
            for m, per_n in rec["errors"].items():
                row = per_n[str(n)]
                ds = sorted(int(d) for d in row)
                ax.plot(ds, [sum(row[str(d)]) / len(row[str(d)]) for d in ds], marker="o", ms=3,
                        label=TITLES.get(m, m), ls="--" if m.startswith("skyformer_op") else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{arm} ({rec['width']}-d, {rec['heads']} heads), N={n}", fontsize=8)
            if i == len(arms) - 1:
                ax.set_xlabel("d (features)")
            if j == 0:
                ax.set_ylabel("‖ΔY‖₂ / ‖Y‖₂")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7)
    fig.suptitle("Skyformer Fig. 1 here: ‖Y_approx − Y_softmax‖₂ / ‖Y_softmax‖₂ (mean over heads and seeds)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"[skyformer_fig1] wrote {path}", flush=True)
