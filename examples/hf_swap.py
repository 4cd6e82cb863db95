#!/usr/bin/env python3
"""Hot-swap check: a transformers LlamaForCausalLM with its RMSNorm, SwiGLU and RoPE
replaced by kernscope operators, against the stock model.

The model is SmolLM2-135M-Instruct loaded by transformers from the GGUF file (dequantized to
FP32; needs the `gguf` package). Three replacements, each a kernscope op on the same torch
tensors (the CPU backend for CPU tensors, CUDA for CUDA tensors):
  - every LlamaRMSNorm       -> kernscope.rms_norm
  - every LlamaMLP's act*up  -> kernscope.silu_and_mul on [gate | up]
  - apply_rotary_pos_emb     -> kernscope.rotary_embedding (NeoX pairing, in place, positions
                                taken from the model's rotary embedding call)
Both models then run the prompt and decode --tokens greedy ids. The script prints the largest
first-step logit difference, whether the top-5 ids agree, and where the greedy ids first
differ. A difference at a step where the stock model's top-1/top-2 margin is below 2e-3 is a
near-tie (either pick is right); the comparison stops there. Exit status 0 when the ids agree
(up to such a near-tie), 1 otherwise.

usage: examples/hf_swap.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--device cpu|cuda] [--tokens 64]
                           [--prompt TEXT]
"""
import argparse
import os
import sys

TIE_MARGIN = 2e-3


def greedy(model, ids, n, device):
    import torch

    out_ids, margins, first = [], [], None
    past, cur = None, torch.tensor([ids], device=device)
    with torch.no_grad():
        for step in range(n):
            out = model(input_ids=cur, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            if step == 0:
                first = logits.clone()
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            nxt = int(torch.argmax(logits))
            out_ids.append(nxt)
            cur = torch.tensor([[nxt]], device=device)
    return out_ids, margins, first


def swap_in_kernscope(model):
    """Replaces RMSNorm, SwiGLU and RoPE of a LlamaForCausalLM by kernscope ops (in place)."""
    import torch
    import transformers.models.llama.modeling_llama as ml

    import kernscope as ks

    swapped = {"rms_norm": 0, "silu_and_mul": 0, "rotary_embedding": 0}

    for mod in model.modules():
        if isinstance(mod, ml.LlamaRMSNorm):
            def norm_forward(x, m=mod):
                return ks.rms_norm(x.contiguous(), m.weight, m.variance_epsilon)
            mod.forward = norm_forward
            swapped["rms_norm"] += 1
        elif isinstance(mod, ml.LlamaMLP):
            def mlp_forward(x, m=mod):
                return m.down_proj(ks.silu_and_mul(torch.cat([m.gate_proj(x), m.up_proj(x)], dim=-1)))
            mod.forward = mlp_forward
            swapped["silu_and_mul"] += 1

    # RoPE: the model's rotary embedding sees the position ids; keep them for the attention
    # layers' apply_rotary_pos_emb calls of the same forward pass.
    rotary = model.model.rotary_emb
    if getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise SystemExit("hf_swap: this RoPE variant scales cos/sin; kernscope implements the plain one")
    cfg = model.config
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    state = {"positions": None}
    stock_rotary_forward = rotary.forward

    def rotary_forward(x, position_ids):
        state["positions"] = position_ids
        return stock_rotary_forward(x, position_ids)

    rotary.forward = rotary_forward

    def apply_rope(q, k, cos, sin, unsqueeze_dim=1):
        b, h, s, d = q.shape
        kh = k.shape[1]
        pos = state["positions"].reshape(-1).to(torch.int64)
        qq = q.transpose(1, 2).reshape(b * s, h, d).contiguous()
        kk = k.transpose(1, 2).reshape(b * s, kh, d).contiguous()
        ks.rotary_embedding(qq, kk, pos, d, float(theta), True)  # NeoX pairing = HF rotate_half
        swapped["rotary_embedding"] += 1
        return qq.view(b, s, h, d).transpose(1, 2), kk.view(b, s, kh, d).transpose(1, 2)

    ml.apply_rotary_pos_emb = apply_rope
    return swapped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Explain in one paragraph why the sky is blue.")
    args = ap.parse_args()

    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        print(f"hf_swap: {e}; this example needs: pip install torch transformers gguf accelerate", file=sys.stderr)
        return 2

    import kernscope as ks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    d, f = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]

    def load():
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).to(device).eval()

    stock_ids, margins, stock_first = greedy(load(), ids, args.tokens, device)
    swapped_model = load()
    counts = swap_in_kernscope(swapped_model)
    ks_ids, _, ks_first = greedy(swapped_model, ids, args.tokens, device)

    print(f"kernscope {ks.__version__}, torch {torch.__version__}, device {device}; "
          f"prompt {len(ids)} tokens, {args.tokens} greedy tokens")
    print("replaced:", ", ".join(f"{k} x{v}" for k, v in counts.items() if k != "rotary_embedding"),
          f"(rotary_embedding calls: {counts['rotary_embedding']})")
    diff = (stock_first - ks_first).abs().max().item()
    top_stock = torch.topk(stock_first, 5).indices.tolist()
    top_ks = torch.topk(ks_first, 5).indices.tolist()
    print(f"first step: largest logit difference {diff:.3g}; top-5 ids {'agree' if top_stock == top_ks else 'DIFFER'}"
          f" ({top_stock} vs {top_ks})")
    for i, (a, b) in enumerate(zip(stock_ids, ks_ids)):
        if a != b:
            tie = margins[i] < TIE_MARGIN
            print(f"greedy ids first differ at step {i}: stock {a} ({tok.decode([a])!r}), kernscope {b} "
                  f"({tok.decode([b])!r}); stock top-1/top-2 margin {margins[i]:.4g}"
                  + (" (a near-tie: either pick is right)" if tie else ""))
            return 0 if tie else 1
    print(f"all {len(stock_ids)} greedy ids agree: {tok.decode(stock_ids)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
