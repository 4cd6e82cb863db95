#!/usr/bin/env bash
# One call on the GPU machine: build for sm_90a, run the GPU tests, the
# sanitizers, the kernscope benchmark and the peers, and write logs / CSVs /
# the report under $OUT (default ./gpu_out).
#   KS_STAGES   comma list of build,test,sanitize,bench,peers,report,model,variants,tune,ab (default: all
#               but variants, tune and ab). ab: AB_OPS (default quant_matmul,decode_fusions) timed as
#               built and under AB_ENV (default KS_QMM_WSTAGE=0) in the same call -> bench_ab.csv. variants: the model stage's bench_ops --variants rows and
#               bench/auto_vs_best.py's 3% table (bench_variants_model.csv, auto_vs_best.md) without
#               the PyTorch peers.
#               tune: `ksctl tune --backend cuda` -> routing_sm_90.json + tune_sm_90.csv (the
#               measured routing table; copy it to src/registry/routing/sm_90.json after review).
#               With every stage the call would return 12 files (the limit is 8: tune and variants
#               add 2 each): run them with fewer stages, e.g. KS_STAGES=build,test,tune,variants.
#               model: the model-path ops (RoPE, decode attention, sampling, argmax, quantized
#               GEMV) against their PyTorch peers -> h200_model.csv / .md
#   PEER_DTYPES dtypes for the peers (default bf16,fp16,fp32)
#   KS_CPU_SUITES=0  the test stage skips ctest's CPU suites (CI runs them); KS_CHECK_SWEEP=0 skips
#               ks_check all; KS_GTEST_FILTER narrows test_cuda_ops (short calls)
# Needs: .dlpack/ (the libdlpack-dev header) and .deps/ (nlohmann-json for the routing tables),
# both carried (scripts/prepare_gpu_carry.sh), and optionally .whl/ (liger-kernel) — see
# docs/perf/README.md.
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
STAGES=${KS_STAGES:-build,test,sanitize,bench,peers,report,model}
PEER_DTYPES=${PEER_DTYPES:-bf16,fp16,fp32}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# The device copy has no .git: the caller passes KS_COMMIT.
export KS_COMMIT=${KS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export KS_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
LOG="$OUT/logs.txt"   # every stage's log, one file (the device returns at most 8 files:
                      # logs.txt, bench_ops.csv, bench_variants.csv (no-PDL and no-staging rows),
                      # h200.csv/md/png (every peer row is in h200.csv), h200_model.csv/md)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee -a "$LOG"

if has build; then
  ks_gpu_build "$LOG" || { tail -40 "$LOG"; exit 1; }
  grep -E "warning|error" "$LOG" | grep -v "^--" | head -20
fi

if has test; then
  $BUILD/tests/test_cuda_ops --gtest_filter="${KS_GTEST_FILTER:-*}" 2>&1 | tee -a "$LOG" | grep -E "^\[  (FAILED|PASSED|  OK|SKIPPED)|Failure|config" | head -60
  if [ "${KS_CPU_SUITES:-1}" = 1 ]; then  # KS_CPU_SUITES=0: CI runs them; a short call skips them
    ctest --test-dir $BUILD -j 8 -E "Cuda" --output-on-failure >> "$LOG" 2>&1; echo "ctest (CPU suites) rc=$?"
  fi
  [ "${KS_CHECK_SWEEP:-1}" = 1 ] && $BUILD/ks_check all | tee -a "$LOG" | grep -E "INCORRECT|correct=" | head -20
fi

if has sanitize; then
  # (racecheck, below, leaves out the long-context attention tests: 400 of its 460 s at e7eaf07)
  F=${SAN_FILTER:-'Cuda*:*CudaAttention*-Cuda.MoreThan2Pow31Elements:CudaSample.IdsEqual*'}
  { compute-sanitizer --tool memcheck --error-exitcode 9 $BUILD/tests/test_cuda_ops --gtest_filter="$F" --gtest_brief=1; echo "memcheck rc=$?";
    compute-sanitizer --tool racecheck --error-exitcode 9 $BUILD/tests/test_cuda_ops --gtest_filter="${RACE_FILTER:-Cuda.RmsNorm*:Cuda.FusedAdd*:Cuda.Softmax*:Cuda.Graph*:Cuda.Argmax*:*CudaAttention*:CudaSample.Graph*:Cuda.FusedNorm*:Cuda.Silu*-*LongContexts*}" --gtest_brief=1; echo "racecheck rc=$?";
  } > "$OUT/sanitizer.txt" 2>&1
  grep -E "rc=|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.txt"; cat "$OUT/sanitizer.txt" >> "$LOG"; rm -f "$OUT/sanitizer.txt"
fi

if has bench; then
  $BUILD/bench_ops --csv "$OUT/bench_ops.csv" | tee -a "$LOG" | tail -100
  # The same kernels without programmatic dependent launch (bf16), for the no-PDL column.
  KS_PDL=0 $BUILD/bench_ops --csv /tmp/bench_nopdl.csv --impl kernscope_nopdl --dtypes ${NOPDL_DTYPES:-bf16} >> "$LOG" 2>&1
  # Comparison: rms_norm / fused_add with the previous weight-preload threshold (KS_NORM_PRELOAD=2), bf16.
  KS_NORM_PRELOAD=2 $BUILD/bench_ops --csv /tmp/bench_preload.csv --impl kernscope_preload2 --ops rms_norm,fused_add_rms_norm --dtypes bf16 >> "$LOG" 2>&1
  echo "preload comparison (op,shape,dtype,us default | us KS_NORM_PRELOAD=2):" | tee -a "$LOG"
  paste -d, <(cut -d, -f5-7,10 "$OUT/bench_ops.csv" | grep -E "^(rms_norm|fused_add_rms_norm),.*,bf16,") <(cut -d, -f10 /tmp/bench_preload.csv | tail -n +2) | tee -a "$LOG"
  # Softmax's cluster path without shared-memory staging (KS_SOFTMAX_SMEM=0): what staging buys.
  KS_SOFTMAX_SMEM=0 $BUILD/bench_ops --csv /tmp/bench_smem.csv --impl kernscope_nosmem --ops softmax >> "$LOG" 2>&1
  paste -d, <(cut -d, -f5-7,10 "$OUT/bench_ops.csv" | grep softmax) <(cut -d, -f9,10 /tmp/bench_smem.csv | tail -n +2) | tee -a "$LOG"
  { cat /tmp/bench_nopdl.csv; tail -n +2 /tmp/bench_smem.csv; } > "$OUT/bench_variants.csv"
  # Host cost per eager call: the C ABI next to the runtime's own launch (bench/launch_overhead.cu).
  $BUILD/launch_overhead | tee -a "$LOG"
fi

if has peers; then
  if ls .whl/liger_kernel*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger_kernel*.whl && export PYTHONPATH=/tmp/site
  fi
  PYTHONUNBUFFERED=1 python3 bench/peers.py --csv /tmp/peers.csv --dtypes "$PEER_DTYPES" > /tmp/peers.txt 2>&1; echo "peers rc=$?"; grep -E "FAILED|unavailable|Error" /tmp/peers.txt | head; tail -3 /tmp/peers.txt; cat /tmp/peers.txt >> "$LOG"
fi

if has report; then
  python3 bench/report.py --ours "$OUT/bench_ops.csv" --ours-extra "$OUT/bench_variants.csv" --peers /tmp/peers.csv --out "$OUT" && cat "$OUT/h200.md"
fi

if has model; then
  # --variants: rotary_embedding, paged_attention, sample and softmax also under each CUDA variant, pinned (issue 6's
  # check that the automatic choice is within 3% of the best variant: bench/auto_vs_best.py)
  $BUILD/bench_ops --csv /tmp/bench_model_all.csv --variants --ops rotary_embedding,paged_attention,sample,argmax,quant_matmul,softmax --dtypes bf16 | tee -a "$LOG" | tail -70
  # the model report: the automatic rows of the model-path ops (softmax is there for auto_vs_best only)
  grep -v -e ',variant:' -e ',softmax,' /tmp/bench_model_all.csv > /tmp/bench_model.csv
  python3 bench/auto_vs_best.py /tmp/bench_model_all.csv --out /tmp/auto_vs_best.md | tee -a "$LOG"
  PYTHONUNBUFFERED=1 python3 bench/peers_model.py --csv /tmp/peers_model.csv >> "$LOG" 2>&1; echo "peers_model rc=$?"
  python3 bench/report.py --ours /tmp/bench_model.csv --peers /tmp/peers_model.csv --out "$OUT" --name h200_model \
    --title "Model-path CUDA operators" --peer-impls torch_sdpa,compile,torch_sort,torch --no-plot \
    --columns "torch_sdpa:torch SDPA,torch_ref:torch eager,compile:torch.compile,torch_sort:torch sort,torch:torch.argmax" &&
    { printf '\n## The automatic choice against every variant (bench_ops --variants)\n\n'; cat /tmp/auto_vs_best.md; } >> "$OUT/h200_model.md" &&
    cat "$OUT/h200_model.md"
fi

if has ab; then
  # One op set timed twice in this call: as built, and under the environment AB_ENV (e.g.
  # KS_QMM_WSTAGE=0, a switch that changes no bits) -> bench_ab.csv, and a side-by-side table.
  AB_ENV=${AB_ENV:-KS_QMM_WSTAGE=0}; AB_OPS=${AB_OPS:-quant_matmul,decode_fusions}
  rm -f /tmp/ab_base.csv /tmp/ab_alt.csv
  $BUILD/bench_ops --csv /tmp/ab_base.csv --ops "$AB_OPS" --dtypes bf16 >> "$LOG" 2>&1; rc_a=$?
  env $AB_ENV $BUILD/bench_ops --csv /tmp/ab_alt.csv --impl "kernscope_ab" --ops "$AB_OPS" --dtypes bf16 >> "$LOG" 2>&1; rc_b=$?
  if [ $rc_a != 0 ] || [ $rc_b != 0 ] || [ "$(wc -l < /tmp/ab_base.csv)" != "$(wc -l < /tmp/ab_alt.csv)" ]; then
    echo "ab: bench_ops failed (rc $rc_a / $rc_b) or the two runs differ in rows; see logs.txt" | tee -a "$LOG"
  else
    { cat /tmp/ab_base.csv; tail -n +2 /tmp/ab_alt.csv; } > "$OUT/bench_ab.csv"  # impl kernscope_ab: the AB_ENV rows
    echo "A/B (op,shape,dtype,impl,us | us with $AB_ENV):" | tee -a "$LOG"
    paste -d, <(cut -d, -f5-8,10 /tmp/ab_base.csv | tail -n +2) <(cut -d, -f10 /tmp/ab_alt.csv | tail -n +2) | tee -a "$LOG"
  fi
fi

if has tune; then
  $BUILD/ksctl tune --backend cuda --reps ${TUNE_REPS:-5} -q --out-dir "$OUT" 2>&1 | tee -a "$LOG" | tail -5
fi

if has variants; then
  # the model stage's variant rows and issue 6's 3% check, without the PyTorch peers (a short
  # call); after a tune stage in this call, the automatic choice is the new measured table's
  # cells first, then the checked-in tables' (as they ship once its cells are put first in
  # sm_90.json; not a table an earlier run left in a reused $OUT)
  has tune && [ -f "$OUT/routing_sm_90.json" ] &&
    export KS_ROUTING_TABLE="$OUT/routing_sm_90.json:src/registry/routing/sm_90.json:src/registry/routing/generic.json" &&
    echo "variants: automatic choice from the tune stage's $KS_ROUTING_TABLE" | tee -a "$LOG"
  $BUILD/bench_ops --csv "$OUT/bench_variants_model.csv" --variants --ops rotary_embedding,paged_attention,sample,argmax,quant_matmul,softmax,decode_fusions --dtypes bf16 2>&1 | tee -a "$LOG" | tail -70
  python3 bench/auto_vs_best.py "$OUT/bench_variants_model.csv" --out "$OUT/auto_vs_best.md" | tee -a "$LOG"
  unset KS_ROUTING_TABLE
fi
