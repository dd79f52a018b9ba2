"""The GPU self-test's parts for ``--attention-cuda-graph`` on the CPU: its ``cuda_graph`` stage with the capture's
stand-in (``dev.perf.graph_standin``), and the ``train`` stage's LM trained with captured steps on a GPU only."""
import math
from pathlib import Path

import torch
from test_gpu_selftest import write_run

from linattn_tools.recipes.selftest import core, graphed, training


def test_cuda_graph_stage_judges_replayed_steps_against_eager(monkeypatch):
    """With the CPU stand-in for the capture (``dev.perf.graph_standin``; small sizes): the fused causal LLN case
    passes its outputs, gradients, buffers and graph count in float16; a replay that is 1 % off fails the outputs and
    gradients; on the CPU the stage itself is one SKIP (CUDA graphs need CUDA)."""
    from dev.perf import graph_standin
    from fairseq_linattn.modules import cuda_graph

    monkeypatch.setitem(graphed.SIZES, False, dict(batch=2, heads=2, n=12, head_dim=16))
    monkeypatch.setattr(cuda_graph, "capture", graph_standin.capture)
    stage = core.Stage("cuda_graph")
    graphed.check_case(stage, "lln", "decoder", "cpu")
    rows = {r.check: r for r in stage.rows}
    name = "lln decoder fused float16"
    for check in ("outputs replayed vs eager", "gradients replayed vs eager",
                  "buffers (moment statistics) replayed vs eager", "graphs captured"):
        assert rows[f"{name} {check}"].status == "PASS", rows[f"{name} {check}"]
    assert rows[f"{name} step time replayed vs eager"].status == "INFO"

    def off(step, args):
        replay = graph_standin.capture(step, args)
        return lambda *inputs: replay(*inputs) * 1.01
    monkeypatch.setattr(cuda_graph, "capture", off)
    stage = core.Stage("cuda_graph")
    graphed.check_case(stage, "lln", "encoder", "cpu")
    rows = {r.check: r for r in stage.rows}
    assert rows["lln encoder fused float16 outputs replayed vs eager"].status == "FAIL"
    assert rows["lln encoder fused float16 gradients replayed vs eager"].status == "FAIL"
    (row,) = graphed.cuda_graph_stage(core.Settings("cpu", Path("/nonexistent"), quick=True)).rows
    assert (row.status, row.detail) == ("SKIP", "CUDA graphs need a CUDA device")
    assert graphed.cases(quick=True) == (("lln", "decoder"),) and ("skyformer", "encoder") in graphed.cases(False)
    assert graphed.buffer_error(torch.tensor(4), torch.tensor(1)) == math.inf


def test_the_train_stage_trains_an_lm_with_captured_steps_on_a_gpu_only(tmp_path, monkeypatch):
    """On CUDA one more causal LLN LM, through train_pg19.sh with --attention-cuda-graph and two batches an update,
    judged from its own TensorBoard as the others; on the CPU, where the option is refused, one SKIP."""
    runs = []

    def recipe(settings, script, args, out, **env):
        runs.append((script, args))
        write_run(out / "tb", [9, 8.5, 8, 7.5, 7, 6.5], [128, 64, 64, 64, 32, 32], {"lln_alpha": 2.0})
        return 0
    monkeypatch.setattr(training, "recipe", recipe)
    stage = core.Stage("train")
    training.graphed_run(stage, core.Settings("cuda", tmp_path, min_loss_scale=1.0), tmp_path, 6, 1)
    ((script, args),) = runs
    assert script == "train_pg19.sh" and args[0] == "lln" and args[-3:] == ["--attention-cuda-graph",
                                                                           "--update-freq", "2"]
    rows = {r.check: r.status for r in stage.rows}
    assert rows["lm lln --attention-cuda-graph --update-freq 2 loss falls"] == "PASS" and len(rows) == 3
    stage = core.Stage("train")
    training.graphed_run(stage, core.Settings("cpu", tmp_path), tmp_path, 6, 1)
    (row,) = stage.rows
    assert row.status == "SKIP" and len(runs) == 1
