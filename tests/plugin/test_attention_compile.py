"""--attention-compile: a module whose op call runs under torch.compile gives the eager module's outputs and
gradients, in one graph, and its first-step check (fairseq_linattn/modules/compile_check.py) passes for real
(the extended tier: each compile takes minutes on this CPU). The modules and the step are the GPU self-test's
(``linattn_tools.recipes.selftest.compiled``), checked here with their own assertions."""
import json
import os
import subprocess

import pytest
import torch
import torch._dynamo
from helpers import ROOT, torch_211_python
from torch._dynamo.utils import counters

from linattn_tools.recipes.selftest.compiled import build_pair, training_step

# minutes a compile on 2 cores: the extended tier. CI compiles causal LLN once, in the self-test's compile stage (the
# slow tier's tests/tools/test_gpu_selftest.py: these modules and this step, compiled against eager, one graph); the
# first-step check's logic is tested without compiling in tests/plugin/test_compile_check.py
EXTENDED = pytest.mark.extended


@pytest.mark.parametrize("method,causal", [pytest.param(*case, marks=EXTENDED) for case in (
    ("lln", True), ("lln", False), ("lln_diag", True), ("lavo", True), ("skyformer", False), ("kernelized", False))])
def test_compiled_module_step_equals_eager(gen, caplog, method, causal):
    """A training step as fairseq's trainer runs it (moment folds deferred): no graph break (the matcher's
    switches and Skyformer's landmark draw once broke it), the eager step's values (Inductor draws Skyformer's
    random landmarks through ATen here, so that both steps draw the same), and the compiled module's own
    first-step check, on as by default, passes once and says so (it puts back the state it uses, so the values
    are those of a step without it)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    compiled, eager = build_pair(method, "decoder" if causal else "encoder", "cpu", check="first-step")
    x = torch.randn(45, 2, compiled.embed_dim, generator=gen)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[1, 30:] = True
    with caplog.at_level("INFO", logger="fairseq_linattn.modules.compile_check"):
        (out_c, gx_c, gp_c), (out_e, gx_e, gp_e) = (training_step(m, x, mask, seed=1) for m in (compiled, eager))
        training_step(compiled, x, mask, seed=2)
    assert sum("first compiled training step matches eager" in r.message for r in caplog.records) == 1
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx_c, gx_e, rtol=1e-4, atol=1e-5)
    assert len(gp_c) == len(gp_e) > 0
    for a, b in zip(gp_c, gp_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert "_compiled_attend" in compiled.__dict__ and "_compiled_attend" not in eager.__dict__
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])


# -- the same cases on torch 2.11, whose compiled autograd.Functions routed gradients wrongly (pytorch#180642) -------
TORCH_211_CASES = ("lln:decoder", "lln_diag:encoder", "lavo:decoder", "skyformer:encoder", "kernelized:encoder")
RUN_CASES = """
import json, sys, torch
from linattn_tools.recipes.selftest.compiled import check_case
from linattn_tools.recipes.selftest.core import Stage
stage = Stage("compile")
for case in sys.argv[1:]:
    check_case(stage, *case.split(":"), "cpu")
print(json.dumps({"torch": torch.__version__, "rows": [[r.check, r.status, r.measured] for r in stage.rows]}))
"""


@pytest.mark.extended  # installs torch 2.11 (a 4.6 GB CUDA build) into a cache outside the clone on first use
def test_compiled_steps_equal_eager_on_torch_2_11():
    """Before the ops returned fresh outputs while compiling, LLN's compiled gradients here were wrong (relative
    error 1, as on the H100 with torch 2.11 + CUDA 13) and the autocast check broke its graph in two."""
    python = torch_211_python()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(python), "-c", RUN_CASES, *TORCH_211_CASES], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"].startswith("2.11."), report["torch"]
    checked = [row for row in report["rows"] if row[1] != "INFO"]
    assert len(checked) == 3 * len(TORCH_211_CASES), report["rows"]
    assert all(row[1] == "PASS" for row in checked), [row for row in checked if row[1] != "PASS"]
