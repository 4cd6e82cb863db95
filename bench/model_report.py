#!/usr/bin/env python3
"""docs/perf/model.md from `ksctl bench-model --device cuda --csv` (kernscope) and
bench/model_peers.py's CSV (PyTorch on the same weights), with the issue's targets and the
llama.cpp figures it cites (measured on the same H200 by the issue's author, not by us).

usage: model_report.py --ours model_cuda.csv --peers model_peers.csv --out model.md [--commit SHA]
"""
import argparse
import csv
import os

LLAMA_CPP = "llama.cpp (February 2025 build, CUDA, all layers on the GPU, a SmolLM2-shaped Q4_1 file, " \
            "figures cited by the issue): decode 408 tokens/s (504 with flash attention), prefill 40,700 tokens/s at 512"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ours", required=True)
    ap.add_argument("--peers", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=os.environ.get("KS_COMMIT", "unknown"))
    a = ap.parse_args()
    ours = list(csv.DictReader(open(a.ours)))
    peers = list(csv.DictReader(open(a.peers))) if os.path.exists(a.peers) else []
    decode = {int(r["prompt_tokens"]): float(r["median_tokens_per_s"]) for r in ours
              if r["phase"] == "decode" and r.get("batch", "1") == "1"}
    batched = [(int(r["batch"]), int(r["prompt_tokens"]), float(r["median_tokens_per_s"])) for r in ours
               if r["phase"] == "decode" and r.get("batch", "1") != "1"]
    prefill = {int(r["prompt_tokens"]): float(r["median_tokens_per_s"]) for r in ours if r["phase"] == "prefill"}
    best_b1 = max((float(p["tokens_per_s"]) for p in peers if p["batch"] == "1" and p["config"] != "hf_generate"),
                  default=float("nan"))
    ks_b1 = decode.get(64, float("nan"))
    lines = [f"# SmolLM2-135M-Instruct (Q4_1) on the H200 through kernscope's CUDA operators (commit {a.commit})", "",
             "kernscope: `ksctl bench-model --device cuda` (weights in their GGUF blocks, FP32 activations, each "
             "decode step one CUDA graph replay; median of repeats). PyTorch: bench/model_peers.py on the same "
             "weights in bf16 (the whole decode step in one CUDA graph, with and without torch.compile; HF "
             "generate). Same GPU call." + ("" if peers else " (PyTorch did not run in this call.)"), "",
             "| configuration | batch | tokens/s |", "|---|---|---|"]
    for n, v in sorted(decode.items()):
        lines.append(f"| kernscope decode (after a {n}-token prompt) | 1 | {v:.0f} |")
    for b, n, v in sorted(batched):
        lines.append(f"| kernscope decode, {b} sequences at once (after a {n}-token prompt) | {b} | {v:.0f} |")
    for n, v in sorted(prefill.items()):
        lines.append(f"| kernscope prefill ({n} tokens) | 1 | {v:.0f} |")
    for p in peers:
        lines.append(f"| {p['config']} | {p['batch']} | {float(p['tokens_per_s']):.0f} |")
    ratio = (f"≥ 2× the best PyTorch configuration at batch 1 ({best_b1:.0f}) — ratio {ks_b1 / best_b1:.2f}×; "
             if peers else "≥ 2× the best PyTorch configuration at batch 1 — not measured (no PyTorch run in this call); ")
    lines += ["", f"Targets (from the issue): decode at batch 1 ≥ 1660 tokens/s — measured {ks_b1:.0f}; " + ratio +
                  f"prefill at 512 tokens ≥ 45,000 tokens/s — measured {prefill.get(512, float('nan')):.0f}.",
              "", LLAMA_CPP + "."]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
