#!/usr/bin/env python3
"""Independent reference for SmolLM2-135M-Instruct (GGUF Q4_1) from HF transformers.

Runs on the GPU machine (torch + transformers there; the `gguf` wheel travels with the
command). transformers dequantizes the GGUF weights to FP32 (d*q+m per block, as
kernscope's contract) and runs the stock LlamaForCausalLM in FP32 with TF32 off.

Writes JSON with, per prompt: the chat-formatted prompt text, its token ids (from the HF
tokenizer built from the same GGUF), exactly --max-new-tokens greedy ids (no stop at EOS), the top-1/top-2 logit margin
at every step (to spot near-ties), and the first decode step's top-5 logits.

usage: make_reference.py --model PATH.gguf --out tests/data/reference_generation.json
"""
import argparse
import json
import os
import platform
import sys

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three prime numbers greater than 10.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", required=True, help="output JSON path")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    d, f = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model = model.to(args.device).eval()

    cases = []
    for p in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids], device=args.device)
        generated, margins, top5 = [], [], None
        past = None
        cur = x
        with torch.no_grad():
            for step in range(args.max_new_tokens):
                out = model(input_ids=cur, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                if step == 0:
                    v, i = torch.topk(logits, 5)
                    top5 = {"ids": i.tolist(), "logits": v.tolist()}
                v2, i2 = torch.topk(logits, 2)
                margins.append(float(v2[0] - v2[1]))
                nxt = int(torch.argmax(logits))  # lowest index wins ties
                generated.append(nxt)  # no early stop: a fixed count of ids per prompt
                cur = torch.tensor([[nxt]], device=args.device)
        cases.append({
            "prompt": p,
            "prompt_text": text,
            "prompt_ids": ids,
            "greedy_ids": generated,
            "greedy_text": tok.decode(generated),
            "top1_top2_margin": margins,
            "first_step_top5": top5,
        })
        print(f"[{p}] -> {tok.decode(generated)!r}", flush=True)

    meta = {
        "model_file": f,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor(),
        "dtype": "float32, tf32 off",
        "method": "greedy argmax with KV cache, stock LlamaForCausalLM from the GGUF (dequantized)",
    }
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "cases": cases}, fh, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
