#!/usr/bin/env bash
# Why decode attention at batch 32 streams K / V slower than torch SDPA (4.06 against 4.46 TB/s
# at 32/8 heads of 128, 8K keys): one GPU call that
#  - times the read patterns alone (bench/kv_read_probe.cu: the paged NHD rows against SDPA's
#    contiguous ones, per-warp 16-key tiles against CTA-wide 64-key tiles, K / V order, cp.async's
#    L2 prefetch size) at batch 32 with 8K and 32K keys -> $OUT/kv_read_T*.csv;
#  - counts, with Nsight Compute's raw metrics, the L2 sectors (hits, misses, the traffic between
#    the L2's two partitions) and DRAM bytes of cuda_mma_cluster, cuda_mma_tma, SDPA's kernel and
#    two probe patterns -> $OUT/ncu_kv_read.txt (a metric this ncu lacks is left out).
# Usage (device): KS_PREBUILT=1 KS_COMMIT=sha scripts/gpu_kv_read.sh   (carry build-prebuilt)
# KS_KV_READ_NCU=0: the probe's timings only; =probe: Nsight Compute of cuda_mma_tma and the probe's
# patterns only (not cuda_mma_cluster and SDPA again).
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # strict mode, $OUT (created), $BUILD and the helpers
ks_gpu_build_and_test 'CudaAttentionMma.TmaTilesGiveTheSameBits' '' || { echo "gpu_kv_read: no bench_ops"; exit 1; }
for T in 8192 32768; do
  $BUILD/kv_read_probe --batch 32 --keys $T --csv "$OUT/kv_read_T$T.csv" | tee -a "$OUT/kv_read.txt"
done
[ "${KS_KV_READ_NCU:-1}" != 0 ] || exit 0
want="dram__bytes_read dram__throughput gpu__time_duration lts__t_sectors_op_read lts__t_sectors_op_read_lookup_hit
lts__t_sectors_op_read_lookup_miss lts__t_sectors_srcunit_tex_op_read lts__t_sectors_srcunit_tex_op_read_lookup_hit
lts__t_sectors_srcunit_tex_op_read_lookup_miss lts__t_requests_srcunit_tex_op_read lts__t_sectors_srcunit_ltcfabric
lts__t_sectors_srcunit_ltcfabric_op_read lts__t_sectors_srcunit_ltcfabric_op_read_lookup_hit lts__t_sector_hit_rate
lts__t_sectors_srcnode_gpc_op_read lts__t_sectors_srcunit_tex_aperture_device_op_read_lookup_hit"
ncu --query-metrics > /tmp/ncu_metrics.txt 2>&1 || true
metrics=()
for m in $want; do
  if grep -qE "^$m( |$)" /tmp/ncu_metrics.txt; then
    case $m in
      dram__throughput|lts__t_sector_hit_rate) metrics+=("$m.avg.pct_of_peak_sustained_elapsed") ;;
      *) metrics+=("$m.sum") ;;
    esac
  else
    echo "(ncu lacks $m)" >> "$OUT/ncu_kv_read.txt"
  fi
done
# lts__t_sector_hit_rate is a ratio: .pct, not .avg.pct_of_peak
list=$(IFS=,; echo "${metrics[*]}" | sed 's/lts__t_sector_hit_rate.avg.pct_of_peak_sustained_elapsed/lts__t_sector_hit_rate.pct/')
shape="b32 h32/8 d128 T8192"
ncu_metrics() { ncu --clock-control none --launch-count 1 --metrics "$list" "$@" 2>&1 | grep -vE "^==PROF==|^ +-+|Metric Name"; }
{
  if [ "${KS_KV_READ_NCU:-1}" = 1 ]; then
    echo "== cuda_mma_cluster ($shape)"
    ncu_metrics --kernel-name regex:paged_attention_mma $BUILD/bench_ops --ops paged_attention --dtypes bf16 --shapes "$shape" --csv /tmp/ncu_b.csv
    echo "== torch SDPA ($shape)"
    ncu_metrics --kernel-name regex:sdpa python3 bench/sdpa_probe.py "$shape"
  fi
  echo "== cuda_mma_tma ($shape)"
  ncu_metrics --kernel-name-base demangled --kernel-name 'regex:mma_kernel<__nv_bfloat16, .int.128, .int.4, .bool.1, .bool.0, .bool.1>' \
    $BUILD/bench_ops --ops paged_attention --dtypes bf16 --shapes "$shape" --variants --csv /tmp/ncu_b.csv
  for pat in "nhd warp16 kv" "nhd warp16 kv L2::128B" "contig cta64 kfirst" "nhd warp16 cg swizzled" "nhd warp16 ca" \
             "nhd warp16 ldg 2 ahead" "nhd warp16 bulk rows" "flat"; do
    echo "== kv_read_probe (batch 32, 8K keys): $pat"
    ncu_metrics --kernel-name regex:'stream_kernel|method_kernel|flat_kernel' $BUILD/kv_read_probe --batch 32 --keys 8192 --only "$pat"
  done
} >> "$OUT/ncu_kv_read.txt" 2>&1
grep -E "^==|dram__throughput|gpu__time|lts__t_requests|lts__t_sectors_srcunit_tex_op_read.sum|tex_op_read_lookup_hit" "$OUT/ncu_kv_read.txt" | cut -c1-110 | head -120
