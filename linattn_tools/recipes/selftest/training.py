"""The ``train``, ``finetune`` and ``eval_lm`` stages: the sample recipes (``DEVICE=gpu SAMPLE=1``, ``--fp16``; on
the CPU ``DEVICE=cpu`` in fp32, which the rows say) judged from this run's own TensorBoard events and logs.

An attention "spec" is what a recipe's ATTN argument takes: one method, or (``--quick``) a comma list with one
method per layer, so that one tiny model trains every method at once.
"""
import math
from pathlib import Path
from typing import Dict, List, Optional

from .. import config as recipe_config
from .. import report
from .core import ROOT, Settings, Stage, child_env, run_logged, tail

FINETUNE_TASK = "kjv_testament"  # the SST-2-shaped sample (data/README.md)
STAT_TAGS = ("lln_sigma_q", "lln_sigma_k", "lln_alpha", "lln_beta")


def specs(settings: Settings) -> Dict[str, List[str]]:
    """{"encoder": [spec, ...], "lm": [...]}: each method alone, or with ``quick`` all of a role in one model."""
    from linattn.methods import methods_for

    encoders, decoders = methods_for("encoder"), methods_for("decoder")
    if settings.quick:
        return {"encoder": [",".join(encoders)], "lm": [",".join(decoders)]}
    return {"encoder": encoders, "lm": decoders}


def layer_args(kind: str, spec: str) -> List[str]:
    """A per-layer list needs as many layers as it names."""
    n = len(spec.split(","))
    if n == 1:
        return []
    return ["--encoder-layers" if kind == "encoder" else "--decoder-layers", str(n)]


def read_scalars(tb_dir: Path, tag: str) -> List[tuple]:
    """[(step, value)] of a TensorBoard scalar in every event file under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for events in sorted({p.parent for p in Path(tb_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            points += [(e.step, e.value) for e in acc.Scalars(tag)]
    return sorted(points)


def recipe(settings: Settings, script: str, args: List[str], out: Path, **env: str) -> int:
    """One recipe script into ``out`` (TensorBoard in ``out/tb``), its output in ``out/selftest.log``."""
    fp16 = "1" if settings.cuda else "0"
    extra = dict(DEVICE="gpu" if settings.cuda else "cpu", SAMPLE="1", FP16=fp16, GPUS_PER_NODE="1", NNODES="1",
                 OUT=str(out), TB=str(out / "tb"), SAMPLE_DATA=str(settings.samples), **env)
    if not settings.cuda:
        extra.setdefault("OMP_NUM_THREADS", "1")  # tiny models: one thread per run is fastest
    return run_logged(["bash", ROOT / "scripts" / script, *args], out / "selftest.log", child_env(**extra))


def judge_run(stage: Stage, name: str, out: Path, settings: Settings, updates: int, warmup: int,
              loss_must_fall: bool = True) -> None:
    """Loss (falls), loss scale after warm-up (>= the floor; fp16 runs only) and moment statistics (finite), read
    from ``out/tb/train_inner`` and ``out/checkpoint_last.pt``."""
    losses = [v for _, v in read_scalars(out / "tb" / "train_inner", "loss")]
    if len(losses) != updates or not all(math.isfinite(v) for v in losses):
        stage.judge(f"{name} loss", False, f"{len(losses)} updates logged", f"{updates} finite losses",
                    str(out / "tb"))
        return
    first, end = losses[0], sum(losses[-3:]) / len(losses[-3:])
    if loss_must_fall:
        stage.judge(f"{name} loss falls", end < first, f"{first:.3f} -> {end:.3f}",
                    "mean of the last 3 updates < first update")
    else:
        stage.add(f"{name} loss", "INFO", f"{first:.3f} -> {end:.3f}", "finite", "too few updates to require a fall")
    scales = [(s, v) for s, v in read_scalars(out / "tb" / "train_inner", "loss_scale")]
    if not settings.cuda:
        stage.add(f"{name} loss scale", "SKIP", detail="--fp16 needs CUDA: the CPU run trains in fp32 (no scaler)")
    else:
        after = [v for s, v in scales if s > warmup]
        low = min(after) if after else None
        stage.judge(f"{name} loss scale after warm-up", low is not None and low >= settings.min_loss_scale, low,
                    f">= {settings.min_loss_scale:g} (updates > {warmup})",
                    f"{sum(b < a for (_, a), (_, b) in zip(scales, scales[1:]))} drops in {len(scales)} updates")
    logged = {tag: [v for _, v in read_scalars(out / "tb" / "train_inner", tag)] for tag in STAT_TAGS}
    buffers = matcher_buffers(out / "checkpoint_last.pt")
    values = [v for vs in logged.values() for v in vs] + [float(x) for b in buffers.values() for x in b.flatten()]
    if not values:
        stage.add(f"{name} moment statistics", "SKIP", detail="no moment-matched layer in this model")
        return
    bad = [v for v in values if not math.isfinite(v)]
    stage.judge(f"{name} moment statistics finite", not bad and all(float(b.min()) > 0 for b in buffers.values()),
                f"{len(values) - len(bad)}/{len(values)} finite", "all finite, variances > 0",
                f"TensorBoard {', '.join(t for t, v in logged.items() if v)}; {len(buffers)} checkpoint buffers")


def matcher_buffers(checkpoint: Path) -> Dict[str, object]:
    """The moment matchers' statistics buffers of a fairseq checkpoint (``*.matcher.*_var_*``)."""
    import torch

    if not checkpoint.is_file():
        return {}
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    return {k: v.float() for k, v in state.items() if ".matcher." in k and "_var_" in k}


def train_stage(settings: Settings) -> Stage:
    stage = Stage("train", note="" if settings.cuda else "CPU equivalent: fp32 (--fp16 needs CUDA)")
    updates = 6 if settings.quick else settings.updates
    warmup = max(1, updates // 10)
    root = settings.stage_dir("train")
    for kind, script in (("encoder", "pretrain_wikitext103.sh"), ("lm", "train_pg19.sh")):
        for spec in specs(settings)[kind]:
            out = root / f"{kind}_{spec.replace(',', '+')}"
            args = [spec, "--max-update", str(updates), "--warmup-updates", str(warmup), "--seed", "1",
                    "--log-interval", "1", *layer_args(kind, spec)]
            if kind == "encoder":
                args += ["--total-num-update", str(updates)]
            name = f"{kind} {spec}"
            code = recipe(settings, script, args, out)
            if code != 0:
                stage.judge(f"{name} ran", False, f"exit {code}", "exit 0", tail(out / "selftest.log"))
                continue
            judge_run(stage, name, out, settings, updates, warmup)
    graphed_run(stage, settings, root, updates, warmup)
    return stage


GRAPHED = ("lln", ["--attention-cuda-graph", "--update-freq", "2"])  # accumulation: two replays an update


def graphed_run(stage: Stage, settings: Settings, root: Path, updates: int, warmup: int) -> None:
    """A causal LLN LM trained with ``--attention-cuda-graph`` and two batches an update, through fairseq's trainer
    (its fp16 optimizer, ``model.train()`` each update, the moment matcher's deferred folds), judged as the others;
    one SKIP on the CPU, where the option is refused."""
    spec, options = GRAPHED
    name = f"lm {spec} {' '.join(options)}"
    if not settings.cuda:
        stage.add(name, "SKIP", detail="CUDA graphs need CUDA")
        return
    out = root / f"lm_{spec}_cuda_graph"
    args = [spec, "--max-update", str(updates), "--warmup-updates", str(warmup), "--seed", "1", "--log-interval",
            "1", *options]
    code = recipe(settings, "train_pg19.sh", args, out)
    if code != 0:
        stage.judge(f"{name} ran", False, f"exit {code}", "exit 0", tail(out / "selftest.log"))
        return
    judge_run(stage, name, out, settings, updates, warmup)


def checkpoint(settings: Settings, kind: str, spec: str) -> Path:
    return settings.work / "train" / f"{kind}_{spec.replace(',', '+')}" / "checkpoint_last.pt"


def finetune_stage(settings: Settings) -> Stage:
    stage = Stage("finetune", note=f"scripts/finetune_glue.sh {FINETUNE_TASK} (the SST-2-shaped sample) from the "
                  "train stage's checkpoint")
    updates = 4 if settings.quick else 20
    root = settings.stage_dir("finetune")
    for spec in specs(settings)["encoder"]:
        name, ckpt = f"{FINETUNE_TASK} {spec}", checkpoint(settings, "encoder", spec)
        if not ckpt.is_file():
            stage.judge(f"{name} ran", False, "no checkpoint", str(ckpt), "the train stage did not write it")
            continue
        out = root / spec.replace(",", "+")
        args = [FINETUNE_TASK, spec, str(ckpt), "--max-update", str(updates), "--total-num-update", str(updates),
                "--warmup-updates", "1", "--seed", "1", *layer_args("encoder", spec)]
        code = recipe(settings, "finetune_glue.sh", args, out)
        if code != 0:
            stage.judge(f"{name} ran", False, f"exit {code}", "exit 0", tail(out / "selftest.log"))
            continue
        judge_run(stage, name, out, settings, updates, 1, loss_must_fall=False)
        accuracy = report.best(report.read_log(out / "train.log")["valid"], "accuracy")
        stage.judge(f"{name} validation accuracy", accuracy is not None and 0 <= accuracy <= 100, accuracy,
                    "reported, in [0, 100]", "chance is 50; a few updates of a tiny model need not beat it")
    return stage


def training_context() -> int:
    sample = recipe_config.load(ROOT / "configs" / "pg19_lm.yaml", sample=True)
    return int(recipe_config.get(sample, "train.tokens-per-sample"))


def eval_lm_stage(settings: Settings) -> Stage:
    context = training_context()
    stage = Stage("eval_lm", note=f"scripts/eval_pg19.sh at {context} and {2 * context} tokens (1x and 2x the "
                  "training context)")
    root = settings.stage_dir("eval_lm")
    for spec in specs(settings)["lm"]:
        ckpt = checkpoint(settings, "lm", spec)
        if not ckpt.is_file():
            stage.judge(f"lm {spec} ran", False, "no checkpoint", str(ckpt), "the train stage did not write it")
            continue
        out = root / spec.replace(",", "+")
        code = recipe(settings, "eval_pg19.sh", [str(ckpt)], out, CONTEXTS=f"{context} {2 * context}")
        rows = report.read_extrapolation(out / "extrapolation.tsv") if code == 0 else []
        if len(rows) != 2:
            stage.judge(f"lm {spec} ran", False, f"exit {code}", "exit 0, 2 contexts", tail(out / "selftest.log"))
            continue
        ppl = [r["ppl"] for r in rows]
        for r in rows:
            stage.judge(f"lm {spec} perplexity at {int(r['context'])}", math.isfinite(r["ppl"]), r["ppl"], "finite")
        ratio = ppl[1] / ppl[0] if all(map(math.isfinite, ppl)) else math.nan
        stage.judge(f"lm {spec} perplexity 2x / 1x", ratio <= 2.0, ratio, "<= 2",
                    "a longer context must not break the model")
    return stage


def lm_checkpoints(settings: Settings) -> Dict[str, Optional[Path]]:
    """{spec: checkpoint_last.pt of the train stage, or None} for every causal spec (the decode stage's models)."""
    return {spec: (p if (p := checkpoint(settings, "lm", spec)).is_file() else None)
            for spec in specs(settings)["lm"]}
