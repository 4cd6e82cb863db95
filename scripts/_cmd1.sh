cp .mdl/part_aa /tmp/ks_part_aa; export KS_COMMIT=$1
KS_CPU_SUITES=0 KS_CHECK_SWEEP=0 KS_GTEST_FILTER='*CudaAttention*:Cuda.Graph*' KS_STAGES=build,test scripts/gpu_check.sh 2>&1 | tail -4
build-gpu/tests/test_cuda_ops --gtest_filter='*ShortContexts*' 2>&1 | grep -E "OK|FAIL" 
build-gpu/bench_ops --ops paged_attention --csv $OUT/attn.csv > /tmp/a.txt 2>&1
export KS_BENCH_ATTN=model
KS_ATTN_LIVE_SPLIT=0 build-gpu/bench_ops --ops paged_attention --impl no_live_split --csv /tmp/n0.csv > /tmp/b.txt 2>&1
for n in 128 256 512; do KS_ATTN_MIN_KEYS=$n build-gpu/bench_ops --ops paged_attention --impl min_keys_$n --csv /tmp/n$n.csv > /tmp/b.txt 2>&1; done
{ cat /tmp/n0.csv; for n in 128 256 512; do tail -n +2 /tmp/n$n.csv; done; } > $OUT/attn_variants.csv
python3 -c "import csv,sys
for f in sys.argv[1:]:
  for r in csv.DictReader(open(f)): print(r['shape'], r['dtype'], r['impl'], r['us'], r['config'][:60])" $OUT/attn.csv $OUT/attn_variants.csv
