#!/usr/bin/env bash
# Static look at a kernel's hot loop without a GPU: the SASS of the CUDA objects in a build,
# per kernel whose name matches PATTERN, the length (instructions) of its longest backward
# branch range (the main loop) and its instruction mix. Fetches cuobjdump and nvdisasm from
# PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into .sass/ the first time.
#   scripts/sass_loop.sh BUILD_DIR PATTERN [SOURCE_STEM]   e.g.  scripts/sass_loop.sh /tmp/bme gqa_kernelI13__nv_bfloat16Li16ELi4E attention
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: sass_loop.sh BUILD_DIR PATTERN [SOURCE_STEM]}
PATTERN=${2:?pattern}
STEM=${3:-}
CUOBJ=.sass/nvidia/cu13/bin/cuobjdump
if [ ! -x "$CUOBJ" ]; then
  mkdir -p .sass/wheels
  python3 -m pip download -q --no-deps -d .sass/wheels nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  for w in .sass/wheels/*.whl; do python3 -m zipfile -e "$w" .sass; done
  chmod +x .sass/nvidia/cu13/bin/*
fi
export PATH="$PWD/.sass/nvidia/cu13/bin:$PATH"
for obj in $(find "$BUILD" -path "*backends/cuda/*${STEM}*.cu.o"); do
  "$CUOBJ" -sass "$obj"
done | python3 -c '
import collections, re, sys
pattern = sys.argv[1]
funcs, cur = {}, None
for line in sys.stdin:
    if "Function : " in line:
        cur = line.split("Function : ")[1].strip()
        funcs[cur] = []
        continue
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if cur and m:
        funcs[cur].append((int(m.group(1), 16), m.group(2).strip()))
for name, ins in funcs.items():
    if pattern not in name:
        continue
    best = None
    for off, t in ins:
        b = re.search(r"BRA\s+.*?0x([0-9a-f]+)", t)
        if b and int(b.group(1), 16) < off and (best is None or off - int(b.group(1), 16) > best[1] - best[0]):
            best = (int(b.group(1), 16), off)
    loop = [t for off, t in ins if best and best[0] <= off <= best[1]]
    mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in loop)
    print(f"{name}\n  {len(ins)} instructions; main loop {len(loop)}: " +
          ", ".join(f"{k} {v}" for k, v in mix.most_common(12)))
' "$PATTERN"
