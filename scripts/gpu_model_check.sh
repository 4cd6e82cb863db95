#!/usr/bin/env bash
# SmolLM2-135M on the GPU machine: builds ksctl and the model tests for sm_90a, runs the
# model tests (the CUDA test compares the CUDA path's greedy ids and logits with the
# transformers reference and the CPU path), `ksctl generate --device cuda`, and
# `ksctl bench-model` on CUDA and the CPU, the PyTorch baselines (bench/model_peers.py) and
# docs/perf/model.md's table (bench/model_report.py); writes logs and CSVs under $OUT.
#
# KS_PREBUILT=1 (build-prebuilt/ carried, from scripts/make_prebuilt.sh): no build; the carried
# ksctl and test_model run (the swap stage still builds the Python package, so leave it out).
# Needs what scripts/prepare_gpu_carry.sh made: .dlpack and .deps carried by this call (not
# under KS_PREBUILT=1: there, .whl and .mdl/part_ab, with build-prebuilt carried by an earlier
# call of the same warm machine or by this one where it fits), and the model in two parts (a call
# carries at most 64 MiB): carry .mdl/part_aa in one call that copies it to /tmp/ks_part_aa (e.g.
# the gpu_check.sh call), then .mdl/part_ab in the next while the machine is warm; this script
# joins them.
#   KS_MODEL_STAGES  comma list of build,test,generate,ablate,bench,swap,profile (default: all but
#                    profile and ablate)
#                    profile: ncu's duration of each kernel of one decode step (decode_profile.csv;
#                    KS_PROFILE_BATCH=32: of one 32-sequence step)
#                    swap: the Python package built here and examples/hf_swap.py --device cuda
#                    (transformers with kernscope's RMSNorm, SwiGLU and RoPE vs the stock model;
#                    the gguf and accelerate wheels travel in .whl)
#                    ablate: batch-1 decode rates with each part of the one-token step left out
#                    (KS_MODEL_ABLATE=head, attention, ...: wrong outputs, timing only) beside the
#                    default -> model_ablate.csv; the drop per part is its cost inside the graph
#   KS_MODEL_CONTEXT=N  bench: the CUDA bench-model runs (and A/B runs) with --context N (e.g. 2048,
#                    generate's default; decode attention sizes its clusters by the capacity)
#   KS_MODEL_CPU=0   bench: skip the CPU path's benchmark; KS_MODEL_PEERS=0: skip the PyTorch
#                    baselines (the report then compares with none); KS_MODEL_AB=0: skip the batch-1
#                    comparison runs (KS_MODEL_FUSE=0, KS_QMM_WSTAGE=0, KS_MODEL_SPLIT_HEAD=1 with and
#                    without cuda_row_stream for the head)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
STAGES=${KS_MODEL_STAGES:-build,test,generate,bench,swap}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
LOG="$OUT/model_logs.txt"
MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$MODEL" ]; then
  # part_aa may have come in an earlier call that saved it to /tmp (see the header)
  A=.mdl/part_aa; [ -f $A ] || A=/tmp/ks_part_aa
  [ -f $A ] && [ -f .mdl/part_ab ] || { echo "gpu_model_check: need .mdl/part_aa (or /tmp/ks_part_aa) and .mdl/part_ab (see the header)"; exit 2; }
  cat $A .mdl/part_ab > "$MODEL"
fi
[ "$(stat -c %s "$MODEL")" = 98362432 ] || { echo "gpu_model_check: the joined model has the wrong size"; exit 2; }
if has build && [ "${KS_PREBUILT:-0}" = 1 ]; then  # carried binaries (scripts/make_prebuilt.sh)
  echo "build-prebuilt at $(tr '\n' ' ' < $BUILD/COMMIT)" | tee -a "$LOG"
  [ -x $BUILD/ksctl ] && [ -x $BUILD/tests/test_model ] || { echo "gpu_model_check: build-prebuilt lacks ksctl / test_model"; exit 1; }
elif has build; then
  ks_gpu_build "$LOG" ksctl test_model test_cuda_ops || { tail -40 "$LOG"; exit 1; }
fi
if has test; then
  KS_MODEL_PATH=$MODEL KS_TEST_DATA=$PWD/tests/data $BUILD/tests/test_model 2>&1 | tee -a "$LOG" |
    grep -E "^\[  (FAILED|PASSED|SKIPPED)|OK \]|Failure|largest|cuda:|cuda dense" | head -40
fi
if has generate; then
  for dev in cuda cpu; do
    echo "== ksctl generate --device $dev" | tee -a "$LOG"
    $BUILD/ksctl generate --model $MODEL --chat --prompt "What is the capital of France?" --max-tokens 48 \
      --device $dev 2>&1 | tee -a "$LOG" | tail -6
  done
  # one-shot decode rates of a short and a longer reply (no warm-up run: the graphs are made while
  # loading), the GPU running ahead in graphs of 4 chained steps against a step per call
  for steps in 4 0; do
    for p in "What is the capital of France?" "Write a haiku about the sea."; do
      echo "== ksctl generate --device cuda, KS_MODEL_DECODE_STEPS=$steps: $p" | tee -a "$LOG"
      KS_MODEL_DECODE_STEPS=$steps $BUILD/ksctl generate --model $MODEL --chat --prompt "$p" --max-tokens 64 \
        --device cuda 2>&1 | tee -a "$LOG" | grep -E "^\[ksctl\] (model|generated)"
    done
  done
  # the KV cache sized for the request (the default since 2026-11-30) against the old default of
  # 2048 tokens, whose attention clusters are 16 CTAs
  for c in 0 2048; do
    echo "== ksctl generate --device cuda --context $c: Write a haiku about the sea." | tee -a "$LOG"
    $BUILD/ksctl generate --model $MODEL --chat --prompt "Write a haiku about the sea." --max-tokens 64 --context $c \
      --device cuda 2>&1 | tee -a "$LOG" | grep -E "^\[ksctl\] generated"
  done
fi
if has ablate; then
  rm -f "$OUT/model_ablate.csv"
  for part in none head attention qkv oproj gateup down attention,oproj,gateup,down,qkv; do
    rm -f /tmp/abl.csv
    abl=(); [ "$part" = none ] || abl=(KS_MODEL_ABLATE=$part)
    env "${abl[@]}" $BUILD/ksctl bench-model --model $MODEL --device cuda ${KS_MODEL_CONTEXT:+--context $KS_MODEL_CONTEXT} \
      --prompt-tokens 64 512 --decode-tokens 128 --repeats 5 --batch 1 --csv /tmp/abl.csv 2>&1 | tee -a "$LOG" |
      grep decode | sed "s/^/ablate $part: /"
    if [ "${PIPESTATUS[0]}" != 0 ] || [ ! -s /tmp/abl.csv ]; then echo "ablate $part: bench-model failed; no rows"; continue; fi
    [ -f "$OUT/model_ablate.csv" ] || echo "ablated,$(head -1 /tmp/abl.csv)" > "$OUT/model_ablate.csv"
    tail -n +2 /tmp/abl.csv | sed "s/^/\"$part\",/" >> "$OUT/model_ablate.csv"
  done
fi
if has bench; then
  $BUILD/ksctl bench-model --model $MODEL --device cuda ${KS_MODEL_CONTEXT:+--context $KS_MODEL_CONTEXT} --prompt-tokens 64 512 --decode-tokens 128 --repeats 5 \
    --batch 1 8 16 32 --csv "$OUT/model_cuda.csv" 2>&1 | tee -a "$LOG"
  # Batch-1 comparisons in the same call, one CSV (model_cuda_ab.csv, a leading `config` column;
  # the call returns at most 8 files):
  #   unfused      KS_MODEL_FUSE=0: 10 kernels per layer instead of 5
  #   no_wstage    KS_QMM_WSTAGE=0: the matmuls' weight staging off (the same bits)
  #   rope_apart   KS_MODEL_FUSE_ROPE=0: RoPE + the cache append as a kernel of their own (6 kernels
  #                per layer; the default until 2026-12-01)
  #   no_live_split  KS_ATTN_LIVE_SPLIT=0: decode attention splits the keys over every CTA of
  #                the cluster sized for the cache's capacity, not over ceil(len / step) of them
  #   pull_merge   KS_ATTN_PUSH_MERGE=0: decode attention's cluster merge by remote reads between two
  #                barriers, not pushed to rank 0 before one
  #   step_timing  KS_MODEL_STEP_TIMING=1 KS_MODEL_DECODE_STEPS=0: each decode step (one graph per
  #                step, the host between steps) timed on the GPU (CUDA events), printed beside the
  #                time per token from the decode rate (the rest is the host's turn)
  #   steps0 / steps1 / steps8  KS_MODEL_DECODE_STEPS=0 / 1 / 8: greedy decode a step per call (the
  #                host between steps) / the GPU running ahead by graphs of 1 / 8 chained steps
  #                (the default: 4)
  #   split_head   KS_MODEL_SPLIT_HEAD=1: the output head split off the last fusion
  #   split_head_warp_groups  the same with cuda_bulk_stream's warp groups for short rows
  #                (KS_QMM_BULK_THREAD_ROWS=0; a thread per row is the default since add6a56)
  #   split_head_stream  the same with quant_matmul's cuda_row_stream first at the head's shape
  #                (bench/routing_head_row_stream.json chained before the checked-in tables)
  #   attn_min128 / attn_min256 / attn_min512  KS_ATTN_MIN_KEYS=N: decode attention gives each
  #                CTA at least N keys (only when named in KS_MODEL_AB_ONLY)
  #   nopdl / rope_apart_nopdl  KS_PDL=0 with / without the q/k/v + RoPE fusion (only when named)
  #   batch_silu_fuse  KS_MODEL_BATCH_SILU_FUSE=1 at batch 8, 16 and 32: SiLU and the down projection
  #                as one kernel (silu_and_mul_quant_matmul's cuda_mma_rows, pinned)
  #   dense_decode  KS_MODEL_DENSE_DECODE=1 at batch 8, 16 and 32: from 16 sequences the matmuls
  #                through FP32 copies and cuBLASLt (the rule until 2026-12-01) instead of
  #                quant_matmul's cuda_mma_rows
  #   batch_qmm / batch_qmm_staged_x  batch 8, 16 and 32 through quant_matmul
  #                (KS_MODEL_BATCH_INVARIANT=1), with cuda_warp_per_column first
  #                (bench/routing_qmm_per_warp.json) / with cuda_staged_x first (only when named)
  #   fuse_attn    KS_MODEL_FUSE_ATTN=1: decode steps run rotary_embedding_kv_append_paged_attention's
  #                one kernel instead of rotary_embedding_kv_append and paged_attention
  #   fuse_attn_batch  the same at batch 8, 16 and 32
  #   wstage2      KS_QMM_WSTAGE_CTAS=2: the matmul kernels stage their weights before the wait in
  #                grids of up to 2 CTAs per SM, the rule before 0736325 (default 3, which takes in
  #                the one-token step's gate|up matmul: 3072 rows, 384 CTAs)
  #   default_rerun  the default configuration again, next to the table A/B
  #   prefetch128  KS_ATTN_PREFETCH_KEYS=128: decode attention warms L2 with 128 keys per CTA before
  #                griddepcontrol.wait (warm_keys_l2; off by default since 87eb81b's A/B)
  #   attn_nopdl / rope_apart_attn_nopdl  KS_PDL_OFF=paged_attention: decode attention launched
  #                without PDL (its clusters wait for the previous kernel's end instead of being placed
  #                early), after the q/k/v + RoPE kernel (what the default's no-early-trigger stands
  #                for: 1643-1651 tokens/s against 1631-1638 for the 6-kernel step in three calls) and
  #                after the RoPE + append kernel (KS_MODEL_FUSE_ROPE=0); rope_nopdl: the RoPE +
  #                append kernel without PDL (6-kernel step)
  #   one_cta256 / one_cta512 / one_cta512_batch / one_cta1024  KS_ATTN_ONE_CTA_KEYS=256 / 512 / 1024
  #                (batch 1 / 8, 16, 32): decode attention runs one CTA per (token, kv head), no
  #                cluster, for tables of at most that many keys (default 256 since 2026-12-01);
  #                one_cta512_ctx400 / ctx400: the same and the default with a 400-token cache and
  #                prompts of 64 and 240 tokens (the whole-cache table then holds up to 368 live
  #                keys); old_rule / old_rule_batch / old_rule_ctx400: the rules before 2026-12-01
  #                (no one-CTA tables, the model's headroom 2); one_cta_off / headroom2: one of them
  #   bucket192 / bucket128  KS_MODEL_ATTN_BUCKET=192 / 128 with KS_ATTN_ONE_CTA_KEYS at the same:
  #                one CTA for the first table only; default3: the default, all three at 64, 200 and
  #                512-token prompts
  #   no_prewait / no_early / cluster_pdl / old_chain / old_chain_batch / default5  the decode step's
  #                attention chain: KS_MODEL_ATTN_PREWAIT=0 (paged_attention without after_append's
  #                promise: nothing read before the wait), KS_QMM_ROPE_EARLY_TRIGGER=0 (the q/k/v +
  #                RoPE kernel does not let the attention launch early), KS_ATTN_CLUSTER_PDL=1
  #                (clusters with PDL); old_chain: all three, the rules before a2bbdd8's A/B;
  #                prewait_steps1: KS_ATTN_PREWAIT_STEPS=1, one step of older keys before the wait (not two)
  #   cluster_pdl_wide_batch  KS_ATTN_CLUSTER_PDL=wide: clusters with PDL where the grid exceeds one CTA
  #                per SM (batched decode's 641-key tables), batch 1, 8, 16, 32 (692b01a: +2.6% / -3.3%
  #                at 8 / 16 sequences after 512-token prompts; off)
  #   cap256 / cap1024  KS_ATTN_CAPACITY_KEYS=256 / 1024: clusters of a CTA per 256 / 1024 keys of the
  #                table's capacity (fewer CTAs, each more keys; 1024: no cluster below 2048 keys)
  #   cap128       KS_ATTN_CAPACITY_KEYS=128: decode attention's cluster holds a CTA per 128 keys of the
  #                table's capacity at most, the rule before 87eb81b's A/B (default 64: a 512..640-token
  #                context on the 656-token table then takes 8 CTAs instead of 4)
  #   one_table / one_table_batch  KS_MODEL_ATTN_BUCKET=0: every step's attention on the whole
  #                context's block table (as before the capacity buckets), batch 1 / 8, 16, 32
  #   headroom2    KS_MODEL_ATTN_HEADROOM=2: a table of at least twice the context (the default
  #                before cf200dc; contexts of 129-256 then take the 512-key table's clusters)
  #   one_table_2048 / buckets_2048  bench-model with --context 2048: one table / the default
  #   ctx656 / ctx1000 / ctx1500 / ctx2048 / ctx4096  the default at these cache capacities (only when
  #                named): the 64-token runs take the same tables at every one of them, so a
  #                spread here is the buffers' placement, not the kernels (is 3c95e82's
  #                1707 with a 208-token cache against 1656 with 656 a placement effect?)
  # KS_MODEL_AB_ONLY=name,name runs only those.
  if [ "${KS_MODEL_AB:-1}" = 1 ]; then
    ab() {  # ab NAME ENV...: one batch-1 bench-model run under the environment ENV...
      local name=$1; shift
      [ -n "${KS_MODEL_AB_ONLY:-}" ] && [[ ",$KS_MODEL_AB_ONLY," != *",$name,"* ]] && return 0
      rm -f /tmp/ab_$name.csv  # (a warm machine keeps /tmp: no rows from an earlier call)
      env "$@" $BUILD/ksctl bench-model --model $MODEL --device cuda ${KS_MODEL_CONTEXT:+--context $KS_MODEL_CONTEXT} --prompt-tokens ${AB_PROMPTS:-64 512} --decode-tokens 128 \
        --repeats 5 --batch ${AB_BATCH:-1} --csv /tmp/ab_$name.csv 2>&1 | tee -a "$LOG" | grep decode | sed "s/^/$name: /"
      local rc=${PIPESTATUS[0]}
      if [ "$rc" != 0 ] || [ ! -s /tmp/ab_$name.csv ]; then echo "$name: bench-model failed (rc=$rc); no rows"; return 0; fi
      if [ ! -f "$OUT/model_cuda_ab.csv" ]; then echo "config,$(head -1 /tmp/ab_$name.csv)" > "$OUT/model_cuda_ab.csv"; fi
      tail -n +2 /tmp/ab_$name.csv | sed "s/^/$name,/" >> "$OUT/model_cuda_ab.csv"
    }
    rm -f "$OUT/model_cuda_ab.csv"
    ab unfused KS_MODEL_FUSE=0
    ab no_wstage KS_QMM_WSTAGE=0
    ab step_timing KS_MODEL_STEP_TIMING=1 KS_MODEL_DECODE_STEPS=0
    for n in 0 1 8; do ab steps$n KS_MODEL_DECODE_STEPS=$n; done
    ab pull_merge KS_ATTN_PUSH_MERGE=0
    ab no_live_split KS_ATTN_LIVE_SPLIT=0
    ab rope_apart KS_MODEL_FUSE_ROPE=0
    if [ -n "${KS_MODEL_AB_ONLY:-}" ]; then
      for n in 128 256 512; do ab attn_min$n KS_ATTN_MIN_KEYS=$n; done
      # batched decode through quant_matmul at every batch size instead of the FP32 copies +
      # cuBLASLt from 16 on: with the per-warp kernel first, and with cuda_staged_x first
      AB_BATCH="8 16 32" ab batch_qmm KS_MODEL_BATCH_INVARIANT=1 \
        KS_ROUTING_TABLE=bench/routing_qmm_per_warp.json:src/registry/routing/sm_90.json:src/registry/routing/generic.json
      AB_BATCH="8 16 32" ab batch_qmm_staged_x KS_MODEL_BATCH_INVARIANT=1 \
        KS_ROUTING_TABLE=bench/routing_staged_x.json:src/registry/routing/sm_90.json:src/registry/routing/generic.json
      for c in 656 1000 1500 2048 4096; do KS_MODEL_CONTEXT=$c ab ctx$c; done
      ab nopdl KS_PDL=0                                  # is the fusion's loss a PDL placement effect?
      ab rope_apart_nopdl KS_MODEL_FUSE_ROPE=0 KS_PDL=0
    fi
    AB_BATCH="8 16 32" ab dense_decode KS_MODEL_DENSE_DECODE=1
    AB_BATCH="8 16 32" ab batch_silu_fuse KS_MODEL_BATCH_SILU_FUSE=1
    ab default_rerun  # (the default again beside the table A/B: the main run comes first and may run cooler)
    ab wstage2 KS_QMM_WSTAGE_CTAS=2  # weight staging for grids of up to 2 CTAs per SM (the default until 0736325)
    ab prefetch128 KS_ATTN_PREFETCH_KEYS=128
    ab cap128 KS_ATTN_CAPACITY_KEYS=128
    ab cap256 KS_ATTN_CAPACITY_KEYS=256
    ab one_cta512 KS_ATTN_ONE_CTA_KEYS=512  # one CTA per unit for tables of <= 512 keys (default 256)
    ab one_cta1024 KS_ATTN_ONE_CTA_KEYS=1024  # ... <= 1024 keys: the 512-token prompt's 641-key table too
    ab old_rule KS_ATTN_ONE_CTA_KEYS=0 KS_MODEL_ATTN_HEADROOM=2  # clusters at every table, headroom 2 (before 2026-12-01)
    AB_BATCH="8 16 32" ab old_rule_batch KS_ATTN_ONE_CTA_KEYS=0 KS_MODEL_ATTN_HEADROOM=2
    ab one_cta_off KS_ATTN_ONE_CTA_KEYS=0
    ab headroom2 KS_MODEL_ATTN_HEADROOM=2
    # 200-token prompts: 200-256 live keys in one CTA (the 256-key table), then 257-328 in the 512-key
    # table's clusters; against the one-CTA rule off (is 193-256 keys in one CTA still a gain?)
    AB_PROMPTS="200" ab prompt200
    AB_PROMPTS="200" ab prompt200_one_cta_off KS_ATTN_ONE_CTA_KEYS=0
    # tables of 192 / 128, 384 / 256, ... keys with the one-CTA bound at the first (54d78ee: 200-256
    # live keys in one CTA lost, 1627 against 1665 with clusters): 64-, 200- and 512-token prompts
    AB_PROMPTS="64 200 512" ab bucket192 KS_MODEL_ATTN_BUCKET=192 KS_ATTN_ONE_CTA_KEYS=192
    AB_PROMPTS="64 200 512" ab bucket128 KS_MODEL_ATTN_BUCKET=128 KS_ATTN_ONE_CTA_KEYS=128
    AB_PROMPTS="64 200 512" ab default3  # the default beside them
    # the decode step's attention chain (2026-12-01): the q/k/v + RoPE kernel's early trigger, the
    # attention's older keys read before the wait (paged_attention_after_append) and clusters
    # launched without PDL, each turned off, and all three (old_chain: the rules before)
    AB_PROMPTS="64 200 512" ab no_prewait KS_MODEL_ATTN_PREWAIT=0
    AB_PROMPTS="64 200 512" ab no_early KS_QMM_ROPE_EARLY_TRIGGER=0
    AB_PROMPTS="64 200 512" ab cluster_pdl KS_ATTN_CLUSTER_PDL=1
    AB_PROMPTS="64 200 512" ab old_chain KS_MODEL_ATTN_PREWAIT=0 KS_QMM_ROPE_EARLY_TRIGGER=0 KS_ATTN_CLUSTER_PDL=1
    AB_BATCH="8 16 32" ab old_chain_batch KS_MODEL_ATTN_PREWAIT=0 KS_QMM_ROPE_EARLY_TRIGGER=0 KS_ATTN_CLUSTER_PDL=1
    AB_PROMPTS="64 200 512" ab prewait_steps1 KS_ATTN_PREWAIT_STEPS=1  # the first step's older keys alone before the wait
    # clusters with PDL only for grids above one CTA per SM (batch 8 after 512 lost 2.5-3.4% without)
    AB_BATCH="1 8 16 32" ab cluster_pdl_wide_batch KS_ATTN_CLUSTER_PDL=wide
    AB_PROMPTS="64 200 512" ab default5
    KS_MODEL_CONTEXT=400 AB_PROMPTS="64 240" ab old_rule_ctx400 KS_ATTN_ONE_CTA_KEYS=0 KS_MODEL_ATTN_HEADROOM=2
    AB_BATCH="8 16 32" ab one_cta512_batch KS_ATTN_ONE_CTA_KEYS=512
    KS_MODEL_CONTEXT=400 AB_PROMPTS="64 240" ab one_cta512_ctx400 KS_ATTN_ONE_CTA_KEYS=512  # a whole-cache table of 400 keys
    KS_MODEL_CONTEXT=400 AB_PROMPTS="64 240" ab ctx400  # ... and its default
    ab cap1024 KS_ATTN_CAPACITY_KEYS=1024
    ab attn_nopdl KS_PDL_OFF=paged_attention
    ab rope_apart_attn_nopdl KS_MODEL_FUSE_ROPE=0 KS_PDL_OFF=paged_attention
    ab rope_nopdl KS_MODEL_FUSE_ROPE=0 KS_PDL_OFF=rotary_embedding_kv_append
    ab one_table KS_MODEL_ATTN_BUCKET=0
    AB_BATCH="8 16 32" ab one_table_batch KS_MODEL_ATTN_BUCKET=0
    KS_MODEL_CONTEXT=2048 ab one_table_2048 KS_MODEL_ATTN_BUCKET=0
    KS_MODEL_CONTEXT=2048 ab buckets_2048 KS_MODEL_ATTN_BUCKET=256
    ab fuse_attn KS_MODEL_FUSE_ATTN=1
    AB_BATCH="8 16 32" ab fuse_attn_batch KS_MODEL_FUSE_ATTN=1
    ab split_head KS_MODEL_SPLIT_HEAD=1
    ab split_head_warp_groups KS_MODEL_SPLIT_HEAD=1 KS_QMM_BULK_THREAD_ROWS=0
    ab split_head_stream KS_MODEL_SPLIT_HEAD=1 \
      KS_ROUTING_TABLE=bench/routing_head_row_stream.json:src/registry/routing/sm_90.json:src/registry/routing/generic.json
  fi
  if [ "${KS_MODEL_CPU:-1}" = 1 ]; then  # KS_MODEL_CPU=0: skip the CPU path's benchmark
    $BUILD/ksctl bench-model --model $MODEL --device cpu --prompt-tokens 64 512 --decode-tokens 64 --repeats 3 \
      --csv "$OUT/model_cpu.csv" 2>&1 | tee -a "$LOG"
  fi
  # the PyTorch baselines on the same weights (CUDA-graph decode step, compiled and not; HF generate)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  [ "${KS_MODEL_PEERS:-1}" = 1 ] && PYTHONPATH=/tmp/site python3 bench/model_peers.py --model $MODEL --csv "$OUT/model_peers.csv" 2>&1 |
    grep -v -i -E "warn|it/s" | tee -a "$LOG" | tail -8
  python3 bench/model_report.py --ours "$OUT/model_cuda.csv" --peers "$OUT/model_peers.csv" --out "$OUT/model.md" &&
    cat "$OUT/model.md"
fi

if has profile; then
  # Where one decode step's time goes: Nsight Compute's duration of every kernel of a decode
  # step (kernels replayed one at a time: no overlap, no PDL; launch gaps not included).
  # KS_PROFILE_BATCH=N (> 1): the kernels of one N-sequence decode step of bench-model instead,
  # taken by the NVTX range each graph replay is (src/model/device.cpp).
  if [ "${KS_PROFILE_BATCH:-1}" -gt 1 ]; then
    ncu --nvtx --nvtx-include "ks_decode_step/" --metrics gpu__time_duration.sum --csv --print-units base \
      --launch-count ${KS_PROFILE_COUNT:-400} \
      $BUILD/ksctl bench-model --model $MODEL --device cuda --prompt-tokens 64 --decode-tokens 3 --repeats 1 \
      --batch ${KS_PROFILE_BATCH} > "$OUT/decode_profile.csv" 2>> "$LOG"
  else
  # The chat prompt (37 tokens) prefills in one unfused step: 1 + 30 x 12 + 2 = 363 launches (no
  # dense weight copies: KS_DENSE_WEIGHTS_MB=0, so loading launches nothing). Skip past it and
  # the first decode step (the graph's capture): 363 + 185. At eedbc6f the skip of 310 landed
  # in the prefill.
  KS_DENSE_WEIGHTS_MB=0 ncu --metrics gpu__time_duration.sum --csv --print-units base --launch-skip ${KS_PROFILE_SKIP:-548} \
    --launch-count ${KS_PROFILE_COUNT:-185} \
    $BUILD/ksctl generate --model $MODEL --chat --prompt "What is the capital of France?" --max-tokens 6 --device cuda \
    --context 2048 > "$OUT/decode_profile.csv" 2>> "$LOG"
  fi
  python3 - "$OUT/decode_profile.csv" <<'PY' | tee -a "$LOG"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; ki = head.index("Kernel Name"); vi = head.index("Metric Value")
tot = collections.Counter(); cnt = collections.Counter()
for r in rows[1:]:
    name = r[ki].split("(")[0].split("<")[0].replace("void ", "")
    tot[name] += float(r[vi].replace(",", "")) / 1000.0; cnt[name] += 1
print("decode profile: kernel, launches, total us, us per launch")
for n, t in tot.most_common():
    print(f"  {n:60s} {cnt[n]:5d} {t:9.1f} {t / cnt[n]:7.2f}")
print(f"  total {sum(tot.values()):.1f} us over {sum(cnt.values())} launches")
PY
fi

if has swap; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  CMAKE_ARGS="-DKS_DLPACK_INCLUDE_DIR=$PWD/.dlpack/usr/include -DCMAKE_CUDA_ARCHITECTURES=90a-real" \
    python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/kspy \
    -C build-dir="$PWD/build-python/model" . >> "$LOG" 2>&1 || echo "python package build failed (see model_logs.txt)"
  PYTHONPATH=/tmp/kspy:/tmp/site python3 examples/hf_swap.py --model $MODEL --device cuda --tokens 64 2>&1 |
    grep -v -i -E "warn|it/s" | tee -a "$LOG" | tail -6
fi
