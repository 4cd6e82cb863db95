"""Package-level behaviour: version, introspection, backend names, exception
classes, DLPack import of foreign objects, threads, installation."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import DTYPES, assert_close, rand, ref_rms_norm

import kernscope as ks


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", ks.__version__)
    try:
        dist = importlib.metadata.version("kernscope")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kernscope is not pip-installed (running from a build tree)")
    assert dist == ks.__version__  # the wheel's version (CMake project) == ks_version()


def test_import_from_another_directory(tmp_path):
    code = "import kernscope, numpy as np; print(kernscope.__version__, kernscope.rms_norm(np.ones((1, 4), np.float32), np.ones(4, np.float32)).tolist())"
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(ks.__version__)


def test_available_rows():
    rows = ks.available()
    assert rows and all(isinstance(r, ks.Variant) for r in rows)
    for op in ks.OPS:
        cpu = [r for r in rows if r.op == op and r.backend == "cpu"]
        assert any(r.variant == "cpu_reference" for r in cpu), op
        for r in cpu:
            assert set(r.dtypes) <= {"fp16", "bf16", "fp32"} and r.dtypes and r.summary
    assert {r.backend for r in rows} <= {"cpu", "cuda", "torch"}


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gemv", "softmax", "argmax",
                                "embedding", "dequantize", "gemm", "quant_matmul", "rotary_embedding",
                                "kv_cache_append", "paged_attention"])
@pytest.mark.parametrize("dt", DTYPES)
def test_which_cpu(op, dt):
    variant, reason = ks.which(op, dtype=dt, device="cpu")
    assert variant.startswith("cpu_") and reason
    names = {r.variant for r in ks.available() if r.op == op and r.backend == "cpu"}
    assert variant in names


def test_which_arguments():
    assert ks.which("rms_norm") == ks.which("rms_norm", "bf16", "cpu")
    assert ks.which("rms_norm", np.float32, "cpu") == ks.which("rms_norm", "fp32", "cpu")
    assert ks.which("quant_matmul", "float32", "cpu")[0] in ("cpu_avx512", "cpu_reference")
    with pytest.raises(ValueError, match="unknown operator"):
        ks.which("flash_attention")
    with pytest.raises(TypeError, match="dtype"):
        ks.which("rms_norm", dtype="int4")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        ks.which("rms_norm", device="tpu")
    if not ks.backend_available("cuda"):
        with pytest.raises(RuntimeError, match="CUDA backend is not available"):
            ks.which("rms_norm", device="cuda")


def test_backend_available():
    assert ks.backend_available("cpu") and ks.backend_available("auto")
    assert isinstance(ks.backend_available("cuda"), bool)
    with pytest.raises(ValueError, match="unknown backend"):
        ks.backend_available("triton")


def test_exception_classes():
    pairs = [(ks.InvalidArgumentError, ValueError), (ks.UnsupportedDtypeError, TypeError),
             (ks.UnsupportedDeviceError, RuntimeError), (ks.BackendUnavailableError, RuntimeError),
             (ks.CudaError, RuntimeError), (ks.OutOfMemoryError, MemoryError), (ks.InternalError, RuntimeError)]
    for cls, base in pairs:
        assert issubclass(cls, ks.KernscopeError) and issubclass(cls, base)
        assert cls.status.startswith("KS_ERROR_")


def _call_every_op(backend):
    f = np.zeros((2, 8), np.float32)
    calls = {
        "rms_norm": lambda: ks.rms_norm(f, f[0].copy(), backend=backend),
        "fused_add_rms_norm": lambda: ks.fused_add_rms_norm(f.copy(), f.copy(), f[0].copy(), backend=backend),
        "silu_and_mul": lambda: ks.silu_and_mul(f, backend=backend),
        "gemv": lambda: ks.gemv(f[0].copy(), f, backend=backend),
        "softmax": lambda: ks.softmax(f, backend=backend),
        "argmax": lambda: ks.argmax(f, backend=backend),
        "embedding": lambda: ks.embedding(np.array([0]), f, backend=backend),
        "dequantize": lambda: ks.dequantize(np.zeros((1, 4), np.uint8), "f32", backend=backend),
        "gemm": lambda: ks.gemm(f, f, backend=backend),
        "quant_matmul": lambda: ks.quant_matmul(np.zeros((1, 32), np.float32), np.zeros((1, 34), np.uint8), "q8_0",
                                                backend=backend),
        "rotary_embedding": lambda: ks.rotary_embedding(np.zeros((1, 1, 8), np.float32), None, np.array([0]),
                                                        backend=backend),
        "kv_cache_append": lambda: ks.kv_cache_append(np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 8), np.float32), np.array([0]),
                                                      backend=backend),
        "paged_attention": lambda: ks.paged_attention(np.zeros((1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1), np.int32), np.array([1], np.int32),
                                                      backend=backend),
    }
    assert set(calls) == set(ks.OPS)
    return calls


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gemv", "softmax", "argmax",
                                "embedding", "dequantize", "gemm", "quant_matmul", "rotary_embedding",
                                "kv_cache_append", "paged_attention"])
def test_backend_names_every_op(op):
    _call_every_op("cpu")[op]()
    _call_every_op("auto")[op]()
    with pytest.raises(ValueError, match=rf"{op}: unknown backend 'triton'; valid backends: 'auto', 'cpu', 'cuda', 'torch'"):
        _call_every_op("triton")[op]()
    with pytest.raises(ValueError, match="unknown backend"):
        _call_every_op(None)[op]()
    with pytest.raises(TypeError, match=rf"{op}: backend='torch' takes torch tensors"):
        _call_every_op("torch")[op]()
    with pytest.raises(RuntimeError):  # host arrays on the CUDA backend: a device error
        _call_every_op("cuda")[op]()


class DLPackOnly:
    """An object that only speaks the DLPack protocol (no array namespace)."""

    def __init__(self, a):
        self.a = a
        self.shape = a.shape
        self.dtype = a.dtype

    def __dlpack__(self, stream=None, max_version=None):
        return self.a.__dlpack__(stream=stream)  # the unversioned (pre-1.0) capsule

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_foreign_dlpack_objects(rng):
    x = rand(rng, (3, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    out = np.empty_like(x)
    y = ks.rms_norm(DLPackOnly(x), DLPackOnly(w), out=DLPackOnly(out))
    assert isinstance(y, DLPackOnly)
    assert_close(out, ref_rms_norm(x, w, 1e-6), "fp32")
    r = rand(rng, (3, 8), "fp32")
    x2, r2 = x.copy(), r.copy()
    ks.fused_add_rms_norm(DLPackOnly(x2), DLPackOnly(r2), w)  # in place through the foreign object
    assert not np.array_equal(x2, x)
    with pytest.raises(TypeError, match="cannot allocate an output"):
        ks.rms_norm(DLPackOnly(x), w)


def test_numpy_readonly_inputs_are_fine(rng):
    x = rand(rng, (2, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    x.flags.writeable = False
    w.flags.writeable = False
    assert_close(ks.rms_norm(x, w), ref_rms_norm(x, w, 1e-6), "fp32")
    with pytest.raises(ValueError, match="rms_norm: out is read-only"):
        ks.rms_norm(w[None].copy(), w, out=x[:1])


def test_threads(rng):
    xs = [rand(rng, (64, 512), "fp32") for _ in range(8)]
    w = rand(rng, (512,), "fp32")
    want = [ks.rms_norm(x, w) for x in xs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: ks.rms_norm(x, w), xs * 4))
    for i, g in enumerate(got):
        assert np.array_equal(g, want[i % 8])
    # errors are per thread: a failure in one thread names its own op and argument
    def bad(_):
        try:
            ks.gemv(xs[0][0], xs[0][:, :7].copy())
        except ValueError as e:
            return str(e)
    msgs = list(concurrent.futures.ThreadPoolExecutor(4).map(bad, range(8)))
    assert all(m.startswith("gemv: weight must have shape") for m in msgs)


def test_force_variant():
    with pytest.raises(ValueError, match="has no variant 'nope'"):
        ks.force_variant("rms_norm", "nope")
    ks.force_variant("rms_norm", "cpu_reference")
    ks.force_variant(None)  # clears every pin


def test_jax_arrays_on_the_host(rng):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.asarray(rand(rng, (3, 16), "fp32"), dtype=jnp.bfloat16), cpu)
    w = jax.device_put(jnp.asarray(rand(rng, (16,), "fp32"), dtype=jnp.bfloat16), cpu)
    y = ks.rms_norm(x, w)  # jax bf16 goes through DLPack as bfloat16
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16
    assert_close(np.asarray(y.astype(jnp.float32)),
                 ref_rms_norm(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), 1e-6), "bf16")
    with pytest.raises(ks.InvalidArgumentError, match=r"rms_norm: weight must have shape \(16,\)"):
        ks.rms_norm(x, w[:3])
    assert ks.dequantize(jnp.zeros((2, 34), jnp.uint8), "q8_0", dtype="bf16").dtype == jnp.bfloat16
    if not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="jax_enable_x64"):
            ks.argmax(x)


def test_last_launch_config_on_cpu():
    ks.rms_norm(np.ones((1, 4), np.float32), np.ones(4, np.float32))
    assert ks.last_launch_config("rms_norm") == ""  # no CUDA launch on this thread


def test_unexportable_arrays_name_the_argument():
    with pytest.raises(TypeError, match="rms_norm: x cannot be exported through DLPack: BufferError"):
        ks.rms_norm(np.array([[1.0, "a"]], dtype=object), np.ones(2, np.float32))
