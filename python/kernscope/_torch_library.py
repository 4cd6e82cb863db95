"""kernscope ops as torch.library custom ops (``torch.ops.kernscope.*``).

Installed when torch is imported (see kernscope/__init__.py). Each native op is
a custom op with a fake (meta) kernel, so torch.compile(fullgraph=True) traces
a kernscope call as one opaque node instead of breaking the graph, and CUDA
graphs (torch.cuda.graphs, mode="reduce-overhead") capture it: the op launches
on torch's current stream and never synchronises.

The public functions (kernscope.rms_norm, ...) switch to the wrappers below only
while torch.compile is tracing; eager calls go straight to the extension.

The ops are defined with the low-level ``torch.library.Library`` API (schema +
a CompositeExplicitAutograd kernel + ``register_fake``) rather than
``torch.library.custom_op``: a call through the dispatcher then costs ~2.6 us
instead of ~8 us on the CPU machine (measured with a no-op kernel), which
compiled graphs that call the op at run time pay on every call. There is no
autograd kernel: the public functions route calls that need gradients to the
PyTorch reference, and the kernels detach their inputs. Under tracing, backend="torch"
and calls that need autograd inline the PyTorch reference instead, which
torch.compile traces like any torch code.

Schema (backend: "auto" | "cpu" | "cuda"):
  rms_norm(Tensor x, Tensor weight, float eps, str backend) -> Tensor
  fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, str backend) -> ()
  silu_and_mul(Tensor x, str backend) -> Tensor
  gemv(Tensor x, Tensor weight, str backend) -> Tensor
  softmax(Tensor x, str backend) -> Tensor
  argmax(Tensor x, str backend) -> Tensor
  sample(Tensor logits, Tensor seed_offset, float temperature, int top_k, float top_p, str backend) -> Tensor
  embedding(Tensor ids, Tensor table, int table_format, ScalarType? dtype, str backend) -> Tensor
  dequantize(Tensor packed, int qtype, ScalarType dtype, str backend) -> Tensor
  gemm(Tensor a, Tensor b, str backend) -> Tensor
  quant_matmul(Tensor x, Tensor weight, int qtype, str backend) -> Tensor
  quant_matmul_a8(Tensor x, Tensor weight, int qtype, str backend) -> Tensor
  fused_add_rms_norm_quant_matmul(Tensor? x, Tensor residual, Tensor norm_weight, Tensor weight, int qtype,
                                  float eps, str backend) -> (Tensor out, Tensor residual_out)
      (residual_out is a new tensor, empty (shape (0,)) when x is None: a functional op, so
      torch.compile needs no auto-functionalization of an optional mutable argument)
  silu_and_mul_quant_matmul(Tensor gate_up, Tensor weight, int qtype, str backend) -> Tensor
  rotary_embedding(Tensor(a!) q, Tensor(b!)? k, Tensor positions, int rotary_dim, float theta,
                   bool is_neox, str backend) -> ()
  kv_cache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping,
                  str backend) -> ()
  rotary_embedding_kv_append(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor(c!) k_cache,
                             Tensor(d!) v_cache, Tensor slot_mapping, int rotary_dim, float theta,
                             bool is_neox, str backend) -> ()
  fused_add_rms_norm_quant_matmul_rope_kv_append(Tensor? x, Tensor residual, Tensor norm_weight,
                                                 Tensor weight, int qtype, float eps, int num_heads,
                                                 int num_kv_heads, Tensor positions, Tensor(a!) k_cache,
                                                 Tensor(b!) v_cache, Tensor slot_mapping, int rotary_dim,
                                                 float theta, bool is_neox, str backend)
                                                 -> (Tensor out, Tensor residual_out)
      (out and residual_out new tensors as in fused_add_rms_norm_quant_matmul; the caches mutated)
  varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale,
                   bool causal, str backend) -> Tensor
  paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor? seq_ids,
                  Tensor context_lens, float scale, str backend) -> Tensor
  rotary_embedding_kv_append_paged_attention(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions,
                                             Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping,
                                             Tensor block_tables, Tensor? seq_ids, Tensor context_lens,
                                             int rotary_dim, float theta, bool is_neox, float scale,
                                             str backend) -> Tensor
      (q, k and the caches mutated as by rotary_embedding_kv_append; out a new tensor)
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import Tensor

from . import _C, _ops
from . import _torch_ref as ref
from ._errors import InvalidArgumentError

_installed = False
_LIB = torch.library.Library("kernscope", "DEF")  # noqa: TOR901 - the low-level API on purpose (see above)


class _Op:
    """A defined op's ``register_fake`` (the custom_op interface used below)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def register_fake(self, fake: Any) -> Any:
        torch.library.register_fake(f"kernscope::{self.name}", fake, lib=_LIB)
        return fake


def _op(schema: str) -> Any:
    """Defines kernscope::<schema> with the decorated function as its kernel for every device."""

    def deco(fn: Any) -> _Op:
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return _Op(name)

    return deco


_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# ---- eager implementations: the extension on torch tensors -------------------------
def _t(t: Optional[Tensor]) -> Optional[Tensor]:
    # A custom op's kernel runs below autograd; a tensor that requires grad (e.g. a
    # Parameter used under inference) is passed as its detached alias.
    return t.detach() if t is not None and t.requires_grad else t


def _code(op: str, backend: str) -> int:
    code = _ops._backend(op, backend)
    if code == _ops._TORCH:
        raise InvalidArgumentError(f"{op}: torch.ops.kernscope.{op} runs the native backends ('auto', 'cpu', 'cuda')")
    return code


def _run(cfn: Any, tensors: tuple, *scalars: Any) -> None:
    fw = _ops._fw(cfn.__name__, "tensor", tensors[0])
    _ops._native(cfn, fw, tensors[0], tuple(_t(t) for t in tensors), *scalars)


@_op("rms_norm(Tensor x, Tensor weight, float eps, str backend) -> Tensor")
def _rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _run(_C.rms_norm, (out, x, weight), eps, _code("rms_norm", backend))
    return out


@_op("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, str backend) -> ()")
def _fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, backend: str) -> None:
    _run(_C.fused_add_rms_norm, (x, residual, weight), eps, _code("fused_add_rms_norm", backend))


@_op("silu_and_mul(Tensor x, str backend) -> Tensor")
def _silu_and_mul(x: Tensor, backend: str) -> Tensor:
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2) if x.dim() else (), dtype=x.dtype, device=x.device)
    _run(_C.silu_and_mul, (out, x), _code("silu_and_mul", backend))
    return out


@_op("gemv(Tensor x, Tensor weight, str backend) -> Tensor")
def _gemv(x: Tensor, weight: Tensor, backend: str) -> Tensor:
    out = torch.empty((weight.shape[0] if weight.dim() else 0,), dtype=x.dtype, device=x.device)
    _run(_C.gemv, (out, x, weight), _code("gemv", backend))
    return out


@_op("softmax(Tensor x, str backend) -> Tensor")
def _softmax(x: Tensor, backend: str) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _run(_C.softmax, (out, x), _code("softmax", backend))
    return out


@_op("argmax(Tensor x, str backend) -> Tensor")
def _argmax(x: Tensor, backend: str) -> Tensor:
    out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    _run(_C.argmax, (out, x), _code("argmax", backend))
    return out


@_op("sample(Tensor logits, Tensor seed_offset, float temperature, int top_k, float top_p, str backend) -> Tensor")
def _sample(logits: Tensor, seed_offset: Tensor, temperature: float, top_k: int, top_p: float,
            backend: str) -> Tensor:
    out = torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    _run(_C.sample, (out, None, logits, seed_offset), temperature, top_k, top_p, _code("sample", backend))
    return out


def _hidden(table: Tensor, table_format: int) -> int:
    if table.dim() != 2:
        return 0
    if table_format == 0:
        return table.shape[1]
    bs, bb = _ops._QGEOM[table_format]
    return table.shape[1] // bb * bs


def _emb_dtype(table: Tensor, table_format: int, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    return table.dtype if table_format == 0 else torch.float32


@_op("embedding(Tensor ids, Tensor table, int table_format, ScalarType? dtype, str backend) -> Tensor")
def _embedding(ids: Tensor, table: Tensor, table_format: int, dtype: Optional[torch.dtype], backend: str) -> Tensor:
    out = torch.empty((*ids.shape, _hidden(table, table_format)), dtype=_emb_dtype(table, table_format, dtype),
                      device=table.device)
    _run(_C.embedding, (out, ids, table), table_format, _code("embedding", backend))
    return out


@_op("dequantize(Tensor packed, int qtype, ScalarType dtype, str backend) -> Tensor")
def _dequantize(packed: Tensor, qtype: int, dtype: torch.dtype, backend: str) -> Tensor:
    out = torch.empty((packed.shape[0] if packed.dim() else 0, _hidden(packed, qtype)), dtype=dtype,
                      device=packed.device)
    _run(_C.dequantize, (out, packed), qtype, _code("dequantize", backend))
    return out


@_op("gemm(Tensor a, Tensor b, str backend) -> Tensor")
def _gemm(a: Tensor, b: Tensor, backend: str) -> Tensor:
    out = torch.empty((*a.shape[:-1], b.shape[0] if b.dim() else 0), dtype=a.dtype, device=a.device)
    _run(_C.gemm, (out, a, b), _code("gemm", backend))
    return out


def _quant_matmul_call(op: str, x: Tensor, weight: Tensor, qtype: int, backend: str) -> Tensor:
    # quant_matmul and quant_matmul_a8 take the same arguments and give out [..., N] in x's dtype
    out = torch.empty((*x.shape[:-1], weight.shape[0] if weight.dim() else 0), dtype=x.dtype, device=x.device)
    _run(getattr(_C, op), (out, x, weight), qtype, _code(op, backend))
    return out


@_op("quant_matmul(Tensor x, Tensor weight, int qtype, str backend) -> Tensor")
def _quant_matmul(x: Tensor, weight: Tensor, qtype: int, backend: str) -> Tensor:
    return _quant_matmul_call("quant_matmul", x, weight, qtype, backend)


@_op("quant_matmul_a8(Tensor x, Tensor weight, int qtype, str backend) -> Tensor")
def _quant_matmul_a8(x: Tensor, weight: Tensor, qtype: int, backend: str) -> Tensor:
    return _quant_matmul_call("quant_matmul_a8", x, weight, qtype, backend)


@_op("fused_add_rms_norm_quant_matmul(Tensor? x, Tensor residual, Tensor norm_weight, Tensor weight, int qtype, float eps, str backend) -> (Tensor, Tensor)")
def _fused_add_rms_norm_quant_matmul(x: Optional[Tensor], residual: Tensor, norm_weight: Tensor, weight: Tensor,
                                     qtype: int, eps: float, backend: str) -> Any:
    # out [..., N]: residual's leading dims (a 0-d residual: the native op names it)
    out = torch.empty((*residual.shape[:-1], weight.shape[0] if weight.dim() else 0),
                      dtype=residual.dtype, device=residual.device)
    res = torch.empty(residual.shape if x is not None else (0,), dtype=residual.dtype, device=residual.device)
    _run(_C.fused_add_rms_norm_quant_matmul, (out, res if x is not None else None, x, residual, norm_weight, weight),
         eps, qtype, _code("fused_add_rms_norm_quant_matmul", backend))
    return out, res


@_op("silu_and_mul_quant_matmul(Tensor gate_up, Tensor weight, int qtype, str backend) -> Tensor")
def _silu_and_mul_quant_matmul(gate_up: Tensor, weight: Tensor, qtype: int, backend: str) -> Tensor:
    out = torch.empty((*gate_up.shape[:-1], weight.shape[0] if weight.dim() else 0),
                      dtype=gate_up.dtype, device=gate_up.device)
    _run(_C.silu_and_mul_quant_matmul, (out, gate_up, weight), qtype, _code("silu_and_mul_quant_matmul", backend))
    return out


@_op("rotary_embedding(Tensor(a!) q, Tensor(b!)? k, Tensor positions, int rotary_dim, float theta, bool is_neox, str backend) -> ()")
def _rotary_embedding(q: Tensor, k: Optional[Tensor], positions: Tensor, rotary_dim: int, theta: float,
                      is_neox: bool, backend: str) -> None:
    _run(_C.rotary_embedding, (q, k, positions), rotary_dim, theta, is_neox, _code("rotary_embedding", backend))


@_op("kv_cache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping, str backend) -> ()")
def _kv_cache_append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor,
                     backend: str) -> None:
    _run(_C.kv_cache_append, (k_cache, v_cache, k, v, slot_mapping), _code("kv_cache_append", backend))


@_op("rotary_embedding_kv_append(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, int rotary_dim, float theta, bool is_neox, str backend) -> ()")
def _rotary_embedding_kv_append(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                                slot_mapping: Tensor, rotary_dim: int, theta: float, is_neox: bool,
                                backend: str) -> None:
    _run(_C.rotary_embedding_kv_append, (q, k, v, positions, k_cache, v_cache, slot_mapping), rotary_dim, theta,
         is_neox, _code("rotary_embedding_kv_append", backend))


@_op("fused_add_rms_norm_quant_matmul_rope_kv_append(Tensor? x, Tensor residual, Tensor norm_weight, Tensor weight, int qtype, float eps, int num_heads, int num_kv_heads, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int rotary_dim, float theta, bool is_neox, str backend) -> (Tensor, Tensor)")
def _fused_add_rms_norm_quant_matmul_rope_kv_append(x: Optional[Tensor], residual: Tensor, norm_weight: Tensor,
                                                    weight: Tensor, qtype: int, eps: float, num_heads: int,
                                                    num_kv_heads: int, positions: Tensor, k_cache: Tensor,
                                                    v_cache: Tensor, slot_mapping: Tensor, rotary_dim: int,
                                                    theta: float, is_neox: bool, backend: str) -> Any:
    out = torch.empty((residual.shape[0] if residual.dim() else 0, weight.shape[0] if weight.dim() else 0),
                      dtype=residual.dtype, device=residual.device)
    res = torch.empty(residual.shape if x is not None else (0,), dtype=residual.dtype, device=residual.device)
    _run(_C.fused_add_rms_norm_quant_matmul_rope_kv_append,
         (out, res if x is not None else None, x, residual, norm_weight, weight, positions, k_cache, v_cache,
          slot_mapping), eps, qtype, num_heads, num_kv_heads, rotary_dim, theta, is_neox,
         _code("fused_add_rms_norm_quant_matmul_rope_kv_append", backend))
    return out, res


@_op("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, bool causal, str backend) -> Tensor")
def _varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                      causal: bool, backend: str) -> Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _run(_C.varlen_attention, (out, q, k, v, cu_seqlens_q, cu_seqlens_k), scale, causal,
         _code("varlen_attention", backend))
    return out


@_varlen_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, backend, out):
    if _ref_or_op("varlen_attention", backend, ("q", "k", "v"), (q, k, v)):
        return _fin(ref.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal), out)
    return _fin(torch.ops.kernscope.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, backend), out)


@_op("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor? seq_ids, Tensor context_lens, float scale, str backend) -> Tensor")
def _paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_ids: Optional[Tensor],
                     context_lens: Tensor, scale: float, backend: str) -> Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # fresh_keys 0 (no promise): kernscope.paged_attention's fresh_keys stays out of the schema (same bits)
    _run(_C.paged_attention, (out, q, k_cache, v_cache, block_tables, seq_ids, context_lens), scale, 0,
         _code("paged_attention", backend))
    return out


@_op("rotary_embedding_kv_append_paged_attention(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor? seq_ids, Tensor context_lens, int rotary_dim, float theta, bool is_neox, float scale, str backend) -> Tensor")
def _rotary_embedding_kv_append_paged_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, k_cache: Tensor,
                                                v_cache: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                                                seq_ids: Optional[Tensor], context_lens: Tensor, rotary_dim: int,
                                                theta: float, is_neox: bool, scale: float, backend: str) -> Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _run(_C.rotary_embedding_kv_append_paged_attention,
         (out, q, k, v, positions, k_cache, v_cache, slot_mapping, block_tables, seq_ids, context_lens), rotary_dim,
         theta, is_neox, scale, _code("rotary_embedding_kv_append_paged_attention", backend))
    return out


# ---- fake (meta) kernels: output shapes only ----------------------------------------
@_rms_norm.register_fake
def _(x, weight, eps, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, backend):
    return None


@_silu_and_mul.register_fake
def _(x, backend):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_gemv.register_fake
def _(x, weight, backend):
    return x.new_empty((weight.shape[0],))


@_softmax.register_fake
def _(x, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_argmax.register_fake
def _(x, backend):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


@_sample.register_fake
def _(logits, seed_offset, temperature, top_k, top_p, backend):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


@_embedding.register_fake
def _(ids, table, table_format, dtype, backend):
    return table.new_empty((*ids.shape, _hidden(table, table_format)),
                           dtype=_emb_dtype(table, table_format, dtype))


@_dequantize.register_fake
def _(packed, qtype, dtype, backend):
    return packed.new_empty((packed.shape[0], _hidden(packed, qtype)), dtype=dtype)


@_gemm.register_fake
def _(a, b, backend):
    return a.new_empty((*a.shape[:-1], b.shape[0]))


@_quant_matmul.register_fake
def _quant_matmul_fake(x, weight, qtype, backend):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_quant_matmul_a8.register_fake(_quant_matmul_fake)  # (the same shapes)


@_fused_add_rms_norm_quant_matmul.register_fake
def _(x, residual, norm_weight, weight, qtype, eps, backend):
    if x is None:
        res = residual.new_empty((0,))
    else:
        res = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return residual.new_empty((*residual.shape[:-1], weight.shape[0])), res


@_silu_and_mul_quant_matmul.register_fake
def _(gate_up, weight, qtype, backend):
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))


@_rotary_embedding.register_fake
def _(q, k, positions, rotary_dim, theta, is_neox, backend):
    return None


@_kv_cache_append.register_fake
def _(k_cache, v_cache, k, v, slot_mapping, backend):
    return None


@_rotary_embedding_kv_append.register_fake
def _(q, k, v, positions, k_cache, v_cache, slot_mapping, rotary_dim, theta, is_neox, backend):
    return None


@_fused_add_rms_norm_quant_matmul_rope_kv_append.register_fake
def _(x, residual, norm_weight, weight, qtype, eps, num_heads, num_kv_heads, positions, k_cache, v_cache,
      slot_mapping, rotary_dim, theta, is_neox, backend):
    if x is None:
        res = residual.new_empty((0,))
    else:
        res = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return residual.new_empty((residual.shape[0], weight.shape[0])), res


@_paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@_rotary_embedding_kv_append_paged_attention.register_fake
def _(q, k, v, positions, k_cache, v_cache, slot_mapping, block_tables, seq_ids, context_lens, rotary_dim, theta,
      is_neox, scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ---- what the public functions call while torch.compile traces -----------------------
def _ref_or_op(op: str, backend: str, names: tuple, tensors: tuple) -> bool:
    """True: inline the PyTorch reference (backend "torch", or autograd with "auto")."""
    return _ops._torch_route(op, _ops._backend(op, backend), backend, names, tensors)


def _fin(y: Tensor, out: Optional[Tensor]) -> Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def rms_norm(x, weight, eps, backend, out):
    if _ref_or_op("rms_norm", backend, ("x", "weight"), (x, weight)):
        return _fin(ref.rms_norm(x, weight, eps), out)
    return _fin(torch.ops.kernscope.rms_norm(x, weight, float(eps), backend), out)


def fused_add_rms_norm(x, residual, weight, eps, backend):
    if _ref_or_op("fused_add_rms_norm", backend, ("x", "residual", "weight"), (x, residual, weight)):
        return ref.fused_add_rms_norm(x, residual, weight, eps)
    torch.ops.kernscope.fused_add_rms_norm(x, residual, weight, float(eps), backend)


def silu_and_mul(x, backend, out):
    if _ref_or_op("silu_and_mul", backend, ("x",), (x,)):
        return _fin(ref.silu_and_mul(x), out)
    return _fin(torch.ops.kernscope.silu_and_mul(x, backend), out)


def gemv(x, weight, backend, out):
    if _ref_or_op("gemv", backend, ("x", "weight"), (x, weight)):
        return _fin(ref.gemv(x, weight), out)
    return _fin(torch.ops.kernscope.gemv(x, weight, backend), out)


def softmax(x, backend, out):
    if _ref_or_op("softmax", backend, ("x",), (x,)):
        return _fin(ref.softmax(x), out)
    return _fin(torch.ops.kernscope.softmax(x, backend), out)


def argmax(x, backend, out):
    if _ref_or_op("argmax", backend, ("x",), (x,)):
        return _fin(ref.argmax(x), out)
    return _fin(torch.ops.kernscope.argmax(x, backend), out)


def sample(logits, seed_offset, temperature, top_k, top_p, backend, out):
    if backend == "torch":
        raise InvalidArgumentError("sample: there is no 'torch' reference backend for sample; use 'auto', 'cpu' or 'cuda'")
    return _fin(torch.ops.kernscope.sample(logits, seed_offset, float(temperature), int(top_k), float(top_p), backend),
                out)


def _dt(op: str, dtype: Any) -> Optional[torch.dtype]:
    return None if dtype is None else _TORCH_DTYPES[_ops._float_dtype(op, dtype)]


def embedding(ids, table, table_format, dtype, backend, out):
    fmt = _ops._qtype("embedding", table_format, allow_none=True)
    if _ref_or_op("embedding", backend, ("table",), (table,)):
        return _fin(ref.embedding(ids, table, fmt, _dt("embedding", dtype)), out)
    return _fin(torch.ops.kernscope.embedding(ids, table, fmt, _dt("embedding", dtype), backend), out)


def dequantize(packed, qtype, dtype, backend, out):
    q = _ops._qtype("dequantize", qtype)
    dt = _dt("dequantize", dtype)
    if _ref_or_op("dequantize", backend, (), ()):
        return _fin(ref.dequantize(packed, q, dt), out)
    return _fin(torch.ops.kernscope.dequantize(packed, q, dt, backend), out)


def gemm(a, b, backend, out):
    if _ref_or_op("gemm", backend, ("a", "b"), (a, b)):
        return _fin(ref.gemm(a, b), out)
    return _fin(torch.ops.kernscope.gemm(a, b, backend), out)


def quant_matmul(x, weight, qtype, backend, out):
    q = _ops._qtype("quant_matmul", qtype)
    if _ref_or_op("quant_matmul", backend, ("x",), (x,)):
        return _fin(ref.quant_matmul(x, weight, q), out)
    return _fin(torch.ops.kernscope.quant_matmul(x, weight, q, backend), out)


def quant_matmul_a8(x, weight, qtype, backend, out):
    q = _ops._qtype("quant_matmul_a8", qtype)
    if _ref_or_op("quant_matmul_a8", backend, ("x",), (x,)):
        return _fin(ref.quant_matmul_a8(x, weight, q), out)
    return _fin(torch.ops.kernscope.quant_matmul_a8(x, weight, q, backend), out)


def fused_add_rms_norm_quant_matmul(x, residual, norm_weight, weight, qtype, eps, backend, out, residual_out):
    op = "fused_add_rms_norm_quant_matmul"
    q = _ops._qtype(op, qtype)
    if _ref_or_op(op, backend, ("x", "residual", "norm_weight"), (x, residual, norm_weight)):
        y, r = ref.fused_add_rms_norm_quant_matmul(x, residual, norm_weight, weight, q, eps, residual_out)
        y = _fin(y, out)
        return y if x is None else (y, r)
    if x is None and residual_out is not None:  # as the C ABI says, before the op sees None for both
        raise InvalidArgumentError(f"{op}: residual_out is given but x is missing: residual_out = x + residual needs x")
    y, r = torch.ops.kernscope.fused_add_rms_norm_quant_matmul(x, residual, norm_weight, weight, q, float(eps), backend)
    y = _fin(y, out)
    return y if x is None else (y, _fin(r, residual_out))


def silu_and_mul_quant_matmul(gate_up, weight, qtype, backend, out):
    q = _ops._qtype("silu_and_mul_quant_matmul", qtype)
    if _ref_or_op("silu_and_mul_quant_matmul", backend, ("gate_up",), (gate_up,)):
        return _fin(ref.silu_and_mul_quant_matmul(gate_up, weight, q), out)
    return _fin(torch.ops.kernscope.silu_and_mul_quant_matmul(gate_up, weight, q, backend), out)


def rotary_embedding(q, k, positions, rotary_dim, theta, is_neox, backend):
    rd = q.shape[-1] if rotary_dim is None else int(rotary_dim)
    if _ref_or_op("rotary_embedding", backend, ("q", "k"), (q, k)):
        return ref.rotary_embedding(q, k, positions, rd, float(theta), bool(is_neox))
    torch.ops.kernscope.rotary_embedding(q, k, positions, rd, float(theta), bool(is_neox), backend)


def kv_cache_append(k_cache, v_cache, k, v, slot_mapping, backend):
    if _ref_or_op("kv_cache_append", backend, ("k", "v"), (k, v)):
        return ref.kv_cache_append(k_cache, v_cache, k, v, slot_mapping)
    torch.ops.kernscope.kv_cache_append(k_cache, v_cache, k, v, slot_mapping, backend)


def rotary_embedding_kv_append(q, k, v, positions, k_cache, v_cache, slot_mapping, rotary_dim, theta, is_neox, backend):
    op = "rotary_embedding_kv_append"
    rd = q.shape[-1] if rotary_dim is None else int(rotary_dim)
    if _ref_or_op(op, backend, ("q", "k", "v"), (q, k, v)):
        return ref.rotary_embedding_kv_append(q, k, v, positions, k_cache, v_cache, slot_mapping, rd, float(theta),
                                              bool(is_neox))
    if k is None:  # as the C ABI says, before the schema's required k sees None
        raise InvalidArgumentError(f"{op}: k is missing: its rotated rows go to k_cache")
    torch.ops.kernscope.rotary_embedding_kv_append(q, k, v, positions, k_cache, v_cache, slot_mapping, rd,
                                                   float(theta), bool(is_neox), backend)


def fused_add_rms_norm_quant_matmul_rope_kv_append(x, residual, norm_weight, weight, qtype, num_heads, num_kv_heads,
                                                   positions, k_cache, v_cache, slot_mapping, eps, rotary_dim, theta,
                                                   is_neox, backend, out, residual_out):
    op = "fused_add_rms_norm_quant_matmul_rope_kv_append"
    q = _ops._qtype(op, qtype)
    h, kvh = int(num_heads), int(num_kv_heads)
    rd = _ops._rope_head_dim(tuple(weight.shape), h, kvh) if rotary_dim is None else int(rotary_dim)
    if _ref_or_op(op, backend, ("x", "residual", "norm_weight"), (x, residual, norm_weight)):
        y, r = ref.fused_add_rms_norm_quant_matmul_rope_kv_append(x, residual, norm_weight, weight, q, eps, h, kvh,
                                                                  positions, k_cache, v_cache, slot_mapping, rd,
                                                                  float(theta), bool(is_neox), residual_out)
        y = _fin(y, out)
        return y if x is None else (y, r)
    if x is None and residual_out is not None:  # as the C ABI says, before the op sees None for both
        raise InvalidArgumentError(f"{op}: residual_out is given but x is missing: residual_out = x + residual needs x")
    y, r = torch.ops.kernscope.fused_add_rms_norm_quant_matmul_rope_kv_append(
        x, residual, norm_weight, weight, q, float(eps), h, kvh, positions, k_cache, v_cache, slot_mapping, rd,
        float(theta), bool(is_neox), backend)
    y = _fin(y, out)
    return y if x is None else (y, _fin(r, residual_out))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, seq_ids, backend, out):
    if _ref_or_op("paged_attention", backend, ("q", "k_cache", "v_cache"), (q, k_cache, v_cache)):
        return _fin(ref.paged_attention(q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale), out)
    return _fin(torch.ops.kernscope.paged_attention(q, k_cache, v_cache, block_tables, seq_ids, context_lens,
                                                    scale, backend), out)


def rotary_embedding_kv_append_paged_attention(q, k, v, positions, k_cache, v_cache, slot_mapping, block_tables,
                                               context_lens, rotary_dim, theta, is_neox, scale, seq_ids, backend, out):
    op = "rotary_embedding_kv_append_paged_attention"
    rd = q.shape[-1] if rotary_dim is None else int(rotary_dim)
    if _ref_or_op(op, backend, ("q", "k", "v", "k_cache", "v_cache"), (q, k, v, k_cache, v_cache)):
        return ref.rotary_embedding_kv_append_paged_attention(q, k, v, positions, k_cache, v_cache, slot_mapping,
                                                              block_tables, seq_ids, context_lens, rd, float(theta),
                                                              bool(is_neox), float(scale), out)
    if k is None:  # as the C ABI says, before the schema's required k sees None
        raise InvalidArgumentError(f"{op}: k is missing: its rotated rows go to k_cache")
    return _fin(torch.ops.kernscope.rotary_embedding_kv_append_paged_attention(
        q, k, v, positions, k_cache, v_cache, slot_mapping, block_tables, seq_ids, context_lens, rd, float(theta),
        bool(is_neox), float(scale), backend), out)


def install() -> None:
    """Point the public functions at this module while torch.compile traces (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    _ops._TL = sys.modules[__name__]
    _ops._compiling = torch.compiler.is_compiling
