"""The operators.

Every op takes arrays of any framework that speaks DLPack (numpy, torch, cupy,
jax, ...) zero-copy, and returns its output allocated by the first input's
framework on the same device (numpy in, numpy out; torch in, torch out). The
numerical contract of each op is in docs/contracts.md of the kernscope source
tree (one section per op, linked from each docstring); the C entry points and
their shape rules are in include/kernscope/kernscope.h.

``backend``:

* ``"auto"`` (default): the native backend of the tensors' device (CPU or CUDA),
  the registry's best variant (see :func:`kernscope.which`). For torch tensors
  that need autograd (grad mode on and an input with ``requires_grad``), the
  PyTorch reference instead, so training code works unchanged.
* ``"cpu"`` / ``"cuda"``: that native backend; inference only (torch tensors
  requiring grad are rejected with BackendUnavailableError, a RuntimeError, while grad mode is on).
* ``"torch"``: the contract written in PyTorch (torch tensors only, any device,
  autograd for rms_norm, silu_and_mul, gemv and softmax).

Any other value raises ValueError listing these names.

Errors (native backends): ValueError for an invalid argument (shape, layout,
scalar, overlap, index), TypeError for an unsupported or mismatched dtype,
RuntimeError for a device mismatch, an unavailable backend or a CUDA error,
MemoryError when memory runs out. The classes are in kernscope (e.g.
``kernscope.InvalidArgumentError``, a ValueError); each message names the op and
the argument. After an error nothing has been written: in-place arguments and
``out=`` are byte-for-byte unchanged.

Layout: every array must be contiguous (row-major; offset views such as
``a[1:]`` are fine); strided views are rejected with ValueError, never copied.

Streams: on CUDA the op runs on the producer's current stream (torch: the
current stream of the tensors' device, through DLPack's C exchange API, so
torch CUDA-graph capture works; cupy: its current stream; others: the default
stream, and the call waits for it), with no synchronisation of its own.
"""

from __future__ import annotations

import enum
import math
import operator as _operator
import sys
from typing import Any, Optional, Sequence, Tuple, TypeVar, Union

from . import _C
from ._errors import BackendUnavailableError, InvalidArgumentError, UnsupportedDtypeError
from ._frameworks import Framework, canonical_dtype, framework_of, frameworks_among

T = TypeVar("T", bound=Any)  # the caller's array type (numpy.ndarray, torch.Tensor, ...)
Array = Any  # any object with __dlpack__ (numpy.ndarray, torch.Tensor, cupy.ndarray, jax.Array, ...)

_AUTO, _CPU, _CUDA, _TORCH = 0, 1, 2, 3
_BACKENDS = {"auto": _AUTO, "cpu": _CPU, "cuda": _CUDA, "torch": _TORCH}
BACKENDS: Tuple[str, ...] = tuple(_BACKENDS)

CONTRACTS = "docs/contracts.md"


class QType(enum.IntEnum):
    """Storage formats of packed weight rows (ks_qtype_t; GGUF block formats)."""

    NONE = 0  #: not packed: a dense float tensor
    F32 = 1  #: block 1, 4 bytes
    F16 = 2  #: block 1, 2 bytes
    BF16 = 3  #: block 1, 2 bytes
    Q4_0 = 4  #: block 32, 18 bytes: f16 d, 16 bytes of nibbles; w = d * (q - 8)
    Q4_1 = 5  #: block 32, 20 bytes: f16 d, f16 m, 16 bytes; w = d * q + m
    Q8_0 = 6  #: block 32, 34 bytes: f16 d, 32 int8; w = d * q


# (elements, bytes) per block, from the library itself.
_QGEOM = {int(q): tuple(_C.qtype_info(int(q))) for q in QType if q != QType.NONE}


def _never() -> bool:
    return False


# Replaced by torch.compiler.is_compiling once torch is imported (see
# _torch_library.install); _TL is then that module.
_compiling = _never
_TL: Any = None
_REF: Any = None


def _ref() -> Any:
    global _REF
    if _REF is None:
        from . import _torch_ref

        _REF = _torch_ref
    return _REF


# ---- argument handling ----------------------------------------------------------
def _backend(op: str, backend: str) -> int:
    code = _BACKENDS.get(backend) if isinstance(backend, str) else None
    if code is None:
        raise InvalidArgumentError(f"{op}: unknown backend {backend!r}; valid backends: 'auto', 'cpu', 'cuda', 'torch'")
    return code


def _fw(op: str, name: str, x: Any) -> Framework:
    fw = framework_of(x)
    if fw is None:
        t = type(x)
        raise TypeError(f"{op}: {name} must be an array or tensor supporting DLPack (numpy, torch, cupy, jax, ...); "
                        f"got {t.__module__}.{t.__qualname__}")
    return fw


def _flag(op: str, name: str, v: Any) -> bool:
    """A bool argument: True / False (or 0 / 1, or a 0-d boolean array); anything else, a str in
    particular ("False" is truthy), is refused by name."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if getattr(getattr(v, "dtype", None), "kind", None) == "b" and tuple(getattr(v, "shape", (1,))) == ():
        return bool(v)
    raise TypeError(f"{op}: {name} must be a bool; got {type(v).__name__} {v!r}")


def _qtype(op: str, qtype: Union[str, int, QType, None], allow_none: bool = False,
           blocks_only: bool = False) -> int:
    # blocks_only: the op takes the block formats alone (quant_matmul_a8), so an unknown name's
    # message lists those (a dense format itself is refused by the op, naming it)
    if qtype is None and allow_none:
        return 0
    if isinstance(qtype, str):
        try:
            q = QType[qtype.upper()]
        except KeyError:
            q = None
    elif isinstance(qtype, int) and not isinstance(qtype, bool):
        q = QType(qtype) if 0 <= int(qtype) <= 6 else None
    else:
        q = None
    if q is None or (q == QType.NONE and not allow_none):
        names = ", ".join(repr(n.lower()) for n in QType.__members__
                          if (n != "NONE" or allow_none) and (not blocks_only or n.startswith("Q")))
        raise InvalidArgumentError(f"{op}: unknown qtype {qtype!r}; expected one of {names}")
    return int(q)


def _float_dtype(op: str, dtype: Any) -> str:
    name = canonical_dtype(dtype, f"{op}: dtype")
    if name not in ("fp16", "bf16", "fp32"):
        raise TypeError(f"{op}: dtype must be fp16, bf16 or fp32; got {dtype!r}")
    return name


def _torch_route(op: str, code: int, backend: str, names: Sequence[str], tensors: Sequence[Any]) -> bool:
    """For torch inputs: True to run the PyTorch reference instead of a native backend."""
    if code == _TORCH:
        return True
    if not sys.modules["torch"].is_grad_enabled():
        return False
    for t in tensors:
        if getattr(t, "requires_grad", False):  # (a numpy array beside a tensor has none)
            if code == _AUTO:
                return True
            name = names[[id(u) for u in tensors].index(id(t))]
            raise BackendUnavailableError(  # (a RuntimeError, as every native refusal of a backend)
                f"{op}: {name} requires grad, and backend {backend!r} is inference-only; use backend='torch' "
                "or 'auto' (the PyTorch reference, with autograd), or call it under torch.no_grad()")
    return False


def _not_torch(op: str, x: Any) -> TypeError:
    t = type(x)
    return TypeError(f"{op}: backend='torch' takes torch tensors; got {t.__module__}.{t.__qualname__}")


def _native(cfn: Any, fw: Framework, first: Any, tensors: tuple, *scalars: Any) -> None:
    """Calls the extension: cfn(tensors, *scalars, backend, stream hint, bf16 mask, sync), after
    each framework among the tensors has prepared its own (numpy bf16 as uint16 views, torch
    tensors that require grad detached), then lets each see what was written (torch's version
    counters)."""
    given = tensors
    fws = frameworks_among(fw, tensors)
    mask = 0
    for f in fws:
        tensors, m = f.prepare(tensors)
        mask |= m
    hint, sync = fw.stream(first)
    written = cfn(tensors, *scalars, hint, mask, sync)
    for f in fws:
        f.written(given, written)


# Per op: (the input whose dtype out must share, None where out's dtype is fixed; the native
# check's words for out's shape), so that the torch path's errors read as the native backends'.
_OUT_RULES = {
    "rms_norm": ("x", "same as x"),
    "silu_and_mul": ("x", "x's shape with the last dim halved"),
    "softmax": ("x", "same as x"),
    "argmax": (None, "x's shape without its last dim (one index per row)"),
    "gemv": ("x", "weight's row count"),
    "gemm": ("a", "a's leading dims + (N,)"),
    "quant_matmul": ("x", "x's leading dims + (N,)"),
    "quant_matmul_a8": ("x", "x's leading dims + (N,)"),
    "silu_and_mul_quant_matmul": ("gate_up", "gate_up's leading dims + (N,)"),
    "embedding": ("table", "ids' shape + (hidden_size,)"),
    "varlen_attention": ("q", "same as q"),
    "paged_attention": ("q", "same as q"),
}


def _out_float_dtype(out: Any) -> Any:
    """out's torch dtype where it is one kernscope writes floats in (fp16, bf16, fp32); else None
    (no out, or another dtype, which _finish's check then names)."""
    dt = getattr(out, "dtype", None)
    import torch  # (only reached on the torch path)
    return dt if dt in (torch.float16, torch.bfloat16, torch.float32) else None


def _finish(op: str, y: Any, out: Any) -> Any:
    """The torch path's result, or out filled with it: out must be a contiguous tensor of the
    result's shape, dtype and device (as the native backends require; copy_ alone would broadcast
    into a larger out or cast into another dtype)."""
    if out is None:
        return y
    ref, why = _OUT_RULES.get(op, (None, "the result's shape"))
    _ref().check_out(op, y, out, ref, why)
    out.copy_(y)
    return out


def _last(shape: Sequence[int]) -> int:
    return int(shape[-1]) if len(shape) else 0


def _dim0(shape: Sequence[int]) -> int:
    return int(shape[0]) if len(shape) else 0


def _packed_cols(shape: Sequence[int], q: int) -> int:
    bs, bb = _QGEOM[q]
    return (int(shape[1]) // bb * bs) if len(shape) == 2 else 0


def _real(op: str, name: str, v: Any) -> float:
    """A float scalar argument: a real number (Python, numpy or a framework's 0-d tensor), not a
    str, bytes, bool or None (``float("0.5")`` would take a string)."""
    if v is None or isinstance(v, (str, bytes, bool)):
        raise TypeError(f"{op}: {name} must be a number; got {type(v).__name__} {v!r}")
    try:
        return float(v)
    except OverflowError:  # (an integer past a double's range: infinite, which the op's own check names)
        return float("inf") if v > 0 else float("-inf")
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be a number; got {type(v).__name__}") from None


def _integer(op: str, name: str, v: Any, any_size: bool = False) -> int:
    """An integer scalar argument (anything with ``__index__``: int, numpy integers, integer 0-d
    tensors), not a bool, str or float (``int(5.7)`` would truncate); within int64 (the C ABI's
    widest) unless ``any_size`` (the caller clamps it)."""
    if isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be an integer; got bool {v!r}")
    try:
        i = _operator.index(v)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an integer; got {type(v).__name__} {v!r}") from None
    if not any_size and not -2 ** 63 <= i < 2 ** 63:
        raise InvalidArgumentError(f"{op}: {name} = {i} is outside int64")
    return i


def _check_layout_first(op: str, arg: str, x: Any) -> None:
    """Before an output is sized from ``arg``'s leading dims: a non-contiguous view (torch, numpy,
    cupy) fails here with the native message, naming ``arg`` (a broadcast view's leading dims may
    describe far more rows than memory holds, and the output sized from them could not be
    allocated: a MemoryError instead of the layout error)."""
    if hasattr(x, "is_contiguous") and hasattr(x, "stride"):  # torch
        if x.is_contiguous():
            return
        strides = tuple(int(v) for v in x.stride())
    elif hasattr(x, "flags") and hasattr(x, "strides") and hasattr(x, "itemsize"):  # numpy, cupy: bytes
        if x.flags.c_contiguous:
            return
        strides = tuple(int(v) // int(x.itemsize) for v in x.strides)
    else:
        return  # (the native check still runs)
    shape = tuple(int(d) for d in x.shape)  # (a tuple's repr is the native shape text: "(5,)", "(2, 3)")
    broadcast = any(st == 0 and n > 1 for st, n in zip(strides, shape))
    raise InvalidArgumentError(
        f"{op}: {arg} must be contiguous (row-major); got shape {shape} strides {strides}"
        + ("; a stride of 0 is a broadcast (expanded) view" if broadcast else "")
        + ": copy it to a contiguous tensor first")


def _check_ndim_first(op: str, arg: str, t: Any, ndim: int) -> None:
    """Before an output is sized from ``arg``'s first dim: its layout (``_check_layout_first``: a
    broadcast weight's first dim may be far more rows than memory holds), then its dims as the
    native check words them (a flattened weight's first dim is its byte count: the output sized
    from it could not be allocated)."""
    _check_layout_first(op, arg, t)
    shape = tuple(int(d) for d in t.shape)
    if len(shape) != ndim:
        raise InvalidArgumentError(f"{op}: {arg} must have {ndim} dims; got shape {shape}")


def _check_rows(op: str, arg: str, shape: Sequence[int], q: int, dtype: Any = None) -> None:
    """Before an output is sized from ``arg``: a 2-D ``[rows, row_bytes]`` of whole blocks of
    format q (uint8; 0: a dense ``[rows, cols]`` with cols > 0), so that an error names ``arg``,
    not the output allocated from it (and is the one the native check gives when out is passed)."""
    if q != 0 and dtype is not None:
        try:
            name = canonical_dtype(dtype)
        except TypeError:  # (a dtype kernscope has no name for: complex, bool, ...)
            name = str(dtype).removeprefix("torch.")
        if name != "uint8":
            raise UnsupportedDtypeError(f"{op}: {arg} has dtype {name}; expected one of: uint8")
    if len(shape) != 2:
        raise InvalidArgumentError(f"{op}: {arg} must be 2-D; got shape {tuple(int(d) for d in shape)}")
    if q == 0:
        if int(shape[1]) == 0:
            raise InvalidArgumentError(f"{op}: {arg} must have a non-empty last dimension; got shape "
                             f"{tuple(int(d) for d in shape)}")
        return
    bs, bb = _QGEOM[q]
    if int(shape[1]) == 0 or int(shape[1]) % bb != 0:
        raise InvalidArgumentError(f"{op}: {arg} has {int(shape[1])} bytes per row; {QType(q).name} rows are "
                         f"whole {bb}-byte blocks of {bs} elements")


# ---- the five core operators ------------------------------------------------------
def rms_norm(x: T, weight: Array, eps: float = 1e-6, *, backend: str = "auto", out: Optional[T] = None) -> T:
    """RMS normalisation over the last dimension.

    ``out = round(fp32(x) * rsqrt(mean(fp32(x)^2) + eps) * fp32(weight))``

    Args:
        x: ``[..., H]``, H > 0; fp16, bf16 or fp32 (numpy bf16: ml_dtypes.bfloat16).
        weight: ``[H]``, x's dtype and device.
        eps: finite, > 0, and still > 0 after rounding to fp32 (1e-50 is rejected).
        backend: "auto" | "cpu" | "cuda" | "torch" (see the module docs).
        out: optional preallocated output, x's shape and dtype; may be x itself
            (in place). Any other overlap with x or weight is rejected.

    Returns:
        A new array of x's shape, dtype, framework and device (or ``out``).

    Raises:
        ValueError: a shape, eps, layout (non-contiguous) or overlap error, or an unknown backend.
        TypeError: an unsupported or mismatched dtype.
        RuntimeError: mixed devices, an unavailable backend, a CUDA error, or a
            torch tensor requiring grad with backend "cpu"/"cuda".

    Contract: docs/contracts.md#rms_norm--ks_rms_normout-x-weight-eps
    """
    if _compiling():
        return _TL.rms_norm(x, weight, eps, backend, out)
    op = "rms_norm"
    code = _backend(op, backend)
    fw = _fw(op, "x", x)
    if fw.is_torch and _torch_route(op, code, backend, ("x", "weight"), (x, weight)):
        return _finish(op, _ref().rms_norm(x, weight, eps), out)
    if code == _TORCH:
        raise _not_torch(op, x)
    if out is None:
        _check_layout_first(op, "x", x)
        out = fw.empty_like(x)
    _native(_C.rms_norm, fw, x, (out, x, weight), _real(op, "eps", eps), code)
    return out


def fused_add_rms_norm(x: Array, residual: Array, weight: Array, eps: float = 1e-6, *,
                       backend: str = "auto") -> None:
    """Residual add then RMS normalisation, in place on x and residual; returns None.

    ``s = fp32(x) + fp32(residual)`` (unrounded); ``residual = round(s)``;
    ``x = round(s * rsqrt(mean(s^2) + eps) * fp32(weight))``.

    Args:
        x: ``[..., H]``, H > 0; fp16, bf16 or fp32. Overwritten with the normalised value.
        residual: x's shape, dtype and device. Overwritten with the rounded sum.
        weight: ``[H]``; read only.
        eps: finite and > 0 (after rounding to fp32).
        backend: "auto" | "cpu" | "cuda" | "torch".

    The three arrays must not overlap. On any error neither x nor residual is changed.

    Raises:
        ValueError, TypeError, RuntimeError: as for :func:`rms_norm`.

    Contract: docs/contracts.md#fused_add_rms_norm--ks_fused_add_rms_normx-residual-weight-eps-in-place
    """
    if _compiling():
        return _TL.fused_add_rms_norm(x, residual, weight, eps, backend)
    op = "fused_add_rms_norm"
    code = _backend(op, backend)
    fw = _fw(op, "x", x)
    if fw.is_torch and _torch_route(op, code, backend, ("x", "residual", "weight"), (x, residual, weight)):
        return _ref().fused_add_rms_norm(x, residual, weight, eps)
    if code == _TORCH:
        raise _not_torch(op, x)
    _native(_C.fused_add_rms_norm, fw, x, (x, residual, weight), _real(op, "eps", eps), code)
    return None


def silu_and_mul(x: T, *, backend: str = "auto", out: Optional[T] = None) -> T:
    """SwiGLU activation: ``out = round(g * sigmoid(g) * u)``, g = fp32(x[..., :D]), u = fp32(x[..., D:]).

    Args:
        x: ``[..., 2D]`` with 2D > 0 and even (D may be odd); fp16, bf16 or fp32. Read only.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[..., D]`` output; must not overlap x.

    Returns:
        A new ``[..., D]`` array (x's dtype, framework and device), or ``out``.

    Raises:
        ValueError: odd or empty last dimension, bad out shape, overlap, layout.
        TypeError, RuntimeError: as for :func:`rms_norm`.

    Contract: docs/contracts.md#silu_and_mul--ks_silu_and_mulout-x
    """
    if _compiling():
        return _TL.silu_and_mul(x, backend, out)
    op = "silu_and_mul"
    code = _backend(op, backend)
    fw = _fw(op, "x", x)
    if fw.is_torch and _torch_route(op, code, backend, ("x",), (x,)):
        return _finish(op, _ref().silu_and_mul(x), out)
    if code == _TORCH:
        raise _not_torch(op, x)
    if out is None:
        _check_layout_first(op, "x", x)
        shape = tuple(x.shape)
        out = fw.empty(x, shape[:-1] + (_last(shape) // 2,) if shape else ())
    _native(_C.silu_and_mul, fw, x, (out, x), code)
    return out


def gemv(x: T, weight: Array, *, backend: str = "auto", out: Optional[T] = None) -> T:
    """Matrix-vector product: ``out[n] = round(sum_h fp32(weight[n, h]) * fp32(x[h]))`` (FP32 sums).

    Args:
        x: ``[H]``, H > 0; fp16, bf16 or fp32.
        weight: ``[N, H]`` (N may be 0), x's dtype and device. x and weight may share storage.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[N]`` output; must overlap neither input.

    Returns:
        A new ``[N]`` array, or ``out``.

    Raises:
        ValueError, TypeError, RuntimeError: as for :func:`rms_norm`.

    Contract: docs/contracts.md#gemv--ks_gemvout-x-weight
    """
    if _compiling():
        return _TL.gemv(x, weight, backend, out)
    op = "gemv"
    code = _backend(op, backend)
    fw = _fw(op, "x", x)
    if fw.is_torch and _torch_route(op, code, backend, ("x", "weight"), (x, weight)):
        return _finish(op, _ref().gemv(x, weight), out)
    if code == _TORCH:
        raise _not_torch(op, x)
    if out is None:
        _check_layout_first(op, "x", x)
        _check_layout_first(op, "weight", weight)
        out = fw.empty(x, (_dim0(tuple(weight.shape)),))
    _native(_C.gemv, fw, x, (out, x, weight), code)
    return out


def softmax(x: T, *, backend: str = "auto", out: Optional[T] = None) -> T:
    """Softmax over the last dimension, as ``torch.softmax(x.float(), -1)`` then one rounding.

    Rows holding NaN or +inf, and rows of only -inf, give all-NaN rows; -inf
    entries of a row with a finite maximum give exactly 0.

    Args:
        x: ``[..., H]``, H > 0; fp16, bf16 or fp32.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional output of x's shape; may be x itself (in place), no other overlap.

    Returns:
        A new array of x's shape, or ``out``.

    Raises:
        ValueError, TypeError, RuntimeError: as for :func:`rms_norm`.

    Contract: docs/contracts.md#softmax--ks_softmaxout-x
    """
    if _compiling():
        return _TL.softmax(x, backend, out)
    op = "softmax"
    code = _backend(op, backend)
    fw = _fw(op, "x", x)
    if fw.is_torch and _torch_route(op, code, backend, ("x",), (x,)):
        return _finish(op, _ref().softmax(x), out)
    if code == _TORCH:
        raise _not_torch(op, x)
    if out is None:
        _check_layout_first(op, "x", x)
        out = fw.empty_like(x)
    _native(_C.softmax, fw, x, (out, x), code)
    return out


# ---- model-path operators ----------------------------------------------------------
def argmax(x: Array, *, backend: str = "auto", out: Optional[Array] = None) -> Array:
    """Index of the maximum along the last dim: int64 of x's shape without its last dim
    (``[rows]`` for x ``[rows, V]``, a 0-d index for x ``[V]``), as ``torch.argmax(x, dim=-1)``.

    Ties give the lowest index; a row holding NaN gives the index of its first
    NaN (as torch.argmax); a row of -inf gives 0.

    Args:
        x: ``[..., V]``, V > 0, any number of leading dims; fp16, bf16 or fp32.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional int64 ``[...]`` output (x's shape without its last dim).

    Returns:
        A new int64 ``[...]`` array, or ``out``.

    Contract: docs/contracts.md#argmax--ks_argmaxout-x
    """
    if _compiling():
        return _TL.argmax(x, backend, out)
    op = "argmax"
    code = _backend(op, backend)
    fw = _fw(op, "x", x)
    if fw.is_torch and _torch_route(op, code, backend, ("x",), (x,)):
        return _finish(op, _ref().argmax(x), out)
    if code == _TORCH:
        raise _not_torch(op, x)
    if out is None:
        _check_layout_first(op, "x", x)
        out = fw.empty(x, tuple(x.shape)[:-1], "int64")
    _native(_C.argmax, fw, x, (out, x), code)
    return out


def sample(logits: Array, seed_offset: Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, *,
           backend: str = "auto", out: Optional[Array] = None, valid: Optional[Array] = None) -> Array:
    """One token id per row: temperature, then top-k, then top-p, then a Philox4x32-10 draw.

    The same ids on every backend ("cpu", "cuda": bit-identical) and for every replay of
    the same (seed, offset): every decision is made on exact fixed-point weights.

    Args:
        logits: ``[..., vocab]``, vocab > 0, any number of leading dims; fp16, bf16 or
            fp32. Row r is the r-th in the leading dims' row-major order (``[2, 3, vocab]``
            draws as its ``[6, vocab]`` reshape).
        seed_offset: int64 ``[2]`` = (seed, offset) on logits' device, read only. Row r
            draws Philox4x32-10(key=seed, counter=(offset, r)); advance offset between
            steps (a captured CUDA graph reads the tensor at every replay).
        temperature: finite, > 0 (also after rounding to fp32).
        top_k: >= 0; 0 (or >= vocab) turns it off. Ties at the cut-off keep the lower index.
        top_p: in (0, 1]; 1 turns it off. Ties at the cut-off keep the lower index.
        backend: "auto" | "cpu" | "cuda" (no "torch" reference for this op).
        out: optional int64 ``[...]`` output (logits' shape without its last dim).
        valid: optional uint8 ``[...]`` (out's shape), set to 1, or 0 for a row without a distribution
            (whose id is the placeholder 0): NaN or +inf logits, only -inf, a finite logit whose
            z = logit / temperature overflows to +inf (e.g. 5 at temperature 1e-39; top_k=1 does
            not avoid it) or finite logits whose z all round to -inf. Pass it wherever such rows
            can occur: without it they are not told apart from a drawn id 0.

    Returns:
        A new int64 ``[...]`` array, or ``out``.

    Raises:
        ValueError: a bad temperature / top_k / top_p, shape or overlap.
        TypeError: an unsupported dtype.

    Contract: docs/contracts.md#sample--ks_sampleout-valid-logits-seed_offset-temperature-top_k-top_p
    """
    if _compiling() and valid is None:
        return _TL.sample(logits, seed_offset, temperature, top_k, top_p, backend, out)
    op = "sample"
    code = _backend(op, backend)
    fw = _fw(op, "logits", logits)
    if code == _TORCH:
        if not fw.is_torch:
            raise _not_torch(op, logits)
        raise InvalidArgumentError("sample: there is no 'torch' reference backend for sample; use 'auto', 'cpu' or 'cuda'")
    if fw.is_torch and getattr(logits, "requires_grad", False):
        logits = logits.detach()  # sampling has no gradient: read the values
    if out is None:
        _check_layout_first(op, "logits", logits)
        out = fw.empty(logits, tuple(logits.shape)[:-1], "int64")
    k = _integer(op, "top_k", top_k, any_size=True)
    if k < -2 ** 63:  # (the native message, with the value passed rather than a clamped one)
        raise InvalidArgumentError(f"{op}: top_k must be >= 0 (0: off); got {k}")
    _native(_C.sample, fw, logits, (out, valid, logits, seed_offset), _real(op, "temperature", temperature),
            # (top_k >= vocab is off: a value past int64 means the same, clamped to fit the C ABI)
            min(k, 2 ** 63 - 1), _real(op, "top_p", top_p), code)
    return out


def embedding(ids: Array, table: T, *, table_format: Union[str, int, QType, None] = None,
              dtype: Any = None, backend: str = "auto", out: Optional[T] = None) -> T:
    """Rows of an embedding table: ``out[..., :] = table[ids[...], :]``.

    Args:
        ids: int32 or int64, any shape. An id < 0 or >= vocab raises ValueError
            naming the index, before anything is written.
        table: dense ``[vocab, hidden]`` fp16/bf16/fp32 (table_format None or
            "none": rows are copied bit-exactly), or uint8 ``[vocab, row_bytes]``
            in a packed format (table_format "q4_0", "q4_1", "q8_0", "f32", "f16",
            "bf16" or a :class:`QType`): rows are decoded in FP32 and rounded once.
        table_format: see table.
        dtype: the output dtype ("fp16", "bf16", "fp32" or a framework dtype).
            Dense tables: the table's dtype (the default). Packed: default "fp32".
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``ids.shape + (hidden,)`` output.

    Returns:
        A new array ``ids.shape + (hidden,)`` in table's framework and device, or ``out``.

    Contract: docs/contracts.md#embedding--ks_embeddingout-ids-table-table_format
    """
    if _compiling():
        return _TL.embedding(ids, table, table_format, dtype, backend, out)
    op = "embedding"
    code = _backend(op, backend)
    fmt = _qtype(op, table_format, allow_none=True)
    fw = _fw(op, "table", table)
    name = None if dtype is None else _float_dtype(op, dtype)
    if fw.is_torch and _torch_route(op, code, backend, ("table",), (table,)):
        tdt = None if name is None else fw.dtype(table, name)
        if tdt is None and fmt not in (None, 0):  # (a packed table: out's dtype decides, as natively)
            tdt = _out_float_dtype(out)
        return _finish(op, _ref().embedding(ids, table, fmt, tdt), out)
    if code == _TORCH:
        raise _not_torch(op, table)
    if out is None:
        _check_layout_first(op, "ids", ids)
        _check_layout_first(op, "table", table)
        tshape = tuple(table.shape)
        _check_rows(op, "table", tshape, fmt, getattr(table, "dtype", None))
        if fmt == 0:
            if "int" in str(getattr(table, "dtype", "")):  # (uint8 bytes: a packed table without its format)
                raise UnsupportedDtypeError(f"{op}: table has dtype {table.dtype}; a dense table is fp16, bf16 or "
                                            "fp32, and a packed one needs table_format= (q4_0, q4_1, q8_0, ...)")
            hidden = int(tshape[1])
        else:
            hidden = _packed_cols(tshape, fmt)
            name = name or "fp32"
        out = fw.empty(table, tuple(ids.shape) + (hidden,), name)
    _native(_C.embedding, fw, table, (out, ids, table), fmt, code)
    return out


def dequantize(packed: Array, qtype: Union[str, int, QType], *, dtype: Any = "fp32", backend: str = "auto",
               out: Optional[Array] = None) -> Array:
    """Decode packed GGUF blocks: uint8 ``[rows, row_bytes]`` -> ``[rows, cols]`` floats.

    ``cols = row_bytes / block_bytes * block_size``. Each element is decoded in
    FP32 (Q4_0: ``d * (q - 8)``; Q4_1: ``d * q + m``; Q8_0: ``d * q``; F32/F16/BF16
    exact) and rounded once to dtype.

    Args:
        packed: uint8 ``[rows, row_bytes]``.
        qtype: "q4_0" | "q4_1" | "q8_0" | "f32" | "f16" | "bf16" (or a :class:`QType`).
        dtype: output dtype, "fp16" | "bf16" | "fp32" (default) or a framework dtype.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[rows, cols]`` output (then dtype is out's).

    Raises:
        ValueError: an unknown qtype, or row_bytes that is not whole blocks.

    Contract: docs/contracts.md#dequantize--ks_dequantizeout-packed-qtype-and-the-gguf-block-formats
    """
    if _compiling():
        return _TL.dequantize(packed, qtype, dtype, backend, out)
    op = "dequantize"
    code = _backend(op, backend)
    q = _qtype(op, qtype)
    fw = _fw(op, "packed", packed)
    name = _float_dtype(op, dtype)
    if fw.is_torch and _torch_route(op, code, backend, (), ()):
        # (out given: its dtype is the output's, as natively)
        return _finish(op, _ref().dequantize(packed, q, _out_float_dtype(out) or fw.dtype(packed, name)), out)
    if code == _TORCH:
        raise _not_torch(op, packed)
    if out is None:
        _check_layout_first(op, "packed", packed)
        shape = tuple(packed.shape)
        _check_rows(op, "packed", shape, q, getattr(packed, "dtype", None))
        out = fw.empty(packed, (_dim0(shape), _packed_cols(shape, q)), name)
    _native(_C.dequantize, fw, packed, (out, packed), q, code)
    return out


def gemm(a: T, b: Array, *, backend: str = "auto", out: Optional[T] = None) -> T:
    """Matrix product with b in nn.Linear layout: ``out[..., n] = round(sum_k fp32(a[..., k]) * fp32(b[n, k]))``.

    Args:
        a: ``[..., K]``, K > 0, any number of leading dims (M = their product; as
            ``torch.nn.functional.linear``); fp16, bf16 or fp32.
        b: ``[N, K]``, a's dtype and device.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[..., N]`` output (a's leading dims); must overlap neither input.

    Contract: docs/contracts.md#gemm--ks_gemmout-a-b
    """
    if _compiling():
        return _TL.gemm(a, b, backend, out)
    op = "gemm"
    code = _backend(op, backend)
    fw = _fw(op, "a", a)
    if fw.is_torch and _torch_route(op, code, backend, ("a", "b"), (a, b)):
        return _finish(op, _ref().gemm(a, b), out)
    if code == _TORCH:
        raise _not_torch(op, a)
    if out is None:
        _check_layout_first(op, "a", a)
        _check_ndim_first(op, "b", b, 2)
        out = fw.empty(a, (*tuple(a.shape)[:-1], _dim0(tuple(b.shape))))
    _native(_C.gemm, fw, a, (out, a, b), code)
    return out


def quant_matmul(x: T, weight: Array, qtype: Union[str, int, QType], *, backend: str = "auto",
                 out: Optional[T] = None) -> T:
    """``out[..., n] = round(sum_k fp32(x[..., k]) * w[n, k])`` with w decoded from packed blocks.

    No dequantized copy of the weight is made; each element is decoded in FP32.

    Args:
        x: ``[..., K]``, any number of leading dims (M = their product; as
            ``torch.nn.functional.linear``); fp16, bf16 or fp32. K must be a multiple of the block size.
        weight: uint8 ``[N, K / block_size * block_bytes]`` in qtype. Read-only: on CUDA it
            may be read before the kernel queued just before this call on the stream finishes,
            so that kernel must not write it (synchronize or record an event in between).
        qtype: "q4_0" | "q4_1" | "q8_0" | "f32" | "f16" | "bf16".
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[..., N]`` output (x's leading dims) in x's dtype.

    Contract: docs/contracts.md#quant_matmul--ks_quant_matmulout-x-weight-qtype
    """
    if _compiling():
        return _TL.quant_matmul(x, weight, qtype, backend, out)
    return _quant_matmul_call("quant_matmul", x, weight, qtype, backend, out)


def _quant_matmul_call(op: str, x: T, weight: Array, qtype, backend: str, out: Optional[T]) -> T:
    # quant_matmul and quant_matmul_a8 take the same arguments: _C's and _ref()'s function of that name.
    code = _backend(op, backend)
    q = _qtype(op, qtype, blocks_only=op == "quant_matmul_a8")
    fw = _fw(op, "x", x)
    if fw.is_torch and _torch_route(op, code, backend, ("x",), (x,)):
        return _finish(op, getattr(_ref(), op)(x, weight, q), out)
    if code == _TORCH:
        raise _not_torch(op, x)
    if out is None:
        _check_layout_first(op, "x", x)
        _check_ndim_first(op, "weight", weight, 2)
        out = fw.empty(x, (*tuple(x.shape)[:-1], _dim0(tuple(weight.shape))))
    _native(getattr(_C, op), fw, x, (out, x, weight), q, code)
    return out


def quant_matmul_a8(x: T, weight: Array, qtype: Union[str, int, QType], *, backend: str = "auto",
                    out: Optional[T] = None) -> T:
    """W4A8 / W8A8: :func:`quant_matmul` with x quantized to int8 per block of 32.

    Each block of 32 values of a row of x (their FP32 values) is quantized as llama.cpp's Q8_1
    activations: ``a = max|x_i|``, ``d = a / 127``, ``q_i = rint(x_i * (127 / a))`` in
    ``[-127, 127]`` (ties to even), so the weights meet ``d * q_i``, within ``a / 254`` of
    x_i. Per block, ``S = sum c_i q_i`` and ``Q = sum q_i`` are exact integer sums (c_i the
    weight's stored codes: Q4_0 / Q4_1 nibbles 0..15, Q8_0 signed bytes) and the block's value
    is formed in FP32 from the block's fp16 scale dw (and minimum mw)::

        Q8_0: (dw * d) * S      Q4_0: (dw * d) * (S - 8 Q)      Q4_1: fma(dw * d, S, mw * (d * Q))

    A row's block values are summed in FP32 in one fixed order, then rounded once to x's
    dtype: every backend and variant gives the same bits. The result differs from
    :func:`quant_matmul` by the quantization of x: up to about 1/254 of each x block's largest
    value per element (times the weights it meets). A block of x holding a NaN or an
    infinity makes every output of its row NaN (other rows are unaffected); a block with
    ``max|x| < 1.5e-36`` (``d`` below FLT_MIN; e.g. all zeros) counts as zero.

    Args:
        x: ``[..., K]``, any number of leading dims (M = their product); fp16, bf16 or fp32. K
            must be a multiple of 32 (the block size). Read only.
        weight: uint8 ``[N, K / 32 * block_bytes]`` in qtype. Read-only: on CUDA it may be read
            before the kernel queued just before this call on the stream finishes, so that
            kernel must not write it (synchronize or record an event in between), as for
            :func:`quant_matmul`.
        qtype: "q4_0" | "q4_1" | "q8_0" (or a :class:`QType`); the dense formats "f32", "f16"
            and "bf16" are rejected.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[..., N]`` output (x's leading dims) in x's dtype; must overlap neither input.

    Returns:
        A new ``[..., N]`` array (x's framework and device), or ``out``.

    Raises:
        ValueError: a qtype other than Q4_0, Q4_1 or Q8_0 (InvalidArgumentError naming qtype),
            an unknown qtype, a K that is not whole blocks, a bad weight or out shape, layout,
            overlap, an unknown backend.
        TypeError: an unsupported or mismatched dtype (weight must be uint8).
        RuntimeError: mixed devices, an unavailable backend, a CUDA error, or a torch tensor
            requiring grad with backend "cpu"/"cuda".

    After an error nothing has been written (out is unchanged).

    Contract: docs/contracts.md#quant_matmul_a8; ks_quant_matmul_a8 in include/kernscope/kernscope.h.
    """
    if _compiling():
        return _TL.quant_matmul_a8(x, weight, qtype, backend, out)
    return _quant_matmul_call("quant_matmul_a8", x, weight, qtype, backend, out)


def fused_add_rms_norm_quant_matmul(x: Optional[T], residual: T, norm_weight: Array, weight: Array,
                                    qtype: Union[str, int, QType], eps: float = 1e-6, *, backend: str = "auto",
                                    out: Optional[T] = None,
                                    residual_out: Optional[T] = None) -> Union[T, Tuple[T, T]]:
    """Decode-step fusion: (residual add +) RMS norm, then :func:`quant_matmul`, in one kernel.

    With x (``s = fp32(x) + fp32(residual)``, unrounded)::

        residual_out = round(s)
        h            = round(s * rsqrt(mean(s^2) + eps) * fp32(norm_weight))
        out          = round(sum_k fp32(h[m, k]) * w[n, k])      (w decoded from weight's blocks)

    Without x (``x=None``): ``h = round(rms_norm(residual, norm_weight, eps))`` and the same out.
    h is rounded to the activation dtype, as the unfused ops store it, but never goes
    through memory. The result equals :func:`fused_add_rms_norm` (or :func:`rms_norm` when x
    is None) followed by :func:`quant_matmul`, up to the FP32 summation order of the sum
    of squares; residual_out holds exactly fused_add_rms_norm's residual values.

    Args:
        x: ``[..., K]`` (residual's shape) or None; fp16, bf16 or fp32. Read only (unlike
            fused_add_rms_norm).
        residual: ``[..., K]``, any number of leading dims (M = their product, as
            :func:`quant_matmul`'s x), K > 0 and a multiple of the block size; x's dtype. Read only.
        norm_weight: ``[K]``, residual's dtype.
        weight: uint8 ``[N, K / block_size * block_bytes]`` in qtype.
        qtype: "q4_0" | "q4_1" | "q8_0" | "f32" | "f16" | "bf16" (or a :class:`QType`).
        eps: finite, > 0 (after rounding to fp32).
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[..., N]`` output (residual's leading dims) in residual's dtype.
        residual_out: optional ``[..., K]`` output (residual's shape) for ``round(x + residual)``, residual's dtype;
            allocated when x is given and it is not. Must be None when x is None.

    out and residual_out must not overlap any input or each other (residual_out cannot be
    residual itself: other rows still read residual while it is written).

    Returns:
        x None: ``out``. x given: ``(out, residual_out)``. New arrays in residual's
        framework and device, or the ones passed.

    Raises:
        ValueError: residual_out given without x; a shape (x, norm_weight, out,
            residual_out; weight's bytes per row for K), eps, qtype, layout or overlap error;
            an unknown backend.
        TypeError: an unsupported or mismatched dtype (weight must be uint8).
        RuntimeError: mixed devices, an unavailable backend, a CUDA error, or a torch
            tensor requiring grad with backend "cpu"/"cuda".

    After an error nothing has been written (out and residual_out are unchanged).

    Contract: docs/contracts.md (fused_add_rms_norm_quant_matmul; fused_add_rms_norm, rms_norm
    and quant_matmul); ks_fused_add_rms_norm_quant_matmul in include/kernscope/kernscope.h.
    """
    if _compiling():
        return _TL.fused_add_rms_norm_quant_matmul(x, residual, norm_weight, weight, qtype, eps, backend, out,
                                                   residual_out)
    op = "fused_add_rms_norm_quant_matmul"
    code = _backend(op, backend)
    q = _qtype(op, qtype)
    fw = _fw(op, "residual", residual)
    if fw.is_torch and _torch_route(op, code, backend, ("x", "residual", "norm_weight"), (x, residual, norm_weight)):
        y, r = _ref().fused_add_rms_norm_quant_matmul(x, residual, norm_weight, weight, q, eps, residual_out, out)
        return y if x is None else (y, r)
    if code == _TORCH:
        raise _not_torch(op, residual)
    if out is None:
        _check_layout_first(op, "residual", residual)
        _check_ndim_first(op, "weight", weight, 2)
        out = fw.empty(residual, (*tuple(residual.shape)[:-1], _dim0(tuple(weight.shape))))
    if x is not None and residual_out is None:
        residual_out = fw.empty_like(residual)
    _native(_C.fused_add_rms_norm_quant_matmul, fw, residual, (out, residual_out, x, residual, norm_weight, weight),
            _real(op, "eps", eps), q, code)
    return out if x is None else (out, residual_out)


def silu_and_mul_quant_matmul(gate_up: T, weight: Array, qtype: Union[str, int, QType], *, backend: str = "auto",
                              out: Optional[T] = None) -> T:
    """Decode-step fusion: :func:`silu_and_mul`, then :func:`quant_matmul`, in one kernel.

    ``h = round(g * sigmoid(g) * u)`` with ``g = fp32(gate_up[..., :K])``, ``u = fp32(gate_up[..., K:])``
    (silu_and_mul's values, rounded to gate_up's dtype but never stored), then
    ``out[m, n] = round(sum_k fp32(h[m, k]) * w[n, k])`` with w decoded from weight's blocks.
    Equals :func:`silu_and_mul` followed by :func:`quant_matmul`.

    Args:
        gate_up: ``[..., 2K]`` (gate then up), any number of leading dims (M = their product),
            K > 0 and a multiple of the block size; fp16, bf16 or fp32. Read only.
        weight: uint8 ``[N, K / block_size * block_bytes]`` in qtype.
        qtype: "q4_0" | "q4_1" | "q8_0" | "f32" | "f16" | "bf16" (or a :class:`QType`).
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[..., N]`` output (gate_up's leading dims) in gate_up's dtype; must
            overlap neither input.

    Returns:
        A new ``[..., N]`` array (gate_up's framework and device), or ``out``.

    Raises:
        ValueError: an odd or empty last dimension of gate_up, a K that is not whole blocks,
            a bad weight or out shape, an unknown qtype, layout, overlap, an unknown backend.
        TypeError, RuntimeError: as for :func:`fused_add_rms_norm_quant_matmul`.

    After an error nothing has been written.

    Contract: docs/contracts.md (silu_and_mul_quant_matmul; silu_and_mul and quant_matmul);
    ks_silu_and_mul_quant_matmul in include/kernscope/kernscope.h.
    """
    if _compiling():
        return _TL.silu_and_mul_quant_matmul(gate_up, weight, qtype, backend, out)
    op = "silu_and_mul_quant_matmul"
    code = _backend(op, backend)
    q = _qtype(op, qtype)
    fw = _fw(op, "gate_up", gate_up)
    if fw.is_torch and _torch_route(op, code, backend, ("gate_up",), (gate_up,)):
        return _finish(op, _ref().silu_and_mul_quant_matmul(gate_up, weight, q), out)
    if code == _TORCH:
        raise _not_torch(op, gate_up)
    if out is None:
        _check_layout_first(op, "gate_up", gate_up)
        _check_ndim_first(op, "weight", weight, 2)
        out = fw.empty(gate_up, (*tuple(gate_up.shape)[:-1], _dim0(tuple(weight.shape))))
    _native(_C.silu_and_mul_quant_matmul, fw, gate_up, (out, gate_up, weight), q, code)
    return out


def rotary_embedding(q: Array, k: Optional[Array], positions: Array, rotary_dim: Optional[int] = None,
                     theta: float = 10000.0, is_neox: bool = True, *, backend: str = "auto") -> None:
    """Rotary position embedding, in place on q and k (k may be None); returns None.

    ``inv_freq[i] = fp32(theta^(-2i/rotary_dim))``, ``angle = fp32(pos) * inv_freq[i]``
    (FP32), each pair ``(a, b) -> (a cos - b sin, b cos + a sin)`` rounded once.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; fp16, bf16 or fp32. Rotated in place.
        k: ``[num_tokens, num_kv_heads, head_dim]`` (q's dtype) or None. Rotated in place.
        positions: int32/int64 ``[num_tokens]``, any value.
        rotary_dim: even, 0 < rotary_dim <= head_dim (default: head_dim); later features pass through.
        theta: finite, > 1.
        is_neox: True: pairs (i, i + rotary_dim/2) (HF rotate_half); False: (2i, 2i+1) (GPT-J, GGUF Llama).
        backend: "auto" | "cpu" | "cuda" | "torch".

    Contract: docs/contracts.md#rotary_embedding--ks_rotary_embeddingq-k-positions-rotary_dim-theta-is_neox-in-place
    """
    if _compiling():
        return _TL.rotary_embedding(q, k, positions, rotary_dim, theta, is_neox, backend)
    op = "rotary_embedding"
    code = _backend(op, backend)
    fw = _fw(op, "q", q)
    rd = _last(tuple(q.shape)) if rotary_dim is None else _integer(op, "rotary_dim", rotary_dim)
    if fw.is_torch and _torch_route(op, code, backend, ("q", "k"), (q, k)):
        return _ref().rotary_embedding(q, k, positions, rd, _real(op, "theta", theta), _flag(op, "is_neox", is_neox))
    if code == _TORCH:
        raise _not_torch(op, q)
    _native(_C.rotary_embedding, fw, q, (q, k, positions), rd, _real(op, "theta", theta),
            _flag(op, "is_neox", is_neox), code)
    return None


def kv_cache_append(k_cache: Array, v_cache: Array, k: Array, v: Array, slot_mapping: Array, *,
                    backend: str = "auto") -> None:
    """Write k/v rows into a paged cache, in place; returns None.

    For token t with ``slot = slot_mapping[t] >= 0``: ``k_cache[slot] = k[t]``,
    ``v_cache[slot] = v[t]`` (bit-exact; slot = block * block_size + offset);
    slot -1 is skipped. The token count comes from slot_mapping (k may hold padding rows).

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; written.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype (fp16, bf16, fp32).
        slot_mapping: int32/int64 ``[num_tokens]``; a slot < -1 or >= num_blocks * block_size
            raises ValueError before anything is written.
        backend: "auto" | "cpu" | "cuda" | "torch".

    Contract: docs/contracts.md#kv_cache_append--ks_kv_cache_appendk_cache-v_cache-k-v-slot_mapping
    """
    if _compiling():
        return _TL.kv_cache_append(k_cache, v_cache, k, v, slot_mapping, backend)
    op = "kv_cache_append"
    code = _backend(op, backend)
    fw = _fw(op, "k_cache", k_cache)
    if fw.is_torch and _torch_route(op, code, backend, ("k", "v"), (k, v)):
        return _ref().kv_cache_append(k_cache, v_cache, k, v, slot_mapping)
    if code == _TORCH:
        raise _not_torch(op, k_cache)
    _native(_C.kv_cache_append, fw, k_cache, (k_cache, v_cache, k, v, slot_mapping), code)
    return None


def rotary_embedding_kv_append(q: Array, k: Array, v: Array, positions: Array, k_cache: Array, v_cache: Array,
                               slot_mapping: Array, rotary_dim: Optional[int] = None, theta: float = 10000.0,
                               is_neox: bool = True, *, backend: str = "auto") -> None:
    """Decode-step fusion: :func:`rotary_embedding` of q and k, then :func:`kv_cache_append` of
    the rotated k and of v, in one pass (one kernel on CUDA); in place, returns None.

    Exactly ``rotary_embedding(q, k, positions, rotary_dim, theta, is_neox)`` followed by
    ``kv_cache_append(k_cache, v_cache, k, v, slot_mapping)``: q and k are rotated in place (k's
    rotated rows are also what the cache receives), and for token t with
    ``slot = slot_mapping[t] >= 0``, ``k_cache[slot] = k[t]`` (rotated), ``v_cache[slot] = v[t]``;
    slot -1 is skipped. Bit for bit the two calls' result. Note the argument order: the
    tensors first (as the C ABI's, with the caches and slot_mapping moved before rotary_dim),
    so that rotary_dim, theta and is_neox keep rotary_embedding's defaults.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; fp16, bf16 or fp32; may be a strided view
            (e.g. of a fused qkv buffer). Rotated in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, q's dtype; required (unlike
            rotary_embedding's). Rotated in place.
        v: k's shape and dtype. Read only.
        positions: int32/int64 ``[num_tokens]``, any value.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, k's dtype; written.
        slot_mapping: int32/int64 ``[n]``, n <= num_tokens (the appended tokens: k may hold
            padding rows, which are still rotated); a slot < -1 or >= num_blocks * block_size
            raises ValueError before anything is written.
        rotary_dim: even, 0 < rotary_dim <= head_dim (default: head_dim); later features pass
            through (and are appended as they are).
        theta: finite, > 1.
        is_neox: True: pairs (i, i + rotary_dim/2) (HF rotate_half); False: (2i, 2i+1).
        backend: "auto" | "cpu" | "cuda" | "torch".

    Every rule of the two ops applies, and a few more, since one pass reads and writes them in
    no fixed order: v must not overlap q or k, and the caches must not overlap q or positions.

    Raises:
        ValueError: k None, a shape, rotary_dim, theta, slot, layout or overlap error; an
            unknown backend.
        TypeError: an unsupported or mismatched dtype.
        RuntimeError: mixed devices, an unavailable backend, a CUDA error, or a torch tensor
            requiring grad with backend "cpu"/"cuda".

    After an error nothing has been written (q, k and the caches are unchanged).

    Contract: docs/contracts.md (rotary_embedding and kv_cache_append);
    ks_rotary_embedding_kv_append in include/kernscope/kernscope.h.
    """
    if _compiling():
        return _TL.rotary_embedding_kv_append(q, k, v, positions, k_cache, v_cache, slot_mapping, rotary_dim, theta,
                                              is_neox, backend)
    op = "rotary_embedding_kv_append"
    code = _backend(op, backend)
    fw = _fw(op, "q", q)
    rd = _last(tuple(q.shape)) if rotary_dim is None else _integer(op, "rotary_dim", rotary_dim)
    if fw.is_torch and _torch_route(op, code, backend, ("q", "k", "v"), (q, k, v)):
        return _ref().rotary_embedding_kv_append(q, k, v, positions, k_cache, v_cache, slot_mapping, rd,
                                                 _real(op, "theta", theta), _flag(op, "is_neox", is_neox))
    if code == _TORCH:
        raise _not_torch(op, q)
    _native(_C.rotary_embedding_kv_append, fw, q, (q, k, v, positions, k_cache, v_cache, slot_mapping), rd,
            _real(op, "theta", theta), _flag(op, "is_neox", is_neox), code)
    return None


def _rope_head_dim(weight_shape: Sequence[int], num_heads: int, num_kv_heads: int) -> int:
    """head_dim = N / (num_heads + 2 num_kv_heads) (0 when that is not a positive count; the C
    ABI then rejects num_heads and num_kv_heads before it looks at rotary_dim)."""
    heads = num_heads + 2 * num_kv_heads
    return _dim0(weight_shape) // heads if heads > 0 else 0


def fused_add_rms_norm_quant_matmul_rope_kv_append(
        x: Optional[T], residual: T, norm_weight: Array, weight: Array, qtype: Union[str, int, QType],
        num_heads: int, num_kv_heads: int, positions: Array, k_cache: Array, v_cache: Array, slot_mapping: Array,
        eps: float = 1e-6, rotary_dim: Optional[int] = None, theta: float = 10000.0, is_neox: bool = True, *,
        backend: str = "auto", out: Optional[T] = None,
        residual_out: Optional[T] = None) -> Union[T, Tuple[T, T]]:
    """Decode-step fusion for one token: :func:`fused_add_rms_norm_quant_matmul` (the q/k/v
    projection), then :func:`rotary_embedding_kv_append` on out's q, k and v column slices, in
    one kernel on CUDA where it can; out (and residual_out) returned, the caches written in place.

    With ``H = num_heads``, ``KVH = num_kv_heads``, ``N = weight's rows`` and
    ``D = head_dim = N / (H + 2 KVH)``, exactly::

        out, residual_out = fused_add_rms_norm_quant_matmul(x, residual, norm_weight, weight, qtype, eps)
        q = out[:, :H*D].reshape(1, H, D)            # views of out, rotated in place
        k = out[:, H*D:(H+KVH)*D].reshape(1, KVH, D)
        v = out[:, (H+KVH)*D:].reshape(1, KVH, D)
        rotary_embedding_kv_append(q, k, v, positions, k_cache, v_cache, slot_mapping, rotary_dim, theta, is_neox)

    Bit for bit the two calls' result: each value of out is rounded to residual's dtype after
    the matmul, then q and k are rotated in FP32 and rounded again; for ``slot = slot_mapping[0]
    >= 0``, ``k_cache[slot] = k[0]`` (rotated) and ``v_cache[slot] = v[0]``; slot -1 is skipped.
    Note the argument order: the tensors first (as the C ABI's, with eps moved after them),
    then eps, rotary_dim, theta and is_neox with their neighbours' defaults.

    Args:
        x: ``[1, K]`` or None; fp16, bf16 or fp32. Read only.
        residual: ``[1, K]`` (one token; ``[0, K]`` does nothing), K > 0 and a multiple of the
            block size; x's dtype. Read only. More than one row raises ValueError (call
            fused_add_rms_norm_quant_matmul, then rotary_embedding_kv_append).
        norm_weight: ``[K]``, residual's dtype.
        weight: uint8 ``[N, K / block_size * block_bytes]`` in qtype, N = (H + 2 KVH) * D: the
            q, k and v projections' rows stacked.
        qtype: "q4_0" | "q4_1" | "q8_0" | "f32" | "f16" | "bf16" (or a :class:`QType`).
        num_heads: H > 0 query heads.
        num_kv_heads: KVH > 0 key/value heads.
        positions: int32/int64 ``[1]`` (``[0]`` with zero rows), any value.
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``, residual's dtype; written.
        slot_mapping: int32/int64 ``[1]`` or ``[0]`` (no append); a slot < -1 or >=
            num_blocks * block_size raises ValueError before anything is written.
        eps: finite, > 0 (after rounding to fp32).
        rotary_dim: even, 0 < rotary_dim <= D (default: D); later features pass through (and
            are appended as they are).
        theta: finite, > 1.
        is_neox: True: pairs (i, i + rotary_dim/2) (HF rotate_half); False: (2i, 2i+1)
            (GPT-J, GGUF Llama; the layout CUDA fuses into the matmul kernel).
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional ``[1, N]`` output in residual's dtype (q, k, v as described, q and k
            rotated).
        residual_out: optional ``[1, K]`` output for ``round(x + residual)``, residual's dtype;
            allocated when x is given and it is not. Must be None when x is None.

    Every rule of the two ops applies, under this op's name, and a few more, since one kernel
    reads and writes them in no fixed order: out and residual_out overlap no input nor each
    other, and the caches, positions and slot_mapping overlap none of the matmul's tensors
    (x, residual, norm_weight, weight, out, residual_out).

    Returns:
        x None: ``out``. x given: ``(out, residual_out)``. New arrays in residual's framework
        and device, or the ones passed.

    Raises:
        ValueError: residual_out given without x; more than one row; num_heads or num_kv_heads
            <= 0, or N not a multiple of num_heads + 2 num_kv_heads; a shape, eps, qtype,
            rotary_dim, theta, slot, layout or overlap error; an unknown backend.
        TypeError: an unsupported or mismatched dtype (weight must be uint8; the caches must
            have residual's dtype).
        RuntimeError: mixed devices, an unavailable backend, a CUDA error, or a torch tensor
            requiring grad with backend "cpu"/"cuda".

    After an error nothing has been written (out, residual_out and the caches are unchanged).

    Contract: docs/contracts.md#fused_add_rms_norm_quant_matmul_rope_kv_append (the two calls'
    result, bit for bit); ks_fused_add_rms_norm_quant_matmul_rope_kv_append in
    include/kernscope/kernscope.h.
    """
    if _compiling():
        return _TL.fused_add_rms_norm_quant_matmul_rope_kv_append(
            x, residual, norm_weight, weight, qtype, num_heads, num_kv_heads, positions, k_cache, v_cache,
            slot_mapping, eps, rotary_dim, theta, is_neox, backend, out, residual_out)
    op = "fused_add_rms_norm_quant_matmul_rope_kv_append"
    code = _backend(op, backend)
    q = _qtype(op, qtype)
    fw = _fw(op, "residual", residual)
    h, kvh = _integer(op, "num_heads", num_heads), _integer(op, "num_kv_heads", num_kv_heads)
    rd = _rope_head_dim(tuple(weight.shape), h, kvh) if rotary_dim is None else _integer(op, "rotary_dim", rotary_dim)
    if fw.is_torch and _torch_route(op, code, backend, ("x", "residual", "norm_weight"), (x, residual, norm_weight)):
        y, r = _ref().fused_add_rms_norm_quant_matmul_rope_kv_append(
            x, residual, norm_weight, weight, q, eps, h, kvh, positions, k_cache, v_cache, slot_mapping, rd,
            _real(op, "theta", theta), _flag(op, "is_neox", is_neox), residual_out, out)
        return y if x is None else (y, r)
    if code == _TORCH:
        raise _not_torch(op, residual)
    if out is None:
        _check_layout_first(op, "residual", residual)
        _check_layout_first(op, "weight", weight)
        out = fw.empty(residual, (_dim0(tuple(residual.shape)), _dim0(tuple(weight.shape))))
    if x is not None and residual_out is None:
        residual_out = fw.empty_like(residual)
    _native(_C.fused_add_rms_norm_quant_matmul_rope_kv_append, fw, residual,
            (out, residual_out, x, residual, norm_weight, weight, positions, k_cache, v_cache, slot_mapping),
            _real(op, "eps", eps), q, h, kvh, rd, _real(op, "theta", theta), _flag(op, "is_neox", is_neox), code)
    return out if x is None else (out, residual_out)


def varlen_attention(q: T, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                     scale: Optional[float] = None, *, causal: bool = True, backend: str = "auto",
                     out: Optional[T] = None) -> T:
    """Attention over packed variable-length sequences (no cache, no padding).

    Sequence s owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key/value rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``. causal: query i of a sequence with len_q queries and
    len_k keys sees keys ``j <= i + len_k - len_q`` (bottom-right aligned); a query that sees no
    key gets a zero row. GQA: query head h reads kv head ``h // (num_heads // num_kv_heads)``.
    FP32 scores, softmax and weighted sum; one rounding.

    Args:
        q: ``[total_q, num_heads, head_dim]``; fp16, bf16 or fp32.
        k, v: ``[total_k, num_kv_heads, head_dim]``, q's dtype.
        cu_seqlens_q, cu_seqlens_k: int32 ``[num_seqs + 1]``, from 0, non-decreasing, to the totals.
        scale: the score scale (default ``1 / sqrt(head_dim)``).
        causal: bottom-right-aligned causal mask (default) or none.
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional output of q's shape.

    Raises:
        ValueError: shapes, GQA head counts, offsets (host) that do not start at 0, decrease, or
            miss the totals, a non-finite scale, ``out`` overlapping an input.
        TypeError: q not fp16/bf16/fp32, k/v/out not q's dtype, cu_seqlens not int32.
        RuntimeError: the backend asked for is not available.

    Contract: docs/contracts.md#varlen_attention--ks_varlen_attentionout-q-k-v-cu_seqlens_q-cu_seqlens_k-scale-causal
    """
    if scale is None:
        scale = 1.0 / math.sqrt(max(_last(tuple(q.shape)), 1))
    if _compiling():
        return _TL.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale),
                                    _flag("varlen_attention", "causal", causal), backend, out)
    op = "varlen_attention"
    code = _backend(op, backend)
    fw = _fw(op, "q", q)
    if fw.is_torch and _torch_route(op, code, backend, ("q", "k", "v"), (q, k, v)):
        return _finish(op, _ref().varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, _real(op, "scale", scale),
                                               _flag(op, "causal", causal)), out)
    if code == _TORCH:
        raise _not_torch(op, q)
    if out is None:
        _check_layout_first(op, "q", q)
        out = fw.empty_like(q)
    _native(_C.varlen_attention, fw, q, (out, q, k, v, cu_seqlens_q, cu_seqlens_k), _real(op, "scale", scale),
            _flag(op, "causal", causal), code)
    return out


def paged_attention(q: T, k_cache: Array, v_cache: Array, block_tables: Array, context_lens: Array,
                    scale: Optional[float] = None, *, seq_ids: Optional[Array] = None, fresh_keys: int = 0,
                    backend: str = "auto", out: Optional[T] = None) -> T:
    """Attention of each query row over a paged KV cache (decode, and causal prefill).

    For token t, head h (kv head ``h // (num_heads // num_kv_heads)``):
    ``s_j = scale * q[t,h] . K_j`` for j < context_lens[t] (FP32), p = softmax(s)
    (FP32), ``out[t,h] = round(sum_j p_j V_j)``. K_j is the cache row at slot
    ``block_tables[seq][j // block_size] * block_size + j % block_size``.
    context_lens 0 gives a zero row. Causal prefill: give each prompt token its
    own context length (position + 1) and its sequence through seq_ids.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; fp16, bf16 or fp32.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        context_lens: int32 ``[num_tokens]``.
        scale: the score scale (default ``1 / sqrt(head_dim)``).
        seq_ids: int32 ``[num_tokens]`` (token t reads block_tables[seq_ids[t]]), or
            None: token t is sequence t (num_seqs == num_tokens).
        fresh_keys: int >= 0; the result is the same bits whatever it is. 0 (default):
            ks_paged_attention. >= 1 (ks_paged_attention_after_append): the caller's
            promise that the kernel launched just before on the same stream (the step's
            cache append) wrote, for every token t, no k_cache / v_cache row that t
            reads below context_lens[t] - fresh_keys, and none of block_tables, seq_ids
            and context_lens; CUDA may then read the older keys before that kernel ends. A
            broken promise may read a row, a length or a table entry before it is written
            (wrong rows, or on cuda_mma_cluster a hung launch: the contract's "A broken
            promise"; not on the CPU). The
            native backends' errors then name paged_attention_after_append. Not passed
            on under torch.compile or on the torch reference (the same result).
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional output of q's shape.

    Raises:
        ValueError: shapes, GQA head counts, and out-of-range block ids, seq ids or
            context lengths (checked before anything is written); fresh_keys < 0.

    Contract: docs/contracts.md#paged_attention--ks_paged_attentionout-q-k_cache-v_cache-block_tables-seq_ids-context_lens-scale;
    fresh_keys: docs/contracts.md#paged_attention_after_append.
    """
    op = "paged_attention"
    fresh_keys = _integer(op, "fresh_keys", fresh_keys)
    if fresh_keys < 0:  # on every route, the torch reference and torch.compile included
        raise InvalidArgumentError(f"paged_attention: fresh_keys = {fresh_keys} must be >= 0")
    scale = 1.0 / math.sqrt(max(_last(tuple(q.shape)), 1)) if scale is None else _real(op, "scale", scale)
    if _compiling():
        return _TL.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, seq_ids, backend, out)
    code = _backend(op, backend)
    fw = _fw(op, "q", q)
    if fw.is_torch and _torch_route(op, code, backend, ("q", "k_cache", "v_cache"), (q, k_cache, v_cache)):
        return _finish(op, _ref().paged_attention(q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale), out)
    if code == _TORCH:
        raise _not_torch(op, q)
    if out is None:
        _check_layout_first(op, "q", q)
        out = fw.empty_like(q)
    _native(_C.paged_attention, fw, q, (out, q, k_cache, v_cache, block_tables, seq_ids, context_lens),
            scale, fresh_keys, code)
    return out


def rotary_embedding_kv_append_paged_attention(
        q: T, k: Array, v: Array, positions: Array, k_cache: Array, v_cache: Array, slot_mapping: Array,
        block_tables: Array, context_lens: Array, rotary_dim: Optional[int] = None, theta: float = 10000.0,
        is_neox: bool = True, scale: Optional[float] = None, *, seq_ids: Optional[Array] = None,
        backend: str = "auto", out: Optional[T] = None) -> T:
    """Decode-step fusion: :func:`rotary_embedding_kv_append` (q and k rotated in place, the
    rotated k and v appended to the caches), then :func:`paged_attention` of the rotated q over
    the appended caches, in one kernel on CUDA where it can; returns the attention output.

    Exactly::

        rotary_embedding_kv_append(q, k, v, positions, k_cache, v_cache, slot_mapping, rotary_dim, theta, is_neox)
        out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, seq_ids=seq_ids)

    On return q and k are rotated and the caches hold the new rows, as after the first call, and
    out holds the second call's result. Bit for bit the two calls' result (on CUDA: with
    paged_attention's cuda_gqa_cluster, which 16-bit automatic routing may not pick) when no token reads a
    cache slot that another token of the call appends (a decode step: each token is the newest
    position of its own sequence); otherwise the CPU still gives the two calls' result, and CUDA's
    fused kernel may read such a slot before or after it is written. Note the argument order: the
    tensors first (rotary_embedding_kv_append's, then paged_attention's block_tables and
    context_lens), then rotary_dim, theta, is_neox and scale with their ops' defaults; seq_ids,
    backend and out by keyword, as in paged_attention.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; fp16, bf16 or fp32. Rotated in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, q's dtype; required. Rotated in place.
        v: k's shape and dtype. Read only.
        positions: int32/int64 ``[num_tokens]``, any value.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype; written
            (slot_mapping's rows), then read by the attention.
        slot_mapping: int32/int64 ``[n]``, n <= num_tokens; a slot < -1 or >= num_blocks *
            block_size raises ValueError before anything is written; slot -1 is skipped.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        context_lens: int32 ``[num_tokens]``: token t sees cache keys ``0 .. context_lens[t] - 1``
            of its sequence (its own new key included when it is among them).
        rotary_dim: even, 0 < rotary_dim <= head_dim (default: head_dim); later features pass
            through (and are appended as they are).
        theta: finite, > 1.
        is_neox: True: pairs (i, i + rotary_dim/2) (HF rotate_half); False: (2i, 2i+1).
        scale: the score scale (default ``1 / sqrt(head_dim)``).
        seq_ids: int32 ``[num_tokens]`` (token t reads block_tables[seq_ids[t]]), or None: token t
            is sequence t (num_seqs == num_tokens).
        backend: "auto" | "cpu" | "cuda" | "torch".
        out: optional output of q's shape and dtype.

    Every rule of the two ops applies, under this op's name, and two more, since one kernel
    writes out while it reads the others and the first step writes what the attention's indices
    must not share: out overlaps none of q, k, v, positions, slot_mapping, the caches,
    block_tables, seq_ids and context_lens; block_tables, seq_ids and context_lens overlap none
    of q, k and the caches.

    Returns:
        A new array of q's shape (q's dtype, framework and device), or ``out``.

    Raises:
        ValueError: k None; a shape, GQA head count, rotary_dim, theta, scale, slot, block id, seq
            id, context length, layout or overlap error; an unknown backend.
        TypeError: an unsupported or mismatched dtype.
        RuntimeError: mixed devices, an unavailable backend, a CUDA error, or a torch tensor
            requiring grad with backend "cpu"/"cuda".

    After an error nothing has been written (q, k, the caches and out are unchanged).

    Contract: docs/contracts.md#rotary_embedding_kv_append_paged_attention;
    ks_rotary_embedding_kv_append_paged_attention in include/kernscope/kernscope.h.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(max(_last(tuple(q.shape)), 1))
    if _compiling():
        return _TL.rotary_embedding_kv_append_paged_attention(q, k, v, positions, k_cache, v_cache, slot_mapping,
                                                              block_tables, context_lens, rotary_dim, theta, is_neox,
                                                              float(scale), seq_ids, backend, out)
    op = "rotary_embedding_kv_append_paged_attention"
    code = _backend(op, backend)
    fw = _fw(op, "q", q)
    rd = _last(tuple(q.shape)) if rotary_dim is None else _integer(op, "rotary_dim", rotary_dim)
    if fw.is_torch and _torch_route(op, code, backend, ("q", "k", "v", "k_cache", "v_cache"),
                                    (q, k, v, k_cache, v_cache)):
        return _ref().rotary_embedding_kv_append_paged_attention(
            q, k, v, positions, k_cache, v_cache, slot_mapping, block_tables, seq_ids, context_lens, rd,
            _real(op, "theta", theta), _flag(op, "is_neox", is_neox), _real(op, "scale", scale), out)
    if code == _TORCH:
        raise _not_torch(op, q)
    if out is None:
        _check_layout_first(op, "q", q)
        out = fw.empty_like(q)
    _native(_C.rotary_embedding_kv_append_paged_attention, fw, q,
            (out, q, k, v, positions, k_cache, v_cache, slot_mapping, block_tables, seq_ids, context_lens), rd,
            _real(op, "theta", theta), _flag(op, "is_neox", is_neox), _real(op, "scale", scale), code)
    return out


OPS: Tuple[str, ...] = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gemv", "softmax", "argmax", "sample",
                        "varlen_attention",
                        "embedding", "dequantize", "gemm", "quant_matmul", "quant_matmul_a8",
                        "fused_add_rms_norm_quant_matmul", "silu_and_mul_quant_matmul", "rotary_embedding",
                        "kv_cache_append", "rotary_embedding_kv_append",
                        "fused_add_rms_norm_quant_matmul_rope_kv_append", "paged_attention",
                        "rotary_embedding_kv_append_paged_attention")
