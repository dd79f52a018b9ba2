"""The plausible one-line bugs that ``python -m linattn_tools.mutation_check`` plants, one at a time.

Each ``Mutant``: an id, the file, an exact snippet of it (occurring exactly once: tests/test_mutation_check.py
checks every snippet against the current code), its replacement, the mistake it stands for, and the test
files that should catch it (run with ``-x``, so a killed mutant costs seconds). ``slow``: the slow-tier test
files for ``--tier both`` (empty: the whole slow tier).
"""
from typing import NamedTuple, Tuple


class Mutant(NamedTuple):
    id: str
    file: str
    original: str
    replacement: str
    description: str
    tests: Tuple[str, ...]
    slow: Tuple[str, ...] = ()


OPS = "linattn/ops/"
MOD = "fairseq_linattn/modules/"
LLN_T = ("tests/test_lln.py", "tests/test_lln_fast_paths.py")
DIAG_T = ("tests/test_lln_diag.py", "tests/test_lln_diag_fast_paths.py")
LAVO_T = ("tests/test_lavo.py", "tests/test_lavo_fast_path.py")
SKY_T = ("tests/test_skyformer.py", "tests/test_skyformer_fast_path.py")
MODULE_T = ("tests/test_modules.py", "tests/test_module_padding.py", "tests/test_module_reference.py")
DECODE_T = ("tests/test_fairseq_decoding.py",)
MM_T = ("tests/test_moment_matching.py",)
FAIRSEQ_SLOW = ("tests/test_fairseq_cli.py", "tests/test_fairseq_workflows.py")

M = Mutant
MUTANTS = [
    # -- shared op helpers --
    M("inputs-scale-f32", OPS + "inputs.py",
      "dtype=torch.float32 if q.dtype != torch.float64 else torch.float64", "dtype=torch.float32",
      "alpha, beta always float32: float64 runs lose their precision", LLN_T),
    M("masking-causal-diagonal", OPS + "masking.py", "(j[None, :] <= index[:, None])", "(j[None, :] < index[:, None])",
      "a causal query row does not see its own key (off by one)", ("tests/test_softmax.py",) + LLN_T),
    M("masking-keyless-guard", OPS + "masking.py", "e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)",
      "e.sum(-1, keepdim=True)", "a row with no allowed key divides 0 by 0 (NaN, not 0)",
      ("tests/test_softmax.py", "tests/test_attention_rows.py") + LLN_T),
    M("precision-autocast-on", OPS + "precision.py", "enabled=False", "enabled=True",
      "autocast left on inside the ops (half matmuls on upcast inputs)", ("tests/test_autocast.py",)),
    M("windows-count-floor", OPS + "windows.py", "nw = -(-n // w)", "nw = n // w",
      "the last, partial window is dropped (floor instead of ceiling)", LAVO_T + DIAG_T),
    M("windows-no-fill", OPS + "windows.py", "    body[:, m:] = fill\n", "",
      "rows past N of a copied group are left uninitialised (no fill)", LAVO_T + DIAG_T),
    # -- moment matching formulas --
    M("mm-prop41-factor2", OPS + "moment_matching.py", "s2 = (sq ** 2 * sk ** 2 - b) / (2 * a)",
      "s2 = (sq ** 2 * sk ** 2 - b) / a", "Prop. 4.1's 2a written as a", MM_T + ("tests/test_modules.py",)),
    M("mm-sigma-swapped", OPS + "moment_matching.py", "(s / sigma_q).clamp_max(max_scale), (s / sigma_k)",
      "(s / sigma_k).clamp_max(max_scale), (s / sigma_q)", "alpha divided by sigma_k, beta by sigma_q", MM_T),
    M("mm-fit-abscissa", OPS + "moment_matching.py", "x = 2 * var_in  # sigma_q~² + sigma_k~²", "x = var_in",
      "the fit's abscissa is one side's variance, not the sum of both", MM_T),
    M("mm-exact-inverse-axes", OPS + "moment_matching.py", "self._interp(target.log(), log_var, log_s2)",
      "self._interp(target.log(), log_s2, log_var)", "the exact table is read forwards where it must be inverted",
      MM_T),
    # -- softmax --
    M("softmax-ref-scale", OPS + "softmax/reference.py", "k.transpose(-1, -2) / math.sqrt(q.shape[-1])",
      "k.transpose(-1, -2)", "the reference's 1/sqrt(D) dropped", ("tests/test_softmax.py",) + MODULE_T),
    M("softmax-sdpa-zero-fill", OPS + "softmax/sdpa.py",
      "return out if has_key is None else out.masked_fill(~has_key, 0.0)", "return out",
      "queries with no allowed key are not zero-filled", ("tests/test_softmax.py",) + MODULE_T),
    M("softmax-causal-alignment", OPS + "softmax/masks.py", ".tril(s - n)", ".tril(n - s)",
      "causal mask aligned top-left instead of bottom-right when S != N", ("tests/test_softmax.py",) + DECODE_T),
    # -- block softmax (LLN+Diag's diagonal part) --
    M("block-ref-scale", OPS + "block_softmax/reference.py", "k.to(ct).transpose(-1, -2) / math.sqrt(q.shape[-1])",
      "k.to(ct).transpose(-1, -2)", "the block reference's 1/sqrt(D) dropped", DIAG_T),
    M("block-size-clamp", OPS + "block_softmax/autograd.py", "bs = min(block_size, n)", "bs = min(block_size, n - 1)",
      "block size clamped one short of N", DIAG_T + ("tests/test_autocast.py",)),
    M("block-looped-scale", OPS + "block_softmax/looped.py", "self.scale = 1 / math.sqrt(d)", "self.scale = 1.0",
      "the fast block softmax's 1/sqrt(D) dropped", DIAG_T),
    M("block-looped-causal-leak", OPS + "block_softmax/looped.py", ".tril()", ".tril(1)",
      "causal blocks let a query see the next token", DIAG_T),
    # -- kernelized --
    M("kernel-ref-half", OPS + "kernelized/reference.py", "torch.exp(-0.5 * (diff * diff).sum(-1))",
      "torch.exp(-(diff * diff).sum(-1))", "Gaussian kernel exp(-|d|²) instead of exp(-|d|²/2)", SKY_T),
    M("kernel-scale-power", OPS + "kernelized/kernel.py", "return q.shape[-1] ** -0.25", "return q.shape[-1] ** -0.5",
      "q, k scaled by D^-1/2 each (scores /D, not /sqrt(D))", SKY_T + ("tests/test_attention_rows.py",)),
    M("kernel-rows-unmasked", OPS + "kernelized/kernel.py",
      "c = c.masked_fill(key_padding_mask[:, None, None, :], 0.0)", "c = c",
      "kernel rows computed without the padding mask", ("tests/test_kernel_rows_masked.py",) + SKY_T),
    M("kernel-chunked-dtype", OPS + "kernelized/chunked.py", "return torch.cat(out, dim=2).to(q.dtype)",
      "return torch.cat(out, dim=2)", "half inputs get a float32 output back", SKY_T + ("tests/test_autocast.py",)),
    M("kernel-sdpa-sink-masked", OPS + "kernelized/parallel.py", "key_padding_mask.new_ones(b, 1)",
      "key_padding_mask.new_zeros(b, 1)", "the parallel form's sink key masked with the padding", SKY_T),
    M("kernel-sdpa-norm-grad-sign", OPS + "kernelized/parallel.py", "value=-1 if ctx.key else 1)",
      "value=1 if ctx.key else -1)", "the norm columns' gradient reaches q and k with swapped signs", SKY_T),
    # -- skyformer --
    M("sky-ref-keys-unzeroed", OPS + "skyformer/reference.py",
      "used4, 0, q.shape[2], True, inplace=False)", "used4, 0, q.shape[2], inplace=False)",
      "the reference's kernel rows of padded keys are not zeroed", SKY_T + ("tests/test_attention_rows.py",)),
    M("sky-backward-scale", OPS + "skyformer/autograd.py", "torch.mul(dqs, scale, out=dq[:, :, r0:r1])",
      "dq[:, :, r0:r1] = dqs", "dq misses the chain rule's D^-1/4", SKY_T),
    M("sky-no-ridge", OPS + "skyformer/nystrom.py", "* keep + gamma * eye", "* keep",
      "the ridge gamma I left out of kappa(L, L)", SKY_T),
    M("sky-newton-constant", OPS + "skyformer/inverse.py", "torch.baddbmm(i13, p, r2, alpha=-0.25)",
      "torch.baddbmm(i13, p, r2, alpha=-0.5)", "Newton-Schulz step's 1/4 written as 1/2", SKY_T),
    M("sky-newton-backward-sign", OPS + "skyformer/inverse.py", "gz = torch.baddbmm(gz, a.mT, w, alpha=-0.25)",
      "gz = torch.baddbmm(gz, a.mT, w, alpha=0.25)", "the iteration's backward through P = A Z with the wrong sign",
      SKY_T),
    M("sky-parallel-padded-rows", OPS + "skyformer/parallel.py",
      "return xs if pad2 is None else xs.masked_fill_(pad2[:, None, :, None], 0.0)", "return xs",
      "the parallel form's padded rows of [Q; K] reach the kernel (inf keys poison it)", SKY_T),
    M("sky-parallel-landmark-grad", OPS + "skyformer/parallel.py", "dv.to(v.dtype), dland, t @ du.mT",
      "dv.to(v.dtype), None, t @ du.mT", "the parallel form drops the landmarks' gradient through C_Q, C_K", SKY_T),
    # -- LLN --
    M("lln-ref-key-shift", OPS + "lln/reference.py", ".log() + key_shift.transpose(-1, -2)", ".log()",
      "the reference's key shift is not added back in log space", LLN_T + ("tests/test_attention_rows.py",)),
    M("lln-divide-guard", OPS + "lln/features.py", "o[..., -1:].clamp_min(_TINY)", "o[..., -1:]",
      "decoding divides by a zero denominator when no key is visible", LLN_T + DECODE_T),
    M("lln-decode-no-rescale", OPS + "lln/decode.py", "s = s * decay.transpose(-1, -2) +", "s = s +",
      "decoding state not rescaled when the running key shift grows", LLN_T + DECODE_T),
    M("lln-learnt-alpha-beta-swap", OPS + "lln/autograd.py", "alpha * q_, beta * k_,", "beta * q_, alpha * k_,",
      "learnt scales: alpha and beta swapped", ("tests/test_learnt_scales.py",) + LLN_T),
    M("lln-output-grad-sign", OPS + "lln/looped.py", "out=buf[..., -1]).neg_()", "out=buf[..., -1])",
      "the denominator's gradient has the wrong sign", LLN_T),
    M("lln-chunk-shift-mask", OPS + "lln/looped.py",
      "(g1 - g0) * c, d), k, beta, mask, g0 * c, c)", "(g1 - g0) * c, d), k, beta, None, g0 * c, c)",
      "causal chunk shifts ignore the padding mask", ("tests/test_causal_padding.py",) + LLN_T),
    M("lln-intra-chunk-future", OPS + "lln/looped.py", ".triu(1)", ".triu(2)",
      "inside a chunk a query sees the next key (future token)", LLN_T),
    M("lln-backward-dz-dropped", OPS + "lln/looped.py",
      "ds[..., -1] += _rows_weighted_sum(fq, go[..., -1].contiguous())",
      "ds[..., -1] += 0", "non-causal backward drops the denominator's term of dL/dz", LLN_T),
    # -- LLN+Diag --
    M("diag-average-mix", OPS + "lln_diag/autograd.py", "blocks_forward_(q, k, v, valid, bs, causal, out, 0.5)",
      "blocks_forward_(q, k, v, valid, bs, causal, out, 1.0)", "the average adds the diagonal part with weight 1",
      DIAG_T),
    M("diag-backward-mix", OPS + "lln_diag/autograd.py", "ctx.c, None, grad, 0.5, dq", "ctx.c, None, grad, 1, dq",
      "causal backward: LLN's half of the gradient taken whole", DIAG_T),
    M("diag-ratio-swapped", OPS + "lln_diag/mixing.py", "return r4 * lln_out + (1 - r4) * diag_out",
      "return (1 - r4) * lln_out + r4 * diag_out", "learnable_ratio weighs the parts the wrong way round",
      DIAG_T + ("tests/test_attention_rows.py",)),
    M("diag-ref-weights", OPS + "lln_diag/reference.py", "return 0.5 * lln + 0.5 * diag", "return lln + 0.5 * diag",
      "the rows' average takes LLN whole", DIAG_T + ("tests/test_attention_rows.py",)),
    # -- LAVO --
    M("lavo-bases-bound", OPS + "lavo/inputs.py", "if num_bases > head_dim:", "if num_bases >= head_dim:",
      "r = D bases refused (off by one)", LAVO_T + MODULE_T),
    M("lavo-memory-scale", OPS + "lavo/memory.py", "torch.softmax(qb * (mean * scale), -1)",
      "torch.softmax(qb * mean, -1)", "the memory softmax's 1/sqrt(D) dropped", LAVO_T),
    M("lavo-memory-grad-window", OPS + "lavo/memory.py",
      "dws = F.pad(dmem.flip(2).cumsum(2).flip(2), (0, 0, 0, 1))[:, :, 1:]",
      "dws = dmem.flip(2).cumsum(2).flip(2)", "causal memory backward: a window's own gradient included",
      LAVO_T),
    M("lavo-cross-mean-padding", OPS + "lavo/cross.py", "bv.sum(2) / cnt.clamp_min(1)[:, None, None]",
      "bv.mean(2)", "the cross memory averages over padded source tokens too", LAVO_T + DECODE_T),
    M("lavo-decode-window-end", OPS + "lavo/decode.py", "ends = (pos + 1) % w == 0", "ends = pos % w == 0",
      "decoding closes a window one token early", LAVO_T + DECODE_T),
    M("lavo-band-future", OPS + "lavo/looped.py", "band = (rel <= 0) & (rel > -w)", "band = (rel <= 1) & (rel > -w)",
      "causal local band lets a query see the next token", LAVO_T),
    M("lavo-ref-window", OPS + "lavo/reference.py", "local = (j <= t) & (j > t - w)", "local = (j <= t) & (j >= t - w)",
      "the reference's causal window holds w + 1 keys", LAVO_T),
    M("lavo-global-half", OPS + "lavo/autograd.py", "pm.mul_(m * 0.5)", "pm.mul_(m * 1.0)",
      "the global part is added whole, not halved", LAVO_T),
    M("lavo-backward-half", OPS + "lavo/autograd.py", ".view_as(qb).mul_(0.5)", ".view_as(qb)",
      "backward of the global part misses its 0.5", LAVO_T),
    M("lavo-tail-unmasked", OPS + "lavo/autograd.py",
      "masked = key_padding_mask is not None or (pad > 0 and not causal)", "masked = key_padding_mask is not None",
      "non-causal: the rows past N of the last window are not masked",
      LAVO_T),
    # -- the attention modules --
    M("base-beam-reorder", MOD + "base.py", "(t.index_select(0, new_order) if t is not None else None)",
      "(t if t is not None else None)", "decoding state not reordered for beams", DECODE_T + MODULE_T),
    M("base-upgrade-prefix", MOD + "base.py", 'prefix = name + "." if name else ""', "prefix = name",
      "checkpoint upgrade's key prefix misses its dot", ("tests/test_checkpoint_upgrade.py",) + MODULE_T, FAIRSEQ_SLOW),
    M("base-head-merge", MOD + "base.py", "out.permute(2, 0, 1, 3).reshape(", "out.permute(2, 1, 0, 3).reshape(",
      "heads merged back in (H, B) order instead of (B, H)", MODULE_T),
    M("padding-not-put-back", MOD + "padding.py", "return _tokens(out, order.argsort(1))", "return out",
      "left-padded outputs left in real-first order", MODULE_T),
    M("padding-rows-columns", MOD + "padding.py", "p = _tokens(_tokens(p, back, 2), back, 3)",
      "p = _tokens(p, back, 2)", "attention rows: columns not put back in token order",
      ("tests/test_attention_rows.py",) + MODULE_T),
    M("softmax-step-mask", MOD + "softmax.py", "key_padding_mask=mask if mask.any() else None",
      "key_padding_mask=None", "softmax decoding ignores the padded prefix", MODULE_T + DECODE_T),
    M("lln-stats-roles", MOD + "lln.py", 'stats=("ema" if self.causal else "batch")',
      'stats=("batch" if self.causal else "ema")', "decoders take batch statistics (future tokens), encoders EMA",
      MODULE_T + DECODE_T),
    M("lln-module-alpha-beta", MOD + "lln.py", 'for name in ("alpha", "beta")]', 'for name in ("beta", "alpha")]',
      "the module's reference and rows get alpha and beta swapped", MODULE_T + ("tests/test_attention_rows.py",)),
    M("diag-step-block", MOD + "lln_diag.py", "key_padding_mask=bpad | (bid != block))", "key_padding_mask=bpad)",
      "decoding's diagonal part reads keys of earlier blocks", MODULE_T + DECODE_T),
    M("diag-module-causal", MOD + "lln_diag.py", "(q, k, v, block_size=self.block_size, causal=self.causal",
      "(q, k, v, block_size=self.block_size, causal=False", "the decoder's diagonal part is not causal",
      MODULE_T + DECODE_T),
    M("kernelized-module-mask", MOD + "kernelized.py",
      "ops.kernelized_attention(q, k, v, key_padding_mask=key_padding_mask,",
      "ops.kernelized_attention(q, k, v, key_padding_mask=None,", "the module drops the padding mask", MODULE_T),
    M("skyformer-eval-landmarks", MOD + "skyformer.py", "training=self.training,", "training=True,",
      "eval draws random landmarks (eval not deterministic)", MODULE_T),
    M("lavo-module-causal", MOD + "lavo.py", "self.bases, self.pos_bias, window=self.window, causal=self.causal",
      "self.bases, self.pos_bias, window=self.window, causal=True", "encoder LAVO made causal (the op's default)",
      MODULE_T),
    M("build-cross-dropped", MOD + "build.py", "causal=causal, cross=cross,", "causal=causal, cross=False,",
      "cross-attention built as self-attention", MODULE_T + DECODE_T),
    M("layers-decoder-not-causal", MOD + "layers.py", "cfg.decoder.attention_heads, causal=True,",
      "cfg.decoder.attention_heads, causal=False,", "decoder self-attention built non-causal",
      DECODE_T + ("tests/test_options.py",), FAIRSEQ_SLOW),
    M("matcher-ema-momentum", MOD + "moment_matcher.py", "m * old + (1 - m) * batch", "(1 - m) * old + m * batch",
      "EMA momentum applied to the batch instead of the history", MM_T),
    M("matcher-empty-fold", MOD + "moment_matcher.py", "torch.isfinite(batch_k) & (count > 0)",
      "torch.isfinite(batch_k)", "an empty batch (no token) is folded into the EMA",
      MM_T + ("tests/test_cpu_ddp.py",), ("tests/test_cpu_ddp.py",)),
    M("matcher-padding-counted", MOD + "moment_matcher.py", "xw = x if keep is None else x * keep", "xw = x",
      "padded tokens enter the sums of the statistics", MM_T + ("tests/test_module_padding.py",)),
    M("matcher-tau", MOD + "moment_matcher.py", "var_lln.clamp_min(1e-12).rsqrt()", "var_lln.clamp_min(1e-12).sqrt()",
      "tau_lln = sqrt(var) instead of 1/sqrt(var) (eq. 11)", MM_T + ("tests/test_training_stats.py",)),
    # -- models, options, logging, fairseq fixes --
    M("lm-positions", "fairseq_linattn/models/linattn_lm.py", "args.no_token_positional_embeddings = True",
      "args.no_token_positional_embeddings = False", "LAVO-only LMs keep absolute positions (LAVO §4.1: none)",
      DECODE_T + ("tests/test_options.py",), FAIRSEQ_SLOW),
    M("transformer-stock-encoder", "fairseq_linattn/models/linattn_transformer.py",
      "return LinAttnTransformerEncoder(args, src_dict, embed_tokens)",
      "return super().build_encoder(args, src_dict, embed_tokens)",
      "encoder-decoder models keep fairseq's softmax encoder whatever --encoder-attention-type says", DECODE_T,
      FAIRSEQ_SLOW),
    M("on-build-skipped", "fairseq_linattn/models/on_build.py", "for fn in ON_BUILD:", "for fn in ON_BUILD[:0]:",
      "the build hooks (statistics recorder) never run", ("tests/test_training_stats.py",), FAIRSEQ_SLOW),
    M("options-layer-counts", "fairseq_linattn/options.py",
      "config.validate(encoder_layers=encoder_layers, decoder_layers=decoder_layers)", "config.validate()",
      "per-layer attention types not checked against the layer counts", ("tests/test_options.py",), FAIRSEQ_SLOW),
    M("logs-not-averaged", "fairseq_linattn/training_logs.py", "float(total) / count, weight=count",
      "float(total), weight=count", "logged statistics are sums over workers, not means",
      ("tests/test_training_logs.py", "tests/test_training_stats.py"), FAIRSEQ_SLOW),
    M("fixes-weights-only", "fairseq_linattn/fairseq_fixes.py", 'kwargs.setdefault("weights_only", False)',
      'kwargs.setdefault("weights_only", True)', "the checkpoint fix keeps torch's weights_only=True",
      ("tests/test_fairseq_fixes.py",), FAIRSEQ_SLOW),
]
