#!/usr/bin/env python3
"""PyTorch baselines for SmolLM2-135M decode on the GPU machine, with the weights of the same
GGUF file (dequantized by transformers, run in bf16), for docs/perf/model.md:

  torch_graph          the whole decode step (RMSNorm, fused qkv, NeoX RoPE, static KV cache,
                       SDPA with GQA, SwiGLU, tied head, argmax) written in torch ops and captured
                       in one CUDA graph, replayed per token (the gpt-fast recipe)
  torch_compile_graph  the same step compiled (mode="max-autotune-no-cudagraphs"), then captured
  hf_generate          transformers' generate(), greedy, batch 1 (what a user gets out of the box)

Batch sizes 1, 8 and 32 for the graph configurations (every row decodes at the same position).
Writes CSV rows: config, batch, tokens_per_s (tokens over all rows per second).

usage: bench/model_peers.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--csv out.csv] [--tokens 256]
       bench/model_peers.py --model ... --device cpu --smoke     # shapes only, no graphs (CPU check)
"""
import argparse
import csv
import os
import statistics
import time

import torch
import torch.nn.functional as F


def load_weights(path, device, dtype):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(os.path.abspath(path))
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    cfg = m.config
    sd = {k: v.to(device=device, dtype=dtype) for k, v in m.state_dict().items()}
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 1e4)
    return cfg, sd, float(theta), m


class Decoder:
    """A SmolLM2-shaped Llama decode step in torch ops over a static cache."""

    def __init__(self, cfg, sd, theta, batch, max_t, device, dtype):
        self.L, self.H = cfg.num_hidden_layers, cfg.hidden_size
        self.NH, self.NKV = cfg.num_attention_heads, cfg.num_key_value_heads
        self.HD, self.I, self.eps = self.H // self.NH, cfg.intermediate_size, cfg.rms_norm_eps
        self.B, self.T = batch, max_t
        p = "model.layers.{}."
        self.emb = sd["model.embed_tokens.weight"]
        self.head = sd.get("lm_head.weight", self.emb)
        self.norm = sd["model.norm.weight"]
        self.layers = []
        for i in range(self.L):
            g = lambda n: sd[p.format(i) + n]  # noqa: E731
            self.layers.append(dict(
                ln1=g("input_layernorm.weight"), ln2=g("post_attention_layernorm.weight"),
                wqkv=torch.cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight")]),
                wo=g("self_attn.o_proj.weight"),
                wgu=torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]), wd=g("mlp.down_proj.weight")))
        self.kc = torch.zeros(self.L, batch, self.NKV, max_t, self.HD, device=device, dtype=dtype)
        self.vc = torch.zeros_like(self.kc)
        inv = 1.0 / (theta ** (torch.arange(0, self.HD, 2, device=device).double() / self.HD))
        ang = torch.arange(max_t, device=device).double()[:, None] * inv[None]
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)
        self.steps = torch.arange(max_t, device=device)

    def rope(self, x, pos):  # x [B, heads, 1, HD], rotate-half (NeoX) pairing
        c, s = self.cos[pos].view(1, 1, 1, -1), self.sin[pos].view(1, 1, 1, -1)
        a, b = x[..., : self.HD // 2], x[..., self.HD // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    def step(self, tok, pos):  # tok [B] int64, pos [1] int64 (all rows at one position)
        B, H, NH, NKV, HD = self.B, self.H, self.NH, self.NKV, self.HD
        h = self.emb[tok]  # [B, H]
        mask = (self.steps <= pos).view(1, 1, 1, self.T)
        for li, w in enumerate(self.layers):
            x = F.rms_norm(h, (H,), w["ln1"], self.eps)
            q, k, v = (x @ w["wqkv"].t()).split([NH * HD, NKV * HD, NKV * HD], -1)
            q = self.rope(q.view(B, 1, NH, HD).transpose(1, 2), pos)
            k = self.rope(k.view(B, 1, NKV, HD).transpose(1, 2), pos)
            self.kc[li].index_copy_(2, pos, k)
            self.vc[li].index_copy_(2, pos, v.view(B, 1, NKV, HD).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, self.kc[li], self.vc[li], attn_mask=mask, enable_gqa=True)
            h = h + o.transpose(1, 2).reshape(B, NH * HD) @ w["wo"].t()
            x = F.rms_norm(h, (H,), w["ln2"], self.eps)
            gu = x @ w["wgu"].t()
            h = h + (F.silu(gu[:, : self.I]) * gu[:, self.I:]) @ w["wd"].t()
        return (F.rms_norm(h, (H,), self.norm, self.eps) @ self.head.t()).argmax(-1)


def graph_tokens_per_s(dec, fn, tokens, device):
    tok = torch.zeros(dec.B, dtype=torch.long, device=device)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(tok, pos)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        nxt = fn(tok, pos)
    rates = []
    for _ in range(3):
        pos.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            g.replay()
            tok.copy_(nxt)
            pos.add_(1)
        torch.cuda.synchronize()
        rates.append(tokens * dec.B / (time.perf_counter() - t0))
    return statistics.median(rates)


def hf_generate_tokens_per_s(model, device, tokens):
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[1] * 32], device=device)
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    model.generate(ids, **kw)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--csv", default="model_peers.csv")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="one eager step per batch size (no graphs, no timing)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg, sd, theta, hf = load_weights(a.model, a.device, torch.bfloat16 if a.device == "cuda" else torch.float32)
    rows = []
    with torch.no_grad():
        for batch in (1, 8, 16, 32):
            dec = Decoder(cfg, sd, theta, batch, a.tokens + 8, a.device, next(iter(sd.values())).dtype)
            if a.smoke:
                out = dec.step(torch.zeros(batch, dtype=torch.long, device=a.device), torch.zeros(1, dtype=torch.long,
                                                                                                   device=a.device))
                print(f"smoke: batch {batch} -> ids {out.tolist()[:4]}")
                continue
            for name, fn in (("torch_graph", dec.step),
                             ("torch_compile_graph", torch.compile(dec.step, mode="max-autotune-no-cudagraphs",
                                                                   fullgraph=True))):
                try:
                    tps = graph_tokens_per_s(dec, fn, a.tokens, a.device)
                except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
                    print(f"{name} batch {batch} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append(dict(config=name, batch=batch, tokens_per_s=round(tps, 1)))
                print(f"{name:22s} batch {batch:3d}: {tps:10.1f} tokens/s", flush=True)
        if not a.smoke:
            tps = hf_generate_tokens_per_s(hf, a.device, min(a.tokens, 128))
            rows.append(dict(config="hf_generate", batch=1, tokens_per_s=round(tps, 1)))
            print(f"{'hf_generate':22s} batch   1: {tps:10.1f} tokens/s", flush=True)
    if rows:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["config", "batch", "tokens_per_s"])
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
