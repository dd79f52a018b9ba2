"""GPU self-test: what to run first on a CUDA machine (``bash scripts/gpu_selftest.sh``, docs/first_gpu_run.md).

Stages, each printing PASS/FAIL per check with the measured number and its threshold:
  env        torch, CUDA and driver versions, GPUs, compute capability, native bfloat16 (bf16 checks skipped
             where it is missing);
  ops        every method (--methods: some) x role x dtype x implementation (parallel, looped; fused in half
             precision where an op has kernels): forward and gradients on the
             device against the float64 reference, eval and train mode (EMA and running statistics, landmark
             redraws, dropout), tolerances from linattn/tolerances.py;
  compile    --attention-compile: every method x role's training step compiled (Triton on a GPU) against eager,
             float32 tolerances, one Dynamo graph, the step's time both ways;
  cuda_graph --attention-cuda-graph: every method x role's training steps captured and replayed against eager
             (outputs, gradients, moment statistics, one graph a shape), the step's time both ways;
  train      a short --fp16 run of the sample recipes per attention (pretrain_wikitext103.sh, train_pg19.sh),
             and a causal LLN LM with --attention-cuda-graph --update-freq 2: loss falls, loss scale after
             warm-up >= --min-loss-scale (this run's TensorBoard), moment statistics finite;
  finetune   finetune_glue.sh on the SST-2-shaped sample from the train stage's checkpoint;
  eval_lm    eval_pg19.sh: perplexity at 1x and 2x the training context (causal models);
  decode     incremental decoding == full forward on the device (padded batch, beam reordering);
  speed      the fused implementation's targets (linattn_tools.benchmark.targets): one module's training step at
             32K tokens a step, fp16 and bf16, N = 4K and 16K, against the softmax module of the same causality:
             a series over its target time or 1.5x its peak memory fails; rows name the implementation that ran;
  multi_gpu  (>= 2 GPUs) 2 ranks vs 1 process on the same global batch: moment statistics identical on both
             ranks and equal to the 1-process run's, losses within 2e-3.
Report: WORK/report.json and WORK/report.md (WORK is emptied of the previous run's files first; the prepared
samples in WORK/samples are kept). Exit status: 0 = every check passed, 1 = a check failed, 2 = no CUDA device
(stops at once, naming the installed torch build). ``--device cpu --quick``: every stage at tiny sizes on the
CPU (fp32 instead of --fp16, 2 gloo processes, speed without a verdict), a few minutes.
"""
import argparse
import logging
import sys
import time
from pathlib import Path

from linattn.methods import METHODS

from .selftest import core
from .selftest.core import ROOT, STAGES, Settings, Stage

NEEDS_SAMPLES = ("train", "finetune", "eval_lm", "decode", "multi_gpu")


def stage_functions() -> dict:
    from .selftest.compiled import compile_stage
    from .selftest.decode import decode_stage
    from .selftest.env import env_stage
    from .selftest.graphed import cuda_graph_stage
    from .selftest.multi import multi_stage
    from .selftest.ops import ops_stage
    from .selftest.speed import speed_stage
    from .selftest.training import eval_lm_stage, finetune_stage, train_stage

    return {"env": env_stage, "ops": ops_stage, "compile": compile_stage, "cuda_graph": cuda_graph_stage,
            "train": train_stage,
            "finetune": finetune_stage, "eval_lm": eval_lm_stage, "decode": decode_stage, "speed": speed_stage,
            "multi_gpu": multi_stage}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_selftest.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default; exit 2 without one) or cpu (the CPU equivalents, for testing)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and update counts, one model per role")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES),
                        help="the stages to run (env always runs); later stages read the train stage's checkpoints")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "gpu_selftest")
    parser.add_argument("--updates", type=int, default=50, help="updates per training run (without --quick)")
    parser.add_argument("--min-loss-scale", type=float, default=1.0,
                        help="floor of the fp16 loss scale after warm-up (fairseq starts at 128)")
    parser.add_argument("--methods", nargs="+", default=[], choices=sorted(METHODS), metavar="METHOD",
                        help=f"the ops and compile stages check only these methods ({', '.join(sorted(METHODS))}; "
                             "default all)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch  # after --help

    if args.device == "cuda" and not torch.cuda.is_available():
        from .selftest.env import no_cuda_message

        print(no_cuda_message(), file=sys.stderr)
        return 2
    from .selftest.env import torch_build

    logging.basicConfig(level=logging.WARNING)  # before fairseq's modules, some of which set DEBUG on import
    started = time.time()
    settings = Settings(args.device, args.work.resolve(), quick=args.quick, updates=args.updates,
                        min_loss_scale=args.min_loss_scale, methods=tuple(args.methods))
    settings.work.mkdir(parents=True, exist_ok=True)
    core.clear_work(settings.work)
    print(f"[gpu_selftest] {torch_build()}, device {args.device}{' --quick' if args.quick else ''}; "
          f"report and work files in {settings.work}", flush=True)
    functions = stage_functions()
    stages = [core.run_stage("env", functions["env"], settings)]
    problem = core.prepare_samples(settings) if set(args.stages) & set(NEEDS_SAMPLES) else None
    for name in (s for s in STAGES if s in args.stages and s != "env"):
        if problem and name in NEEDS_SAMPLES:
            stages.append(Stage(name))
            stages[-1].add("samples prepared", "FAIL", detail=problem)
        else:
            stages.append(core.run_stage(name, functions[name], settings))
    meta = {"torch": torch_build()}
    if settings.cuda:
        meta["gpu"] = torch.cuda.get_device_name(0)
    seconds = time.time() - started
    path = core.write_report(settings, stages, meta, seconds)
    line = core.summary_line(stages, seconds)
    print(f"[gpu_selftest] report: {path} and {path.with_suffix('.json')}")
    print(line)
    return 0 if line.startswith("gpu_selftest: PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
