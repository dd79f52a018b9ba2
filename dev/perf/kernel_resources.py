"""What each fused kernel costs an H100's SM, read from its sm_90 binary without a GPU: registers a thread, bytes a
thread spills to local memory (ptxas' stack frame), shared memory a block, and the static count of tensor-core
(HMMA/HGMMA), fp32 FMA and local-memory (STL/LDL, and the bytes they move a thread) instructions in its SASS
(docs/design.md §1.3.1).

Each kernel goes through Triton's whole pipeline for ``GPUTarget("cuda", 90, 32)`` (``--arch 80``: an A100's) with
the Triton installed (its bundled ptxas and cuobjdump), at ``LAUNCH``'s settings or with ``--set`` overrides:

    python -m dev.perf.kernel_resources --json runs/kernel_resources.json
    python -m dev.perf.kernel_resources --configs fp16:64 --set '{"lln_causal_grads": {"num_warps": 4}}'
    python -m dev.perf.kernel_resources --configs fp16:64 --markdown-against earlier.json

Each kernel is specialised as Triton's JIT specialises its real launch: its pointers 16-byte aligned and its integer
arguments divisible by 16 marked ``tt.divisibility = 16`` (``attrs``), its integers equal to 1 made constants, as
``dev.perf.launches`` recorded them from the training step's own launches at (B, N, H, D) = (16, 2048, 12, 64) and
(16, 2048, 6, 128) (``SPECIALISATION``, the least specialised of a kernel's launches with its build's constexprs; a
kernel the recorded steps do not launch: its pointers only). ``--no-hints`` builds without (registers and spills
then pessimistic: offsets whose alignment the compiler cannot prove are loaded element by element).
Each row also has the blocks an SM holds (``blocks_per_sm``) and its occupancy (warps resident / 64).

A thread has at most 255 registers; what does not fit is spilled to local memory, which lives in L1/L2/HBM: a
spilling kernel turns its register tiles into memory traffic. On the H100 (Triton 3.6) the launch setting that
moved an op's time by 3x (the non-causal ``_state_grad`` at 4 warps against 8) is the switch between spilling (264
bytes) and not.
"""
import argparse
import functools
import inspect
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dev.perf.binary import resources
from dev.perf.launches import SPECIALISATION, function
from linattn.ops.triton import (
    block_softmax,
    lavo,
    lavo_backward,
    lln_causal,
    lln_causal_backward,
    lln_key_max,
    lln_noncausal,
    lln_noncausal_backward,
    moment_match,
    nystrom,
    nystrom_backward,
    nystrom_inverse,
    token_moments,
)
from linattn.ops.triton.common import LAUNCH, TF32_SETTINGS, launch
from linattn_tools.benchmark.cli import write_json

HALF = {"fp16": tl.float16, "bf16": tl.bfloat16}
SHARED_KIB = {90: 227, 80: 163}  # the shared memory a block may opt in to: H100/H200 (sm_90), A100 (sm_80)
# an SM's limits (registers, shared memory KiB, threads, blocks) and the shared memory reserved per block (KiB)
SM_LIMITS = {90: dict(registers=65536, shared_kib=228, threads=2048, blocks=32, reserved_kib=1),
             80: dict(registers=65536, shared_kib=164, threads=2048, blocks=32, reserved_kib=1)}
MATCHED = ("CAUSAL", "ORDERED", "KEYS", "ENDS")  # what tells a kernel's recorded launches apart (``specialised``)
REGISTER_GRANULE = 256  # registers are allocated to a warp in units of 256 (8 a thread)
HALF_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "grad_ptr", "x_ptr", "w_ptr", "a_ptr", "dx_ptr", "bases_ptr",
                 "dq_ptr", "dk_ptr", "dv_ptr", "aq_ptr", "ak_ptr", "av_ptr", "half_ptr")
FLOATS, MASKS, INDICES = ("scale", "sm_scale", "s", "gamma"), ("mask_ptr", "valid_ptr"), ("order_ptr",)
DOUBLES = ("first_ptr", "second_ptr", "stats_ptr", "moments_ptr", "pending_ptr", "table_ptr")  # the moment matching's
LONGS = ("batches_ptr",)  # the moment matching's
# Bytes a thread still spills at LAUNCH's settings (fairseq's layout), per head size, the most of fp16 and bf16 with
# Triton 3.6 and 3.9: the limit the extended tier holds them to, which only shrinks (docs/design.md §1.3.1; the
# history of each residue is in docs/benchmarks.md § Fused kernels' registers). At D = 64 none since 0bc1d3b (the
# causal LLN, LAVO and Nyström backwards split by gradient or stepping fewer rows). At D = 128 none since the Nyström
# backward's rows, landmarks and values went to kernels of their own (its tf32 products within the shared memory,
# where its exact ones spilled 32 / 672 bytes with Triton 3.6 / 3.9).
RESIDUAL_SPILL_BYTES = {64: {}, 128: {}}
# Per head size, the kernels whose grid at the targets' shapes (docs/benchmarks/predicted_h100.json: D = 64, H = 12
# and D = 128, H = 6) is more than two waves of one block an SM and that still hold one block an SM with fp16 or bf16
# inputs and Triton 3.6 or 3.9, and why: the ledger ``test_predict`` holds the records to, which only shrinks. Empty
# at D = 128 since the Nyström backward's two take the landmarks a block at a time (``nystrom_backward``).
ONE_BLOCK_AN_SM = {64: {}, 128: {}}
CONFIGS = ("fp16:64", "bf16:64", "fp16:128", "bf16:128")  # the head sizes the methods' SHARED_MEMORY_KIB cover
VARIANTS = (("WIDE", 1), ("WIDE", 3), ("WIDE", 0), ("BV", 32))  # the tuner's alternatives (--variants-at)


def kernels(half) -> List[Tuple[object, str, dict]]:
    """(kernel, LAUNCH key, constexprs) of every fused kernel for inputs of the Triton half type ``half``, at the
    training shapes' sizes (chunks, blocks and windows of 64, 128 landmarks) and the kernels' own row counts; LAVO's
    four twice (causal, then non-causal: a window's queries meet its own window's key slots only, its rows read
    through a real-first order)."""
    common = dict(HALF_TY=half, EMULATE=False, HAS_MASK=True)
    window = dict(BW=64, HALF_TY=half, EMULATE=False, CAUSAL=True, ORDERED=False)
    own_window = {**window, "CAUSAL": False, "ORDERED": True}  # an encoder's padded batch: rows through the order
    line = dict(A=0.15, B=-0.35, MAX_SCALE=8.0, MOMENTS=True, MODE=moment_match.LINE.value, ALPHA=0.0, BETA=0.0,
                TBLOCK=1, BLOCK=16)  # the moment matching's default mode
    lavo_kernels = [(lavo._local, "lavo_local"), (lavo._memory, "lavo_memory"),
                    (lavo_backward._memory_grad, "lavo_memory_grad"), (lavo_backward._bases_grad, "lavo_bases_grad"),
                    (lavo_backward._local_query_grad, "lavo_local_query_grad"),
                    (lavo_backward._local_grad, "lavo_local_grad")]
    return [(lln_key_max._block_max, "lln_key_max", dict(BR=64, HAS_MASK=True)),
            (lln_causal._states, "lln_causal_ends", dict(BC=64, ENDS=True, **common)),  # the walk's segments' ends
            (lln_causal._states, "lln_causal_states", dict(BC=64, ENDS=False, **common)),
            (lln_causal._outputs, "lln_causal_outputs", dict(BC=64, AVERAGED=False, **common)),  # LLN's; LLN+Diag's
            # (AVERAGED: an fp32 out and its half copy) is the same code and one store more
            (lln_causal_backward._grad_states, "lln_causal_grad_ends", dict(BC=64, ENDS=True)),
            (lln_causal_backward._grad_states, "lln_causal_grad_states", dict(BC=64, ENDS=False)),
            (lln_causal_backward._grads, "lln_causal_grads", dict(BC=64, **common)),
            (lln_causal_backward._value_grads, "lln_causal_value_grads", dict(BC=64, **common)),
            (lln_noncausal._state, "lln_noncausal_state", dict(BLOCK=lln_noncausal.ROWS, **common)),
            (lln_noncausal._readout, "lln_noncausal_readout",
             dict(BLOCK=lln_noncausal.ROWS, AVERAGED=False, HALF_TY=half, EMULATE=False)),
            (lln_noncausal_backward._state_grad, "lln_noncausal_state_grad",
             dict(BLOCK=lln_noncausal.ROWS, HALF_TY=half, EMULATE=False)),
            (lln_noncausal_backward._rows_grad, "lln_noncausal_rows_grad",
             dict(BLOCK=lln_noncausal.ROWS, HAS_MASK=True)),
            (token_moments._row_moments, "lln_token_moments", dict(BLOCK=token_moments.ROWS, HAS_MASK=True)),
            (moment_match._scales, "lln_moment_scales", dict(FOLD=False, PENDING=False, MOMENTUM=0.0, BATCH=False,
                                                             **line)),
            (moment_match._scales, "lln_moment_fold", dict(FOLD=True, PENDING=False, MOMENTUM=0.99, BATCH=True,
                                                           **line)),
            (block_softmax._forward, "block_softmax", dict(BB=64, CAUSAL=True, AVERAGE=True, **common)),
            (block_softmax._backward, "block_softmax_backward", dict(BB=64, CAUSAL=True, **common)),
            (nystrom._state, "nystrom_state", dict(BL=128, KEYS=True, **common)),
            (nystrom._readout, "nystrom_readout", dict(BLOCK=nystrom.ROWS, BL=128, KEYS=False, **common)),
            (nystrom_backward._rows_grad, "nystrom_rows_grad", dict(BL=128, **common)),
            (nystrom_backward._landmarks_grad, "nystrom_landmarks_grad", dict(BL=128, **common)),
            (nystrom_inverse._inverse, "nystrom_inverse", dict(BL=128, STEPS=nystrom_inverse.STEPS)),
            (nystrom_inverse._inverse_grad, "nystrom_inverse_grad", dict(BL=128, STEPS=nystrom_inverse.STEPS))] + [
        (kernel, key, consts) for consts in (window, own_window) for kernel, key in lavo_kernels]


def build(kernel, key: str, consts: dict, half: str, d: int, change: Optional[dict] = None, arch: int = 90,
          hints: bool = True):
    """``kernel`` compiled for sm_``arch`` (90: H100) at head size d = Dv, its half pointers ``half`` ("fp16" or
    "bf16"), at ``launch(key, d)`` updated by ``change`` (its TF32, if any, as LAUNCH's), specialised as its launches
    are (``hints``: ``specialised``); returns (Triton's compiled kernel, the settings used)."""
    types, consts, options, settings, attrs = _compile_args(kernel, key, consts, half, d, change, hints)
    return triton.compile(ASTSource(fn=kernel, signature=types, constexprs=consts, attrs=_attrs(types, attrs)),
                          target=GPUTarget("cuda", arch, 32), options=options), settings


def _attrs(types: dict, divisible: List[str]):
    """Triton's ``attrs`` for the arguments named in ``divisible`` (``tt.divisibility = 16``): from Triton 3.3 on
    (3.6 and 3.9 alike) a dict of argument paths to the backend's parsed attributes (what ``JITFunction._pack_args``
    passes); before, an ``AttrsDescriptor``."""
    names = list(types)
    try:
        from triton.backends.compiler import BaseBackend
        return {(names.index(p),): BaseBackend.parse_attr("D") for p in divisible}
    except AttributeError:  # Triton 3.0-3.2
        from triton.backends.compiler import AttrsDescriptor
        return AttrsDescriptor.from_dict({"arg_properties": {"tt.divisibility": [names.index(p) for p in divisible]}})


@functools.lru_cache(maxsize=1)
def _recorded() -> dict:
    return json.loads(SPECIALISATION.read_text())["kernels"] if SPECIALISATION.exists() else {}


def specialised(kernel, consts: dict, d: int, types: dict) -> Tuple[str, List[str], dict]:
    """(how, the arguments divisible by 16, the arguments made constants) of ``kernel`` built with ``consts`` at head
    size d, as the JIT specialises its recorded launches (``SPECIALISATION``) of the same ``MATCHED`` constexprs
    (causality, order, keys or queries; the others, the interpreter's among them, do not change an argument's
    specialisation): an argument is divisible, or a constant, only where it is so in every one
    of them. how: "launch"; "pointers" where none was recorded (each pointer taken as aligned, as the caching
    allocator's blocks and the layouts' views at multiples of 16 bytes are)."""
    table = _recorded().get(str(d)) or _recorded().get("64", {})
    recorded = table.get(function(kernel.fn), [])
    launches = [e for e in recorded if all(consts.get(k, v) == v for k, v in e["constexprs"].items() if k in MATCHED)]
    if not launches:
        return "pointers", [p for p, t in types.items() if t.startswith("*")], {}
    divisible = [p for p in types if types[p] != "constexpr" and all(e["spec"].get(p) == "D" for e in launches)]
    first = launches[0]["spec"]
    constants = {p: first[p]["constant"] for p in types if types[p] != "constexpr" and isinstance(first.get(p), dict)
                 and all(e["spec"].get(p) == first[p] for e in launches)}
    return "launch", divisible, constants


def _compile_args(kernel, key: str, consts: dict, half: str, d: int, change: Optional[dict], hints: bool = True):
    """``build``'s (signature, constexprs, options, settings, the arguments divisible by 16): what Triton
    compiles."""
    change = dict(change or {})
    if "TF32" in change:  # as LAUNCH writes it: the kernel's WIDE
        change["WIDE"] = TF32_SETTINGS[change.pop("TF32")]
    settings = {**launch(key, d), **change}
    params = inspect.signature(kernel.fn).parameters
    # FAIRSEQ: the kernels read and write fairseq's layout, as the module's head split gives q, k, v
    consts = {p: v for p, v in {**dict(BD=d, BDV=d, BR=d, FAIRSEQ=True), **consts, **settings}.items() if p in params}
    types = {p: "constexpr" if p in consts else ("*" + half if p in HALF_POINTERS else "*u8" if p in MASKS else
             "*fp64" if p in DOUBLES else "*i64" if p in LONGS else
             "*i32" if p in INDICES else "*fp32" if p.endswith("_ptr") else "fp32" if p in FLOATS else "i32")
             for p in params}
    options = {k: settings[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in settings}
    divisible = []
    if hints:
        _, divisible, constants = specialised(kernel, consts, d, types)
        types.update({p: "constexpr" for p in constants})
        consts.update(constants)
    return types, consts, options, settings, divisible


def _same_binary(job: Tuple[str, int, int, dict, int, bool]) -> tuple:
    """What decides a ``table`` job's binary: two jobs alike here compile to the same (a kernel that reads no half
    tensor and no head size, as Skyformer's M^-1, is one binary at every dtype and D)."""
    half, d, index, change, arch, hints = job
    kernel, key, consts = kernels(HALF[half])[index]
    types, consts, options, _, divisible = _compile_args(kernel, key, consts, half, d, change, hints)
    return key, index, arch, tuple(divisible), *(tuple(sorted((k, str(v)) for k, v in x.items()))
                                                for x in (types, consts, options))


def table(configs: List[Tuple[str, int]], variants_at: List[Tuple[str, int]], overrides: Optional[dict] = None,
          only: Optional[List[str]] = None, arch: int = 90, jobs: int = 1, hints: bool = True) -> List[dict]:
    """One row per kernel build for each (half dtype, D = Dv) of ``configs``: at LAUNCH's settings (updated by
    ``overrides`` {key: settings}), and at the configurations of ``variants_at`` each kernel's tuning alternatives
    (tf32, tf32x3, exact fp32 products, walks split over value columns) as well, where the kernel has the setting;
    the kernels named in ``only`` (LAUNCH keys), or all; built for sm_``arch`` by ``jobs`` processes (a build is one
    core's work: Triton's passes, then ptxas), the rows in that order; builds that compile to the same binary
    (``_same_binary``) built once; specialised as their launches (``hints``) or not."""
    builds = []  # (half, d, the kernel's index in kernels(), change, arch, hints): what _row builds
    for half, d in configs:
        for index, (_, key, _) in enumerate(kernels(HALF[half])):
            if only and key not in only:
                continue
            base = (overrides or {}).get(key, {})
            own = launch(key, d)
            builds += [(half, d, index, change, arch, hints) for change in [base] + [
                {**base, setting: value} for setting, value in VARIANTS
                if (half, d) in variants_at and setting in own and own[setting] != value]]
    binaries = [_same_binary(job) for job in builds]
    first = {}
    for job, binary in zip(builds, binaries):
        first.setdefault(binary, job)
    if jobs == 1:
        built = dict(zip(first, map(_row, first.values())))
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            built = dict(zip(first, pool.map(_row, first.values())))
    return [{**built[binary], "dtype": job[0], "d": job[1], "change": job[3]} for job, binary in zip(builds, binaries)]


def _row(job: Tuple[str, int, int, dict, int, bool]) -> dict:
    """The row of one build of ``table``'s (half, d, the kernel's index, change, arch, hints), printed as it is
    done."""
    half, d, index, change, arch, hints = job
    kernel, key, consts = kernels(HALF[half])[index]
    compiled, settings = build(kernel, key, consts, half, d, change, arch, hints)
    types = _compile_args(kernel, key, consts, half, d, change, False)[0]
    row = dict(arch=arch, dtype=half, d=d, kernel=key, causal=consts.get("CAUSAL"), change=change,
               num_warps=settings["num_warps"], function=function(kernel.fn),
               hints=specialised(kernel, consts, d, types)[0] if hints else "none", **resources(compiled))
    row.update(occupancy(row["registers"], row["num_warps"], row["shared_bytes"], arch))
    print(_line(row), flush=True)
    return row


def occupancy(registers: int, num_warps: int, shared_bytes: int, arch: int = 90) -> Dict[str, float]:
    """Blocks of ``num_warps`` warps, ``registers`` a thread and ``shared_bytes`` a block that one SM of sm_``arch``
    holds at once (registers allocated a warp in granules of ``REGISTER_GRANULE``, each block's shared memory plus
    the reserved KiB, the SM's threads and blocks), and the occupancy: warps resident over the SM's 64."""
    limits = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = limits["registers"] // per_warp // num_warps
    by_shared = limits["shared_kib"] * 1024 // (shared_bytes + limits["reserved_kib"] * 1024)
    by_threads = limits["threads"] // (num_warps * 32)
    blocks = min(by_registers, by_shared, by_threads, limits["blocks"])
    return dict(blocks_per_sm=blocks, occupancy=blocks * num_warps * 32 / limits["threads"])


def name(row: dict) -> str:
    """The kernel's LAUNCH key, and " causal" for LAVO's causal build."""
    return row["kernel"] + " causal" * bool(row["causal"])


def _line(row: dict) -> str:
    over = " over the shared memory" if row["shared_bytes"] > SHARED_KIB[row["arch"]] * 1024 else ""
    return (f"{row['dtype']} {row['d']:>3} {name(row):<30} {json.dumps(row['change']):<22} warps {row['num_warps']}"
            f" regs {row['registers']:>3} spill {row['spill_bytes']:>5} B shared {row['shared_bytes'] // 1024:>3} KiB"
            f" | mma {row['tensor_core']:>4} ffma {row['ffma']:>5} stl {row['local_stores']:>4}"
            f" ldl {row['local_loads']:>4} ({row['local_bytes']:>5} B) of {row['instructions']}"
            f" | replicated dots {row['replicated_dots']} | {row['blocks_per_sm']} blocks/SM"
            f" ({row['occupancy']:.0%}) hints {row['hints']}{over}")


COMPARED = ("registers", "spill_bytes", "local_bytes", "ffma", "tensor_core")  # ``markdown_against``'s columns


def markdown_against(before: dict, now: dict) -> str:
    """A markdown table of the builds at LAUNCH's settings of two runs' JSON (``before``, ``now``) at the
    configurations both have: registers, spilled bytes, local bytes moved, FFMAs and tensor-core instructions, before
    -> now (static counts)."""
    def keyed(run):
        return {(row["dtype"], row["d"], name(row)): row for row in run["rows"] if not row["change"]}
    old, new = keyed(before), keyed(now)
    lines = [f"| kernel (Triton {now['triton']}) | registers | spilled B / thread | local B moved / thread | FFMA |"
             " tensor-core |", "|---|---|---|---|---|---|"]
    for key in (k for k in new if k in old):
        a, b = old[key], new[key]
        cells = [f"{a.get(f, '?')} → {b[f]}" for f in COMPARED]
        lines.append(f"| {key[0]} D={key[1]} {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _config(text: str) -> Tuple[str, int]:
    half, _, d = text.partition(":")
    if half not in HALF or not d.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected dtype:D with dtype one of {sorted(HALF)}, e.g. fp16:64")
    return half, int(d)


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of processes, 1 or more")
    return int(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", type=_config, default=[_config(c) for c in CONFIGS],
                        help=f"half dtype:D = Dv pairs (default {' '.join(CONFIGS)})")
    parser.add_argument("--variants-at", nargs="*", type=_config, default=[],
                        help="pairs of --configs where each kernel's tuning alternatives are built too")
    parser.add_argument("--kernels", nargs="+", choices=sorted(LAUNCH), help="only these (default: all)")
    parser.add_argument("--set", type=json.loads, default={}, help='launch overrides, {"kernel": {"num_warps": 8}}')
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_KIB), default=90, help="sm_ARCH: 90 H100, 80 A100")
    parser.add_argument("--jobs", type=_jobs, default=len(os.sched_getaffinity(0)),
                        help="builds at once, one a process (default: this process's cores)")
    parser.add_argument("--no-hints", action="store_true",
                        help="build without the launches' specialisation (no tt.divisibility, no constants)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown-against", help="then print a markdown table of this earlier run's JSON -> this one")
    args = parser.parse_args(argv)
    rows = table(args.configs, args.variants_at, args.set, args.kernels, args.arch, args.jobs, not args.no_hints)
    spilling = [row for row in rows if not row["change"] and row["spill_bytes"]]
    beyond = [f"{row['dtype']}:{row['d']} {name(row)}" for row in spilling
              if row["spill_bytes"] > RESIDUAL_SPILL_BYTES.get(row["d"], {}).get(name(row), 0)]
    print(f"{len(rows)} builds; at LAUNCH's settings {len(spilling)} spill" + (
        f"; beyond RESIDUAL_SPILL_BYTES: {', '.join(beyond) or 'none'}" if args.arch == 90 else ""))
    if args.json:
        target = {90: "sm_90 (H100)", 80: "sm_80 (A100)"}[args.arch]
        write_json(Path(args.json), dict(target=target, triton=triton.__version__, hints=not args.no_hints,
                                         rows=rows))
    if args.markdown_against:
        now = dict(triton=triton.__version__, rows=rows)
        print(markdown_against(json.loads(Path(args.markdown_against).read_text()), now))


if __name__ == "__main__":
    main()
