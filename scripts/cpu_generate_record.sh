#!/usr/bin/env bash
# The CPU path's end-to-end speed on this machine, as a record: `ksctl generate` on SmolLM2-135M
# (the README's chat command, then a 128-token greedy continuation), each RUNS times, at the
# automatic thread count and at --threads 1; one CSV row per run with the machine's CPU, core
# count, commit, command, prompt tokens, prefill and decode tokens/s (ksctl's own figures).
#   scripts/cpu_generate_record.sh [ksctl] [out.csv]   (defaults: build/ksctl,
#   docs/perf/cpu_generate_<commit>.csv; the model from `make run`'s cache or MODEL=path)
# CPU speed varies a lot between machines and with other load: quote these as this machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
KSCTL=${1:-build/ksctl}
[ -x "$KSCTL" ] || { echo "cpu_generate_record: no ksctl at $KSCTL (build it: make)"; exit 1; }
COMMIT=$("$KSCTL" --version | sed -n 's/.*(commit \([0-9a-f]*\).*/\1/p')  # the binary's own commit
OUTCSV=${2:-docs/perf/cpu_generate_$COMMIT.csv}
MODEL=${MODEL:-${KS_CACHE:-$HOME/.cache/kernscope}/SmolLM2-135M-Instruct.Q4_1.gguf}
RUNS=${RUNS:-5}
[ -f "$MODEL" ] || { echo "cpu_generate_record: no model at $MODEL (make run fetches it)"; exit 1; }
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1 | tr ',' ' ')
cores=$(nproc)
echo "cpu,cores,commit,case,threads,run,prompt_tokens,generated_tokens,prefill_tok_s,decode_tok_s" > "$OUTCSV"
for threads in 0 1; do
  for c in chat story; do
    for ((i = 1; i <= RUNS; ++i)); do
      if [ $c = chat ]; then
        args=(--chat --prompt "What is the capital of France?")
      else
        args=(--prompt "Once upon a time, in a small village by the sea," --max-tokens 128)
      fi
      log=$("$KSCTL" generate --model "$MODEL" --threads $threads "${args[@]}" 2>&1 >/dev/null)
      p=$(sed -n 's/.*prompt \([0-9]*\) tokens: prefill \([0-9.]*\) tokens\/s.*/\1,\2/p' <<< "$log")
      d=$(sed -n 's/.*generated \([0-9]*\) tokens.*decode \([0-9.]*\) tokens\/s.*/\1,\2/p' <<< "$log")
      [ -n "$p" ] && [ -n "$d" ] || { echo "cpu_generate_record: could not read ksctl's figures:"; echo "$log"; exit 1; }
      IFS=, read -r pt pr <<< "$p"
      IFS=, read -r gt dr <<< "$d"
      echo "$cpu,$cores,$COMMIT,$c,$threads,$i,$pt,$gt,$pr,$dr" >> "$OUTCSV"
    done
  done
done
python3 - "$OUTCSV" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(f"{rows[0]['cpu']}, {rows[0]['cores']} cores, {rows[0]['commit']} (tokens/s, median of {len(rows) // 4} runs)")
for case in ("chat", "story"):
    for th in ("0", "1"):
        r = [x for x in rows if x["case"] == case and x["threads"] == th]
        print(f"  {case:5s} threads={'auto' if th == '0' else th}: prompt {r[0]['prompt_tokens']} tokens, prefill "
              f"{statistics.median(float(x['prefill_tok_s']) for x in r):.0f}; {r[0]['generated_tokens']} generated, "
              f"decode {statistics.median(float(x['decode_tok_s']) for x in r):.0f}")
EOF
echo "-> $OUTCSV"
