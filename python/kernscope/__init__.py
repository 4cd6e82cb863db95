"""kernscope: LLM inference operators behind one C ABI, for any DLPack array.

Quick start::

    import numpy as np, kernscope as ks
    x = np.random.randn(8, 4096).astype(np.float32)
    w = np.ones(4096, np.float32)
    y = ks.rms_norm(x, w, eps=1e-6)          # numpy in, numpy out (zero-copy input)
    ks.which("rms_norm", dtype="fp32", device="cpu")   # -> (variant, reason)

Ops: rms_norm, fused_add_rms_norm, silu_and_mul, gemv, softmax, argmax, sample,
embedding, dequantize, gemm, quant_matmul, quant_matmul_a8 (W4A8 / W8A8),
fused_add_rms_norm_quant_matmul, silu_and_mul_quant_matmul, rotary_embedding, kv_cache_append,
rotary_embedding_kv_append, fused_add_rms_norm_quant_matmul_rope_kv_append,
paged_attention, rotary_embedding_kv_append_paged_attention, varlen_attention.
Each has a numerical contract in docs/contracts.md and the same ``backend``
keyword ("auto", "cpu", "cuda", "torch"); see kernscope._ops.

With torch installed, the ops are also registered as torch.library custom ops
(``torch.ops.kernscope.*``, with fake kernels), so ``torch.compile`` traces
kernscope calls without graph breaks; this happens when torch is imported,
before or after kernscope, and never imports torch by itself.
"""

from __future__ import annotations

import importlib.util as _importlib_util
import sys as _sys
from collections import namedtuple as _namedtuple
import typing as _t

from . import _C
from ._errors import (
    BackendUnavailableError,
    CudaError,
    InternalError,
    InvalidArgumentError,
    KernscopeError,
    OutOfMemoryError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
)
from . import _errors
from ._frameworks import canonical_dtype
from ._ops import _integer, _qtype
from ._ops import (
    BACKENDS,
    OPS,
    QType,
    argmax,
    sample,
    varlen_attention,
    dequantize,
    embedding,
    fused_add_rms_norm,
    fused_add_rms_norm_quant_matmul,
    fused_add_rms_norm_quant_matmul_rope_kv_append,
    gemm,
    gemv,
    kv_cache_append,
    paged_attention,
    quant_matmul,
    quant_matmul_a8,
    rms_norm,
    rotary_embedding,
    rotary_embedding_kv_append,
    rotary_embedding_kv_append_paged_attention,
    silu_and_mul,
    silu_and_mul_quant_matmul,
    softmax,
)

_C._set_error_classes(_errors.BY_STATUS)

#: The library's version, from ks_version() ("MAJOR.MINOR.PATCH").
__version__: str = _C.version()

Variant = _namedtuple("Variant", ["op", "backend", "variant", "dtypes", "summary"])
Variant.__doc__ = """One implementation of an op: (op, backend, variant name, dtypes tuple, one-line summary)."""

_DEVICES = {"auto": 0, "cpu": 1, "cuda": 2}


def _device_code(device: _t.Any) -> int:
    name = str(device)  # also torch.device("cuda:0")
    base = name.split(":", 1)[0].lower()
    if base not in _DEVICES:
        raise InvalidArgumentError(f"which: unknown device {device!r}; valid devices: 'auto', 'cpu', 'cuda'")
    return _DEVICES[base]


def _shape_cols(op: str, cols: _t.Any) -> int:
    """which's cols: an int, or "AxB" (also "A*B") for a product where the op's cols key is one
    (ks_op_cols_factors: quant_matmul's N x K, paged_attention's max_blocks_per_seq x block_size),
    as ``ksctl which --cols``."""
    if isinstance(cols, str):
        parts = cols.replace("X", "x").replace("*", "x").split("x")
        # (ASCII digits only: str.isdigit accepts superscripts such as '²', which int() refuses; no
        # spaces, as ksctl which --cols refuses them)
        if len(parts) not in (1, 2) or not all(p.isascii() and p.isdigit() for p in parts):
            raise InvalidArgumentError(f"which: cols must be a non-negative integer or 'NxK'; got {cols!r}")
        # (the ops whose routing key's cols multiplies two sizes: ks_op_cols_factors, as `ksctl which`)
        if len(parts) == 2 and _C.op_cols_factors(op) is None:
            raise InvalidArgumentError(f"which: cols 'AxB' (a product) is the key of the ops whose cols multiply two "
                                       f"sizes (quant_matmul's N x K, paged_attention's max_blocks_per_seq x "
                                       f"block_size); {op}'s cols is one number (docs/routing.md#shape-keys-rows-cols)")
        n = 1
        for p in parts:
            n *= int(p)
        return n
    return _integer("which", "cols", cols, any_size=True)


def which(op: str, dtype: _t.Any = "fp32", device: _t.Any = "cpu", rows: _t.Optional[int] = None,
          cols: _t.Union[int, str, None] = None, qtype: _t.Optional[str] = None) -> _t.Tuple[str, str]:
    """The variant the registry picks for ``op`` on ``device`` with activations of
    ``dtype``, and why: ``(variant, reason)``.

    Args:
        op: an op name (see :data:`OPS`).
        dtype: "fp16" | "bf16" | "fp32" (or a numpy/torch dtype); fp32 by default, as
            ``ksctl which``; "bf16:q4_1" (``ksctl which --dtype``'s spelling) is dtype "bf16"
            with qtype "q4_1".
        device: "cpu" | "cuda" | "auto" (or a torch.device / "cuda:0").
        rows, cols: both or neither: the choice for a call of that shape as the routing table
            keys it (docs/routing.md#shape-keys-rows-cols, e.g. quant_matmul: m and n * k; where
            cols is such a product it may be given as "NxK", e.g. "49152x576" for quant_matmul,
            "64x16" for paged_attention's max_blocks_per_seq x block_size), so the cell such a call uses decides
            (ks_which_shape). The variant's own limits (alignment, sizes) still apply per call.
        qtype: for the packed-weight ops, the weights' block format as the ops take it ("q4_1",
            "Q4_1", QType.Q4_1, ...): the routing cells bound to one apply (docs/routing.md); None
            skips them.

    Raises:
        ValueError: an unknown op or device; only one of rows and cols; a negative one, or one
            of 2^63 or more; cols a string that is not "NxK"; an unknown qtype, or one given for an
            op without packed weights; a block format given both in dtype and as qtype.
        TypeError: an unsupported dtype; rows or cols not an integer (a float or bool).
        RuntimeError: the device's backend is not available (e.g. "cuda" without a GPU).
    """
    if not isinstance(op, str):
        raise TypeError(f"which: op must be a str; got {type(op).__name__}")
    if (rows is None) != (cols is None):
        raise InvalidArgumentError("which: give both rows and cols, or neither")
    # (a block format as the ops take it: "q4_1", "Q4_1" or QType.Q4_1; the C ABI's "bf16:q4_1")
    if isinstance(dtype, str) and ":" in dtype:  # (the C ABI's and ksctl's "bf16:q4_1" spelling)
        if qtype is not None:
            raise InvalidArgumentError(f"which: dtype {dtype!r} names a block format and qtype={qtype!r} "
                                       "another: give it once")
        dtype, qtype = dtype.split(":", 1)
    dt = canonical_dtype(dtype, "which: dtype") + ("" if qtype is None else ":" + QType(_qtype("which", qtype)).name.lower())
    try:
        if rows is not None:
            # (integers only, as the ops' arguments: int(1.5) and int(True) would pass; past int64: named)
            r = _integer("which", "rows", rows, any_size=True)
            c = _shape_cols(op, cols)
            for name, v in (("rows", r), ("cols", c)):
                if v >= 2 ** 63:
                    raise InvalidArgumentError(f"which: {name} must be < 2^63; got {v}")
            return tuple(_C.which_shape(op, dt, _device_code(device), r, c))  # type: ignore
        return tuple(_C.which(op, dt, _device_code(device)))  # type: ignore[return-value]
    except InvalidArgumentError as e:
        if qtype is not None and "block format after ':'" in str(e):  # (the C ABI's words are about its dtype string)
            raise InvalidArgumentError(f"which: qtype is for the ops with packed weights only; {op} has none") from None
        if qtype is not None and str(e).startswith("which: dtype: "):  # (a format the op does not take)
            raise InvalidArgumentError("which: qtype: " + str(e)[len("which: dtype: "):].replace(
                f"got {dt!r}", f"got {qtype!r}")) from None
        raise


def routing_table() -> _t.Dict[str, _t.Any]:
    """The active routing table (docs/routing.md): which variant goes first per op, backend,
    GPU arch, dtype and (rows, cols) bucket; the first matching cell wins, then the remaining
    variants by priority. Works without a GPU (the CUDA cells are listed all the same).

    Returns the parsed JSON of ``ks_routing_table``: ``{"schema", "files", "cells": [{"op",
    "backend", "arch", "dtype", "qtype" (the weights' block format, "*": any), "rows": [min, max or
    None], "cols", "order", "basis"
    ("measured" | "heuristic"), "source", "why", "table", "index"}]}``.

    Raises:
        ValueError: ``KS_ROUTING_TABLE`` names a table that does not parse (file and field named).
    """
    import json as _json

    return _json.loads(_C.routing_table())


def _torch_importable() -> bool:
    return "torch" in _sys.modules or _importlib_util.find_spec("torch") is not None


def available() -> _t.List[Variant]:
    """Every implementation kernscope has here: the native registry's variants
    (CPU, and CUDA when built with it), plus the PyTorch reference of each op
    when torch is installed. Rows are :class:`Variant` tuples."""
    rows = []
    for op, backend, name, dtypes, summary in _C.variants():
        rows.append(Variant(op, backend, name, tuple(d for d in dtypes.split(",") if d), summary))
    if _torch_importable():
        for op in OPS:
            rows.append(Variant(op, "torch", "torch_reference", ("fp16", "bf16", "fp32"),
                                "the contract written in PyTorch (any torch device; autograd)"))
    return rows


def set_deterministic(enabled: bool) -> None:
    """Deterministic (batch-invariant) mode, process-wide: a row's result never depends on
    how many rows the call holds or where the row sits (variants that cannot promise it,
    such as cuBLASLt gemm and cluster-split attention, are skipped; softmax keeps to its
    row-group kernel). ``KS_DETERMINISTIC=1`` turns it on at start.
    Contract: docs/contracts.md ("Summation order")."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_deterministic: enabled must be a bool; got {type(enabled).__name__}")
    _C.set_deterministic(enabled)


def deterministic() -> bool:
    """Whether deterministic mode is on (see :func:`set_deterministic`)."""
    return bool(_C.deterministic())


def backend_available(backend: str) -> bool:
    """True when ``backend`` ("auto", "cpu", "cuda", "torch") can run here
    ("cuda": compiled in and a device present; "torch": torch is installed)."""
    if backend == "torch":
        return _torch_importable()
    if backend not in _DEVICES:
        raise InvalidArgumentError(f"backend_available: unknown backend {backend!r}; valid backends: "
                         + ", ".join(repr(b) for b in BACKENDS))
    return bool(_C.backend_available(_DEVICES[backend]))


def force_variant(op: _t.Any = None, variant: _t.Any = None) -> None:
    """Pin ``op`` to the named variant for calls on this thread that run on the
    variant's backend; calls on the other backend are routed as usual (``variant=None``:
    back to automatic selection; ``op=None``: clear every pin). A pinned variant
    that cannot run a call fails it with BackendUnavailableError. For tests and
    benchmarks that run every variant (ks_force_variant). ``op`` and ``variant`` must be
    str (or None): anything else raises TypeError, a name with a NUL character ValueError."""
    _C.force_variant(op, variant)


def forced_variant(op: str) -> _t.Optional[str]:
    """The variant pinned for ``op`` on this thread by :func:`force_variant`, or None
    (ks_forced_variant). Unknown op: InvalidArgumentError."""
    return _C.forced_variant(op)


def last_launch_config(op: str) -> str:
    """The launch configuration (block shape, vector width, cluster size, ...) of
    this thread's last CUDA launch of ``op``, as text; "" if none (always "" on
    the CPU). For benchmarks and diagnostics (ks_last_launch_config)."""
    return _C.last_launch_config(op)


# ---- torch integration ------------------------------------------------------------
def _install_torch() -> None:
    try:
        from . import _torch_library

        _torch_library.install()
    except Exception as e:  # never break the caller's `import torch`
        import warnings

        warnings.warn(f"kernscope: torch.library registration failed ({type(e).__name__}: {e}); "
                      "kernscope ops still work eagerly but torch.compile will graph-break on them")


class _TorchImportHook:
    """A meta-path finder that registers kernscope's torch ops right after
    ``import torch`` finishes. It imports nothing: it asks the other finders for
    torch's spec and wraps that spec's loader; a find_spec that only probes
    (_importlib_util.find_spec) leaves no trace. It removes itself once done."""

    def find_spec(self, name: str, path: _t.Any = None, target: _t.Any = None) -> _t.Any:
        if name != "torch":
            return None
        spec = None
        for finder in list(_sys.meta_path):
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        inner = getattr(loader, "exec_module", None)
        if loader is None or inner is None:
            return spec
        hook = self

        def exec_module(module: _t.Any) -> None:
            inner(module)
            try:
                _sys.meta_path.remove(hook)
            except ValueError:
                pass
            _install_torch()

        try:
            loader.exec_module = exec_module
        except Exception:  # a loader that refuses attributes: torch still imports, eager ops still work
            pass
        return spec


if "torch" in _sys.modules:
    _install_torch()
elif not any(isinstance(f, _TorchImportHook) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _TorchImportHook())

__all__ = [
    "__version__",
    "BACKENDS",
    "OPS",
    "QType",
    "Variant",
    "which",
    "routing_table",
    "available",
    "backend_available",
    "set_deterministic",
    "deterministic",
    "force_variant",
    "forced_variant",
    "last_launch_config",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gemv",
    "softmax",
    "argmax",
    "sample",
    "varlen_attention",
    "embedding",
    "dequantize",
    "gemm",
    "quant_matmul",
    "quant_matmul_a8",
    "fused_add_rms_norm_quant_matmul",
    "silu_and_mul_quant_matmul",
    "rotary_embedding",
    "kv_cache_append",
    "rotary_embedding_kv_append",
    "fused_add_rms_norm_quant_matmul_rope_kv_append",
    "paged_attention",
    "rotary_embedding_kv_append_paged_attention",
    *_errors.__all__,
]

del annotations  # the __future__ feature object: not part of the package's namespace
