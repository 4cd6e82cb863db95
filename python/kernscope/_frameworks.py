"""Array frameworks: recognising the caller's arrays, allocating outputs beside
them, and the stream handshake for the native call.

kernscope never copies an input: every tensor reaches the C ABI through DLPack,
zero-copy. Outputs are allocated by the inputs' own framework on their device
(numpy in, numpy out; torch in, torch out; cupy, jax, or any array-API
namespace likewise), then handed to the C ABI the same way.

Nothing here imports numpy, torch, cupy or jax: a framework is looked at only
once the caller has passed one of its arrays (so it is already imported).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Tuple

# Canonical dtype names used across the package.
FLOAT_NAMES = ("fp16", "bf16", "fp32")
_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "fp64": "fp64", "float64": "fp64", "double": "fp64",
    "int64": "int64", "int32": "int32", "uint8": "uint8", "uint16": "uint16",
}
_NUMPY_NAMES = {"fp16": "float16", "fp32": "float32", "fp64": "float64", "int64": "int64",
                "int32": "int32", "uint8": "uint8"}


def canonical_dtype(dtype: Any, what: str = "dtype") -> str:
    """'fp16' | 'bf16' | 'fp32' | ... for a name or a numpy/torch/jax/cupy dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype)
        if name.startswith("torch."):
            name = name[6:]
        else:
            np = sys.modules.get("numpy")
            try:
                name = np.dtype(dtype).name if np is not None else getattr(dtype, "name", name)
            except TypeError:
                name = getattr(dtype, "name", name)
    canon = _ALIASES.get(name.lower())
    if canon is None:
        raise TypeError(f"{what}: unknown dtype {dtype!r}; expected one of fp16, bf16, fp32")
    return canon


class Framework:
    """How to treat one kind of array. Subclasses override what differs."""

    name = "dlpack"
    is_torch = False

    def is_device(self, x: Any) -> bool:
        """True when x lives on an accelerator (not host memory)."""
        dev = x.__dlpack_device__()
        return int(dev[0]) not in (1, 3)  # kDLCPU, kDLCUDAHost

    def stream(self, x: Any) -> Tuple[int, bool]:
        """(stream hint for __dlpack__ and the launch, wait for the stream after the call).

        Host arrays: (0, False). Device arrays of a framework without a
        stream API: the legacy default stream (1), and the call waits for it,
        since the producer keeps no stream order with us.
        """
        if not self.is_device(x):
            return 0, False
        return 1, True

    def prepare(self, tensors: tuple) -> Tuple[tuple, int]:
        """(tensors for the C call, bf16 mask); see python/src/ext.cpp. Touches only this
        framework's own arrays: a call runs every framework's prepare among its tensors."""
        return tensors, 0

    def written(self, tensors: tuple, mask: int) -> None:
        """After a native call that wrote tensors[i] for each bit i of mask (as given, before
        prepare): this framework's bookkeeping for its own arrays among them."""

    def dtype(self, like: Any, name: str) -> Any:
        raise TypeError(f"cannot allocate {name} arrays for {type(like).__module__}.{type(like).__name__}")

    def empty_like(self, like: Any) -> Any:
        """An output of like's shape and dtype (contiguous when like is; a strided
        input is rejected before its output is looked at)."""
        return self.empty(like, tuple(like.shape))

    def empty(self, like: Any, shape: tuple, dtype: Optional[str] = None) -> Any:
        xp = getattr(like, "__array_namespace__", None)
        if xp is None:
            raise TypeError(
                f"cannot allocate an output for {type(like).__module__}.{type(like).__name__} "
                "(no __array_namespace__); pass out=")
        ns = xp()
        dt = like.dtype if dtype is None else self.dtype(like, dtype)
        return ns.empty(shape, dtype=dt, device=like.device)


class ArrayAPI(Framework):
    """Any array-API namespace (x.__array_namespace__())."""

    name = "array_api"

    def dtype(self, like: Any, name: str) -> Any:
        ns = like.__array_namespace__()
        attr = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64",
                "int64": "int64", "int32": "int32", "uint8": "uint8"}[name]
        dt = getattr(ns, attr, None)
        if dt is None:
            raise TypeError(f"{ns.__name__} has no {attr} dtype")
        return dt


class Numpy(Framework):
    name = "numpy"

    def __init__(self) -> None:
        self._np = sys.modules["numpy"]
        self._bf16_type: Any = None

    def is_device(self, x: Any) -> bool:
        return False

    def stream(self, x: Any) -> Tuple[int, bool]:
        return 0, False

    def _bf16(self) -> Any:
        if self._bf16_type is None:
            ml = sys.modules.get("ml_dtypes")
            if ml is None:
                return None
            self._bf16_type = ml.bfloat16
        return self._bf16_type

    def prepare(self, tensors: tuple) -> Tuple[tuple, int]:
        # numpy's __dlpack__ cannot export ml_dtypes.bfloat16: pass a uint16 view
        # and mark it for the extension to relabel as bfloat16 (same bits).
        bf16 = self._bf16()
        if bf16 is None:
            return tensors, 0
        mask = 0
        out = None
        ndarray = self._np.ndarray
        for i, t in enumerate(tensors):
            if isinstance(t, ndarray) and t.dtype.type is bf16:
                if out is None:
                    out = list(tensors)
                out[i] = t.view(self._np.uint16)
                mask |= 1 << i
        return (tensors if out is None else tuple(out)), mask

    def dtype(self, like: Any, name: str) -> Any:
        if name == "bf16":
            try:
                import ml_dtypes
            except ImportError:  # pragma: no cover - depends on the environment
                raise TypeError("bf16 numpy arrays need the ml_dtypes package (pip install ml_dtypes)") from None
            return self._np.dtype(ml_dtypes.bfloat16)
        return self._np.dtype(_NUMPY_NAMES[name])

    def empty_like(self, like: Any) -> Any:
        return self._np.empty(like.shape, like.dtype)

    def empty(self, like: Any, shape: tuple, dtype: Optional[str] = None) -> Any:
        return self._np.empty(shape, dtype=like.dtype if dtype is None else self.dtype(like, dtype))


class Torch(Framework):
    name = "torch"
    is_torch = True

    def __init__(self) -> None:
        self._torch = torch = sys.modules["torch"]
        self._dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                        "fp64": torch.float64, "int64": torch.int64, "int32": torch.int32,
                        "uint8": torch.uint8}
        # torch >= 2.10 exports a DLPack C exchange table: the extension then reads
        # tensors and the current stream itself, and no hint is needed.
        self._exchange = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        graph = getattr(torch.autograd, "graph", None)
        self._bump = getattr(graph, "increment_version", None)

    def is_device(self, x: Any) -> bool:
        return x.device.type != "cpu"

    def stream(self, x: Any) -> Tuple[int, bool]:
        if self._exchange or x.device.type != "cuda":
            return 0, False
        s = self._torch.cuda.current_stream(x.device).cuda_stream
        return (s if s else 1), False  # 1: the legacy default stream, torch's default

    def prepare(self, tensors: tuple) -> Tuple[tuple, int]:
        # torch's __dlpack__ refuses a tensor that requires grad (nn.Parameter weights), even under
        # no_grad; the native path runs only where no autograd is asked for (_torch_route), so such
        # a tensor goes as its detach(): the same storage and version counter. (The C exchange API
        # of torch >= 2.10 reads it as it is.)
        if self._exchange:
            return tensors, 0
        out = None
        tensor = self._torch.Tensor
        for i, t in enumerate(tensors):
            if isinstance(t, tensor) and t.requires_grad:
                if out is None:
                    out = list(tensors)
                out[i] = t.detach()
        return (tensors if out is None else tuple(out)), 0

    def written(self, tensors: tuple, mask: int) -> None:
        # A torch in-place op bumps its tensor's version counter, so that autograd refuses a
        # backward through a value saved before the write; the native writes do the same.
        if self._bump is None:
            return
        tensor = self._torch.Tensor
        for i, t in enumerate(tensors):
            if (mask >> i) & 1 and isinstance(t, tensor):
                try:
                    self._bump(t)
                except RuntimeError:  # (a torch that keeps no counter for this tensor, e.g. an inference tensor)
                    pass

    def dtype(self, like: Any, name: str) -> Any:
        return self._dtypes[name]

    def empty_like(self, like: Any) -> Any:
        # Keeps like's layout: contiguous, since a strided input is rejected before
        # the output is looked at.
        return self._torch.empty_like(like)

    def empty(self, like: Any, shape: tuple, dtype: Optional[str] = None) -> Any:
        if dtype is None:
            return like.new_empty(shape)
        return like.new_empty(shape, dtype=self._dtypes[dtype])


class Cupy(Framework):
    name = "cupy"

    def __init__(self) -> None:
        self._cp = sys.modules["cupy"]

    def is_device(self, x: Any) -> bool:
        return True

    def stream(self, x: Any) -> Tuple[int, bool]:
        with x.device:
            s = self._cp.cuda.get_current_stream().ptr
        return (s if s else 1), False  # cupy orders its own work on this stream

    def dtype(self, like: Any, name: str) -> Any:
        if name == "bf16":
            raise TypeError("cupy has no bfloat16 dtype")
        return self._cp.dtype(_NUMPY_NAMES[name])

    def empty(self, like: Any, shape: tuple, dtype: Optional[str] = None) -> Any:
        with like.device:
            return self._cp.empty(shape, dtype=like.dtype if dtype is None else self.dtype(like, dtype))


class Jax(Framework):
    """jax arrays are immutable: kernscope writes only into arrays it allocated
    itself, except for the in-place ops (fused_add_rms_norm, rotary_embedding,
    kv_cache_append, rotary_embedding_kv_append, the caches of
    fused_add_rms_norm_quant_matmul_rope_kv_append, and q, k and the caches of
    rotary_embedding_kv_append_paged_attention), which mutate the buffers they
    are given."""

    name = "jax"

    def __init__(self) -> None:
        import jax.numpy as jnp

        self._jnp = jnp

    def _device(self, x: Any) -> Any:
        return next(iter(x.devices()))

    def is_device(self, x: Any) -> bool:
        return self._device(x).platform != "cpu"

    def dtype(self, like: Any, name: str) -> Any:
        return {"fp16": self._jnp.float16, "bf16": self._jnp.bfloat16, "fp32": self._jnp.float32,
                "fp64": self._jnp.float64, "int64": self._jnp.int64, "int32": self._jnp.int32,
                "uint8": self._jnp.uint8}[name]

    def empty(self, like: Any, shape: tuple, dtype: Optional[str] = None) -> Any:
        dt = like.dtype if dtype is None else self.dtype(like, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # jax's own 64-bit warning: the check below says more
            out = self._jnp.zeros(shape, dtype=dt, device=self._device(like))
        if out.dtype != dt:
            raise TypeError(f"jax allocated {out.dtype} for a {dtype} output; 64-bit outputs need "
                            "jax.config.update('jax_enable_x64', True)")
        return out


_BY_TYPE: dict = {}
_GENERIC = Framework()


def framework_of(x: Any) -> Optional[Framework]:
    """The Framework for x's type (cached per type); None if x is no array."""
    t = type(x)
    fw = _BY_TYPE.get(t)
    if fw is None:
        fw = _BY_TYPE[t] = _detect(t)
    return fw


def _detect(t: type) -> Optional[Framework]:
    root = t.__module__.split(".", 1)[0]
    np = sys.modules.get("numpy")
    if np is not None and issubclass(t, np.ndarray):
        return Numpy()
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(t, torch.Tensor):
        return Torch()
    if root == "cupy" and "cupy" in sys.modules:
        return Cupy()
    if root in ("jax", "jaxlib") and "jax" in sys.modules:
        return Jax()
    if not (hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__")):
        return None  # e.g. numpy scalars (np.float32(1.0)): no DLPack export
    if hasattr(t, "__array_namespace__"):
        return ArrayAPI()
    return _GENERIC


def is_torch(x: Any) -> bool:
    return isinstance(framework_of(x), Torch)


def frameworks_among(fw: Framework, tensors: tuple) -> list:
    """fw, then every other framework of the tensors (None entries skipped), each once."""
    out = [fw]
    for t in tensors:
        if t is not None:
            f = framework_of(t)
            if f is not None and all(f is not g for g in out):
                out.append(f)
    return out
