"""Package-level behaviour: version, introspection, backend names, exception
classes, DLPack import of foreign objects, threads, installation."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import DTYPES, assert_close, f64, make_packed, rand, ref_rms_norm

import kernscope as ks
from kernscope import _C


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
    # the decode-step fusions run the CPU's own unfused steps ("cpu_composed") instead of a reference
    composed = {"fused_add_rms_norm_quant_matmul", "silu_and_mul_quant_matmul", "rotary_embedding_kv_append",
                "fused_add_rms_norm_quant_matmul_rope_kv_append", "rotary_embedding_kv_append_paged_attention"}
    for op in ks.OPS:
        cpu = [r for r in rows if r.op == op and r.backend == "cpu"]
        assert any(r.variant == ("cpu_composed" if op in composed else "cpu_reference") for r in cpu), op
        for r in cpu:
            assert set(r.dtypes) <= {"fp16", "bf16", "fp32"} and r.dtypes and r.summary
    assert {r.backend for r in rows} <= {"cpu", "cuda", "torch"}


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gemv", "softmax", "argmax",
                                "sample", "embedding", "dequantize", "gemm", "quant_matmul", "quant_matmul_a8",
                                "fused_add_rms_norm_quant_matmul", "silu_and_mul_quant_matmul", "rotary_embedding",
                                "kv_cache_append", "rotary_embedding_kv_append",
                                "fused_add_rms_norm_quant_matmul_rope_kv_append", "paged_attention",
                                "rotary_embedding_kv_append_paged_attention", "varlen_attention"])
@pytest.mark.parametrize("dt", DTYPES)
def test_which_cpu(op, dt):
    variant, reason = ks.which(op, dtype=dt, device="cpu")
    assert variant.startswith("cpu_") and reason
    names = {r.variant for r in ks.available() if r.op == op and r.backend == "cpu"}
    assert variant in names


def test_routing_table_lists_cells_and_which_explains_them():
    t = ks.routing_table()
    assert t["schema"] == "kernscope-routing-active/1" and "generic.json" in t["files"]
    names = {(r.op, r.backend, r.variant) for r in ks.available()}
    for c in t["cells"]:
        assert c["basis"] in ("measured", "heuristic") and c["why"]
        assert c["rows"][0] <= (c["rows"][1] if c["rows"][1] is not None else 2**63)
        if c["backend"] == "cpu":  # every CPU variant a cell names exists (CUDA: when built, ksctl table --check)
            assert all((c["op"], "cpu", v) in names for v in c["order"]), c
    qm = [c for c in t["cells"] if c["op"] == "quant_matmul" and c["backend"] == "cpu"]
    assert qm and qm[0]["order"][0] == "cpu_avx512"
    _, reason = ks.which("quant_matmul", "fp32", "cpu")
    assert "routing cell" in reason and "generic.json" in reason


def test_routing_table_from_env_and_a_bad_one(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "kernscope-routing/1", "arch": "*", "cells": [{"op": "softmax"}]}')
    code = ("import numpy as np, kernscope as ks\n"
            "try:\n    ks.routing_table()\nexcept ValueError as e:\n    print('ERR', e)\n"
            "ks.force_variant('rms_norm', 'cpu_reference')\n"  # a pinned call fails on a bad table too
            "try:\n    ks.rms_norm(np.ones((2, 8), np.float32), np.ones(8, np.float32))\n"
            "except ValueError as e:\n    print('PINNED', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KS_ROUTING_TABLE": str(bad)},
                       capture_output=True, text=True, timeout=120)
    # (the call's name in front, as every error: "routing_table: routing: <file> ...")
    assert "ERR routing_table: routing: " in r.stdout and "bad.json cell 0: missing \"backend\"" in r.stdout, \
        r.stdout + r.stderr
    assert "PINNED rms_norm: routing: " in r.stdout, r.stdout + r.stderr


def test_routing_table_with_a_misspelt_op_fails_to_load(tmp_path):
    # a cell whose op is not an operator of this build could never match: the load fails, naming
    # the cell and the op (not a silently ignored cell)
    bad = tmp_path / "misspelt.json"
    bad.write_text('{"schema": "kernscope-routing/1", "arch": "*", "cells": ['
                   '{"op": "rms_norm", "backend": "cpu", "order": ["cpu_reference"], "basis": "heuristic", "why": "w"},'
                   '{"op": "rmsnorm", "backend": "cpu", "order": ["cpu_reference"], "basis": "heuristic", "why": "w"}]}')
    code = ("import numpy as np, kernscope as ks\n"
            "try:\n    ks.routing_table()\nexcept ValueError as e:\n    print('ERR', e)\n"
            "try:\n    ks.rms_norm(np.ones((2, 8), np.float32), np.ones(8, np.float32))\n"
            "except ValueError as e:\n    print('CALL', e)\n")
    out = _python_with_routing_table(os.fsencode(str(bad)), code)
    assert "ERR routing_table: routing: " in out, out
    assert "misspelt.json cell 1: \"op\": unknown operator 'rmsnorm'" in out, out
    assert "CALL rms_norm: routing: " in out, out


def _python_with_routing_table(table: bytes, code: str) -> str:
    """code run by a fresh interpreter with KS_ROUTING_TABLE=table (bytes: any path); its stdout
    and stderr, decoded with U+FFFD for bytes that are not UTF-8."""
    r = subprocess.run([sys.executable, "-c", code], env={**os.environb, b"KS_ROUTING_TABLE": table},
                       capture_output=True, timeout=120)
    return (r.stdout + r.stderr).decode("utf-8", "replace")


def test_routing_table_errors_name_the_file_even_when_it_is_not_utf8(tmp_path):
    # a KS_ROUTING_TABLE path that is not UTF-8 (the error names it with U+FFFD for its bad bytes:
    # strict decoding raised UnicodeDecodeError from every op), a duplicate key (JSON keeps
    # the last: a misspelt first "op" vanished without a word) and one file listed twice (its
    # errors could not say which entry they meant)
    dup = tmp_path / "dup.json"
    dup.write_text('{"schema": "kernscope-routing/1", "arch": "*", "cells": ['
                   '{"op": "rmsnorm", "op": "rms_norm", "backend": "cpu", "order": ["cpu_reference"], '
                   '"basis": "heuristic", "why": "w"}]}')
    code = ("import numpy as np, kernscope as ks\n"
            "try:\n    ks.argmax(np.zeros((2, 3), np.float32))\nexcept ValueError as e:\n    print('ERR', e)\n")
    bad_path = os.fsencode(str(tmp_path)) + b"/bad\xffname.json"
    twice = os.fsencode(f"{dup}:{tmp_path}/./dup.json")  # one file listed twice: refused before it is read
    for table, want in ((bad_path, "bad\ufffdname.json: KS_ROUTING_TABLE names a file that cannot be read"),
                        (os.fsencode(str(dup)), "dup.json cell 0: duplicate key \"op\""),
                        (twice, "KS_ROUTING_TABLE lists this file twice (also as ")):
        out = _python_with_routing_table(table, code)
        assert "ERR argmax: routing: " in out and want in out, out


def test_which_takes_the_weights_block_format(tmp_path):
    # with tests/data/routing_quant_qtype.json (the reference first for Q4_1 weights at M = 3,
    # N x K = 19 x 4096): the bound cell decides for qtype="q4_1" only; every cell lists its qtype
    table = os.path.join(os.path.dirname(__file__), "..", "data", "routing_quant_qtype.json")
    code = ("import kernscope as ks\n"
            "print('Q41', ks.which('quant_matmul', 'fp32', 'cpu', 3, 77824, qtype='q4_1')[0])\n"
            "print('Q80', ks.which('quant_matmul', 'fp32', 'cpu', 3, '19x4096', qtype='q8_0')[0])\n"
            "print('NONE', ks.which('quant_matmul', 'fp32', 'cpu', 3, 77824)[0])\n"
            "print('DEF', ks.which('quant_matmul', 'fp32', 'cpu', 3, 2 * 77824)[0])\n"
            "print('QTYPES', sorted({c['qtype'] for c in ks.routing_table()['cells']}))\n"
            "print('UPPER', ks.which('quant_matmul', 'fp32', 'cpu', 3, 77824, qtype='Q4_1')[0])\n"
            "print('ENUM', ks.which('quant_matmul', 'fp32', 'cpu', 3, 77824, qtype=ks.QType.Q4_1)[0])\n"
            "for bad in ('q4_k', '', 'none', 4.5):\n"
            "    try:\n        ks.which('quant_matmul', 'fp32', 'cpu', qtype=bad)\n    except ValueError as e:\n"
            "        print('BAD', 'which: unknown qtype' in str(e))\n"
            "try:\n    ks.which('rms_norm', 'fp32', 'cpu', qtype='q4_1')\nexcept ValueError as e:\n"
            "    print('NOPACKED', 'packed weights only' in str(e))\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KS_ROUTING_TABLE": table},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Q41 cpu_reference" in r.stdout, r.stdout
    assert "QTYPES ['q4_1']" in r.stdout, r.stdout
    assert "UPPER cpu_reference" in r.stdout and "ENUM cpu_reference" in r.stdout, r.stdout
    assert r.stdout.count("BAD True") == 4, r.stdout
    assert "NOPACKED True" in r.stdout, r.stdout
    # Q8_0, and no format: the choice of a shape without a cell (the registry's first runnable)
    got = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines() if line.startswith(("Q80", "NONE", "DEF"))}
    assert got["Q80"] == got["NONE"] == got["DEF"], r.stdout


def test_python_m_kernscope_prints_variants_and_routing_without_a_gpu():
    r = subprocess.run([sys.executable, "-m", "kernscope"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "cpu_reference" in r.stdout and "routing table (" in r.stdout, r.stdout
    assert re.search(r"\n  gemm +cuda ", r.stdout) and "cuda_cublaslt > cuda_tiled" in r.stdout, r.stdout
    # columns aligned for every op name, the longest included: the backend column starts at one
    # offset on every variant line, and so does the "rows" column on every cell line
    out = r.stdout.split("\n\n")
    variants = [ln for ln in out[1].splitlines()[1:] if ln.strip()]
    cells = [ln for ln in out[2].splitlines()[1:] if ln.strip()]
    assert len({re.search(r" (cpu|cuda|torch) ", ln).start() for ln in variants}) == 1, out[1]  # (torch: where it is installed)
    assert len({ln.index(" rows ") for ln in cells}) == 1, out[2]


def test_main_survives_a_closed_pipe():
    # `python -m kernscope | head -0`: the reader is gone before the first line (closed while
    # the child still imports the package); exit 0, no traceback
    p = subprocess.Popen([sys.executable, "-m", "kernscope"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err


def test_main_help_and_unknown_arguments():
    # --help describes the listing (exit 0, no table); an argument it does not take: exit 2
    h = subprocess.run([sys.executable, "-m", "kernscope", "--help"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "routing table" in h.stdout and "variants (op" not in h.stdout, h.stdout
    b = subprocess.run([sys.executable, "-m", "kernscope", "bogus"], capture_output=True, text=True, timeout=120)
    assert b.returncode == 2 and "unrecognized arguments: bogus" in b.stderr and b.stdout == "", (b.stdout, b.stderr)


def test_which_arguments():
    assert ks.which("rms_norm") == ks.which("rms_norm", "fp32", "cpu")  # the defaults of `ksctl which`
    assert ks.which("rms_norm", np.float32, "cpu") == ks.which("rms_norm", "fp32", "cpu")
    assert ks.which("quant_matmul", "float32", "cpu")[0] in ("cpu_avx512", "cpu_reference")
    with pytest.raises(ValueError, match=r"unknown operator 'flash_attention' .*in Python, kernscope\.OPS\)"):
        ks.which("flash_attention")
    # paged_attention_after_append runs paged_attention's variants: it answers as that operator
    v, why = ks.which("paged_attention_after_append", "fp32", "cpu")
    assert v == ks.which("paged_attention", "fp32", "cpu")[0] and "runs paged_attention's variants" in why
    with pytest.raises(TypeError, match="dtype"):
        ks.which("rms_norm", dtype="int4")
    # the CLI's "bf16:q8_0" spelling is dtype + qtype (given once); a format the op does not take is
    # named as given
    assert ks.which("quant_matmul_a8", dtype="bf16:q8_0") == ks.which("quant_matmul_a8", "bf16", qtype="q8_0")
    with pytest.raises(ks.InvalidArgumentError, match="give it once"):
        ks.which("quant_matmul_a8", dtype="bf16:q8_0", qtype="q4_1")
    with pytest.raises(ks.InvalidArgumentError, match="unknown qtype 'q4_k'"):
        ks.which("quant_matmul_a8", dtype="bf16:q4_k")
    with pytest.raises(ks.InvalidArgumentError, match="which: qtype: .*got 'f16'"):
        ks.which("quant_matmul_a8", "bf16", qtype="f16")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        ks.which("rms_norm", device="tpu")
    if not ks.backend_available("cuda"):
        with pytest.raises(RuntimeError, match="CUDA backend is not available"):
            ks.which("rms_norm", device="cuda")


def test_which_for_a_shape_uses_that_shapes_cell(tmp_path):
    # a table whose quant_matmul cells differ by rows: which(rows=...) names each cell's variant
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"schema": "kernscope-routing/1", "arch": "*", "cells": [
        {"op": "quant_matmul", "backend": "cpu", "dtype": "fp32", "rows": [0, 4], "order": ["cpu_reference"],
         "basis": "heuristic", "why": "test: small m"},
        {"op": "quant_matmul", "backend": "cpu", "dtype": "fp32", "rows": [5, None], "order": ["cpu_avx512"],
         "basis": "heuristic", "why": "test: large m"}]}))
    code = ("import kernscope as ks; print(ks.which('quant_matmul', 'fp32', 'cpu', rows=2, cols=576)[0]); "
            "print(ks.which('quant_matmul', 'fp32', 'cpu', rows=100, cols=576)[0]); "
            "print(ks.which('quant_matmul', 'fp32', 'cpu', rows=2, cols=576)[1])")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KS_ROUTING_TABLE": str(table)},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    small, large, why = r.stdout.splitlines()
    assert small == "cpu_reference" and "rows 2, cols 576" in why, r.stdout
    assert large in ("cpu_avx512", "cpu_reference")  # cpu_reference where the CPU has no AVX-512
    if ks.which("quant_matmul", "fp32", "cpu")[0] == "cpu_avx512":  # this CPU runs the AVX-512 variant
        assert large == "cpu_avx512"
    with pytest.raises(ValueError, match="both rows and cols"):
        ks.which("quant_matmul", "fp32", "cpu", rows=2)
    with pytest.raises(ValueError, match="rows and cols must be >= 0"):
        ks.which("quant_matmul", "fp32", "cpu", rows=-1, cols=5)
    # cols as "NxK" (quant_matmul's key is N * K), as `ksctl which --cols 576x576`
    assert ks.which("quant_matmul", "fp32", "cpu", rows=1, cols="576x576") == \
        ks.which("quant_matmul", "fp32", "cpu", rows=1, cols=576 * 576)
    assert ks.which("quant_matmul", "fp32", "cpu", rows=1, cols="576*576") == \
        ks.which("quant_matmul", "fp32", "cpu", rows=1, cols=331776)
    for bad in ("576x", "x576", "576x576x2", "-5", "abc", "576 x 576", " 576", "5\u00b2"):
        with pytest.raises(ValueError, match="cols must be a non-negative integer or 'NxK'"):
            ks.which("quant_matmul", "fp32", "cpu", rows=1, cols=bad)
    # integers only (int(1.5) and int(True) passed before), and within int64, named
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="which: rows must be an integer"):
            ks.which("quant_matmul", "fp32", "cpu", rows=bad, cols=5)
    with pytest.raises(TypeError, match="which: cols must be an integer"):
        ks.which("quant_matmul", "fp32", "cpu", rows=1, cols=2.5)
    with pytest.raises(ValueError, match=r"which: rows must be < 2\^63"):
        ks.which("quant_matmul", "fp32", "cpu", rows=2 ** 63, cols=5)
    with pytest.raises(ValueError, match=r"which: cols must be < 2\^63"):
        ks.which("quant_matmul", "fp32", "cpu", rows=1, cols="99999999999x99999999999")


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
        "sample": lambda: ks.sample(f, np.array([1, 2], np.int64), backend=backend),
        "varlen_attention": lambda: ks.varlen_attention(np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 8), np.float32),
                                                        np.zeros((2, 1, 8), np.float32), np.array([0, 2], np.int32),
                                                        np.array([0, 2], np.int32), backend=backend),
        "embedding": lambda: ks.embedding(np.array([0]), f, backend=backend),
        "dequantize": lambda: ks.dequantize(np.zeros((1, 4), np.uint8), "f32", backend=backend),
        "gemm": lambda: ks.gemm(f, f, backend=backend),
        "quant_matmul": lambda: ks.quant_matmul(np.zeros((1, 32), np.float32), np.zeros((1, 34), np.uint8), "q8_0",
                                                backend=backend),
        "quant_matmul_a8": lambda: ks.quant_matmul_a8(np.zeros((1, 32), np.float32), np.zeros((1, 34), np.uint8),
                                                      "q8_0", backend=backend),
        "fused_add_rms_norm_quant_matmul": lambda: ks.fused_add_rms_norm_quant_matmul(
            np.zeros((1, 32), np.float32), np.zeros((1, 32), np.float32), np.ones(32, np.float32),
            np.zeros((1, 34), np.uint8), "q8_0", backend=backend),
        "silu_and_mul_quant_matmul": lambda: ks.silu_and_mul_quant_matmul(np.zeros((1, 64), np.float32),
                                                                          np.zeros((1, 34), np.uint8), "q8_0",
                                                                          backend=backend),
        "rotary_embedding": lambda: ks.rotary_embedding(np.zeros((1, 1, 8), np.float32), None, np.array([0]),
                                                        backend=backend),
        "kv_cache_append": lambda: ks.kv_cache_append(np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 8), np.float32), np.array([0]),
                                                      backend=backend),
        "rotary_embedding_kv_append": lambda: ks.rotary_embedding_kv_append(
            np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32),
            np.array([0]), np.zeros((1, 1, 1, 8), np.float32), np.zeros((1, 1, 1, 8), np.float32), np.array([0]),
            backend=backend),
        "fused_add_rms_norm_quant_matmul_rope_kv_append": lambda: ks.fused_add_rms_norm_quant_matmul_rope_kv_append(
            None, np.zeros((1, 32), np.float32), np.ones(32, np.float32), np.zeros((24, 34), np.uint8), "q8_0", 1, 1,
            np.array([0]), np.zeros((1, 1, 1, 8), np.float32), np.zeros((1, 1, 1, 8), np.float32), np.array([0]),
            backend=backend),
        "paged_attention": lambda: ks.paged_attention(np.zeros((1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1, 1, 8), np.float32),
                                                      np.zeros((1, 1), np.int32), np.array([1], np.int32),
                                                      backend=backend),
        "rotary_embedding_kv_append_paged_attention": lambda: ks.rotary_embedding_kv_append_paged_attention(
            np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32),
            np.array([0]), np.zeros((1, 1, 1, 8), np.float32), np.zeros((1, 1, 1, 8), np.float32), np.array([0]),
            np.zeros((1, 1), np.int32), np.array([1], np.int32), backend=backend),
    }
    assert set(calls) == set(ks.OPS)
    return calls


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gemv", "softmax", "argmax",
                                "sample", "embedding", "dequantize", "gemm", "quant_matmul", "quant_matmul_a8",
                                "fused_add_rms_norm_quant_matmul", "silu_and_mul_quant_matmul", "rotary_embedding",
                                "kv_cache_append", "rotary_embedding_kv_append",
                                "fused_add_rms_norm_quant_matmul_rope_kv_append", "paged_attention",
                                "rotary_embedding_kv_append_paged_attention", "varlen_attention"])
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


class DLPackRaises(DLPackOnly):
    """A producer whose __dlpack__ fails with the exception it was given."""

    def __init__(self, a, exc):
        super().__init__(a)
        self.exc = exc

    def __dlpack__(self, stream=None, max_version=None):
        raise self.exc


def test_a_failing_producer_is_named(rng):
    # the producer's ValueError / TypeError / RuntimeError keep their class and get the op and
    # argument in front (they passed through bare before); other exceptions propagate as raised
    x = rand(rng, (3, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    for exc in (RuntimeError("boom"), ValueError("boom"), TypeError("boom")):
        with pytest.raises(type(exc), match=r"rms_norm: weight: its __dlpack__ failed: \w+: boom"):
            ks.rms_norm(x, DLPackRaises(w, exc), out=np.empty_like(x))
    with pytest.raises(KeyError):
        ks.rms_norm(x, DLPackRaises(w, KeyError("boom")), out=np.empty_like(x))


class DeviceClaim(DLPackOnly):
    """A broken producer: host memory, but __dlpack_device__ names CUDA device 0."""

    def __dlpack__(self, stream=None, max_version=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return (2, 0)


def test_a_producer_that_names_a_device_for_host_memory(rng):
    # the stream and the wait after the call followed the first argument's __dlpack_device__, so
    # the op wrote its outputs and then failed waiting for a CUDA stream (no libcuda here): the
    # wait now follows the tensors themselves, all in host memory, and the call succeeds
    x = rand(rng, (3, 8), "fp32")
    r = rand(rng, (3, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    x2, r2 = x.copy(), r.copy()
    ks.fused_add_rms_norm(DeviceClaim(x2), DeviceClaim(r2), DeviceClaim(w))
    s = f64(x) + f64(r)
    assert_close(r2, s, "fp32")
    assert_close(x2, ref_rms_norm(s, w, 1e-6), "fp32")
    out = np.full_like(x, np.nan)
    ks.rms_norm(DeviceClaim(x), DeviceClaim(w), out=DeviceClaim(out))
    assert_close(out, ref_rms_norm(x, w, 1e-6), "fp32")


def test_a_broadcast_matrix_gets_the_layout_error_not_a_memory_error():
    # an output sized from a broadcast view's rows (2^36 here) could not be allocated: the
    # layout error naming the argument comes first, as natively
    x = np.ones(64, np.float32)
    huge = np.broadcast_to(np.float32(1), (2 ** 36, 64))
    pat = r"must be contiguous .*a stride of 0 is a broadcast"
    with pytest.raises(ks.InvalidArgumentError, match="gemv: weight " + pat):
        ks.gemv(x, huge)
    with pytest.raises(ks.InvalidArgumentError, match="gemm: b " + pat):
        ks.gemm(x.reshape(1, 64), huge)
    with pytest.raises(ks.InvalidArgumentError, match="embedding: table " + pat):
        ks.embedding(np.zeros(2, np.int64), huge)
    packed = np.broadcast_to(np.uint8(0), (2 ** 36, 40))  # q4_1 rows of K = 64
    for op in (ks.quant_matmul, ks.quant_matmul_a8):
        with pytest.raises(ks.InvalidArgumentError, match=f"{op.__name__}: weight " + pat):
            op(x.reshape(1, 64), packed, "q4_1")
    with pytest.raises(ks.InvalidArgumentError, match="silu_and_mul_quant_matmul: weight " + pat):
        ks.silu_and_mul_quant_matmul(np.ones((1, 128), np.float32), packed, "q4_1")


def test_numpy_readonly_inputs_are_fine(rng):
    x = rand(rng, (2, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    x.flags.writeable = False
    w.flags.writeable = False
    assert_close(ks.rms_norm(x, w), ref_rms_norm(x, w, 1e-6), "fp32")
    with pytest.raises(ValueError, match="rms_norm: out is read-only"):
        ks.rms_norm(w[None].copy(), w, out=x[:1])


def _thread_cases(rng):
    """One entry per op: (op, good, bad, exc, pattern). good() returns fresh arrays
    (the result, or the in-place arguments after the call) and must give the same
    bytes in any thread; bad() must raise exc matching pattern (its own op and
    argument). Inputs are shared between threads and only read; in-place ops work
    on copies. Some shapes are past the library's OpenMP threshold, so parallel
    regions also start from many threads at once."""
    f32 = "fp32"
    x, w, r = rand(rng, (16, 64), f32), rand(rng, (64,), f32), rand(rng, (16, 64), f32)
    xb, wb = rand(rng, (16, 64), "bf16"), rand(rng, (64,), "bf16")  # the bf16 (uint16 view) path
    big = rand(rng, (256, 512), f32)  # 131072 elements: OpenMP parallel regions
    gw = rand(rng, (48, 64), f32)
    ga, gb = rand(rng, (64, 64), f32), rand(rng, (48, 64), f32)
    ids, table = np.array([3, 0, 7, 1], np.int64), rand(rng, (8, 64), f32)
    packed = make_packed(rng, 64, 64, 4)  # q4_0
    qx = rand(rng, (8, 64), f32)
    gu = rand(rng, (8, 128), f32)
    q, k = rand(rng, (4, 4, 16), f32), rand(rng, (4, 2, 16), f32)
    pos = np.array([0, 5, 2, 9], np.int64)
    kv = rand(rng, (4, 2, 16), f32)
    slots = np.array([0, 7, -1, 3], np.int64)
    kc = rand(rng, (3, 4, 2, 16), f32)
    bt, ctx = np.array([[0, 1], [2, 0], [1, 2], [0, 2]], np.int32), np.array([1, 8, 5, 3], np.int32)
    strided = big[:, ::2]

    def fused():
        a, b = x.copy(), r.copy()
        ks.fused_add_rms_norm(a, b, w)
        return a, b

    def rotary():
        a, b = q.copy(), k.copy()
        ks.rotary_embedding(a, b, pos, 8, 10000.0, False)
        return a, b

    def kv_append():
        a, b = np.zeros((2, 4, 2, 16), np.float32), np.zeros((2, 4, 2, 16), np.float32)
        ks.kv_cache_append(a, b, kv, kv[::-1].copy(), slots)
        return a, b

    def rope_kv_append():
        a, b, c, d = q.copy(), k.copy(), np.zeros((2, 4, 2, 16), np.float32), np.zeros((2, 4, 2, 16), np.float32)
        ks.rotary_embedding_kv_append(a, b, kv, pos, c, d, slots, 8, 10000.0, False)
        return a, b, c, d

    def rope_append_attention():
        a, b, c, d = q.copy(), k.copy(), kc.copy(), kc[::-1].copy()
        out = ks.rotary_embedding_kv_append_paged_attention(a, b, kv, pos, c, d, slots, bt, ctx, 8, 10000.0, False)
        return out, a, b, c, d

    def norm_rope_append():  # q4_0 weight [64, 64]: H 4 + 2 KVH 2 heads of D = 8, rotary_dim 8
        c, d = np.zeros((2, 4, 2, 8), np.float32), np.zeros((2, 4, 2, 8), np.float32)
        out, res = ks.fused_add_rms_norm_quant_matmul_rope_kv_append(qx[:1], qx[1:2], w, packed, "q4_0", 4, 2, pos[1:2],
                                                                      c, d, slots[3:], 1e-6, 8, 10000.0, False)
        return out, res, c, d

    return [
        ("rms_norm", lambda: (ks.rms_norm(x, w), ks.rms_norm(xb, wb), ks.rms_norm(big, big[0].copy())),
         lambda: ks.rms_norm(x, w[:7]), ValueError, r"rms_norm: weight must have shape \(64,\)"),
        ("fused_add_rms_norm", fused,
         lambda: ks.fused_add_rms_norm(x.copy(), r[:3].copy(), w), ValueError, "fused_add_rms_norm: residual"),
        ("silu_and_mul", lambda: (ks.silu_and_mul(x), ks.silu_and_mul(big)),
         lambda: ks.silu_and_mul(x[:, :63].copy()), ValueError, "silu_and_mul: x.s last dimension must be even"),
        ("gemv", lambda: (ks.gemv(x[0], gw), ks.gemv(big[0], big)),
         lambda: ks.gemv(x[0], x[:, :7].copy()), ValueError, r"gemv: weight must have shape \(N, 64\)"),
        ("softmax", lambda: (ks.softmax(x), ks.softmax(big)),
         lambda: ks.softmax(strided), ValueError, "softmax: x must be contiguous"),
        ("argmax", lambda: (ks.argmax(x), ks.argmax(big)),
         lambda: ks.argmax(x, out=np.empty(16, np.int32)), TypeError, "argmax: out has dtype int32"),
        ("varlen_attention", lambda: ks.varlen_attention(q, kv, kv, np.array([0, 1, 4], np.int32),
                                                         np.array([0, 2, 4], np.int32)),
         lambda: ks.varlen_attention(q, kv, kv, np.array([0, 3, 1], np.int32), np.array([0, 2, 4], np.int32)),
         ValueError, r"varlen_attention: cu_seqlens_q\[2\] = 1"),
        ("sample", lambda: (ks.sample(x, np.array([5, 1], np.int64), 0.8, 10, 0.9), ks.sample(big, np.array([5, 2], np.int64))),
         lambda: ks.sample(x, np.array([5, 1], np.int64), 0.0), ValueError,
         r"sample: temperature must be finite and > 0 \(also after rounding to fp32; for greedy decoding use argmax\)"),
        ("embedding", lambda: (ks.embedding(ids, table), ks.embedding(ids, packed, table_format="q4_0")),
         lambda: ks.embedding(np.array([3, 8]), table), ValueError, r"embedding: ids\[1\] = 8 is outside"),
        ("dequantize", lambda: (ks.dequantize(packed, "q4_0"), ks.dequantize(packed, "q4_0", dtype="bf16")),
         lambda: ks.dequantize(packed[:, :35].copy(), "q4_0"), ValueError, "dequantize: "),
        ("gemm", lambda: ks.gemm(ga, gb),
         lambda: ks.gemm(ga, gb[:, :9].copy()), ValueError, "gemm: b must have shape"),
        ("quant_matmul", lambda: (ks.quant_matmul(qx, packed, "q4_0"), ks.quant_matmul(qx[:1], packed, "q4_0")),
         lambda: ks.quant_matmul(qx[:, :32].copy(), packed, "q4_0"), ValueError, "quant_matmul: weight"),
        ("quant_matmul_a8", lambda: (ks.quant_matmul_a8(qx, packed, "q4_0"), ks.quant_matmul_a8(qx[:1], packed, "q4_0")),
         lambda: ks.quant_matmul_a8(qx, np.zeros((64, 128), np.uint8), "f16"), ValueError, "quant_matmul_a8: qtype"),
        ("fused_add_rms_norm_quant_matmul",
         lambda: (ks.fused_add_rms_norm_quant_matmul(qx, qx[::-1].copy(), w, packed, "q4_0"),
                  ks.fused_add_rms_norm_quant_matmul(None, qx[:1], w, packed, "q4_0")),
         lambda: ks.fused_add_rms_norm_quant_matmul(None, qx, w[:7].copy(), packed, "q4_0"), ValueError,
         "fused_add_rms_norm_quant_matmul: norm_weight must have shape"),
        ("silu_and_mul_quant_matmul",
         lambda: (ks.silu_and_mul_quant_matmul(gu, packed, "q4_0"),
                  ks.silu_and_mul_quant_matmul(gu[:1], packed, "q4_0")),
         lambda: ks.silu_and_mul_quant_matmul(gu[:, :127].copy(), packed, "q4_0"), ValueError,
         "silu_and_mul_quant_matmul: gate_up.s last dimension must be even"),
        ("rotary_embedding", rotary,
         lambda: ks.rotary_embedding(q.copy(), None, pos[:3].copy(), 8), ValueError,
         "rotary_embedding: positions must have shape"),
        ("kv_cache_append", kv_append,
         lambda: ks.kv_cache_append(np.zeros((2, 4, 2, 16), np.float32), np.zeros((2, 4, 2, 16), np.float32),
                                    kv, kv.copy(), np.array([0, 8, -1, 1])), ValueError,
         r"kv_cache_append: slot_mapping\[1\] = 8 is outside"),
        ("rotary_embedding_kv_append", rope_kv_append,
         lambda: ks.rotary_embedding_kv_append(q.copy(), k.copy(), kv, pos, np.zeros((2, 4, 2, 16), np.float32),
                                               np.zeros((2, 4, 2, 16), np.float32), slots, 7), ValueError,
         r"rotary_embedding_kv_append: rotary_dim must be even and in \(0, head_dim=16\]; got 7"),
        ("fused_add_rms_norm_quant_matmul_rope_kv_append", norm_rope_append,
         lambda: ks.fused_add_rms_norm_quant_matmul_rope_kv_append(qx[:1], qx[1:2], w, packed, "q4_0", 0, 2, pos[1:2],
                                                                   np.zeros((2, 4, 2, 8), np.float32),
                                                                   np.zeros((2, 4, 2, 8), np.float32), slots[3:]),
         ValueError, r"fused_add_rms_norm_quant_matmul_rope_kv_append: num_heads and num_kv_heads must be > 0; got 0"),
        ("rotary_embedding_kv_append_paged_attention", rope_append_attention,
         lambda: ks.rotary_embedding_kv_append_paged_attention(q.copy(), k.copy(), kv, pos, kc.copy(), kc.copy(), slots,
                                                               bt, np.array([1, 13, 1, 1], np.int32)), ValueError,
         r"rotary_embedding_kv_append_paged_attention: context_lens\[1\] = 13 is outside"),
        ("paged_attention", lambda: ks.paged_attention(q, kc, kc[::-1].copy(), bt, ctx),
         lambda: ks.paged_attention(q, kc, kc.copy(), bt, np.array([1, 13, 1, 1], np.int32)), ValueError,
         r"paged_attention: context_lens\[1\] = 13 is outside"),
        # errors raised by the extension itself while importing the arguments
        ("import", lambda: ks.rms_norm(DLPackOnly(x), DLPackOnly(w), out=DLPackOnly(np.empty_like(x))).a,
         lambda: ks.rms_norm(np.array([[1.0, "a"]], dtype=object), w[:2].copy()), TypeError,
         "rms_norm: x cannot be exported through DLPack"),
    ]


def _as_bytes(result):
    parts = result if isinstance(result, tuple) else (result,)
    return tuple(np.ascontiguousarray(p).view(np.uint8).tobytes() for p in parts)


# Many threads at once, fresh threads every round, each interleaving
# succeeding and failing calls of every op. Successful calls must match the
# single-threaded bytes; every failure must carry its own op's message (the C
# library's message is per thread). The GIL is released around each C call, so
# calls really overlap. Odd rounds start all threads' calls together (a
# barrier); even rounds let each thread call as soon as it runs, while later
# threads are still being created and earlier ones exit, as in an executor
# (the thread-start pattern of the crash seen on a 16-core machine).
THREADS = 24
ROUNDS = 8
CALLS = 60


def test_float64_refusal_says_to_convert():
    """numpy's default float64: the dtype refusal says what to do."""
    with pytest.raises(TypeError, match=r"softmax: x has unsupported dtype float64; .* \(convert float64 values to float32 first, or float64 indices to int64\)"):
        ks.softmax(np.ones((2, 8)))


def test_threads(rng):
    cases = _thread_cases(rng)
    assert {c[0] for c in cases} - {"import"} == set(ks.OPS)
    want = {op: _as_bytes(good()) for op, good, *_ in cases}
    for op, _, bad, exc, pattern in cases:  # the failing calls, single-threaded first
        with pytest.raises(exc, match=pattern):
            bad()
    problems = []
    lock = threading.Lock()
    ops_seen = set()

    def worker(seed, barrier):
        order = np.random.default_rng(seed)
        if barrier is not None:
            barrier.wait()
        for i in order.integers(0, 2 * len(cases), CALLS):
            op, good, bad, exc, pattern = cases[i // 2]
            try:
                if i % 2 == 0:
                    got = _as_bytes(good())
                    if got != want[op]:
                        raise AssertionError(f"{op}: result differs from the single-threaded one")
                else:
                    try:
                        bad()
                    except exc as e:
                        if not re.match(pattern, str(e)):
                            raise AssertionError(f"{op}: wrong message {str(e)!r}") from None
                    else:
                        raise AssertionError(f"{op}: the failing call did not raise")
            except Exception as e:  # noqa: BLE001 - collected, asserted below
                with lock:
                    problems.append(f"{type(e).__name__}: {e}")
            with lock:
                ops_seen.add((op, i % 2))

    for rnd in range(ROUNDS):
        barrier = threading.Barrier(THREADS) if rnd % 2 else None
        threads = [threading.Thread(target=worker, args=(rnd * THREADS + t, barrier)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not problems, problems[:5]
    assert len(ops_seen) == 2 * len(cases)  # every op, succeeding and failing

    # the original check: failing calls from executors' fresh threads
    def bad_gemv(_):
        try:
            ks.gemv(np.ones(64, np.float32), np.ones((3, 7), np.float32))
        except ValueError as e:
            return str(e)

    for _ in range(4):
        with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
            msgs = list(pool.map(bad_gemv, range(4 * THREADS)))
        assert all(m and m.startswith("gemv: weight must have shape") for m in msgs), set(msgs)


@pytest.mark.parametrize("dt", DTYPES)
def test_paged_attention_fresh_keys_same_bits(rng, dt):
    # fresh_keys >= 1 calls ks_paged_attention_after_append (a promise CUDA may use to read the
    # older keys early): the result is paged_attention's bit for bit whatever fresh_keys is
    q, kc, vc = rand(rng, (4, 4, 16), dt), rand(rng, (3, 4, 2, 16), dt), rand(rng, (3, 4, 2, 16), dt)
    bt, ctx = np.array([[0, 1], [2, 0], [1, 2], [0, 2]], np.int32), np.array([1, 8, 5, 3], np.int32)
    seq = np.array([3, 0, 0, 2], np.int32)
    for kw in ({}, {"seq_ids": seq}):
        want = _as_bytes(ks.paged_attention(q, kc, vc, bt, ctx, 0.3, **kw))
        for n in (0, 1, 5):
            assert _as_bytes(ks.paged_attention(q, kc, vc, bt, ctx, 0.3, fresh_keys=n, **kw)) == want, (n, kw)
            out = np.full_like(q, np.nan)
            assert ks.paged_attention(q, kc, vc, bt, ctx, 0.3, fresh_keys=n, out=out, **kw) is out
            assert _as_bytes(out) == want, (n, kw)


def test_paged_attention_fresh_keys_errors(rng):
    q, kc = rand(rng, (4, 4, 16), "fp32"), rand(rng, (3, 4, 2, 16), "fp32")
    bt, ctx = np.array([[0, 1], [2, 0], [1, 2], [0, 2]], np.int32), np.array([1, 8, 5, 3], np.int32)
    out = np.full_like(q, 7.0)
    for n in (-1, -5):
        with pytest.raises(ValueError, match=rf"paged_attention: fresh_keys = {n} must be >= 0"):
            ks.paged_attention(q, kc, kc.copy(), bt, ctx, fresh_keys=n, out=out)
    assert (out == 7.0).all()
    # the op's own errors: paged_attention's at fresh_keys 0, under ks_paged_attention_after_append's
    # name otherwise
    bad = np.array([1, 13, 1, 1], np.int32)
    with pytest.raises(ks.InvalidArgumentError, match=r"^paged_attention: context_lens\[1\] = 13 is outside"):
        ks.paged_attention(q, kc, kc.copy(), bt, bad, fresh_keys=0, out=out)
    with pytest.raises(ks.InvalidArgumentError,
                       match=r"^paged_attention_after_append: context_lens\[1\] = 13 is outside"):
        ks.paged_attention(q, kc, kc.copy(), bt, bad, fresh_keys=1, out=out)
    assert (out == 7.0).all()


def test_invalid_backend_code_is_checked_with_the_gil():
    """The extension checks backend codes before it releases the GIL: raising
    with the GIL released crashed the interpreter."""
    x = np.ones(8, np.float32)
    for code in (-1, 3, 7):
        with pytest.raises(ValueError, match="backend code must be 0"):
            _C.gemv((np.empty(2, np.float32), x, np.ones((2, 8), np.float32)), code, 0, 0, False)
        with pytest.raises(ValueError, match="backend code must be 0"):
            _C.rms_norm((np.empty_like(x), x, x), 1e-6, code, 0, 0, False)


def test_force_variant():
    with pytest.raises(ValueError, match="has no variant 'nope'"):
        ks.force_variant("rms_norm", "nope")
    assert ks.forced_variant("rms_norm") is None
    ks.force_variant("rms_norm", "cpu_reference")
    assert ks.forced_variant("rms_norm") == "cpu_reference"
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        ks.forced_variant("nope")
    ks.force_variant(None)  # clears every pin
    assert ks.forced_variant("rms_norm") is None
    # names: str or None only (a C++ bad_cast leaked before), no NUL (C would read "rms_norm")
    with pytest.raises(TypeError, match="force_variant: op must be a str or None"):
        ks.force_variant(3, None)
    with pytest.raises(TypeError, match="force_variant: variant must be a str or None"):
        ks.force_variant("rms_norm", 3)
    with pytest.raises(ValueError, match="force_variant: op must not contain NUL"):
        ks.force_variant("rms_norm\x00junk", "cpu_reference")
    assert ks.forced_variant("rms_norm") is None
    with pytest.raises(ValueError, match="forced_variant: op must not contain NUL"):
        ks.forced_variant("rms_norm\x00junk")
    with pytest.raises(ValueError, match="which: op must not contain NUL"):
        ks.which("rms_norm\x00junk")
    with pytest.raises(ValueError, match="which: cols must be"):
        ks.which("quant_matmul", "fp32", "cpu", rows=1, cols="\u00b2x3")


def test_exchange_api_attribute_that_cannot_be_a_table(rng):
    # type(obj).__dlpack_c_exchange_api__ as an int is an address the producer vouches for
    # (DLPack 1.2); one that cannot be a table's (small, negative, unaligned, a bool) is ignored,
    # so the object's __dlpack__ is used: such an attribute segfaulted the import before
    x = rand(rng, (4, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    want = ks.rms_norm(x, w)
    for bogus in (12345, -1, True, 65536 + 4):
        class Odd(np.ndarray):
            __dlpack_c_exchange_api__ = bogus
        got = ks.rms_norm(x.view(Odd), w.view(Odd), out=np.empty_like(x))
        np.testing.assert_array_equal(np.asarray(got), want)


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
    packed = jax.device_put(jnp.zeros((2, 34), jnp.uint8), cpu)  # jax's default device may be a GPU
    assert ks.dequantize(packed, "q8_0", dtype="bf16").dtype == jnp.bfloat16
    if not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="jax_enable_x64"):
            ks.argmax(x)


def test_last_launch_config_on_cpu():
    ks.rms_norm(np.ones((1, 4), np.float32), np.ones(4, np.float32))
    assert ks.last_launch_config("rms_norm") == ""  # no CUDA launch on this thread


def test_unexportable_arrays_name_the_argument():
    with pytest.raises(TypeError, match="rms_norm: x cannot be exported through DLPack: BufferError"):
        ks.rms_norm(np.array([[1.0, "a"]], dtype=object), np.ones(2, np.float32))


def test_deterministic_mode_round_trip_and_rows(rng):
    before = ks.deterministic()
    try:
        ks.set_deterministic(True)
        assert ks.deterministic() is True
        x = rand(rng, (64, 96), "fp32")
        alone = ks.softmax(x[5:6].copy())
        assert np.array_equal(ks.softmax(x)[5:6], alone)  # a row alone == the same row in a batch
        ks.set_deterministic(False)
        assert ks.deterministic() is False
    finally:
        ks.set_deterministic(before)


def test_numpy_scalar_is_rejected_by_name():
    with pytest.raises(TypeError, match="softmax: x must be an array or tensor supporting DLPack"):
        ks.softmax(np.float32(1.0))
    with pytest.raises(TypeError, match="set_deterministic: enabled must be a bool"):
        ks.set_deterministic("yes")


def test_bool_arguments_refuse_other_types(rng):
    # is_neox / causal: "False" is truthy, so a str (or None, a list) is refused by name, not read as a truth value
    q = rand(rng, (2, 2, 8), "fp32")
    pos = np.array([3, 4])
    for bad in ("False", None, [], 2):
        with pytest.raises(TypeError, match="rotary_embedding: is_neox must be a bool"):
            ks.rotary_embedding(q.copy(), None, pos, is_neox=bad)
    a, b, c = q.copy(), q.copy(), q.copy()
    ks.rotary_embedding(a, None, pos, is_neox=True)
    ks.rotary_embedding(b, None, pos, is_neox=1)
    ks.rotary_embedding(c, None, pos, is_neox=np.bool_(True))
    assert np.array_equal(a, b) and np.array_equal(a, c)
    qv = rand(rng, (3, 2, 8), "fp32")
    cu = np.array([0, 3], np.int32)
    with pytest.raises(TypeError, match="varlen_attention: causal must be a bool"):
        ks.varlen_attention(qv, qv, qv, cu, cu, causal="no")


def test_python_side_argument_errors_are_kernscope_errors(rng):
    # errors the Python layer raises itself are InvalidArgumentError (a KernscopeError and a ValueError)
    x = rand(rng, (2, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    cases = [
        lambda: ks.paged_attention(np.zeros((1, 2, 8), np.float32), np.zeros((1, 16, 1, 8), np.float32),
                                   np.zeros((1, 16, 1, 8), np.float32), np.zeros((1, 1), np.int32),
                                   np.ones(1, np.int32), fresh_keys=-1),
        lambda: ks.dequantize(np.zeros(34, np.uint8), "q8_0"),
        lambda: ks.dequantize(np.zeros((2, 33), np.uint8), "q8_0"),
        lambda: ks.rms_norm(x, w, out=np.broadcast_to(np.float32(0), x.shape)),
        lambda: ks.rms_norm(x, w, backend="gpu"),
        lambda: ks.which("rms_norm", device="tpu"),
    ]
    for i, call in enumerate(cases):
        with pytest.raises(ks.InvalidArgumentError) as e:
            call()
        assert isinstance(e.value, ks.KernscopeError) and isinstance(e.value, ValueError), i


def test_embedding_packed_table_without_its_format_names_table():
    with pytest.raises(ks.UnsupportedDtypeError, match="embedding: table has dtype uint8; .*table_format="):
        ks.embedding(np.array([1]), np.zeros((16, 34), np.uint8))


def test_which_shape_key_and_qtype_errors_name_the_argument():
    # "AxB" only where the op's cols key is a product (as ksctl which refuses it for other ops):
    # the quant_matmul ops' N x K, the fused one with RoPE and append included, and paged_attention's
    # max_blocks_per_seq x block_size (its entry point paged_attention_after_append as well)
    with pytest.raises(ks.InvalidArgumentError, match="multiply two sizes .*; softmax's cols is one number"):
        ks.which("softmax", "fp32", "cpu", 1, "8x8")
    for op in ("quant_matmul", "quant_matmul_a8", "fused_add_rms_norm_quant_matmul",
               "fused_add_rms_norm_quant_matmul_rope_kv_append", "silu_and_mul_quant_matmul"):
        assert ks._C.op_cols_factors(op).startswith("N x K")
        assert ks.which(op, "fp32", "cpu", 1, "576x576") == ks.which(op, "fp32", "cpu", 1, 331776)
    for op in ("paged_attention", "paged_attention_after_append", "rotary_embedding_kv_append_paged_attention"):
        assert ks._C.op_cols_factors(op).startswith("max_blocks_per_seq x block_size")
        assert ks.which(op, "fp32", "cpu", 1, "64x16") == ks.which(op, "fp32", "cpu", 1, 1024)
    for op in ("softmax", "rms_norm", "argmax", "no_such_op"):
        assert ks._C.op_cols_factors(op) is None
    assert ks.which("softmax", "fp32", "cpu", 1, "64")[0] == ks.which("softmax", "fp32", "cpu", 1, 64)[0]
    assert ks.which("quant_matmul", "fp32", "cpu", 1, "576x576") == ks.which("quant_matmul", "fp32", "cpu", 1, 331776)
    with pytest.raises(ks.InvalidArgumentError, match="which: qtype is for the ops with packed weights only; rms_norm"):
        ks.which("rms_norm", "fp32", "cpu", qtype="q4_1")


def test_exchange_api_written_tensors_carry_their_flags(rng):
    # A producer with the DLPack 1.2 C exchange table (as torch >= 2.10): inputs take its bare
    # DLTensor fill (no allocation), but a tensor the op writes takes the managed export, the
    # only one that carries DLPack's flags, so a read-only buffer is refused by name and left
    # as it was (the bare fill has no flags: such a buffer was written, a PROT_READ mapping crashed)
    import ctypes

    class Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32), ("dtype", DType),
                    ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                    ("byte_offset", ctypes.c_uint64)]

    Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    class Managed(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", Deleter), ("flags", ctypes.c_uint64), ("dl_tensor", Tensor)]

    class Header(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev", ctypes.c_void_p)]

    FromTensor = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Tensor))
    FromManaged = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
    Stream = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))

    class Table(ctypes.Structure):
        _fields_ = [("header", Header), ("allocator", ctypes.c_void_p), ("managed_from", FromManaged),
                    ("to_py", ctypes.c_void_p), ("tensor_from", FromTensor), ("stream", Stream)]

    live, keep, used = {}, {}, []

    def fill(arr, t):
        shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
        strides = (ctypes.c_int64 * arr.ndim)(*[s // arr.itemsize for s in arr.strides])
        keep[id(shape)] = (shape, strides)
        t.data = arr.__array_interface__["data"][0]
        t.device = Device(1, 0)  # kDLCPU
        t.ndim = arr.ndim
        t.dtype = DType(2, 32, 1)  # float32
        t.shape, t.strides, t.byte_offset = shape, strides, 0

    def tensor_from(obj, out):
        used.append("tensor")
        fill(live[obj], out.contents)
        return 0

    @Deleter
    def deleter(p):
        keep.pop(p, None)

    def managed_from(obj, out):
        used.append("managed")
        arr = live[obj]
        m = Managed(1, 0, None, deleter, 0 if arr.flags.writeable else 1, Tensor())
        fill(arr, m.dl_tensor)
        keep[ctypes.addressof(m)] = m
        out[0] = ctypes.addressof(m)
        return 0

    callbacks = (FromTensor(tensor_from), FromManaged(managed_from),
                 Stream(lambda device_type, device_id, out: 0))
    table = Table(Header(1, 2, None), None, callbacks[1], None, callbacks[0], callbacks[2])

    class Producer:
        __dlpack_c_exchange_api__ = ctypes.addressof(table)

        def __init__(self, arr):
            self.arr = arr
            live[id(self)] = arr

        def __dlpack__(self, **kw):
            return self.arr.__dlpack__(**kw)

        def __dlpack_device__(self):
            return (1, 0)

    x = rand(rng, (2, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    ro = np.full((2, 8), 7.0, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ks.InvalidArgumentError, match="rms_norm: out is read-only; it is written by this op"):
        ks.rms_norm(Producer(x), Producer(w), out=Producer(ro))
    assert (ro == 7.0).all()
    assert "managed" in used and "tensor" in used  # out managed, inputs by the bare fill
    out = np.full((2, 8), np.nan, np.float32)
    used.clear()
    ks.rms_norm(Producer(x), Producer(w), out=Producer(out))
    np.testing.assert_array_equal(out, ks.rms_norm(x, w))
    assert sorted(used) == ["managed", "tensor", "tensor"]
    assert not keep or all(isinstance(v, tuple) for v in keep.values())  # every managed export deleted
