"""What the Triton kernels share: launch sizes, the half dtypes, and a tensor-core product of bounded operands.

Loops over a runtime length are ``for ... in range(start, end, step)`` loops, which Triton software-pipelines on a
GPU (a ``while`` loop it does not); Triton's interpreter takes their runtime bounds from 3.9 on (3.6's fails with
NumPy >= 2.4), so the tests need Triton >= 3.9, while a GPU runs any Triton its torch ships (3.6 with torch 2.11).
"""
import functools
import json
import os
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..packed_heads import head_stride, packed_siblings

HALF = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # the input dtypes the kernels take
TINY = tl.constexpr(1e-30)  # the smallest denominator, as ``lln/features._TINY`` (a constexpr: kernels read it)

# Launch settings per kernel (warps, pipeline stages, BF and BV: features and value columns per program of a walk
# over the chunks, of the non-causal LLN readout and backward's rows, or of the block softmax's backward (BF, BV at
# most D's and Dv's block: the whole of it), SPLIT: chunks a segment of a walk (``walk_grid``), BLOCK: rows a step
# of the Nyström state and backward ((BLOCK, BJ) tiles of C, dE or their transposes in registers; BJ: the backward's
# landmarks a step of its rows' kernel or a program of its landmarks', at most L's block; the state's: all L), TF32:
# the products of unbounded fp32 operands on tensor cores, in tf32 (true) or tf32x3 ("x3"), instead of exact fp32
# FMAs (false); ``wide_dot``).
# Chosen so that no kernel spills registers at D = 64 where a setting can avoid it: exact fp32 products of 64x64
# tiles are FMAs whose operands fill a thread's 255 registers, and a spilled tile goes to local memory and back at
# each use, which bounds a kernel's time (docs/design.md §1.3.1, *Registers*; what each setting spills, read from
# the sm_90 binaries, is in docs/benchmarks.md).
# LINATTN_TRITON_LAUNCH='{"kernel": {"num_warps": 8}}' overrides them (tuning).
LAUNCH = {"lln_key_max": dict(num_warps=4, num_stages=2),
          "lln_causal_ends": dict(BF=16, BV=128, num_warps=4, num_stages=2),
          "lln_causal_states": dict(BF=16, BV=128, SPLIT=32, num_warps=4, num_stages=2),
          "lln_causal_outputs": dict(BF=64, BV=64, num_warps=4, num_stages=1, TF32=True),
          "lln_causal_grad_ends": dict(BF=16, BV=128, num_warps=4, num_stages=2, TF32=True),
          "lln_causal_grad_states": dict(BF=16, BV=128, SPLIT=32, num_warps=4, num_stages=2, TF32=True),
          "lln_causal_grads": dict(BF=16, BV=128, num_warps=4, num_stages=1, TF32=True),
          "lln_causal_value_grads": dict(BF=64, BV=64, num_warps=4, num_stages=1, TF32=True),
          "lln_noncausal_state": dict(num_warps=4, num_stages=2),
          "lln_noncausal_readout": dict(BV=64, num_warps=8, num_stages=1),
          "lln_noncausal_state_grad": dict(num_warps=8, num_stages=2),
          "lln_noncausal_rows_grad": dict(BF=64, BV=64, num_warps=4, num_stages=1, TF32=True),
          "block_softmax": dict(num_warps=4, num_stages=1),
          "block_softmax_backward": dict(BF=64, BV=64, num_warps=4, num_stages=1, TF32=True),
          "nystrom_state": dict(BLOCK=32, num_warps=8, num_stages=2),
          "nystrom_readout": dict(num_warps=4, num_stages=1, TF32=True),
          "nystrom_rows_grad": dict(BLOCK=16, BJ=128, num_warps=8, num_stages=1, TF32=True),
          "nystrom_landmarks_grad": dict(BLOCK=16, BJ=128, num_warps=8, num_stages=1, TF32=True),
          "nystrom_inverse": dict(BLOCK=32, BK=16, num_warps=4, num_stages=1, TF32="x3"),
          "nystrom_inverse_grad": dict(BLOCK=16, BK=16, num_warps=4, num_stages=1, TF32="x3"),
          "lavo_local": dict(BLOCK=64, BK=64, num_warps=4, num_stages=1),
          "lavo_memory": dict(BLOCK=64, num_warps=4, num_stages=1, TF32=True),
          "lavo_memory_grad": dict(BLOCK=32, num_warps=4, num_stages=1, TF32=True),
          "lavo_bases_grad": dict(BLOCK=32, COLS=64, num_warps=4, num_stages=1, TF32=True),
          "lavo_local_query_grad": dict(BLOCK=32, BK=32, num_warps=4, num_stages=1, TF32=True),
          "lavo_local_grad": dict(BLOCK=16, BK=32, COLS=64, num_warps=4, num_stages=1, TF32=True),
          "lln_token_moments": dict(num_warps=8, num_stages=1),
          # one program over a layer's G <= H groups; float64 products and sums rounded apart (no FMA), as PyTorch's
          "lln_moment_scales": dict(num_warps=1, num_stages=1, enable_fp_fusion=False),
          "lln_moment_fold": dict(num_warps=1, num_stages=1, enable_fp_fusion=False)}

# At D or Dv over 64 (blocks of 128), where ``LAUNCH``'s settings would spill more: more warps for the kernels that
# spill less with them (docs/benchmarks.md, Fused kernels' registers, D = 128), the Nyström backward's tiles cut to
# a block of landmarks on 4 warps, two blocks an SM (its rows 64 a step over 16 landmarks at a time, each block's
# rows of L and W read again: not held, as all 128 took 168 KiB of shared memory; its landmarks 64 a program),
# fewer value columns a program for the non-causal ``_readout`` (32: two blocks an SM on 8 warps), and the causal
# LLN kernels' tiles cut to (C, 32) or (C, 64) on 4 warps, two blocks an SM: ``_outputs`` and ``_value_grads`` step
# over 32 features, ``_grads`` over 32 value columns (of its 32 features), the backward's walk takes 64 (BF, BV;
# ``_outputs``' BV splits it over programs of 64 value columns). LAVO's stay on 4 warps at two blocks an SM by
# fewer columns of D a product's step (BK) or fewer rows a step (BLOCK).
# At D = 64 LAUNCH keeps a 64-row tile's kernels at two or more blocks an SM: on 4 warps (at most 255 registers a
# thread, and no product replicated across warpgroups: at 8 warps a chained product's 64 rows are held and computed
# by both, docs/design.md §1.3.1, *Replicated products*), or on 8 where a kernel holds at most 128 (the non-causal
# ``_readout`` and ``_state_grad``, their products of half operands; the Nyström backward's two, 16 rows a step).
LAUNCH_128 = {"nystrom_rows_grad": dict(BLOCK=64, BJ=16, num_warps=4),
              "nystrom_landmarks_grad": dict(BJ=64, num_warps=4), "block_softmax": dict(num_warps=8),
              "lln_causal_ends": dict(num_warps=8),
              "lln_causal_outputs": dict(BF=32), "lln_causal_grad_ends": dict(BV=64),
              "lln_causal_grad_states": dict(BV=64), "lln_causal_grads": dict(BF=32, BV=32),
              "lln_causal_value_grads": dict(BF=32), "lln_noncausal_readout": dict(BV=32, num_warps=8),
              "lln_noncausal_state": dict(num_warps=8), "lln_noncausal_rows_grad": dict(num_warps=8),
              "lavo_local": dict(BK=32), "lavo_memory": dict(BLOCK=16),
              "lavo_bases_grad": dict(BLOCK=16, COLS=32),
              "lavo_local_grad": dict(COLS=32)}

# Under Triton's interpreter a program costs about 0.2 ms a block operation whatever the block's size (and a call
# of a jit function about as much again): there the M^-1 kernels' passes over blocks of rows (BLOCK) and steps of
# the inner dimension (BK) take the whole matrix at once (0: d's block), and their products are exact fp32 (one
# operation, where tf32x3's emulation takes a dozen), which keeps an op at seconds, not minutes. LAUNCH's own
# sizes and tf32x3 are tested set explicitly (tests/ops/skyformer/test_nystrom_inverse_fused.py).
INTERPRETED = {"nystrom_inverse": dict(BLOCK=0, BK=0, TF32=False),
               "nystrom_inverse_grad": dict(BLOCK=0, BK=0, TF32=False)}

# A kernel's TF32 setting -> its ``wide_dot`` WIDE (one more under Triton's interpreter: the rounding emulated)
TF32_SETTINGS = {False: 0, True: 1, "x3": 3}


def launch(kernel: str, d: int, dv: int = 0) -> dict:
    """The launch keywords of ``kernel`` (a key of ``LAUNCH``) at head size d (value size dv, default d), with
    ``LAUNCH_128``'s where either needs a block of 128: BF and BV at most d's and dv's block; TF32 (false, true or
    "x3") as the kernel's ``WIDE`` (``wide_dot``: 0 exact fp32, 1 tf32, 3 tf32x3; 2 and 4 the same emulated under
    Triton's interpreter). Worked out once per kernel, sizes, ``LINATTN_TRITON_LAUNCH`` value and table (every
    kernel call asks)."""
    return dict(_settings(kernel, d, dv, *_launch_key()))


def _launch_key() -> tuple:
    """What launch settings read besides the kernel and sizes: ``LINATTN_TRITON_LAUNCH``, whether under Triton's
    interpreter, and the ids of the tables (a table replaced, as a test does, is another key)."""
    return (os.environ.get("LINATTN_TRITON_LAUNCH", "{}"), os.environ.get("TRITON_INTERPRET") == "1",
            id(LAUNCH), id(LAUNCH_128), id(INTERPRETED))


@functools.lru_cache(maxsize=256)
def _settings(kernel: str, d: int, dv: int, overrides: str, interpret: bool, *tables: int) -> tuple:
    """``launch``'s keywords as (name, value) pairs; ``tables``: the ids of the tables read (a table replaced, as a
    test does, is another key)."""
    wide_block = LAUNCH_128.get(kernel, {}) if block(max(d, dv)) > 64 else {}
    interpreted = INTERPRETED.get(kernel, {}) if interpret else {}
    settings = {**LAUNCH[kernel], **wide_block, **interpreted, **json.loads(overrides).get(kernel, {})}
    if "BF" in settings:
        settings["BF"] = min(settings["BF"], block(d))
    if "BV" in settings:
        settings["BV"] = min(settings["BV"], block(dv or d))
    if "TF32" in settings:
        tf32 = settings.pop("TF32")
        if tf32 not in TF32_SETTINGS:
            raise ValueError(f"{kernel}: TF32 must be false, true or \"x3\", got {tf32!r}")
        wide = TF32_SETTINGS[tf32]
        settings["WIDE"] = wide + 1 if wide and interpret else wide
    return tuple(settings.items())


class Walk(NamedTuple):
    """One launch of a walk over the chunks (``walk_grid``): its grid, the most serial steps a program of it takes
    (chunks, and the segments it carries in), its segments' chunks and its launch keywords."""
    grid: Tuple[int, int, int]
    steps: int
    seg: int
    settings: Mapping


def walk_grid(b: int, h: int, n: int, d: int, dv: int, chunk: int, backward: bool = False) -> Tuple[Walk, Walk]:
    """The two launches of causal LLN's walk over its n / chunk chunks (``lln_causal._states``, or the backward's
    ``lln_causal_backward._grad_states``), in segments of SPLIT chunks (the walk's ``LAUNCH``), a program a head,
    segment, block of BF features and block of BV value columns: the ends (each segment walked from a zero state, its
    end stored: every segment but the last, or the first backward, which no other segment reads; none if one) and
    the walk (each segment from its carry over the ends before it, or after it backward: a step a segment, then a
    step a chunk). A fixed count of launches whatever n; the wrappers launch these grids. Worked out once per shape
    and launch settings (``_launch_key``); the settings read-only."""
    return _walks(b, h, n, d, dv, chunk, backward, *_launch_key())


@functools.lru_cache(maxsize=1024)
def _walks(b: int, h: int, n: int, d: int, dv: int, chunk: int, backward: bool, *key) -> Tuple[Walk, Walk]:
    """``walk_grid``'s launches; ``key``: ``_launch_key()``, read by ``launch`` again."""
    ends = launch("lln_causal_grad_ends" if backward else "lln_causal_ends", d, dv)
    walk = launch("lln_causal_grad_states" if backward else "lln_causal_states", d, dv)
    nc = cdiv(n, chunk)
    seg = min(walk.pop("SPLIT"), nc)
    if seg < 1:
        raise ValueError(f"SPLIT must be 1 or more chunks, got {seg}")
    nseg = cdiv(nc, seg)
    ends, walk = MappingProxyType(ends), MappingProxyType(walk)
    return (Walk((b * h * (nseg - 1), cdiv(d, ends["BF"]), cdiv(dv, ends["BV"])), seg if nseg > 1 else 0, seg, ends),
            Walk((b * h * nseg, cdiv(d, walk["BF"]), cdiv(dv, walk["BV"])), nseg - 1 + seg, seg, walk))


def fairseq_layout(x: torch.Tensor) -> bool:
    """Whether x (B,H,N,X) is in fairseq's layout, its own (heads X apart) or packed (``head_stride``)."""
    return head_stride(x) is not None


def in_layout(x: torch.Tensor, fairseq: bool) -> torch.Tensor:
    """x (B,H,N,X) in fairseq's own layout (``fairseq``) or contiguous, as the kernels read it (``tile_at`` with X):
    itself where it is so, else a copy."""
    if fairseq:
        return x if head_stride(x) == x.shape[-1] else x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    return x.contiguous()


def each_in_layout(*tensors: torch.Tensor) -> Tuple[bool, Tuple[int, ...], Tuple[torch.Tensor, ...]]:
    """(fairseq, X of each, tensors): each (B,H,N,X) tensor as the kernels read it (``tile_at`` with its X), in the
    first's layout: fairseq's, in place at its head stride (packed too, ``head_stride``) or else copied to fairseq's
    own, or contiguous (X: its width)."""
    if fairseq_layout(tensors[0]):
        tensors = tuple(t if fairseq_layout(t) else in_layout(t, True) for t in tensors)
        return True, tuple(head_stride(t) for t in tensors), tensors
    tensors = tuple(t.contiguous() for t in tensors)
    return False, tuple(t.shape[-1] for t in tensors), tensors


def inputs_in_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor,
                     pack: Optional[bool] = None) -> Tuple[bool, int, int, Tuple[torch.Tensor, ...]]:
    """(fairseq, SQK, SV, (q, k, v, *rest)): q, k, v (B,H,N,D|Dv) as the kernels read them and write their gradients
    (``new_grads``), at X = SQK for q and k, SV for v (``tile_at``): in place where ``pack`` (a backward op's, as
    its gradients are laid out; None, a forward op's: where they are ``packed_siblings``: SQK = SV = 2D+Dv), else
    in q's layout, fairseq's own or contiguous (``in_layout``: SQK = D, SV = Dv); the ``rest`` likewise in their
    own."""
    fairseq = fairseq_layout(q)
    rest = tuple(in_layout(t, fairseq) for t in rest)
    if packed_siblings(q, k, v) if pack is None else pack:
        if not packed_siblings(q, k, v):  # asked to pack apart tensors: one packed copy of them
            *parts, _ = packed_parts(q, v)
            q, k, v = (part.copy_(t) for part, t in zip(parts, (q, k, v)))
        return True, head_stride(q), head_stride(v), (q, k, v, *rest)
    q, k, v = (in_layout(t, fairseq) for t in (q, k, v))
    return fairseq, q.shape[-1], v.shape[-1], (q, k, v, *rest)


def new_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: bool) -> Tuple[torch.Tensor, ...]:
    """Empty dq, dk, dv laid out as ``inputs_in_layout(..., pack=pack)`` lays out q, k, v, and the ``packed`` tensor
    they lie in: if ``pack`` (its caller's ``packed_heads.packs_grads``), ``packed_parts``; else each with the rows
    of its input in q's layout (``new_rows``), ``packed`` a stand-in (0,). A backward op returns ``op_grads`` of
    them: their shapes follow ``pack`` alone, not how q, k, v alias (what ``torch.compile`` and ``opcheck`` need)."""
    if pack:
        return packed_parts(q, v)
    return (*(new_rows(t, t.shape[-1], q.dtype, q) for t in (q, k, v)), q.new_empty(0))


def packed_parts(q: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Three empty (B,H,N,D), (B,H,N,D), (B,H,N,Dv) packed siblings (``packed_siblings``: the module's packed
    projection's layout) of q's shape and dtype, and the (B,H,N,2D+Dv) tensor they are views of."""
    b, h, n, d = q.shape
    packed = q.new_empty((n, b, h, 2 * d + v.shape[-1])).permute(1, 2, 0, 3)
    return packed[..., :d], packed[..., d:2 * d], packed[..., 2 * d:], packed


def op_grads(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, packed: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """What a backward op returns of ``new_grads`` (a custom op's outputs may not alias one another): (dq, dk, dv,
    stand-in), or three stand-ins and ``packed``, which holds dq, dk, dv (``grads_of`` takes them apart)."""
    if packed.dim() == 4:
        return packed.new_empty(0), packed.new_empty(0), packed.new_empty(0), packed
    return dq, dk, dv, packed


def grads_of(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, packed: torch.Tensor,
             d: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (head size d) from what a backward op returned (``op_grads``): views of ``packed`` where it holds
    them."""
    if packed.dim() == 4:
        return packed[..., :d], packed[..., d:2 * d], packed[..., 2 * d:]
    return dq, dk, dv


def new_rows(like: torch.Tensor, width: int, dtype: torch.dtype,
             layout_of: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An empty (B,H,N,width) tensor with the rows of ``like`` (B,H,N,X), in fairseq's layout if ``layout_of``
    (default: like) is, else contiguous: an op's outputs all take q's, the layout its kernels read (``in_layout``)."""
    b, h, n, _ = like.shape
    if fairseq_layout(like if layout_of is None else layout_of):
        return like.new_empty((n, b, h, width), dtype=dtype).permute(1, 2, 0, 3)
    return like.new_empty((b, h, n, width), dtype=dtype)


def mask_bytes(mask: Optional[torch.Tensor], stand_in: torch.Tensor) -> torch.Tensor:
    """A (B,N) bool key padding mask as the kernels read it (a byte a key, nonzero = padded): its bytes viewed as
    uint8, no copy (a conversion would be a launch on every call), contiguous; ``stand_in`` (never read) for none."""
    return stand_in if mask is None else mask.contiguous().view(torch.uint8)


@triton.jit
def tile_at(pid, rows, cols, R, X, BH, FAIRSEQ: tl.constexpr):
    """Offsets (rows, cols) of head ``pid``'s rows ``rows`` and columns ``cols`` (B*H order) in a (B,H,R,·) tensor
    (``in_layout``): fairseq's (heads X apart, rows BH*X apart: X the head stride, ``head_stride``) or contiguous
    (heads R*X apart, rows X). Tensors of one layout and X share the offsets."""
    if FAIRSEQ:
        return pid * X + rows[:, None] * (BH * X) + cols[None, :]
    return pid * R * X + rows[:, None] * X + cols[None, :]


def block(n: int) -> int:
    """The power-of-two block (>= 16, the smallest tensor-core tile) that holds n rows or columns."""
    return max(16, next_power_of_2(n))


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (>= 1), on the host: ``triton.next_power_of_2`` and ``triton.cdiv`` are
    constexpr functions, a few µs a call, and a step calls these a few dozen times."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of positive ints, on the host (``next_power_of_2``)."""
    return -(-a // b)


def emulate_half_dot(dtype: torch.dtype) -> bool:
    """Whether ``half_dot`` multiplies its rounded operands in fp32: under Triton's interpreter (3.6 to 3.9 at
    least) a bf16 ``tl.dot`` multiplies the raw bits as integers, and fp32 -> bf16 truncates (a GPU rounds to
    nearest); a product of two halves is exact in fp32."""
    return os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16


@triton.jit
def half_dot(a, b, HALF_TY: tl.constexpr, EMULATE: tl.constexpr):
    """a (M,K) @ b (K,N) with both rounded to HALF_TY (tensor cores on a GPU), accumulated in fp32; for operands
    bounded in magnitude (features <= 1 after their shifts, values as given, normalised states). EMULATE: bf16's
    rounding to nearest by bit arithmetic (``_round_bf16``), the products in fp32."""
    if EMULATE:
        return tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a.to(HALF_TY), b.to(HALF_TY), out_dtype=tl.float32)


@triton.jit
def _round_bf16(x):
    """Finite fp32 x rounded to bf16's 7-bit mantissa, to nearest (ties to even, as PTX's cvt.rn.bf16.f32), kept in
    fp32: Triton's interpreter truncates the conversion."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def wide_dot(a, b, WIDE: tl.constexpr):
    """a (M,K) @ b (K,N) of unbounded fp32 operands (output gradients, states) in fp32: WIDE 0, exact products (FMA
    units); 1, both rounded to tf32 (10-bit mantissa, fp32's range) on tensor cores; 3, tf32x3: each operand split
    into its tf32 rounding and the tf32 rounding of the rest, three tensor-core products (big·big + big·small +
    small·big), close to fp32's accuracy; 2 and 4, the same roundings under the interpreter (which multiplies a
    tf32 ``tl.dot`` in fp32), each rounded product exact in fp32."""
    if WIDE == 1:
        return tl.dot(a, b, input_precision="tf32")
    if WIDE == 2:
        return tl.dot(_round_tf32(a), _round_tf32(b), input_precision="ieee")
    if WIDE == 3:
        return tl.dot(a, b, input_precision="tf32x3")
    if WIDE == 4:
        a_big = _round_tf32(a)
        b_big = _round_tf32(b)
        small = tl.dot(a_big, _round_tf32(b - b_big), input_precision="ieee")
        small += tl.dot(_round_tf32(a - a_big), b_big, input_precision="ieee")
        return small + tl.dot(a_big, b_big, input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _round_tf32(x):
    """fp32 x rounded to tf32's 10-bit mantissa (to nearest, ties away from zero, as PTX's cvt.rna.tf32; a tensor
    core fed raw fp32 drops the low bits instead: at most one tf32 ulp apart)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def block_rows(mask_ptr, blk, pid, H, N, SIZE, BR: tl.constexpr, HAS_MASK: tl.constexpr):
    """Block ``blk`` of SIZE rows (in BR >= SIZE lanes) of head ``pid`` (B*H order; mask (B,N), True = padded):
    the lane index, the row index, whether the row is inside the sequence, and whether it holds a visible key."""
    i = tl.arange(0, BR)
    rows = blk * SIZE + i
    ok = (i < SIZE) & (rows < N)
    key_ok = ok
    if HAS_MASK:
        key_ok = ok & (tl.load(mask_ptr + (pid // H) * N + rows, mask=ok, other=1) == 0)
    return i, rows, ok, key_ok


@triton.jit
def load_state(ptr, at, D, DV, BD: tl.constexpr, BDV: tl.constexpr):
    """A state [S, z] stored (D, DV+1) fp32 at ``ptr + at``: S (BD, BDV) and z (BD,), 0 outside."""
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    row = ptr + at + d * (DV + 1)
    return (tl.load(row[:, None] + e[None, :], mask=(d[:, None] < D) & (e[None, :] < DV), other=0.0),
            tl.load(row + DV, mask=d < D, other=0.0))
