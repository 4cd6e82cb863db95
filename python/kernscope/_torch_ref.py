"""backend="torch": the numerical contracts of docs/contracts.md written in PyTorch.

These are the references the native backends are held to, with the same
validation rules and the same exception classes. They run on any torch device,
are traceable by torch.compile, and support autograd for rms_norm,
silu_and_mul, gemv and softmax (the formulas are plain differentiable torch ops;
embedding, gemm, quant_matmul, its two fusions (activations) and paged_attention are
differentiable too, but only the first four are tested with gradcheck; quant_matmul_a8's
gradient reaches x only through its block scales, its codes being rounded).

Precision: fp16/bf16/fp32 inputs are upcast to FP32 and rounded once to the
input dtype at the end, as the contract says (the quant_matmul fusions also
round their normalised or gated activations to the input dtype in between, as
the unfused ops store them, and the one-token norm + q/k/v matmul + RoPE + cache
append fusion rounds its matmul output before the rotation, as the two calls
it stands for). fp64 inputs (not a kernscope dtype; accepted here
so torch.autograd.gradcheck can run) are computed in fp64.

This module is imported only when backend="torch" is used (or autograd routes a
call here), so kernscope does not need torch otherwise.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from ._errors import InvalidArgumentError, KernscopeError, UnsupportedDeviceError, UnsupportedDtypeError

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX = (torch.int32, torch.int64)
_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8"}
# ks_qtype_t -> (block elements, block bytes)
_QGEOM = {1: (1, 4), 2: (1, 2), 3: (1, 2), 4: (32, 18), 5: (32, 20), 6: (32, 34)}
_QNAMES = {1: "F32", 2: "F16", 3: "BF16", 4: "Q4_0", 5: "Q4_1", 6: "Q8_0"}


# ---- validation (mirrors src/core/common.cpp) --------------------------------
def _dname(t: torch.Tensor) -> str:
    return _NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _shape(s) -> str:
    s = tuple(s)
    return "(" + ", ".join(str(int(v)) for v in s) + ("," if len(s) == 1 else "") + ")"


def _tensor(op: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor for backend='torch'; got {type(t).__name__}")
    if not t.is_contiguous():
        broadcast = any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))
        raise InvalidArgumentError(
            f"{op}: {name} must be contiguous (row-major); got shape {_shape(t.shape)} strides {_shape(t.stride())}"
            + ("; a stride of 0 is a broadcast (expanded) view" if broadcast else "")
            + ": copy it to a contiguous tensor first")
    return t


def _float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise UnsupportedDtypeError(f"{op}: {name} has dtype {_dname(t)}; expected one of: fp16, bf16, fp32")


def _index(op: str, name: str, t: torch.Tensor, allowed=_INDEX) -> None:
    if t.dtype not in allowed:
        names = ", ".join(_NAMES[d] for d in allowed)
        raise UnsupportedDtypeError(f"{op}: {name} has dtype {_dname(t)}; expected one of: {names}")


def _same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise UnsupportedDtypeError(
            f"{op}: {name} has dtype {_dname(t)} but {ref_name} has {_dname(ref)}; they must match")


def _same_device(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise UnsupportedDeviceError(
            f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; they must share a device")


def _min_ndim(op: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() < n:
        raise InvalidArgumentError(f"{op}: {name} must have at least {n} dims; got shape {_shape(t.shape)}")


def _ndim(op: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != n:
        raise InvalidArgumentError(f"{op}: {name} must have {n} dims; got shape {_shape(t.shape)}")


def _nonempty_last(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() == 0 or t.shape[-1] == 0:
        raise InvalidArgumentError(f"{op}: {name} must have a non-empty last dimension; got shape {_shape(t.shape)}")


def _require_shape(op: str, name: str, t: torch.Tensor, shape, why: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise InvalidArgumentError(f"{op}: {name} must have shape {_shape(shape)} ({why}); got {_shape(t.shape)}")


def check_out(op: str, y: torch.Tensor, out, ref: Optional[str], why: str) -> None:
    """out for the torch path's result y (ops._finish): a contiguous torch.Tensor of y's dtype,
    device and shape, in the native messages' words (ref: the input whose dtype out shares, whose
    dtype y has; None where out's dtype is fixed; why: the native shape check's reason)."""
    out = _tensor(op, "out", out)
    if out.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8):
        hint = (" (convert float64 values to float32 first, or float64 indices to int64)"
                if out.dtype == torch.float64 else "")
        raise UnsupportedDtypeError(  # (the native DLPack check's words, src/core/common.cpp)
            f"{op}: out has unsupported dtype {str(out.dtype).replace('torch.', '')}; kernscope takes float16, "
            f"bfloat16 and float32 values, int32 / int64 indices and uint8 packed blocks, each where the op's "
            f"argument is one{hint}")
    if out.dtype != y.dtype:
        if ref is None:
            raise UnsupportedDtypeError(f"{op}: out has dtype {_dname(out)}; expected one of: {_dname(y)}")
        raise UnsupportedDtypeError(f"{op}: out has dtype {_dname(out)} but {ref} has {_dname(y)}; they must match")
    if out.device != y.device:
        raise UnsupportedDeviceError(f"{op}: out is on {out.device} but {ref or 'the result'} is on {y.device}; "
                                     "they must share a device")
    _require_shape(op, "out", out, y.shape, why)


# Rounding to fp32 (nearest-even) gives 0 at or below 2^-150 and inf at or above
# 2^128 - 2^103 (pure Python, so torch.compile traces it without a graph break).
_FP32_ROUNDS_TO_ZERO = 2.0 ** -150
_FP32_ROUNDS_TO_INF = 2.0 ** 128 - 2.0 ** 103


def _eps(op: str, eps: float) -> float:
    e = float(eps)
    if not math.isfinite(e) or not e > 0.0:
        raise InvalidArgumentError(f"{op}: eps must be finite and > 0; got {eps}")
    if e <= _FP32_ROUNDS_TO_ZERO or e >= _FP32_ROUNDS_TO_INF:
        raise InvalidArgumentError(
            f"{op}: eps must be representable as a positive finite fp32 value; got {eps}"
            + (" (0 in fp32)" if e <= _FP32_ROUNDS_TO_ZERO else " (inf in fp32)"))
    return e


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Data pointers are not traceable: under torch.compile the check is skipped.
    if _compiling() or a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _no_overlap(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if _overlap(a, b):
        raise InvalidArgumentError(f"{op}: {a_name} and {b_name} overlap in memory; they must not")


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _no_autocast(t: torch.Tensor):
    dev = t.device.type
    try:
        enabled = torch.is_autocast_enabled(dev)
    except TypeError:  # torch < 2.4
        enabled = torch.is_autocast_enabled()
    return torch.autocast(dev, enabled=False) if enabled else contextlib.nullcontext()


def _first_bad(mask: torch.Tensor) -> Optional[int]:
    # Data-dependent: skipped under torch.compile (no graph break, no host sync).
    if _compiling():
        return None
    flat = mask.reshape(-1)
    if not bool(flat.any()):
        return None
    return int(flat.nonzero()[0, 0])


# ---- the five core operators ------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    op = "rms_norm"
    _tensor(op, "x", x), _tensor(op, "weight", weight)
    _float(op, "x", x)
    _same_dtype(op, "weight", weight, "x", x)
    _same_device(op, "weight", weight, "x", x)
    _nonempty_last(op, "x", x)
    _require_shape(op, "weight", weight, (x.shape[-1],), "hidden_size of x")
    eps = _eps(op, eps)
    acc = _acc(x)
    xf = x.to(acc)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * r * weight.to(acc)).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    op = "fused_add_rms_norm"
    _tensor(op, "x", x), _tensor(op, "residual", residual), _tensor(op, "weight", weight)
    _float(op, "x", x)
    _same_dtype(op, "residual", residual, "x", x)
    _same_dtype(op, "weight", weight, "x", x)
    _same_device(op, "residual", residual, "x", x)
    _same_device(op, "weight", weight, "x", x)
    _nonempty_last(op, "x", x)
    _require_shape(op, "residual", residual, x.shape, "same as x")
    _require_shape(op, "weight", weight, (x.shape[-1],), "hidden_size of x")
    eps = _eps(op, eps)
    _no_overlap(op, "x", x, "residual", residual)
    _no_overlap(op, "x", x, "weight", weight)
    _no_overlap(op, "residual", residual, "weight", weight)
    acc = _acc(x)
    s = x.to(acc) + residual.to(acc)  # unrounded FP32 sum
    y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * weight.to(acc)
    residual.copy_(s)
    x.copy_(y)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    op = "silu_and_mul"
    _tensor(op, "x", x)
    _float(op, "x", x)
    _nonempty_last(op, "x", x)
    if x.shape[-1] % 2:
        raise InvalidArgumentError(
            f"{op}: x's last dimension must be even (gate and up halves); got shape {_shape(x.shape)}")
    d = x.shape[-1] // 2
    xf = x.to(_acc(x))
    g, u = xf[..., :d], xf[..., d:]
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    op = "gemv"
    _tensor(op, "x", x), _tensor(op, "weight", weight)
    _float(op, "x", x)
    _same_dtype(op, "weight", weight, "x", x)
    _same_device(op, "weight", weight, "x", x)
    _ndim(op, "x", x, 1)
    _nonempty_last(op, "x", x)
    _ndim(op, "weight", weight, 2)
    if weight.shape[1] != x.shape[0]:
        raise InvalidArgumentError(
            f"{op}: weight must have shape (N, {x.shape[0]}) to match x; got {_shape(weight.shape)}")
    acc = _acc(x)
    with _no_autocast(x):
        return torch.mv(weight.to(acc), x.to(acc)).to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    op = "softmax"
    _tensor(op, "x", x)
    _float(op, "x", x)
    _nonempty_last(op, "x", x)
    with _no_autocast(x):
        return torch.softmax(x.to(_acc(x)), dim=-1).to(x.dtype)


# ---- model-path operators ----------------------------------------------------
def argmax(x: torch.Tensor) -> torch.Tensor:
    op = "argmax"
    _tensor(op, "x", x)
    _float(op, "x", x)
    if x.dim() < 1:
        raise InvalidArgumentError(f"{op}: x must have at least 1 dims; got shape {_shape(x.shape)}")
    _nonempty_last(op, "x", x)
    return torch.argmax(x.to(_acc(x)), dim=-1)


def _check_packed(op: str, name: str, packed: torch.Tensor, qtype: int, cols: Optional[int],
                  cols_what: str) -> int:
    """Validates packed uint8 rows [R, row_bytes] of cols columns in a GGUF block format (cols
    None: as many as the rows hold); returns cols."""
    if qtype not in _QGEOM:
        raise InvalidArgumentError(f"{op}: qtype {qtype} is not a packed format")
    bs, bb = _QGEOM[qtype]
    _index(op, name, packed, (torch.uint8,))
    _ndim(op, name, packed, 2)
    rows, row_bytes = packed.shape
    if cols is None:
        cols = row_bytes // bb * bs
    if cols % bs:
        raise InvalidArgumentError(
            f"{op}: {cols_what} = {cols} is not a multiple of the {_QNAMES[qtype]} block size {bs} "
            f"({name}'s rows are whole blocks)")
    if row_bytes != cols // bs * bb:
        raise InvalidArgumentError(
            f"{op}: {name} must have {cols // bs * bb} bytes per row for {cols} {_QNAMES[qtype]} columns, "
            f"from {cols_what}; got shape {_shape(packed.shape)}")
    return cols


def _decode(op: str, name: str, packed: torch.Tensor, qtype: int, cols: Optional[int] = None,
            cols_what: str = "columns") -> torch.Tensor:
    """FP32 values of packed uint8 rows [R, row_bytes] in a GGUF block format."""
    cols = _check_packed(op, name, packed, qtype, cols, cols_what)
    bs, bb = _QGEOM[qtype]
    rows = packed.shape[0]
    if qtype in (1, 2, 3):
        # (a byte view reinterpreted as wider elements needs its storage offset a multiple of the
        # element size: an offset view, which the contract allows, is copied to fresh storage first)
        dense = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}[qtype]
        if packed.storage_offset() % dense.itemsize:
            packed = packed.clone()
        return packed.view(dense).float() if qtype != 1 else packed.view(dense).clone()
    nb = cols // bs
    blk = packed.reshape(rows, nb, bb)

    def half(lo: int) -> torch.Tensor:  # f16 scalar at byte lo of each block -> [rows, nb, 1]
        return blk[..., lo:lo + 2].contiguous().view(torch.float16).float()

    if qtype == 6:  # Q8_0: f16 d, 32 int8
        d = half(0)
        q = blk[..., 2:].contiguous().view(torch.int8).float()
        w = d * q
    else:
        codes = blk[..., 2:] if qtype == 4 else blk[..., 4:]
        q = torch.cat([codes & 0xF, codes >> 4], dim=-1).float()  # j < 16: low nibble of byte j
        d = half(0)
        w = d * (q - 8.0) if qtype == 4 else d * q + half(2)
    return w.reshape(rows, cols)


def embedding(ids: torch.Tensor, table: torch.Tensor, table_format: int = 0,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    op = "embedding"
    _tensor(op, "ids", ids), _tensor(op, "table", table)
    _index(op, "ids", ids)
    _same_device(op, "ids", ids, "table", table)
    _ndim(op, "table", table, 2)
    vocab = table.shape[0]
    bad = _first_bad((ids < 0) | (ids >= vocab))
    if bad is not None:
        raise InvalidArgumentError(
            f"{op}: ids[{bad}] = {int(ids.reshape(-1)[bad])} is outside [0, {vocab})")
    flat = ids.reshape(-1).long()
    if table_format == 0:
        _float(op, "table", table)
        if dtype is not None and dtype != table.dtype:
            raise UnsupportedDtypeError(
                f"{op}: a dense table's rows are copied exactly: dtype must be the table's ({_dname(table)})")
        rows = table.index_select(0, flat)
        out_dtype = table.dtype
    else:
        out_dtype = dtype if dtype is not None else torch.float32
        if out_dtype not in _FLOATS[:3]:
            raise UnsupportedDtypeError(f"{op}: out has dtype {out_dtype}; expected one of: fp16, bf16, fp32")
        rows = _decode(op, "table", table.index_select(0, flat), table_format).to(out_dtype)
    return rows.reshape(*ids.shape, rows.shape[-1]).to(out_dtype)


def dequantize(packed: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    op = "dequantize"
    _tensor(op, "packed", packed)
    if dtype not in _FLOATS[:3]:
        raise UnsupportedDtypeError(f"{op}: out has dtype {dtype}; expected one of: fp16, bf16, fp32")
    return _decode(op, "packed", packed, qtype).to(dtype)


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    op = "gemm"
    _tensor(op, "a", a), _tensor(op, "b", b)
    _float(op, "a", a)
    _same_dtype(op, "b", b, "a", a)
    _same_device(op, "b", b, "a", a)
    _min_ndim(op, "a", a, 1)
    _ndim(op, "b", b, 2)
    _nonempty_last(op, "a", a)
    if b.shape[1] != a.shape[-1]:
        raise InvalidArgumentError(f"{op}: b must have shape (N, {a.shape[-1]}) to match a's K; got {_shape(b.shape)}")
    acc = _acc(a)
    with _no_autocast(a):  # (a [..., K]: the matmul broadcasts over the leading dims)
        return (a.to(acc) @ b.to(acc).T).to(a.dtype)


def _check_x_weight(op: str, x, weight) -> None:
    # quant_matmul's and quant_matmul_a8's checks of x and weight before the format's (as the
    # native ops share them)
    _tensor(op, "x", x), _tensor(op, "weight", weight)
    _float(op, "x", x)
    _same_device(op, "weight", weight, "x", x)
    _min_ndim(op, "x", x, 1)
    _nonempty_last(op, "x", x)


def quant_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    op = "quant_matmul"
    _check_x_weight(op, x, weight)
    w = _decode(op, "weight", weight, qtype, cols=x.shape[-1], cols_what="x's K (columns)")
    acc = _acc(x)
    with _no_autocast(x):
        return (x.to(acc) @ w.to(acc).T).to(x.dtype)


# quant_matmul_a8: the integer block formats, and the smallest block scale d that is not zero.
_A8_QTYPES = (4, 5, 6)
_FLT_MIN = 2.0 ** -126


def _block_codes(op: str, name: str, packed: torch.Tensor, qtype: int, cols: int, cols_what: str):
    """(c, dw, mw) of Q4_0 / Q4_1 / Q8_0 rows [R, row_bytes] holding cols columns: c [R, nb, 32] the
    stored codes as int64 (Q4_0 / Q4_1: nibble j < 16 the low nibble of byte j, then the high
    nibbles; Q8_0: the signed byte), dw [R, nb] the fp16 scales and mw [R, nb] the fp16 minimums
    (Q4_1; None otherwise), both as FP32 (exact)."""
    _check_packed(op, name, packed, qtype, cols, cols_what)
    bb = _QGEOM[qtype][1]
    rows, nb = packed.shape[0], cols // 32
    blk = packed.reshape(rows, nb, bb)

    def half(lo: int) -> torch.Tensor:  # the f16 at byte lo of each block -> [rows, nb]
        return blk[..., lo:lo + 2].contiguous().view(torch.float16).float().reshape(rows, nb)

    if qtype == 6:
        c = blk[..., 2:].contiguous().view(torch.int8).long()
    else:
        nib = blk[..., 2:] if qtype == 4 else blk[..., 4:]
        c = torch.cat([nib & 0xF, nib >> 4], dim=-1).long()
    return c, half(0), (half(2) if qtype == 5 else None)


def _a8_quantize(x: torch.Tensor, acc: torch.dtype):
    """(d [M, nb], q [M, nb, 32]) of x [M, K] per docs/contracts.md#quant_matmul_a8, every step one
    rounding in acc (FP32 for the kernscope dtypes): a = max |x_i| over the block's values; a block
    holding a NaN or an infinity gets d = NaN and codes 0; a block with a / 127 < FLT_MIN gets d = 0
    and codes 0; otherwise d = a / 127 and q_i = rint(x_i * (127 / a)) (ties to even) clamped to
    [-127, 127]. The codes are integers held in acc (zero gradient through the rounding)."""
    m, k = x.shape
    xb = x.to(acc).reshape(m, k // 32, 32)
    finite = torch.isfinite(xb)
    bad = ~finite.all(dim=-1)
    xf = torch.where(finite, xb, torch.zeros_like(xb))
    amax = xf.abs().amax(dim=-1)
    # (tensor / tensor: a division by a Python scalar may run as a product with its reciprocal)
    c127 = torch.full_like(amax, 127.0)
    d = torch.div(amax, c127)
    keep = ~bad & (d >= _FLT_MIN)
    safe = torch.where(keep, amax, torch.ones_like(amax))  # no division by 0 where the block is dropped
    inv = torch.where(keep, torch.div(c127, safe), torch.zeros_like(amax))
    q = torch.clamp(torch.round(xf * inv.unsqueeze(-1)), -127.0, 127.0)
    d = torch.where(keep, d, torch.zeros_like(d))
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    return d, q


def _fma_fp32(a64: torch.Tensor, s64: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma(a, s, c) rounded once to FP32, for FP32 a and c and an integer s with |s| < 2^20: a * s
    is exact in FP64; the FP64 sum is rounded to odd (TwoSum's exact error decides the neighbour),
    which makes the rounding to FP32 that follows the single rounding of the exact value (53 >= 24
    + 2 bits)."""
    p = a64 * s64
    c64 = c.double()
    t = p + c64
    bp = t - p
    err = (p - (t - bp)) + (c64 - bp)
    even = (t.view(torch.int64) & 1) == 0
    fix = (err != 0) & even & torch.isfinite(t) & torch.isfinite(err)
    toward = torch.where(err > 0, torch.full_like(t, math.inf), torch.full_like(t, -math.inf))
    return torch.where(fix, torch.nextafter(t, toward), t).float()


def _a8_row_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (nb block values) in the contract's order: lane sums s_l = ((0 + v_l)
    + v_{l+32}) + ... for l < 32, then the butterfly s_l = s_l + s_{l xor o}, o = 16, 8, 4, 2, 1; s_0."""
    nb = v.shape[-1]
    lanes = -(-nb // 32)
    vp = torch.nn.functional.pad(v, (0, lanes * 32 - nb)).reshape(*v.shape[:-1], lanes, 32)
    s = torch.zeros((*v.shape[:-1], 32), dtype=v.dtype, device=v.device)
    for i in range(lanes):  # (a padded 0 leaves every lane sum as it is: each starts at +0)
        s = s + vp[..., i, :]
    lane = torch.arange(32, device=v.device)
    for o in (16, 8, 4, 2, 1):
        s = s + s[..., lane ^ o]
    return s[..., 0]


def quant_matmul_a8(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """quant_matmul with x quantized to int8 per block of 32 (W4A8 / W8A8), written from
    docs/contracts.md#quant_matmul_a8: the codes and scales of x (_a8_quantize), exact integer
    block sums S = sum c_i q_i and Q = sum q_i (FP64, exact: |S| < 2^20), each block's value
    formed in FP32 as the contract writes it (Q4_1's fma rounded once), the row's block values
    summed in FP32 in the contract's fixed order, one rounding to x's dtype. The native
    backends give the same bits (in eager mode). fp64 x (gradcheck only) runs every step in FP64.
    Gradients reach x only through the block scales d (the codes are rounded)."""
    op = "quant_matmul_a8"
    _check_x_weight(op, x, weight)
    if qtype not in _A8_QTYPES:
        names = {0: "none", 1: "F32", 2: "F16", 3: "BF16"}  # the native message's names
        got = f"{names[int(qtype)]} (a dense format: quant_matmul takes it)" if int(qtype) in names else str(int(qtype))
        raise InvalidArgumentError(
            f"{op}: qtype must be an integer block format (Q4_0, Q4_1 or Q8_0); got {got}")
    c, dw, mw = _block_codes(op, "weight", weight, qtype, x.shape[-1], "x's K (columns)")
    lead = x.shape[:-1]  # x [..., K]: the rows of its 2-d view, out [..., N]
    x = x.reshape(-1, x.shape[-1])
    acc = _acc(x)
    with _no_autocast(x):
        d, q = _a8_quantize(x, acc)
        s = torch.einsum("mbi,nbi->mnb", q.double(), c.double())  # exact integer sums [M, N, nb]
        qs = q.sum(dim=-1)  # [M, nb], exact (|Q| <= 32 * 127)
        dd = dw.to(acc).unsqueeze(0) * d.unsqueeze(1)  # dw * d, [M, N, nb]
        if qtype == 6:
            v = dd * s.to(acc)
        elif qtype == 4:
            v = dd * (s - 8.0 * qs.double().unsqueeze(1)).to(acc)
        else:
            mdq = mw.to(acc).unsqueeze(0) * (d * qs).unsqueeze(1)  # mw * (d * Q)
            v = _fma_fp32(dd.double(), s, mdq) if acc == torch.float32 else dd * s + mdq
        return _a8_row_sum(v).to(x.dtype).reshape(*lead, c.shape[0])  # (N explicit: an empty lead has no -1)


def _check_norm_qmm(op: str, x: Optional[torch.Tensor], residual: torch.Tensor, norm_weight: torch.Tensor,
                    weight: torch.Tensor, qtype: int, eps: float, residual_out: Optional[torch.Tensor],
                    out: Optional[torch.Tensor], leading_dims: bool = True):
    """fused_add_rms_norm_quant_matmul's validation (src/ops/matmul_ops.cpp) under op's name, out's
    and the overlaps' too; returns (the decoded weight, eps). leading_dims: residual [..., K] (else
    [M, K] only: the RoPE fusion)."""
    if x is None and residual_out is not None:
        raise InvalidArgumentError(
            f"{op}: residual_out is given but x is missing: residual_out = x + residual needs x")
    _tensor(op, "residual", residual), _tensor(op, "norm_weight", norm_weight), _tensor(op, "weight", weight)
    _float(op, "residual", residual)
    if leading_dims:
        _min_ndim(op, "residual", residual, 1)
    else:
        _ndim(op, "residual", residual, 2)
    _nonempty_last(op, "residual", residual)
    given = [(name, t) for name, t in (("x", x), ("residual_out", residual_out)) if t is not None]
    for name, t in given:
        _tensor(op, name, t)
        _same_dtype(op, name, t, "residual", residual)
    for name, t in given:
        _same_device(op, name, t, "residual", residual)
    for name, t in given:
        _require_shape(op, name, t, residual.shape, "same as residual")
    _same_dtype(op, "norm_weight", norm_weight, "residual", residual)
    _same_device(op, "norm_weight", norm_weight, "residual", residual)
    _same_device(op, "weight", weight, "residual", residual)
    _require_shape(op, "norm_weight", norm_weight, (residual.shape[-1],), "hidden_size (K) of residual")
    w = _decode(op, "weight", weight, qtype, cols=residual.shape[-1], cols_what="residual's K (columns)")
    if out is not None:  # the native op's out checks, before anything is written
        _tensor(op, "out", out)
        _same_dtype(op, "out", out, "residual", residual)
        _same_device(op, "out", out, "residual", residual)
        _require_shape(op, "out", out, (*residual.shape[:-1], weight.shape[0]), "residual's leading dims + (N,)")
    eps = _eps(op, eps)
    inputs = (("residual", residual), ("norm_weight", norm_weight), ("weight", weight), ("x", x))
    for name, t in inputs:
        if t is None:
            continue
        if out is not None:
            _no_overlap(op, "out", out, name, t)
        if residual_out is not None:
            _no_overlap(op, "residual_out", residual_out, name, t)
    if out is not None and residual_out is not None:
        _no_overlap(op, "out", out, "residual_out", residual_out)
    return w, eps


def _norm_qmm(x: Optional[torch.Tensor], residual: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor,
              eps: float):
    """(y, s): quant_matmul of round(rms_norm(s) * norm_weight) with s = x + residual (residual when x
    is None), unrounded FP32; y in residual's dtype."""
    acc = _acc(residual)
    s = residual.to(acc) if x is None else x.to(acc) + residual.to(acc)  # unrounded FP32 sum
    h = (s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * norm_weight.to(acc)).to(residual.dtype)
    with _no_autocast(residual):
        y = (h.to(acc) @ w.to(acc).T).to(residual.dtype)
    return y, s


def _residual_result(x: Optional[torch.Tensor], residual: torch.Tensor, s: torch.Tensor,
                     residual_out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if x is None:
        return None
    if residual_out is None:
        return s.to(residual.dtype)
    residual_out.copy_(s)
    return residual_out


def fused_add_rms_norm_quant_matmul(x: Optional[torch.Tensor], residual: torch.Tensor, norm_weight: torch.Tensor,
                                    weight: torch.Tensor, qtype: int, eps: float = 1e-6,
                                    residual_out: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
    """(out, residual_out): fused_add_rms_norm (rms_norm when x is None) then quant_matmul, with the
    normalised activations rounded to residual's dtype in between; out and residual_out (None
    when x is None) are the given tensors, written, or new ones. Every check (out's and the
    overlaps' too) before anything is written, with src/ops/matmul_ops.cpp's messages."""
    op = "fused_add_rms_norm_quant_matmul"
    w, eps = _check_norm_qmm(op, x, residual, norm_weight, weight, qtype, eps, residual_out, out)
    y, s = _norm_qmm(x, residual, norm_weight, w, eps)
    if out is not None:
        out.copy_(y)
        y = out
    return y, _residual_result(x, residual, s, residual_out)


def silu_and_mul_quant_matmul(gate_up: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """silu_and_mul then quant_matmul, with the activations rounded to gate_up's dtype in between."""
    op = "silu_and_mul_quant_matmul"
    _tensor(op, "gate_up", gate_up), _tensor(op, "weight", weight)
    _float(op, "gate_up", gate_up)
    _same_device(op, "weight", weight, "gate_up", gate_up)
    _min_ndim(op, "gate_up", gate_up, 1)
    _nonempty_last(op, "gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise InvalidArgumentError(
            f"{op}: gate_up's last dimension must be even (gate and up halves); got {_shape(gate_up.shape)}")
    k = gate_up.shape[-1] // 2
    w = _decode(op, "weight", weight, qtype, cols=k, cols_what="gate_up's K (half its columns)")
    acc = _acc(gate_up)
    gf = gate_up.to(acc)
    g, u = gf[..., :k], gf[..., k:]
    h = (g * torch.sigmoid(g) * u).to(gate_up.dtype)
    with _no_autocast(gate_up):
        return (h.to(acc) @ w.to(acc).T).to(gate_up.dtype)


def _check_rotary(op: str, q: torch.Tensor, k: Optional[torch.Tensor], positions: torch.Tensor,
                  rotary_dim: int, theta: float) -> int:
    """rotary_embedding's validation (src/ops/model_ops.cpp validate_rotary) under op's name;
    returns rotary_dim as an int."""
    _tensor(op, "q", q), _tensor(op, "positions", positions)
    _float(op, "q", q)
    _index(op, "positions", positions)
    _same_device(op, "positions", positions, "q", q)
    _ndim(op, "q", q, 3)
    _ndim(op, "positions", positions, 1)
    t_count, _, head_dim = q.shape
    if head_dim == 0:
        raise InvalidArgumentError(f"{op}: q's head_dim must be > 0")
    _require_shape(op, "positions", positions, (t_count,), "one position per token of q")
    if k is not None:
        _tensor(op, "k", k)
        _same_dtype(op, "k", k, "q", q)
        _same_device(op, "k", k, "q", q)
        _ndim(op, "k", k, 3)
        if k.shape[0] != t_count or k.shape[2] != head_dim:
            raise InvalidArgumentError(
                f"{op}: k must have shape (num_tokens, num_kv_heads, head_dim) = ({t_count}, *, {head_dim}); "
                f"got {_shape(k.shape)}")
        _no_overlap(op, "q", q, "k", k)
        _no_overlap(op, "k", k, "positions", positions)  # the rotation writes k while it reads positions
    _no_overlap(op, "q", q, "positions", positions)
    rd = int(rotary_dim)
    if rd <= 0 or rd > head_dim or rd % 2:
        raise InvalidArgumentError(f"{op}: rotary_dim must be even and in (0, head_dim={head_dim}]; got {rotary_dim}")
    if not math.isfinite(theta) or not theta > 1.0:
        raise InvalidArgumentError(f"{op}: theta must be finite and > 1; got {theta}")
    return rd


def _rotate(q: torch.Tensor, k: Optional[torch.Tensor], positions: torch.Tensor, rd: int, theta: float,
            is_neox: bool) -> None:
    half = rd // 2
    i = torch.arange(half, dtype=torch.float64, device=q.device)
    inv_freq = torch.pow(torch.tensor(float(theta), dtype=torch.float64, device=q.device),
                         -2.0 * i / rd).to(torch.float32)
    angle = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # FP32 product
    c = torch.cos(angle)[:, None, :]
    s = torch.sin(angle)[:, None, :]
    for t in (q, k):
        if t is None or t.shape[1] == 0:
            continue
        acc = _acc(t)
        tf = t[..., :rd].to(acc)
        if is_neox:
            a, b = tf[..., :half], tf[..., half:]
        else:
            a, b = tf[..., 0::2], tf[..., 1::2]
        na = a * c.to(acc) - b * s.to(acc)
        nb = b * c.to(acc) + a * s.to(acc)
        if is_neox:
            t[..., :half].copy_(na)
            t[..., half:rd].copy_(nb)
        else:
            t[..., 0:rd:2].copy_(na)
            t[..., 1:rd:2].copy_(nb)


def rotary_embedding(q: torch.Tensor, k: Optional[torch.Tensor], positions: torch.Tensor,
                     rotary_dim: int, theta: float = 10000.0, is_neox: bool = True) -> None:
    rd = _check_rotary("rotary_embedding", q, k, positions, rotary_dim, theta)
    _rotate(q, k, positions, rd, theta, is_neox)


def _check_cache(op: str, name: str, c: torch.Tensor, kvh: int, hd: int) -> None:
    _ndim(op, name, c, 4)
    if c.shape[2] != kvh or c.shape[3] != hd:
        raise InvalidArgumentError(
            f"{op}: {name} must have shape (num_blocks, block_size, {kvh}, {hd}); got {_shape(c.shape)}")


def _check_kv_append(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """kv_cache_append's validation (src/ops/model_ops.cpp validate_kv_append) under op's name;
    returns the slots as int64."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        _tensor(op, name, t)
    _float(op, "k", k)
    _same_dtype(op, "v", v, "k", k)
    _same_dtype(op, "k_cache", k_cache, "k", k)
    _same_dtype(op, "v_cache", v_cache, "k", k)
    _index(op, "slot_mapping", slot_mapping)
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        _same_device(op, name, t, "k", k)
    _ndim(op, "k", k, 3)
    _nonempty_last(op, "k", k)
    _ndim(op, "slot_mapping", slot_mapping, 1)
    n = slot_mapping.shape[0]
    kvh, hd = k.shape[1], k.shape[2]
    if k.shape[0] < n:
        raise InvalidArgumentError(f"{op}: k has {k.shape[0]} tokens but slot_mapping has {n}")
    _require_shape(op, "v", v, k.shape, "same as k")
    _check_cache(op, "k_cache", k_cache, kvh, hd)
    _require_shape(op, "v_cache", v_cache, k_cache.shape, "same as k_cache")
    _no_overlap(op, "k_cache", k_cache, "v_cache", v_cache)
    for name, t in (("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        _no_overlap(op, "k_cache", k_cache, name, t)
        _no_overlap(op, "v_cache", v_cache, name, t)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    slots = slot_mapping.long()
    bad = _first_bad((slots < -1) | (slots >= num_slots))
    if bad is not None:
        raise InvalidArgumentError(
            f"{op}: slot_mapping[{bad}] = {int(slots[bad])} is outside [-1, {num_slots})")
    return slots


def _append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            slots: torch.Tensor) -> None:
    n, kvh, hd = slots.shape[0], k.shape[1], k.shape[2]
    if n == 0 or kvh * hd == 0:
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    keep = slots >= 0
    if _compiling():
        # Shapes that do not depend on the data (a boolean index is aten.nonzero, which a
        # fullgraph trace cannot take on older torch): every token writes a row; a skipped one
        # (slot -1) writes the first kept token's row again at that token's slot, the same bytes,
        # or, where no token is kept, row 0's own bytes back. (index_put's order for a slot named
        # by two kept tokens stays unpromised here.)
        src = torch.where(keep, torch.arange(n, device=slots.device), torch.argmax(keep.to(torch.int32)))
        dst = slots[src].clamp(min=0)
        any_kept = keep.any()
        kf, vf = k_cache.view(num_slots, kvh, hd), v_cache.view(num_slots, kvh, hd)
        kf[dst] = torch.where(any_kept, k[:n][src], kf[dst])
        vf[dst] = torch.where(any_kept, v[:n][src], vf[dst])
        return
    dst = slots[keep]
    # a slot named by several tokens gets the later token's rows, as on the CPU (index_put does not
    # promise which of duplicate indices lands)
    src = torch.nonzero(keep).squeeze(1)  # the tokens written, in order
    dst, inv = torch.unique(dst, return_inverse=True)
    src = torch.full(dst.shape, -1, dtype=src.dtype, device=src.device).scatter_reduce(0, inv, src, "amax")
    k_cache.view(num_slots, kvh, hd)[dst] = k[:n][src]
    v_cache.view(num_slots, kvh, hd)[dst] = v[:n][src]


def kv_cache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    slots = _check_kv_append("kv_cache_append", k_cache, v_cache, k, v, slot_mapping)
    _append(k_cache, v_cache, k, v, slots)


def _check_rope_kv_append(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, rotary_dim: int,
                          theta: float):
    """rotary_embedding_kv_append's validation (src/ops/model_ops.cpp validate_rope_kv_append, k
    given) under op's name; returns (rotary_dim as an int, the slots as int64)."""
    rd = _check_rotary(op, q, k, positions, rotary_dim, theta)
    slots = _check_kv_append(op, k_cache, v_cache, k, v, slot_mapping)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _no_overlap(op, name, c, "q", q)
        _no_overlap(op, name, c, "positions", positions)
    _no_overlap(op, "v", v, "q", q)
    _no_overlap(op, "v", v, "k", k)
    _no_overlap(op, "slot_mapping", slot_mapping, "q", q)  # the rotation must not rewrite the slots
    _no_overlap(op, "slot_mapping", slot_mapping, "k", k)
    return rd, slots


def rotary_embedding_kv_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               rotary_dim: int, theta: float = 10000.0, is_neox: bool = True) -> None:
    """rotary_embedding(q, k) then kv_cache_append(k_cache, v_cache, k, v, slot_mapping), in place;
    every check of both (and the fused op's own overlap rules) before anything is written.
    Validation in the order of src/ops/model_ops.cpp, with its messages."""
    op = "rotary_embedding_kv_append"
    if k is None:
        raise InvalidArgumentError(f"{op}: k is missing: its rotated rows go to k_cache")
    rd, slots = _check_rope_kv_append(op, q, k, v, positions, k_cache, v_cache, slot_mapping, rotary_dim, theta)
    if q.shape[0] == 0 or q.shape[1] + k.shape[1] == 0:
        return
    _rotate(q, k, positions, rd, theta, is_neox)
    _append(k_cache, v_cache, k, v, slots)


def fused_add_rms_norm_quant_matmul_rope_kv_append(
        x: Optional[torch.Tensor], residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, qtype: int,
        eps: float, num_heads: int, num_kv_heads: int, positions: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor, rotary_dim: int, theta: float = 10000.0,
        is_neox: bool = True, residual_out: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
    """(out, residual_out): fused_add_rms_norm_quant_matmul for one token, then
    rotary_embedding_kv_append on out's q, k and v column slices ([1, H, D], [1, KVH, D],
    [1, KVH, D]); the caches written in place. Every check of both (and the fused op's own rules)
    before anything is written, in the order of src/ops/model_ops.cpp, with its messages."""
    op = "fused_add_rms_norm_quant_matmul_rope_kv_append"
    w, eps = _check_norm_qmm(op, x, residual, norm_weight, weight, qtype, eps, residual_out, out, leading_dims=False)
    m, n = residual.shape[0], weight.shape[0]
    if m > 1:
        raise InvalidArgumentError(
            f"{op}: residual has {m} rows; this fusion is a one-token decode step (for more rows call "
            "fused_add_rms_norm_quant_matmul, then rotary_embedding_kv_append)")
    h, kvh = int(num_heads), int(num_kv_heads)
    if h <= 0 or kvh <= 0:
        raise InvalidArgumentError(f"{op}: num_heads and num_kv_heads must be > 0; got {h} and {kvh}")
    if h > 2 ** 40 or kvh > 2 ** 40:
        raise InvalidArgumentError(f"{op}: num_heads and num_kv_heads must be at most 2^40")
    heads = h + 2 * kvh
    if n % heads or n == 0:
        raise InvalidArgumentError(
            f"{op}: weight's {n} rows (out's columns) must be (num_heads + 2 num_kv_heads) x head_dim with "
            f"num_heads={h}, num_kv_heads={kvh}")
    d = n // heads
    y = out if out is not None else torch.empty((m, n), dtype=residual.dtype, device=residual.device)
    qkv = y.view(m, heads, d)
    q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    try:
        rd = _check_rotary(op, q, k, positions, rotary_dim, theta)
        slots = _check_kv_append(op, k_cache, v_cache, k, v, slot_mapping)
    except KernscopeError as e:  # the two ops' rules speak of q, k and v: say what they are here
        raise type(e)(f"{e} (q, k and v: out's columns [0, {h * d}), [{h * d}, {(h + kvh) * d}) and "
                      f"[{(h + kvh) * d}, {n}) as [1, heads, head_dim={d}])") from None
    # the caches are written, and positions and slot_mapping read, while the matmul's tensors are
    # read and out / residual_out written
    mm = (("residual", residual), ("norm_weight", norm_weight), ("weight", weight), ("x", x),
          ("residual_out", residual_out), ("out", y))
    for name, t in mm:
        if t is None:
            continue
        _no_overlap(op, "k_cache", k_cache, name, t)
        _no_overlap(op, "v_cache", v_cache, name, t)
        if name in ("out", "residual_out"):
            _no_overlap(op, name, t, "positions", positions)
            _no_overlap(op, name, t, "slot_mapping", slot_mapping)
    _no_overlap(op, "k_cache", k_cache, "positions", positions)
    _no_overlap(op, "v_cache", v_cache, "positions", positions)
    val, s = _norm_qmm(x, residual, norm_weight, w, eps)
    y.copy_(val)
    r = _residual_result(x, residual, s, residual_out)
    if m:
        _rotate(q, k, positions, rd, theta, is_neox)
        _append(k_cache, v_cache, k, v, slots)
    return y, r


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """The varlen_attention contract in PyTorch: per sequence, FP32 scores, bottom-right causal
    mask, FP32 softmax (a query with no visible key: zeros), FP32 weighted sum; one rounding."""
    op = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _tensor(op, name, t)
    _float(op, "q", q)
    _same_dtype(op, "k", k, "q", q)
    _same_dtype(op, "v", v, "q", q)
    _index(op, "cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    _index(op, "cu_seqlens_k", cu_seqlens_k, (torch.int32,))
    _ndim(op, "q", q, 3)
    _ndim(op, "k", k, 3)
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] or v.shape != k.shape or k.shape[2] != q.shape[2]:
        raise InvalidArgumentError(f"{op}: k and v must be [total_k, num_kv_heads, head_dim] with num_heads "
                                   f"({q.shape[1]}) a multiple of num_kv_heads; got {tuple(k.shape)}, {tuple(v.shape)}")
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    g = q.shape[1] // k.shape[1]
    for s in range(len(cq) - 1):
        qs = q[cq[s]:cq[s + 1]].float().transpose(0, 1)                          # [H, lq, D]
        ks_ = k[ck[s]:ck[s + 1]].float().repeat_interleave(g, 1).transpose(0, 1)  # [H, lk, D]
        vs = v[ck[s]:ck[s + 1]].float().repeat_interleave(g, 1).transpose(0, 1)
        lq, lk = qs.shape[1], ks_.shape[1]
        if lq == 0 or lk == 0:
            continue
        sc = (qs @ ks_.transpose(1, 2)) * scale                                   # [H, lq, lk]
        p = None
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            hidden = j > i + lk - lq                                                # [lq, lk]
            p = torch.softmax(sc.masked_fill(hidden, float("-inf")), -1)
            p = torch.where(hidden.all(-1)[:, None], torch.zeros_like(p), p)       # no visible key: zeros
            if not bool(torch.isfinite(vs).all()):
                # only visible keys enter the sum: a NaN/inf V row hidden from a query (weight 0)
                # must not reach it through 0 * NaN
                contrib = (p[..., None] * vs[:, None, :, :]).masked_fill(hidden[None, :, :, None], 0.0)
                out[cq[s]:cq[s + 1]] = contrib.sum(2).transpose(0, 1)
                continue
        else:
            p = torch.softmax(sc, -1)
        out[cq[s]:cq[s + 1]] = (p @ vs).transpose(0, 1)
    return out.to(q.dtype)


def _check_paged(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_ids: Optional[torch.Tensor], context_lens: torch.Tensor, scale: float):
    """paged_attention's validation (src/ops/model_ops.cpp validate_paged_attention, out aside)
    under op's name, the visible block table entries too, before anything is written; returns
    what _attend reads (None when no token sees a key): (slots, visible, context_lens as int64)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens)):
        _tensor(op, name, t)
    _float(op, "q", q)
    _same_dtype(op, "k_cache", k_cache, "q", q)
    _same_dtype(op, "v_cache", v_cache, "q", q)
    _index(op, "block_tables", block_tables, (torch.int32,))
    _index(op, "context_lens", context_lens, (torch.int32,))
    if seq_ids is not None:
        _tensor(op, "seq_ids", seq_ids)
        _index(op, "seq_ids", seq_ids, (torch.int32,))
        _same_device(op, "seq_ids", seq_ids, "q", q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens)):
        _same_device(op, name, t, "q", q)
    _ndim(op, "q", q, 3)
    n_tok, n_heads, hd = q.shape
    if hd == 0 or n_heads == 0:
        raise InvalidArgumentError(f"{op}: q must have num_heads > 0 and head_dim > 0")
    _ndim(op, "k_cache", k_cache, 4)
    kvh = k_cache.shape[2]
    _check_cache(op, "k_cache", k_cache, kvh, hd)
    _require_shape(op, "v_cache", v_cache, k_cache.shape, "same as k_cache")
    if kvh == 0 or n_heads % kvh:
        raise InvalidArgumentError(f"{op}: num_heads ({n_heads}) must be a multiple of num_kv_heads ({kvh}) "
                                   "(q's dim 1, k_cache's dim 2)")
    n_blocks, bsz = k_cache.shape[0], k_cache.shape[1]
    _ndim(op, "block_tables", block_tables, 2)
    n_seqs, max_blocks = block_tables.shape
    _require_shape(op, "context_lens", context_lens, (n_tok,), "one per query token")
    if seq_ids is not None:
        _require_shape(op, "seq_ids", seq_ids, (n_tok,), "one per query token")
        seq = seq_ids.long()
    else:
        if n_seqs != n_tok:
            raise InvalidArgumentError(
                f"{op}: without seq_ids, block_tables needs one row per query token ({n_tok}); "
                f"got {_shape(block_tables.shape)}")
        seq = torch.arange(n_tok, device=q.device)
    if not math.isfinite(scale):
        raise InvalidArgumentError(f"{op}: scale must be finite")
    ctx = context_lens.long()
    bad = _first_bad((seq < 0) | (seq >= n_seqs))
    if bad is not None:
        raise InvalidArgumentError(f"{op}: seq_ids[{bad}] = {int(seq[bad])} is outside [0, {n_seqs})")
    cap = max_blocks * bsz
    bad = _first_bad((ctx < 0) | (ctx > cap))
    if bad is not None:
        raise InvalidArgumentError(
            f"{op}: context_lens[{bad}] = {int(ctx[bad])} is outside [0, max_blocks_per_seq * block_size = {cap}]")
    # The longest context sets the gather width (data-dependent: not for torch.compile).
    length = int(ctx.max()) if n_tok else 0
    if n_tok == 0 or length == 0:
        return None
    j = torch.arange(length, device=q.device)
    blocks = block_tables.long()[seq][:, j // bsz]  # [T, L]
    visible = j[None, :] < ctx[:, None]  # [T, L]
    bad_blk = visible & ((blocks < 0) | (blocks >= n_blocks))
    if not _compiling() and bool(bad_blk.any()):
        t_idx, j_idx = (int(v) for v in bad_blk.nonzero()[0])
        s_idx, b_idx = int(seq[t_idx]), j_idx // bsz
        raise InvalidArgumentError(
            f"{op}: block_tables[{s_idx}, {b_idx}] = {int(block_tables[s_idx, b_idx])} is outside [0, {n_blocks})")
    slots = torch.where(visible, blocks * bsz + j % bsz, torch.zeros_like(blocks))
    return slots, visible, ctx


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan, scale: float) -> torch.Tensor:
    """The attention of q over the caches at _check_paged's slots: FP32 scores, softmax and
    weighted sum, one rounding to q's dtype."""
    if plan is None:
        return torch.zeros_like(q)
    slots, visible, ctx = plan
    n_heads, hd, kvh = q.shape[1], q.shape[2], k_cache.shape[2]
    acc = _acc(q)
    group = n_heads // kvh
    keys = k_cache.reshape(-1, kvh, hd)[slots].to(acc).repeat_interleave(group, dim=2)  # [T, L, H, D]
    vals = v_cache.reshape(-1, kvh, hd)[slots].to(acc).repeat_interleave(group, dim=2)
    # positions past a token's context gather slot 0 (any values, NaN included): zeroed, so only
    # visible keys enter the sum (a hidden NaN would reach it through 0 * NaN)
    vals = vals.masked_fill(~visible[:, :, None, None], 0.0)
    with _no_autocast(q):
        scores = torch.einsum("thd,tlhd->thl", q.to(acc), keys) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        p = torch.where((ctx > 0)[:, None, None], p, torch.zeros_like(p))
        out = torch.einsum("thl,tlhd->thd", p, vals)
    return out.to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: Optional[torch.Tensor], context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    plan = _check_paged("paged_attention", q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale)
    return _attend(q, k_cache, v_cache, plan, scale)


def rotary_embedding_kv_append_paged_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
        seq_ids: Optional[torch.Tensor], context_lens: torch.Tensor, rotary_dim: int, theta: float = 10000.0,
        is_neox: bool = True, scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """rotary_embedding_kv_append(q, k, v, ...) in place, then paged_attention of the rotated q
    over the appended caches: the output (out, written, or a new tensor). Every check of both
    (and the fused op's own overlap rules) before anything is written, in the order of
    src/ops/model_ops.cpp, with its messages."""
    op = "rotary_embedding_kv_append_paged_attention"
    if k is None:
        raise InvalidArgumentError(f"{op}: k is missing: its rotated rows go to k_cache")
    rd, slots = _check_rope_kv_append(op, q, k, v, positions, k_cache, v_cache, slot_mapping, rotary_dim, theta)
    plan = _check_paged(op, q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale)
    if out is not None:
        _tensor(op, "out", out)
        _same_dtype(op, "out", out, "q", q)
        _same_device(op, "out", out, "q", q)
        _require_shape(op, "out", out, q.shape, "same as q")
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                        ("context_lens", context_lens), ("seq_ids", seq_ids), ("k", k), ("v", v),
                        ("positions", positions), ("slot_mapping", slot_mapping)):
            if t is not None:
                _no_overlap(op, "out", out, name, t)
    # the attention's index tensors apart from what the first step writes
    for wname, w in (("q", q), ("k", k), ("k_cache", k_cache), ("v_cache", v_cache)):
        _no_overlap(op, "block_tables", block_tables, wname, w)
        _no_overlap(op, "context_lens", context_lens, wname, w)
        if seq_ids is not None:
            _no_overlap(op, "seq_ids", seq_ids, wname, w)
    if q.shape[0] and q.shape[1] + k.shape[1]:
        _rotate(q, k, positions, rd, theta, is_neox)
        _append(k_cache, v_cache, k, v, slots)
    y = _attend(q, k_cache, v_cache, plan, scale)
    if out is None:
        return y
    out.copy_(y)
    return out
