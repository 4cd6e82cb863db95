"""Exception classes: one per ks_status_t, each also a standard Python exception.

=============================  ==========================  ======================
ks_status_t                    kernscope class             also an instance of
=============================  ==========================  ======================
KS_ERROR_INVALID_ARGUMENT      InvalidArgumentError        ValueError
KS_ERROR_UNSUPPORTED_DTYPE     UnsupportedDtypeError       TypeError
KS_ERROR_UNSUPPORTED_DEVICE    UnsupportedDeviceError      RuntimeError
KS_ERROR_BACKEND_UNAVAILABLE   BackendUnavailableError     RuntimeError
KS_ERROR_CUDA                  CudaError                   RuntimeError
KS_ERROR_OUT_OF_MEMORY         OutOfMemoryError            MemoryError
KS_ERROR_INTERNAL              InternalError               RuntimeError
=============================  ==========================  ======================

Messages come from ``ks_last_error()`` and name the op and the argument, e.g.
``rms_norm: weight must have shape (4,) (hidden_size of x); got (3,)``.
After any error, no output has been written.
"""

from __future__ import annotations


class KernscopeError(Exception):
    """Base class of the errors raised by kernscope's native backends."""

    status: str = "KS_ERROR_INTERNAL"


class InvalidArgumentError(KernscopeError, ValueError):
    """Bad shape, stride, layout, scalar, overlap or index (KS_ERROR_INVALID_ARGUMENT)."""

    status = "KS_ERROR_INVALID_ARGUMENT"


class UnsupportedDtypeError(KernscopeError, TypeError):
    """A dtype the op does not take, or mismatched dtypes (KS_ERROR_UNSUPPORTED_DTYPE)."""

    status = "KS_ERROR_UNSUPPORTED_DTYPE"


class UnsupportedDeviceError(KernscopeError, RuntimeError):
    """Tensors on a device the backend cannot use, or on mixed devices (KS_ERROR_UNSUPPORTED_DEVICE)."""

    status = "KS_ERROR_UNSUPPORTED_DEVICE"


class BackendUnavailableError(KernscopeError, RuntimeError):
    """The backend is not compiled in, has no device, or has no kernel for the call
    (KS_ERROR_BACKEND_UNAVAILABLE)."""

    status = "KS_ERROR_BACKEND_UNAVAILABLE"


class CudaError(KernscopeError, RuntimeError):
    """A CUDA runtime call or launch failed (KS_ERROR_CUDA)."""

    status = "KS_ERROR_CUDA"


class OutOfMemoryError(KernscopeError, MemoryError):
    """Host or device memory ran out (KS_ERROR_OUT_OF_MEMORY)."""

    status = "KS_ERROR_OUT_OF_MEMORY"


class InternalError(KernscopeError, RuntimeError):
    """A bug in kernscope (KS_ERROR_INTERNAL)."""

    status = "KS_ERROR_INTERNAL"


# Indexed by the numeric ks_status_t (0 = KS_SUCCESS is never raised).
BY_STATUS = (
    InternalError,
    InvalidArgumentError,
    UnsupportedDtypeError,
    UnsupportedDeviceError,
    BackendUnavailableError,
    CudaError,
    OutOfMemoryError,
    InternalError,
)

__all__ = [
    "KernscopeError",
    "InvalidArgumentError",
    "UnsupportedDtypeError",
    "UnsupportedDeviceError",
    "BackendUnavailableError",
    "CudaError",
    "OutOfMemoryError",
    "InternalError",
]
