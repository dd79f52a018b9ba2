"""What a kernel's sm_90 binary holds, read without a GPU (``kernel_resources``' columns): registers and spilled
bytes a thread, shared memory a block, and static SASS counts (tensor-core products and their FLOPs, fp32 FMAs,
local-memory traffic), the TTIR's divisibility marks and the TTGIR's replicated products."""
import collections
import os
import re
import subprocess
import tempfile
from typing import Dict

import triton

SASS_OPCODE = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)"  # an instruction's opcode, after its predicate


def resources(compiled) -> Dict[str, int]:
    """Registers and spilled bytes a thread (ptxas' stack frame), shared memory a block, and static SASS instruction
    counts (tensor-core products, fp32 FMAs, local-memory stores and loads and the bytes they move a thread, all) of
    a compiled kernel; straight-line code runs each once a program, a loop's body once an iteration."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", usage))
    opcodes = re.findall(SASS_OPCODE, sass)
    ops = collections.Counter(m.split(".")[0] for m in opcodes)
    local = [m for m in opcodes if m.split(".")[0] in ("STL", "LDL")]
    warps = compiled.metadata.num_warps
    return dict(registers=int(found["REG"]), spill_bytes=int(found["STACK"]), shared_bytes=compiled.metadata.shared,
                tensor_core=ops["HGMMA"] + ops["HMMA"], ffma=ops["FFMA"], local_stores=ops["STL"],
                local_loads=ops["LDL"], local_bytes=sum(_width(m) for m in local), instructions=sum(ops.values()),
                tensor_flops=tensor_flops(sass, warps),
                divisibility_hints=compiled.asm["ttir"].count("tt.divisibility = 16"),  # arguments marked in its TTIR
                replicated_dots=replicated_dots(compiled.asm["ttgir"]))


HMMA_SHAPES = {"16816": (16, 8, 16), "1688": (16, 8, 8), "16832": (16, 8, 32), "884": (8, 8, 4)}


def tensor_flops(sass: str, num_warps: int) -> int:
    """FLOPs a program's tensor-core instructions do, each run once (a loop's body once): an HGMMA M x N x K is a
    warpgroup's (num_warps / 4 of them), an HMMA (16816: m16 n8 k16) a warp's; 2 FLOPs a multiply-add."""
    flops = sum(2 * int(m) * int(n) * int(k) for m, n, k in re.findall(r"\bHGMMA\.(\d+)x(\d+)x(\d+)", sass))
    flops *= max(1, num_warps // 4)
    for shape in re.findall(r"\bHMMA\.(\d+)", sass):
        m, n, k = HMMA_SHAPES.get(shape, (0, 0, 0))
        flops += 2 * m * n * k * num_warps
    return flops


def replicated_dots(ttgir: str) -> int:
    """Tensor-core products whose (M, N) result is smaller than its layout's tile of warps, so that warps hold (and
    compute) the same elements: Triton lays a product whose result flows into another product (a chained dot, as
    P V after Q K^T) with every warp along M (warpsPerCTA [num_warps, 1]); at 8 warps that is 128 rows, and an
    M = 64 result is then held whole by each of the two warpgroups, as many registers a thread as at 4 warps."""
    layouts = {}
    for name_, body in re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<\{(.*)\}>", ttgir, re.M):
        warps = [int(x) for x in re.search(r"warpsPerCTA = \[([\d, ]+)\]", body).group(1).split(",")]
        instr = [int(x) for x in re.search(r"instrShape = \[([\d, ]+)\]", body).group(1).split(",")]
        layouts[name_] = (warps[0] * instr[0], warps[1] * instr[1])
    count = 0
    for line in ttgir.splitlines():
        found = re.search(r"(?:warp_group_dot|tt\.dot) .*-> tensor<(\d+)x(\d+)x\w+, (#mma\d*)>", line)
        if found:
            rows, cols, layout = int(found.group(1)), int(found.group(2)), found.group(3)
            count += layouts[layout][0] > rows or layouts[layout][1] > cols
    return count


def _width(opcode: str) -> int:
    """Bytes a thread moves in one local-memory instruction (STL, STL.64, STL.128, LDL.U8 ...)."""
    bits = re.search(r"\.(128|64|U8|S8|U16|S16)\b", opcode)
    return {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}[bits.group(1)] if bits else 4
