"""Every fused kernel compiled for an H100 (sm_90) without a GPU, through Triton's whole pipeline and its bundled
ptxas (``dev.perf.kernel_resources``): within the H100's shared memory a block and each method's
``SHARED_MEMORY_KIB``, and spilling no registers beyond what ``RESIDUAL_SPILL_BYTES`` records (none at D = 64 or
128)."""
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, torch_211_python

from dev.perf.kernel_resources import ONE_BLOCK_AN_SM, RESIDUAL_SPILL_BYTES, SHARED_KIB, name

pytest.importorskip("triton", minversion="3.6")


def resources(python, tmp_path, *args):
    """The tool's rows, run by ``python`` (Triton compiles for a GPU only with the interpreter off)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    run = subprocess.run([python, "-m", "dev.perf.kernel_resources", *args, "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_exact_fp32_products_spill_and_launchs_settings_do_not(tmp_path):
    """The causal ``_grads`` (dq, dk) with its products of unbounded operands in exact fp32 (8 warps: the settings
    the H100 ran, the causal op at a fifth of its byte floor) fills 255 registers and spills (456 bytes a thread with
    Triton 3.9 since the backward's dv went to its own kernel; 4.2 KiB before), its 64x64x32 products as thousands
    of FMAs; at LAUNCH's settings (tf32 products on tensor cores) it spills no more than the recorded residue."""
    args = ("--configs", "fp16:64", "--kernels", "lln_causal_grads")
    ran = {"TF32": False, "num_warps": 8, "BF": 32}  # 3a9230f's settings, in exact fp32
    [exact] = resources(sys.executable, tmp_path, *args, "--set", json.dumps({"lln_causal_grads": ran}))
    [row] = resources(sys.executable, tmp_path, *args)
    assert exact["registers"] == 255 and exact["spill_bytes"] >= 256 and exact["local_stores"] > 50
    assert exact["local_bytes"] >= 4 * (exact["local_stores"] + exact["local_loads"])
    assert exact["ffma"] > 1000
    assert row["spill_bytes"] == 0 == len(RESIDUAL_SPILL_BYTES[64]) and exact["spill_bytes"] >= 256
    assert row["local_bytes"] < exact["local_bytes"] / 10
    assert row["ffma"] < exact["ffma"] / 10 and row["tensor_core"] > exact["tensor_core"]
    # built as its recorded launches are specialised (its TTIR's arguments marked divisible by 16); at LAUNCH's 4
    # warps two blocks an SM and no product computed twice (at 8, both warpgroups compute the chained products)
    assert row["hints"] == "launch" and row["divisibility_hints"] > 0
    assert row["num_warps"] == 4 and row["blocks_per_sm"] >= 2 and row["replicated_dots"] == 0


@pytest.mark.extended  # four sm_90 builds; CI builds the causal _grads in the test above
def test_chained_products_of_64_rows_are_replicated_at_8_warps_and_lavos_key_rows_are_not(tmp_path):
    """The causal ``_grads``' in-chunk (C, C) products feed further products: at 8 warps Triton lays them with every
    warp along their 64 rows, so both warpgroups hold the same tiles (at 4 warps none is replicated); LAVO's causal
    ``_local_grad`` holds its softmax tiles a key a row, (2w, BLOCK) = 128 rows, which 8 warps hold once, a whole
    window's queries a step included (its non-causal (w, w) tiles are replicated then); at LAUNCH's 4 warps neither
    is."""
    args = ("--configs", "fp16:64", "--kernels")
    [at_8] = resources(sys.executable, tmp_path, *args, "lln_causal_grads", "--set",
                       json.dumps({"lln_causal_grads": {"num_warps": 8}}))
    [at_4] = resources(sys.executable, tmp_path, *args, "lln_causal_grads")
    assert at_8["num_warps"] == 8 and at_8["replicated_dots"] >= 2 and at_4["replicated_dots"] == 0
    whole = json.dumps({"lavo_local_grad": {"num_warps": 8, "BLOCK": 64, "BK": 64}})
    lavo = {row["causal"]: row for row in resources(sys.executable, tmp_path, *args, "lavo_local_grad", "--set", whole)}
    assert lavo[True]["num_warps"] == 8 and lavo[True]["replicated_dots"] == 0 < lavo[False]["replicated_dots"]
    at_launch = resources(sys.executable, tmp_path, *args, "lavo_local_grad")
    assert [(row["num_warps"], row["replicated_dots"]) for row in at_launch] == [(4, 0), (4, 0)]


@pytest.mark.extended  # twelve sm_90 builds, a developer's option
def test_builds_in_several_processes_give_one_process_s_rows_in_order(tmp_path, capsys):
    """``--jobs``: the builds spread over processes come back as the rows one process makes, in the same order (a
    pool that returned them as they finish would not); a count below 1 is refused at parsing."""
    from dev.perf.kernel_resources import main
    args = ("--configs", "fp16:64", "bf16:64", "--kernels", "lln_moment_fold", "lln_key_max", "lln_token_moments")
    one, two = (resources(sys.executable, tmp_path, *args, "--jobs", jobs) for jobs in ("1", "2"))
    assert one == two and [row["kernel"] for row in one] == ["lln_key_max", "lln_token_moments", "lln_moment_fold"] * 2
    assert [row["dtype"] for row in one] == ["fp16"] * 3 + ["bf16"] * 3
    # each specialised as its recorded launches (its TTIR's arguments marked divisible by 16), blocks an SM reported
    assert all(row["hints"] == "launch" and row["divisibility_hints"] > 0 and row["blocks_per_sm"] >= 1 for row in one)
    with pytest.raises(SystemExit):
        main(["--jobs", "0"])
    assert "argument --jobs: '0': expected a whole number of processes, 1 or more" in capsys.readouterr().err


@pytest.mark.extended  # two sm_90 builds
def test_the_launches_specialisation_takes_registers_off(tmp_path):
    """The causal ``_outputs`` built as its launches are specialised (pointers aligned, N, D, the head stride and
    B*H divisible by 16) holds fewer registers than built without (``--no-hints``: 233 -> 156 with Triton 3.9), whose
    TTIR marks no argument."""
    args = ("--configs", "fp16:64", "--kernels", "lln_causal_outputs")
    [hinted] = resources(sys.executable, tmp_path, *args)
    [plain] = resources(sys.executable, tmp_path, *args, "--no-hints")
    assert plain["hints"] == "none" and plain["divisibility_hints"] == 0 < hinted["divisibility_hints"]
    assert hinted["registers"] < plain["registers"] - 32


@pytest.mark.extended  # ~13 min on 2 cores; CI builds sm_90 kernels with this venv's Triton in the tests above
@pytest.mark.parametrize("triton_of", ["this venv", "torch 2.11"])
def test_every_kernel_fits_an_h100_and_spills_no_more_than_recorded(triton_of, tmp_path):
    """fp16 and bf16 at D = Dv = 64 and 128, and each kernel's tuning alternatives at fp16, 64 (tf32, tf32x3, exact
    fp32, value blocks of 32); the shared memory also for an A100; no spill beyond ``RESIDUAL_SPILL_BYTES`` (none
    recorded at either head size); minutes on 2 cores without Triton's cache. Twice:
    with this venv's Triton (3.9, the interpreter's) and with the Triton torch 2.11's CUDA wheels ship (3.6, what the
    H100 ran)."""
    python = sys.executable if triton_of == "this venv" else str(torch_211_python())
    rows = resources(python, tmp_path, "--configs", "fp16:64", "bf16:64", "fp16:128", "bf16:128",
                     "--variants-at", "fp16:64")
    limit = SHARED_KIB[90] * 1024
    at_launch = [row for row in rows if not row["change"]]
    # tf32 twice where it applies; BV: the 4 walks, the causal _outputs, _grads and _value_grads, the non-causal
    # _readout and _rows_grad and the block softmax's backward
    assert len(at_launch) == 4 * 35 and len(rows) == 4 * 35 + 22 * 2 + 10
    # LAUNCH's settings fit, and so do the alternatives (tf32x3's split operands too, since the Nyström backward's
    # rows and landmarks went to kernels of their own)
    over = [(row["kernel"], row["change"]) for row in rows if row["shared_bytes"] > limit]
    assert over == []
    # each method's SHARED_MEMORY_KIB, which keeps its kernels off devices with less, bounds its kernels' blocks
    from linattn.ops.block_softmax import fused as block
    from linattn.ops.lavo import fused as lavo
    from linattn.ops.lln import fused as lln
    from linattn.ops.skyformer import fused as skyformer
    tables = {"lln_": lln, "block_softmax": block, "nystrom_": skyformer, "lavo_": lavo}
    # also as built for an A100 (sm_80), which the same table admits at D = 64
    a100 = resources(python, tmp_path, "--arch", "80", "--configs", "fp16:64", "bf16:64", "fp16:128")
    assert len(a100) == 3 * 35
    for row in at_launch + a100:
        need = next(m for prefix, m in tables.items() if row["kernel"].startswith(prefix)).SHARED_MEMORY_KIB[row["d"]]
        assert row["shared_bytes"] <= need * 1024, row
    # registers: none spilled but the recorded residue (docs/design.md §1.3.1), none at all at D = 64 or 128
    beyond = {(row["dtype"], row["d"], name(row)): row["spill_bytes"] for row in at_launch
              if row["spill_bytes"] > RESIDUAL_SPILL_BYTES[row["d"]].get(name(row), 0)}
    assert beyond == {}
    # blocks an SM: two or more for every build at D = 64; at D = 128 one only for the ledger's kernels and those
    # whose grids at the targets' shapes are at most two waves (as tests/devtools/test_predict.py holds the records)
    predicted = json.loads((ROOT / "docs/benchmarks/predicted_h100.json").read_text())
    programs = {}
    for launch in (k for g in predicted["grids_128"] for k in g["launches"]):
        programs[launch["key"]] = max(programs.get(launch["key"], 0), launch["programs"])
    crowded = {(row["d"], row["kernel"]) for row in at_launch if row["blocks_per_sm"] < 2
               and (row["d"] == 64 or programs.get(row["kernel"], 0) > 2 * predicted["gpu"]["sms"])}
    assert crowded <= {(128, key) for key in ONE_BLOCK_AN_SM[128]} and not ONE_BLOCK_AN_SM[64]


def test_markdown_against_compares_the_builds_both_runs_have():
    """Rows at LAUNCH's settings only, matched by dtype, D and kernel (LAVO's causality included); a kernel one run
    lacks is left out."""
    from dev.perf.kernel_resources import markdown_against

    def row(kernel, causal, regs, spill, change=None):
        return dict(dtype="fp16", d=64, kernel=kernel, causal=causal, change=change or {}, registers=regs,
                    spill_bytes=spill, local_bytes=3 * spill, ffma=10 * spill, tensor_core=regs // 10)

    before = dict(triton="3.6.0", rows=[row("lavo_local", True, 255, 48), row("lavo_local", False, 199, 0),
                                        row("gone", None, 1, 1)])
    now = dict(triton="3.6.0", rows=[row("lavo_local", True, 246, 0), row("lavo_local", True, 100, 9, {"WIDE": 3}),
                                     row("lavo_local", False, 162, 0), row("new", None, 2, 2)])
    lines = markdown_against(before, now).splitlines()
    assert lines[2:] == ["| fp16 D=64 lavo_local causal | 255 → 246 | 48 → 0 | 144 → 0 | 480 → 0 | 25 → 24 |",
                         "| fp16 D=64 lavo_local | 199 → 162 | 0 → 0 | 0 → 0 | 0 → 0 | 19 → 16 |"]
