// The five core operators on CUDA: every hostile input from the CUDA issue,
// compared with the CPU reference (backend cpu on host copies) and with FP64.
// Outputs are poisoned (0xFF bytes: NaN in every dtype) before each launch.
// Skipped when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <limits>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "backends/cuda/launch_rules.hpp"
#include "gguf_blocks_fp64.hpp"
#include "rope_attention_case.hpp"
#include "test_util.hpp"

namespace {

using kstest::Buf;
using ks::DType;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

bool have_gpu() { return ks::backend_available(ks::Backend::Cuda); }
#define NEED_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

// A device allocation with `offset` bytes before the tensor data (offset views).
struct DBuf {
  DType dtype;
  std::vector<int64_t> shape;
  size_t offset = 0;
  char* base = nullptr;
  DBuf(DType dt, std::vector<int64_t> s, size_t off = 0) : dtype(dt), shape(std::move(s)), offset(off) {
    const size_t n = nbytes() + off + 64;
    if (cudaMalloc(&base, n) != cudaSuccess) base = nullptr;
  }
  ~DBuf() {
    if (base) cudaFree(base);
  }
  DBuf(const DBuf&) = delete;
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * ks::dtype_size(dtype); }
  void* data() const { return base + offset; }
  ks::TensorView view() const { return ks::TensorView(data(), dtype, shape, DLDevice{kDLCUDA, 0}); }
  void upload(const Buf& h) { ASSERT_EQ(cudaMemcpy(data(), h.data(), nbytes(), cudaMemcpyHostToDevice), cudaSuccess); }
  void download(Buf& h) const { ASSERT_EQ(cudaMemcpy(h.data(), data(), nbytes(), cudaMemcpyDeviceToHost), cudaSuccess); }
  void poison() { ASSERT_EQ(cudaMemset(data(), 0xFF, nbytes()), cudaSuccess); }
};

// Compares a GPU result with the CPU reference result: both are within the
// dtype tolerance of FP64, so they may differ by twice that.
::testing::AssertionResult close_to_cpu(const Buf& gpu, const Buf& cpu, double extra_atol = 0) {
  const double t = kstest::tol(gpu.dtype);
  return kstest::allclose(gpu.values(), cpu.values(), 2 * t, 2 * t + extra_atol);
}

const std::vector<int64_t> kHidden = {1, 3, 127, 3420, 3584, 4097, 16384, 65536, 262144};

struct Case {
  DType dt;
  size_t off;
};
std::vector<Case> cases() {
  std::vector<Case> v;
  for (DType d : kstest::float_dtypes())
    for (size_t off : {size_t(0), ks::dtype_size(d)}) v.push_back({d, off});  // aligned; one element off 16 B
  return v;
}

TEST(Cuda, RmsNormHiddenSizesOffsetsAgainstCpuAndFp64) {
  NEED_GPU();
  for (auto c : cases())
    for (int64_t H : kHidden)
      for (int64_t rows : {int64_t(1), int64_t(7)}) {
        SCOPED_TRACE(std::string(ks::dtype_name(c.dt)) + " H=" + std::to_string(H) + " rows=" + std::to_string(rows) +
                     " off=" + std::to_string(c.off));
        Buf x(c.dt, {rows, H}, c.off), w(c.dt, {H}, c.off), ref(c.dt, {rows, H}), got(c.dt, {rows, H});
        kstest::fill_normal(x);
        kstest::fill_normal(w);
        DBuf dx(c.dt, {rows, H}, c.off), dw(c.dt, {H}, c.off), dout(c.dt, {rows, H}, c.off);
        dx.upload(x);
        dw.upload(w);
        dout.poison();
        ks::rms_norm(dout.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::rms_norm(ref.view(), x.view(), w.view(), 1e-6, ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(got, ref));
        // FP64
        std::vector<double> f64(size_t(rows * H));
        for (int64_t r = 0; r < rows; ++r) {
          double ss = 0;
          for (int64_t i = 0; i < H; ++i) ss += x.get(r * H + i) * x.get(r * H + i);
          const double sc = 1 / std::sqrt(ss / H + double(1e-6f));
          for (int64_t i = 0; i < H; ++i) f64[size_t(r * H + i)] = x.get(r * H + i) * sc * w.get(i);
        }
        EXPECT_TRUE(kstest::allclose(got.values(), f64, kstest::tol(c.dt), kstest::tol(c.dt)));
      }
}

TEST(Cuda, FusedAddRmsNormAgainstCpu) {
  NEED_GPU();
  for (auto c : cases())
    for (int64_t H : {int64_t(1), int64_t(127), int64_t(3420), int64_t(4097), int64_t(8192), int64_t(65536), int64_t(262144)})
      for (int64_t rows : {int64_t(1), int64_t(5)}) {
        SCOPED_TRACE(std::string(ks::dtype_name(c.dt)) + " H=" + std::to_string(H) + " off=" + std::to_string(c.off));
        Buf x(c.dt, {rows, H}, c.off), r(c.dt, {rows, H}, c.off), w(c.dt, {H}, c.off);
        kstest::fill_normal(x);
        kstest::fill_normal(r);
        kstest::fill_normal(w);
        DBuf dx(c.dt, {rows, H}, c.off), dr(c.dt, {rows, H}, c.off), dw(c.dt, {H}, c.off);
        dx.upload(x);
        dr.upload(r);
        dw.upload(w);
        ks::fused_add_rms_norm(dx.view(), dr.view(), dw.view(), 1e-6, ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        Buf gx(c.dt, {rows, H}), gr(c.dt, {rows, H});
        dx.download(gx);
        dr.download(gr);
        ks::fused_add_rms_norm(x.view(), r.view(), w.view(), 1e-6, ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(gx, x));
        // residual = round(x + r) is exact in both: bitwise equal
        EXPECT_EQ(std::memcmp(gr.data(), r.data(), r.nbytes()), 0);
      }
}

TEST(Cuda, SiluAndMulAgainstCpu) {
  NEED_GPU();
  for (auto c : cases())
    for (int64_t D : {int64_t(1), int64_t(3), int64_t(127), int64_t(4097), int64_t(14336)})
      for (int64_t rows : {int64_t(1), int64_t(16), int64_t(3)}) {
        SCOPED_TRACE(std::string(ks::dtype_name(c.dt)) + " D=" + std::to_string(D) + " off=" + std::to_string(c.off));
        Buf x(c.dt, {rows, 2 * D}, c.off), ref(c.dt, {rows, D}), got(c.dt, {rows, D});
        kstest::fill_normal(x, 3.0);
        DBuf dx(c.dt, {rows, 2 * D}, c.off), dout(c.dt, {rows, D}, c.off);
        dx.upload(x);
        dout.poison();
        ks::silu_and_mul(dout.view(), dx.view(), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::silu_and_mul(ref.view(), x.view(), ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(got, ref));
      }
}

TEST(Cuda, GemvAgainstCpuAndReadOnlyAliasing) {
  NEED_GPU();
  for (auto c : cases())
    for (auto [N, H] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 3}, {33, 127}, {512, 1024}, {300, 4097}, {64, 14336}}) {
      SCOPED_TRACE(std::string(ks::dtype_name(c.dt)) + " N=" + std::to_string(N) + " H=" + std::to_string(H));
      Buf x(c.dt, {H}, c.off), w(c.dt, {N, H}, c.off), ref(c.dt, {N}), got(c.dt, {N});
      kstest::fill_normal(x);
      kstest::fill_normal(w);
      DBuf dx(c.dt, {H}, c.off), dw(c.dt, {N, H}, c.off), dout(c.dt, {N}, c.off);
      dx.upload(x);
      dw.upload(w);
      dout.poison();
      ks::gemv(dout.view(), dx.view(), dw.view(), ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      dout.download(got);
      ks::gemv(ref.view(), x.view(), w.view(), ks::Backend::Cpu);
      // dot products of H terms: allow the FP32 order bound on top (|x|,|w| ~ 1)
      EXPECT_TRUE(close_to_cpu(got, ref, 16 * std::sqrt(double(H)) * 6e-8 * double(H)));
      // x aliasing a row of weight (read-only): allowed
      ks::TensorView xrow(static_cast<char*>(dw.data()) + (N - 1) * H * ks::dtype_size(c.dt), c.dt, {H},
                          DLDevice{kDLCUDA, 0});
      dout.poison();
      ks::gemv(dout.view(), xrow, dw.view(), ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      Buf xr(c.dt, {H});
      std::memcpy(xr.data(), static_cast<const char*>(w.data()) + (N - 1) * H * ks::dtype_size(c.dt), xr.nbytes());
      dout.download(got);
      ks::gemv(ref.view(), xr.view(), w.view(), ks::Backend::Cpu);
      EXPECT_TRUE(close_to_cpu(got, ref, 16 * std::sqrt(double(H)) * 6e-8 * double(H)));
    }
}

TEST(Cuda, SoftmaxHiddenSizesAndClusterPath) {
  NEED_GPU();
  for (auto c : cases())
    for (int64_t H : kHidden)
      for (int64_t rows : {int64_t(1), int64_t(7), int64_t(64)}) {
        if (rows == 64 && H < 65536) continue;
        SCOPED_TRACE(std::string(ks::dtype_name(c.dt)) + " H=" + std::to_string(H) + " rows=" + std::to_string(rows) +
                     " off=" + std::to_string(c.off));
        Buf x(c.dt, {rows, H}, c.off), ref(c.dt, {rows, H}), got(c.dt, {rows, H});
        kstest::fill_normal(x, 3.0);
        DBuf dx(c.dt, {rows, H}, c.off), dout(c.dt, {rows, H}, c.off);
        dx.upload(x);
        dout.poison();
        ks::softmax(dout.view(), dx.view(), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::softmax(ref.view(), x.view(), ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(got, ref)) << ks_last_launch_config("softmax");
      }
  // the anchor shapes that take the cluster path
  for (auto [rows, H] : std::vector<std::pair<int64_t, int64_t>>{{64, 128256}, {256, 151936}}) {
    Buf x(DType::BF16, {rows, H}), ref(DType::BF16, {rows, H}), got(DType::BF16, {rows, H});
    kstest::fill_normal(x, 3.0);
    DBuf dx(DType::BF16, {rows, H}), dout(DType::BF16, {rows, H});
    dx.upload(x);
    dout.poison();
    ks::softmax(dout.view(), dx.view(), ks::Backend::Cuda);
    CK(cudaDeviceSynchronize());
    const std::string cfg = ks_last_launch_config("softmax");
    std::printf("softmax %lldx%lld config: %s\n", (long long)rows, (long long)H, cfg.c_str());
    EXPECT_EQ(cfg.rfind("cluster=", 0), 0u) << "the wide-row anchor shapes take the cluster path on sm_90";
    dout.download(got);
    ks::softmax(ref.view(), x.view(), ks::Backend::Cpu);
    EXPECT_TRUE(close_to_cpu(got, ref));
  }
}

// The shared-memory staging variant of the cluster path (KS_SOFTMAX_SMEM=1, an
// experiment until measured faster) against the CPU reference, including rows whose
// slices are all -inf, NaN and +inf.
TEST(Cuda, SoftmaxSharedMemoryStagingVariant) {
  NEED_GPU();
  kstest::ScopedEnv staging("KS_SOFTMAX_SMEM", "1");
  const float inf = INFINITY;
  for (DType dt : kstest::float_dtypes())
    for (auto [rows, H] : std::vector<std::pair<int64_t, int64_t>>{{5, 16384}, {64, 32000}, {64, 128256}, {7, 262144}}) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(H));
      Buf x(dt, {rows, H}), ref(dt, {rows, H}), got(dt, {rows, H});
      kstest::fill_normal(x, 3.0);
      for (int64_t i = 0; i < H - H / 8; ++i) x.set(0 * H + i, -inf);  // whole slices -inf
      x.set(1 * H + 5, NAN);
      x.set(2 * H + H - 1, inf);
      DBuf dx(dt, {rows, H}), dout(dt, {rows, H});
      dx.upload(x);
      dout.poison();
      ks::softmax(dout.view(), dx.view(), ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      const std::string cfg = ks_last_launch_config("softmax");
      dout.download(got);
      ks::softmax(ref.view(), x.view(), ks::Backend::Cpu);
      EXPECT_TRUE(close_to_cpu(got, ref)) << cfg;
      std::printf("smem staging %s %lldx%lld: %s\n", ks::dtype_name(dt), (long long)rows, (long long)H, cfg.c_str());
    }
}

TEST(Cuda, SoftmaxNonFiniteRows) {
  NEED_GPU();
  const float inf = INFINITY, nan = NAN;
  for (DType dt : kstest::float_dtypes())
    for (int64_t H : {int64_t(5), int64_t(4096), int64_t(131072)}) {
      Buf x(dt, {5, H}), ref(dt, {5, H}), got(dt, {5, H});
      kstest::fill_normal(x);
      for (int64_t i = 0; i < H; ++i) x.set(0 * H + i, -inf);            // all -inf
      x.set(1 * H + H / 2, nan);                                           // NaN
      x.set(2 * H + H - 1, inf);                                           // +inf
      for (int64_t i = 0; i < H; i += 2) x.set(3 * H + i, -inf);          // -inf mask mixed with finite
      const int64_t head = H - std::max<int64_t>(1, H / 8);
      for (int64_t i = 0; i < head; ++i) x.set(4 * H + i, -inf);          // whole CTA slices -inf, the tail finite
      DBuf dx(dt, {5, H}), dout(dt, {5, H});
      dx.upload(x);
      dout.poison();
      ks::softmax(dout.view(), dx.view(), ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      dout.download(got);
      ks::softmax(ref.view(), x.view(), ks::Backend::Cpu);
      for (int64_t i = 0; i < H; ++i) {
        ASSERT_TRUE(std::isnan(got.get(0 * H + i)));
        ASSERT_TRUE(std::isnan(got.get(1 * H + i)));
        ASSERT_TRUE(std::isnan(got.get(2 * H + i)));
        if (i % 2 == 0) ASSERT_EQ(got.get(3 * H + i), 0.0);
        if (i < head) ASSERT_EQ(got.get(4 * H + i), 0.0);
        else ASSERT_TRUE(std::isfinite(got.get(4 * H + i)));
      }
      EXPECT_TRUE(close_to_cpu(got, ref));
    }
}

TEST(Cuda, RmsNormFp16NearMaxDoesNotOverflow) {
  NEED_GPU();
  const int64_t H = 4096;
  Buf x(DType::F16, {2, H}), w(DType::F16, {H}), got(DType::F16, {2, H}), ref(DType::F16, {2, H});
  kstest::fill_uniform(x, 60000, 65504);
  kstest::fill_uniform(w, 0.5, 1.5);
  DBuf dx(DType::F16, {2, H}), dw(DType::F16, {H}), dout(DType::F16, {2, H});
  dx.upload(x);
  dw.upload(w);
  dout.poison();
  ks::rms_norm(dout.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  dout.download(got);
  ks::rms_norm(ref.view(), x.view(), w.view(), 1e-6, ks::Backend::Cpu);
  for (int64_t i = 0; i < got.numel(); ++i) ASSERT_TRUE(std::isfinite(got.get(i)));
  EXPECT_TRUE(close_to_cpu(got, ref));
}

TEST(Cuda, ZeroRowsLaunchNothingAndWriteNothing) {
  NEED_GPU();
  DBuf dx(DType::BF16, {0, 4096}), dw(DType::BF16, {4096}), dout(DType::BF16, {0, 4096});
  EXPECT_NO_THROW(ks::rms_norm(dout.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cuda));
  EXPECT_NO_THROW(ks::softmax(dout.view(), dx.view(), ks::Backend::Cuda));
  DBuf dx2(DType::BF16, {0, 8}), do2(DType::BF16, {0, 4});
  EXPECT_NO_THROW(ks::silu_and_mul(do2.view(), dx2.view(), ks::Backend::Cuda));
  CK(cudaDeviceSynchronize());
}

TEST(Cuda, ValidationOnDeviceTensorsWritesNothing) {
  NEED_GPU();
  const int64_t H = 256;
  Buf x(DType::BF16, {4, H}), w(DType::BF16, {H});
  kstest::fill_normal(x);
  kstest::fill_normal(w);
  DBuf dx(DType::BF16, {4, H}), dr(DType::BF16, {4, H}), dw(DType::BF16, {H});
  dx.upload(x);
  dr.upload(x);
  dw.upload(w);
  // overlap: residual == x
  EXPECT_THROW(ks::fused_add_rms_norm(dx.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cuda), ks::InvalidArgument);
  Buf back(DType::BF16, {4, H});
  dx.download(back);
  EXPECT_EQ(std::memcmp(back.data(), x.data(), x.nbytes()), 0);
  // host weight with device x: device mismatch
  EXPECT_THROW(ks::rms_norm(dr.view(), dx.view(), w.view(), 1e-6, ks::Backend::Cuda), ks::UnsupportedDevice);
  // device tensors on the CPU backend
  EXPECT_THROW(ks::rms_norm(dr.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cpu), ks::UnsupportedDevice);
}

TEST(Cuda, BatchInvariantRows) {
  NEED_GPU();
  for (DType dt : kstest::float_dtypes())
    for (int64_t H : {int64_t(576), int64_t(4096), int64_t(4097)}) {
      const int64_t R = 1024;
      Buf x(dt, {R, H}), w(dt, {H});
      kstest::fill_normal(x);
      kstest::fill_normal(w);
      DBuf dx(dt, {R, H}), dw(dt, {H}), dall(dt, {R, H}), done(dt, {1, H});
      dx.upload(x);
      dw.upload(w);
      ks::rms_norm(dall.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cuda);
      ks::TensorView row(static_cast<char*>(dx.data()) + 777 * H * ks::dtype_size(dt), dt, {1, H}, DLDevice{kDLCUDA, 0});
      ks::rms_norm(done.view(), row, dw.view(), 1e-6, ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      Buf all(dt, {R, H}), one(dt, {1, H});
      dall.download(all);
      done.download(one);
      EXPECT_EQ(std::memcmp(static_cast<char*>(all.data()) + 777 * H * ks::dtype_size(dt), one.data(), one.nbytes()), 0);
    }
}

// More than 2^31 elements: int64 indexing end to end. Checked at rows around the
// 2^31-element boundary and the last row.
TEST(Cuda, MoreThan2Pow31Elements) {
  NEED_GPU();
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  const int64_t H = 16384, R = (int64_t(1) << 31) / H + 3;  // 2^31 + 3H elements
  if (free_b < size_t(3) * R * H * 2 + (size_t(1) << 30)) GTEST_SKIP() << "needs ~13 GB of device memory";
  DBuf dx(DType::BF16, {R, H}), dout(DType::BF16, {R, H}), dw(DType::BF16, {H});
  ASSERT_NE(dx.base, nullptr);
  ASSERT_NE(dout.base, nullptr);
  // fill with a repeated random 1 MiB pattern (rows differ: 1 MiB is not a multiple of a row... it is: use an odd chunk)
  const int64_t chunk = H * 63 + 5;  // elements; not a multiple of H, so rows differ
  Buf pat(DType::BF16, {chunk}), w(DType::BF16, {H});
  kstest::fill_normal(pat);
  kstest::fill_normal(w);
  dw.upload(w);
  for (int64_t e = 0; e < R * H; e += chunk) {
    const int64_t n = std::min(chunk, R * H - e);
    CK(cudaMemcpy(static_cast<char*>(dx.data()) + e * 2, pat.data(), size_t(n) * 2, cudaMemcpyHostToDevice));
  }
  dout.poison();
  ks::rms_norm(dout.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  for (int64_t r : {int64_t(0), (int64_t(1) << 31) / H - 1, (int64_t(1) << 31) / H, (int64_t(1) << 31) / H + 1, R - 1}) {
    Buf xr(DType::BF16, {1, H}), got(DType::BF16, {1, H}), ref(DType::BF16, {1, H});
    CK(cudaMemcpy(xr.data(), static_cast<char*>(dx.data()) + r * H * 2, H * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(got.data(), static_cast<char*>(dout.data()) + r * H * 2, H * 2, cudaMemcpyDeviceToHost));
    ks::rms_norm(ref.view(), xr.view(), w.view(), 1e-6, ks::Backend::Cpu);
    EXPECT_TRUE(close_to_cpu(got, ref)) << "row " << r;
  }
  // silu_and_mul over the same bytes viewed as [R, H] -> [R, H/2]
  DBuf dsm(DType::BF16, {R, H / 2});
  dsm.poison();
  ks::silu_and_mul(dsm.view(), dx.view(), ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  for (int64_t r : {(int64_t(1) << 31) / H, R - 1}) {
    Buf xr(DType::BF16, {1, H}), got(DType::BF16, {1, H / 2}), ref(DType::BF16, {1, H / 2});
    CK(cudaMemcpy(xr.data(), static_cast<char*>(dx.data()) + r * H * 2, H * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(got.data(), static_cast<char*>(dsm.data()) + r * (H / 2) * 2, H, cudaMemcpyDeviceToHost));
    ks::silu_and_mul(ref.view(), xr.view(), ks::Backend::Cpu);
    EXPECT_TRUE(close_to_cpu(got, ref)) << "row " << r;
  }
  // softmax in place over > 2^31 elements
  ks::softmax(dx.view(), dx.view(), ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  {
    const int64_t r = R - 1;
    Buf got(DType::BF16, {1, H});
    CK(cudaMemcpy(got.data(), static_cast<char*>(dx.data()) + r * H * 2, H * 2, cudaMemcpyDeviceToHost));
    double s = 0;
    for (int64_t i = 0; i < H; ++i) s += got.get(i);
    EXPECT_NEAR(s, 1.0, 0.02);
  }
}

// Programmatic dependent launch keeps stream order: a chain of ops where each
// consumes the previous output, with a copy engine transfer and a memset (not
// kernscope's) in between, eager and captured in a graph, equals the same chain
// step by step with a host sync after every op.
TEST(Cuda, DependentChainKeepsStreamOrder) {
  NEED_GPU();
  const DType dt = DType::BF16;
  for (auto [R, H] : std::vector<std::pair<int64_t, int64_t>>{{1, 4096}, {64, 32000}, {4096, 1024}}) {
    SCOPED_TRACE("R=" + std::to_string(R) + " H=" + std::to_string(H));
    Buf x(dt, {R, H}), w(dt, {H});
    kstest::fill_normal(x, 2.0);
    kstest::fill_normal(w);
    DBuf dx(dt, {R, H}), dw(dt, {H}), a(dt, {R, H}), b(dt, {R, H}), res(dt, {R, H}), half(dt, {R, H / 2});
    dx.upload(x);
    dw.upload(w);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto chain = [&](bool sync_each) {
      auto step = [&] {
        if (sync_each) CK(cudaStreamSynchronize(s));
      };
      CK(cudaMemcpyAsync(a.data(), dx.data(), dx.nbytes(), cudaMemcpyDeviceToDevice, s));
      step();
      CK(cudaMemsetAsync(res.data(), 0, res.nbytes(), s));
      step();
      for (int k = 0; k < 6; ++k) {
        ks::rms_norm(b.view(), a.view(), dw.view(), 1e-6, ks::Backend::Cuda, s);
        step();
        ks::fused_add_rms_norm(b.view(), res.view(), dw.view(), 1e-6, ks::Backend::Cuda, s);
        step();
        ks::softmax(a.view(), b.view(), ks::Backend::Cuda, s);
        step();
        ks::silu_and_mul(half.view(), a.view(), ks::Backend::Cuda, s);
        step();
        CK(cudaMemcpy2DAsync(a.data(), H * 2, half.data(), H, H, R, cudaMemcpyDeviceToDevice, s));  // a[:, :H/2] = half
        step();
      }
    };
    chain(true);
    CK(cudaStreamSynchronize(s));
    Buf want(dt, {R, H}), got(dt, {R, H});
    a.download(want);
    a.poison();
    CK(cudaDeviceSynchronize());  // poison runs on the legacy stream; s does not wait for it
    chain(false);
    CK(cudaStreamSynchronize(s));
    a.download(got);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.nbytes()), 0) << "eager chain differs from the synced one";
    a.poison();
    CK(cudaDeviceSynchronize());  // poison runs on the legacy stream; s does not wait for it
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    chain(false);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      a.poison();
      CK(cudaDeviceSynchronize());
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      a.download(got);
      EXPECT_EQ(std::memcmp(want.data(), got.data(), want.nbytes()), 0) << "graph replay " << rep;
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(s));
  }
}

// All five ops captured in one CUDA graph on a non-default stream, replayed
// twice; the replay results equal eager results bitwise (no host sync, no
// allocation inside the ops, the caller's stream is used).
// rotary_embedding on CUDA against the CPU reference: NeoX and interleaved, int32 and
// int64 positions (incl. 2^31 + 5 and values past fp32's integers), partial rotary_dim
// (the tail must stay bit-identical), GQA head counts, q only, and q / k as strided
// views of one fused qkv buffer (v and the padding between heads untouched).
TEST(Cuda, RotaryAgainstCpuIncludingStridedQkv) {
  NEED_GPU();
  struct G {
    int64_t T, H, KVH, D, rd, pad;
  };
  const std::vector<G> geoms = {{1, 9, 3, 64, 64, 0}, {7, 4, 2, 16, 16, 8}, {33, 8, 8, 128, 64, 0},
                                {5, 2, 1, 10, 6, 2},  {300, 32, 8, 128, 128, 0}};
  for (DType dt : kstest::float_dtypes())
    for (DType pdt : {DType::I32, DType::I64})
      for (int neox : {1, 0})
        for (const G& g : geoms)
          for (bool with_k : {true, false})
          for (const char* variant : {"cuda_vec16", "cuda_token_cta"}) {
            SCOPED_TRACE(std::string(variant) + " " + ks::dtype_name(dt) + (neox ? " neox" : " interleaved") + " T=" +
                         std::to_string(g.T) + " H=" + std::to_string(g.H) + " KVH=" + std::to_string(g.KVH) +
                         " D=" + std::to_string(g.D) + " rd=" + std::to_string(g.rd) + " pad=" +
                         std::to_string(g.pad) + (with_k ? "" : " q only"));
            const int64_t HS = g.D + g.pad, W = (g.H + 2 * g.KVH) * HS;
            Buf qkv(dt, {g.T, W}), pos(pdt, {g.T});
            kstest::fill_normal(qkv, 2.0);
            std::mt19937_64 r(g.T * 131 + g.D);
            for (int64_t t = 0; t < g.T; ++t) {
              int64_t v = int64_t(r() % 100000);
              if (t == 1) v = 16777217;  // not an fp32 integer
              if (t == 2 && pdt == DType::I64) v = (int64_t(1) << 31) + 5;
              pos.set(t, double(v));
            }
            Buf cpu = qkv;
            DBuf dqkv(dt, {g.T, W}), dpos(pdt, {g.T});
            dqkv.upload(qkv);
            dpos.upload(pos);
            const size_t es = ks::dtype_size(dt);
            auto strided = [&](void* base, int64_t heads, size_t col, DLDevice dev) {
              DLTensor t{};
              t.data = static_cast<char*>(base) + col * es;
              t.device = dev;
              t.ndim = 3;
              t.dtype = ks::TensorView(nullptr, dt, {1}).dl().dtype;
              static thread_local int64_t shp[2][3], str[2][3];
              static thread_local int slot = 0;
              slot ^= 1;
              shp[slot][0] = g.T, shp[slot][1] = heads, shp[slot][2] = g.D;
              str[slot][0] = W, str[slot][1] = HS, str[slot][2] = 1;
              t.shape = shp[slot];
              t.strides = str[slot];
              return t;
            };
            const DLDevice cuda{kDLCUDA, 0}, host{kDLCPU, 0};
            DLTensor dq = strided(dqkv.data(), g.H, 0, cuda), dk = strided(dqkv.data(), g.KVH, size_t(g.H * HS), cuda);
            const ks::TensorView dpos_v = dpos.view(), pos_v = pos.view();  // dl() points into the view
            DLTensor dp = dpos_v.dl();
            // the vector variant takes the call iff every pointer and stride is a multiple of 16 bytes
            // and rotary_dim / 2 a multiple of the pairs 16 bytes hold (computed here independently)
            const int64_t vec = 16 / int64_t(es), pairs = neox ? vec : vec / 2;
            const bool vec_ok = (g.rd / 2) % pairs == 0 && HS % vec == 0 && W % vec == 0;
            ASSERT_EQ(ks_force_variant("rotary_embedding", variant), KS_SUCCESS) << ks_last_error();
            const ks_status_t st =
                ks_rotary_embedding(&dq, with_k ? &dk : nullptr, &dp, g.rd, 10000.0, neox, KS_BACKEND_CUDA, nullptr);
            ks_force_variant("rotary_embedding", nullptr);
            if (std::string(variant) == "cuda_vec16" && !vec_ok) {
              ASSERT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << "the vector variant took an unaligned call";
              continue;
            }
            ASSERT_EQ(st, KS_SUCCESS) << ks_last_error();
            CK(cudaDeviceSynchronize());
            DLTensor cq = strided(cpu.data(), g.H, 0, host), ck = strided(cpu.data(), g.KVH, size_t(g.H * HS), host);
            DLTensor cp = pos_v.dl();
            ASSERT_EQ(ks_rotary_embedding(&cq, with_k ? &ck : nullptr, &cp, g.rd, 10000.0, neox, KS_BACKEND_CPU, nullptr),
                      KS_SUCCESS)
                << ks_last_error();
            Buf got(dt, {g.T, W});
            dqkv.download(got);
            // rotated features: within twice the dtype tolerance (both within it of FP64, cos/sin
            // differ by an ulp or two); everything else bit-identical to the input
            for (int64_t t = 0; t < g.T; ++t)
              for (int64_t j = 0; j < W; ++j) {
                const int64_t h = j / HS, f = j % HS, i = t * W + j;
                const bool rotated = f < g.rd && (h < g.H || (with_k && h < g.H + g.KVH));
                if (rotated) {
                  const double a = got.get(i), b = cpu.get(i), tl = 2 * kstest::tol(dt) + 1e-5;
                  ASSERT_LE(std::fabs(a - b), tl + tl * std::fabs(b)) << "token " << t << " column " << j;
                } else {
                  ASSERT_EQ(0, std::memcmp(static_cast<const char*>(got.data()) + size_t(i) * es,
                                           static_cast<const char*>(qkv.data()) + size_t(i) * es, es))
                      << "untouched element changed: token " << t << " column " << j;
                }
              }
          }
}

// kv_cache_append on CUDA: bit-exact copies to the slots, -1 skipped, and device slots
// out of range skipped as well (no host check is possible without a sync): nothing
// outside the listed slots changes. k/v carry padding tokens past slot_mapping's length.
TEST(Cuda, KvCacheAppendSlotsAndSkips) {
  NEED_GPU();
  for (DType dt : kstest::float_dtypes())
    for (DType sdt : {DType::I32, DType::I64})
      for (auto [KVH, D] : std::vector<std::pair<int64_t, int64_t>>{{3, 64}, {8, 128}, {1, 3}}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " KVH=" + std::to_string(KVH) + " D=" + std::to_string(D));
        const int64_t blocks = 6, bs = 16, T = 9, padded = 12;
        Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D}), k(dt, {padded, KVH, D}), v(dt, {padded, KVH, D});
        kstest::fill_normal(kc);
        kstest::fill_normal(vc);
        kstest::fill_normal(k);
        kstest::fill_normal(v);
        Buf slots(sdt, {T});
        const int64_t sv[T] = {0, 17, -1, 95, 40, -1, 3, 64, 5};
        for (int64_t t = 0; t < T; ++t) slots.set(t, double(sv[t]));
        DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dk(dt, k.shape), dv(dt, v.shape), ds(sdt, {T});
        dkc.upload(kc);
        dvc.upload(vc);
        dk.upload(k);
        dv.upload(v);
        ds.upload(slots);
        ks::kv_cache_append(dkc.view(), dvc.view(), dk.view(), dv.view(), ds.view(), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        Buf kref = kc, vref = vc;
        ks::kv_cache_append(kref.view(), vref.view(), k.view(), v.view(), slots.view(), ks::Backend::Cpu);
        Buf kg(dt, kc.shape), vg(dt, vc.shape);
        dkc.download(kg);
        dvc.download(vg);
        EXPECT_EQ(0, std::memcmp(kg.data(), kref.data(), kg.nbytes())) << "k_cache";
        EXPECT_EQ(0, std::memcmp(vg.data(), vref.data(), vg.nbytes())) << "v_cache";
        // device slots out of range: skipped, nothing written anywhere
        const int64_t bad[3] = {blocks * bs, -7, 2};
        Buf bslots(sdt, {3});
        for (int i = 0; i < 3; ++i) bslots.set(i, double(bad[i]));
        DBuf dbs(sdt, {3});
        dbs.upload(bslots);
        ks::kv_cache_append(dkc.view(), dvc.view(), dk.view(), dv.view(), dbs.view(), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dkc.download(kg);
        const size_t row = size_t(KVH * D) * ks::dtype_size(dt);
        std::memcpy(static_cast<char*>(kref.data()) + 2 * row, static_cast<const char*>(k.data()) + 2 * row, row);
        EXPECT_EQ(0, std::memcmp(kg.data(), kref.data(), kg.nbytes())) << "only slot 2 (token 2) may change";
      }
}

namespace {
// argmax of x ([R, V] on the host) on CUDA (poisoned output) into got and on the CPU into ref; every
// row's two ids are compared (the first 5 mismatches reported).
void argmax_cuda_and_cpu(Buf& x, Buf& got, Buf& ref) {
  const int64_t R = x.shape[0];
  DBuf dx(x.dtype, x.shape), dout(DType::I64, {R});
  dx.upload(x);
  dout.poison();
  ks::argmax(dout.view(), dx.view(), ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  dout.download(got);
  ks::argmax(ref.view(), x.view(), ks::Backend::Cpu);
  int bad = 0;
  for (int64_t r = 0; r < R; ++r)
    if (got.get(r) != ref.get(r) && bad++ < 5) ADD_FAILURE() << "row " << r << ": " << got.get(r) << " vs " << ref.get(r);
  EXPECT_EQ(bad, 0);
}
}  // namespace

// argmax on CUDA: equal to the CPU reference (first maximum, first NaN, all -inf -> 0),
// with ties placed on purpose, over widths up to the vocabulary size: -0 ties +0; rows of
// 1001 values start off a 16-byte boundary, so row 5's first value (read among the row's
// unaligned head) ties a later one that a vector load reads.
TEST(Cuda, ArgmaxTiesNanAndWideRows) {
  NEED_GPU();
  for (DType dt : kstest::float_dtypes())
    for (int64_t V : {int64_t(1), int64_t(7), int64_t(1000), int64_t(1001), int64_t(32000), int64_t(128256)}) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " V=" + std::to_string(V));
      const int64_t R = 6;
      Buf x(dt, {R, V}), ref(DType::I64, {R}), got(DType::I64, {R});
      kstest::fill_normal(x);
      if (V > 3) {
        x.set(0 * V + V / 2, 50.0), x.set(0 * V + V - 1, 50.0);           // tie: the first wins
        x.set(1 * V + V / 3, std::nan("")), x.set(1 * V + V - 2, std::nan(""));  // first NaN wins
        for (int64_t i = 0; i < V; ++i) x.set(4 * V + i, -1.0 - double(i % 7));
        x.set(4 * V + V / 4, -0.0), x.set(4 * V + V / 2, 0.0);            // -0 ties +0: the first wins
        x.set(5 * V + 0, 60.0), x.set(5 * V + V - 3, 60.0);               // head element ties a later one
      }
      for (int64_t i = 0; i < V; ++i) x.set(2 * V + i, -INFINITY);        // all -inf: 0
      x.set(3 * V + V - 1, INFINITY);                                      // +inf at the end
      argmax_cuda_and_cpu(x, got, ref);
      if (V > 3) {
        EXPECT_EQ(ref.get(4), double(V / 4));  // (the reference agrees with the contract)
        EXPECT_EQ(ref.get(5), 0.0);
      }
    }
}

// argmax on CUDA, more hostile rows (equal to the CPU reference, and to the contract where stated):
// more rows than the grid has CTAs (each CTA loops over rows), NaN at index 0 and in a row's
// unaligned head, negative NaN with a payload, an all-NaN row, +0 before -0, a subnormal against
// 0 and against another subnormal (an ftz build would tie them), two maxima in one vector,
// a tie across threads (vector 1 and vector 512), an all-equal row, -FLT_MAX among -inf, and
// widths at the cluster thresholds (16384, 32768, 65536).
TEST(Cuda, ArgmaxHostileRows) {
  NEED_GPU();
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double sub = std::ldexp(1.0, -130);  // fp32 subnormal (bf16 keeps it; fp16 flushes it to 0 on store)
  for (DType dt : kstest::float_dtypes())
    for (int64_t V : {int64_t(3), int64_t(9), int64_t(4105), int64_t(16384), int64_t(32768), int64_t(65536)}) {
      const int64_t R = V < 100 ? int64_t(8) * sms + 37 : 12;  // small rows: more rows than CTAs
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " V=" + std::to_string(V) + " R=" + std::to_string(R));
      Buf x(dt, {R, V}), ref(DType::I64, {R}), got(DType::I64, {R});
      kstest::fill_normal(x);
      auto row = [&](int64_t r, int64_t i, double v) { x.set((r % R) * V + (i % V), v); };
      row(0, 0, std::nan(""));                                     // NaN at index 0
      row(1, 1, std::nan("")), row(1, V - 1, INFINITY);            // NaN (in the head of a misaligned row) before +inf
      {  // a negative NaN with a payload, after a positive one
        const int64_t r = 2;
        if (dt == DType::F32) {
          const uint32_t bits = 0xFFC00123u;
          float f;
          std::memcpy(&f, &bits, 4);
          row(r, V / 2, f);
        } else {
          row(r, V / 2, -std::nan(""));
        }
        row(r, V - 1, std::nan(""));
      }
      for (int64_t i = 0; i < V; ++i) row(3, i, std::nan(""));     // all NaN: 0
      for (int64_t i = 0; i < V; ++i) row(4, i, -1.0);
      row(4, V / 3, 0.0), row(4, V - 1, -0.0);                     // +0 before -0: the first
      for (int64_t i = 0; i < V; ++i) row(5, i, -1.0);
      if (dt != DType::F16) row(5, V / 2, sub), row(5, V / 3, 0.0), row(5, V - 2, sub / 2);  // a subnormal beats 0
      for (int64_t i = 0; i < V; ++i) row(6, i, 0.25);             // all equal: 0
      for (int64_t i = 0; i < V; ++i) row(7, i, -INFINITY);
      row(7, V - 1, dt == DType::F16 ? -65504.0 : -3.0e38);        // the most negative finite-ish value among -inf
      row(8, 2, 70.0), row(8, 5, 70.0);                            // two maxima in the first vector
      if (V > 8 * 513) row(9, 8 * 512 + 1, 80.0), row(9, 8 + 1, 80.0);  // vector 512 and vector 1
      argmax_cuda_and_cpu(x, got, ref);
      EXPECT_EQ(ref.get(0), 0.0);
      EXPECT_EQ(ref.get(3), 0.0);
      EXPECT_EQ(ref.get(4), double(V / 3));
      if (dt != DType::F16 && V > 3) EXPECT_EQ(ref.get(5), double(V / 2));
      EXPECT_EQ(ref.get(6), 0.0);
      EXPECT_EQ(ref.get(7), double(V - 1));
      if (V > 5) EXPECT_EQ(ref.get(8), 2.0);
    }
}

// embedding on CUDA: dense rows bit-exact; packed rows (Q4_0, Q4_1, Q8_0, F16, BF16, F32)
// decoded as the CPU does; a device id out of range gives a NaN row (no host check).
TEST(Cuda, EmbeddingDenseAndPackedRows) {
  NEED_GPU();
  using namespace kstest::gguf;
  const int64_t vocab = 50, H = 96;
  for (DType dt : kstest::float_dtypes())
    for (DType idt : {DType::I32, DType::I64}) {
      Buf ids(idt, {2, 3});
      const int64_t iv[6] = {0, 49, 7, 7, 13, 2};
      for (int i = 0; i < 6; ++i) ids.set(i, double(iv[i]));
      DBuf dids(idt, {2, 3});
      dids.upload(ids);
      // dense
      Buf table(dt, {vocab, H}), ref(dt, {2, 3, H}), got(dt, {2, 3, H});
      kstest::fill_normal(table);
      DBuf dtable(dt, {vocab, H}), dout(dt, {2, 3, H});
      dtable.upload(table);
      dout.poison();
      ks::embedding(dout.view(), dids.view(), dtable.view(), ks::QType::None, ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      dout.download(got);
      ks::embedding(ref.view(), ids.view(), table.view(), ks::QType::None, ks::Backend::Cpu);
      EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), got.nbytes())) << ks::dtype_name(dt) << " dense";
      for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0, KS_QTYPE_F16, KS_QTYPE_BF16, KS_QTYPE_F32}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)));
        Buf packed = make_packed(q, vocab, H);
        DBuf dp(DType::U8, packed.shape);
        dp.upload(packed);
        dout.poison();
        ks::embedding(dout.view(), dids.view(), dp.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::embedding(ref.view(), ids.view(), packed.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
        // d * q + m may be fused on one side and not the other: one FP32 ulp, then one rounding
        EXPECT_TRUE(kstest::allclose(got.values(), ref.values(), 1e-6 + kstest::tol(dt), 1e-6 + kstest::tol(dt)));
      }
      // out-of-range device ids: NaN rows, the others still right
      Buf bad(idt, {2});
      bad.set(0, double(vocab)), bad.set(1, 3.0);
      DBuf dbad(idt, {2});
      dbad.upload(bad);
      DBuf dout2(dt, {2, H});
      dout2.poison();
      ks::embedding(dout2.view(), dbad.view(), dtable.view(), ks::QType::None, ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      Buf got2(dt, {2, H});
      dout2.download(got2);
      for (int64_t j = 0; j < H; ++j) {
        EXPECT_TRUE(std::isnan(got2.get(j))) << "id out of range must give NaN";
        EXPECT_EQ(got2.get(H + j), table.get(3 * H + j));
      }
    }
}

// dequantize on CUDA: every GGUF block format, odd row counts, against the CPU reference
// (d * q + m may be fused on one side: one FP32 ulp before the rounding to the output).
TEST(Cuda, DequantizeEveryFormat) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0, KS_QTYPE_F16, KS_QTYPE_BF16, KS_QTYPE_F32})
      for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 32}, {7, 96}, {300, 4096}}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " " + std::to_string(R) + "x" +
                     std::to_string(C));
        Buf packed = make_packed(q, R, C), ref(dt, {R, C}), got(dt, {R, C});
        DBuf dp(DType::U8, packed.shape), dout(dt, {R, C});
        dp.upload(packed);
        dout.poison();
        ks::dequantize(dout.view(), dp.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::dequantize(ref.view(), packed.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
        EXPECT_TRUE(kstest::allclose(got.values(), ref.values(), 1e-6 + kstest::tol(dt), 1e-6 + kstest::tol(dt)));
      }
}

namespace {
// quant_matmul on CUDA of host x [M, K] and packed weights w (format q) into host got [M, N]:
// uploaded to fresh device buffers x_off / w_off bytes past their start, the output poisoned first.
void cuda_quant_matmul(Buf& got, const Buf& x, const Buf& w, ks_qtype_t q, size_t x_off = 0, size_t w_off = 0) {
  DBuf dx(x.dtype, x.shape, x_off), dw(DType::U8, w.shape, w_off), dout(got.dtype, got.shape);
  dx.upload(x);
  dw.upload(w);
  dout.poison();
  ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  dout.download(got);
}
}  // namespace

// quant_matmul on CUDA against the CPU backend: GGUF Q4_0 / Q4_1 / Q8_0 weights, M from 1
// (decode) to 9 (chunks of 4 rows plus a tail), K with one and many blocks.
TEST(Cuda, QuantMatmulBlockFormats) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 576, 576}, {9, 37, 32}, {4, 130, 1536}, {2, 3, 4096}}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M=" + std::to_string(M) +
                     " N=" + std::to_string(N) + " K=" + std::to_string(K));
        Buf x(dt, {M, K}), ref(dt, {M, N}), got(dt, {M, N});
        kstest::fill_normal(x);
        Buf w = make_packed(q, N, K);
        ks::quant_matmul(ref.view(), x.view(), w.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
        // aligned (word loads of the blocks, 16-byte loads of x) and offset by one byte / one
        // element (the byte-wise path)
        for (size_t off : {size_t(0), size_t(1)}) {
          cuda_quant_matmul(got, x, w, q, off ? ks::dtype_size(dt) : 0, off);
          // sums of K products in different orders (|x| ~ 1, |w| ~ 1): the random-walk bound
          EXPECT_TRUE(close_to_cpu(got, ref, 16 * std::sqrt(double(K)) * 6e-8 * double(K))) << "offset " << off;
        }
      }
}

// ---- dense weights (F32, F16, BF16) on CUDA ---------------------------------------------------
namespace {
const std::vector<ks_qtype_t> kDenseQ = {KS_QTYPE_F32, KS_QTYPE_F16, KS_QTYPE_BF16};

std::string dense_trace(DType dt, ks_qtype_t q, int64_t M, int64_t N, int64_t K) {
  return std::string(ks::dtype_name(dt)) + " weights " + kstest::gguf::qfmt(q).name + " M=" + std::to_string(M) +
         " N=" + std::to_string(N) + " K=" + std::to_string(K);
}

// Every element of `got` [M, N] against the FP64 dot product of x [M, K] and the decoded
// weights wd [N, K]: a sum of K products, each and every partial sum rounded in FP32, is within
// (K + 1) u sum |x w| of the exact value (u = 2^-24, the worst case, whatever the order), then the
// output's rounding (the dtype's unit roundoff, relative: 2^-8 for bf16, 2^-11 for fp16, 2^-24
// for fp32) and its subnormal spacing.
int count_outside_fp64_bound(const Buf& got, const Buf& x, const std::vector<double>& wd, int64_t M, int64_t N,
                             int64_t K) {
  const DType dt = got.dtype;
  const double half_ulp = dt == DType::BF16 ? 0x1p-8 : dt == DType::F16 ? 0x1p-11 : 0x1p-24;
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = x.get(m * K + k) * wd[size_t(n * K + k)];
        acc += p;
        mag += std::abs(p);
      }
      const double err = double(K + 1) * 0x1p-24 * mag;
      const double lim = err + half_ulp * (std::abs(acc) + err) + (dt == DType::F32 ? 1e-38 : 1e-7);
      const double g = got.get(m * N + n);
      if (!(std::abs(g - acc) <= lim) && bad++ < 5)
        ADD_FAILURE() << "row " << m << " column " << n << ": " << g << " vs FP64 " << acc << " (bound " << lim << ")";
    }
  return bad;
}
}  // namespace

// quant_matmul with dense weights on CUDA (cuda_warp_per_column's dense kernel, the only CUDA
// variant that takes them): every x dtype and weight format; K odd (element-wise path), a
// multiple of 8 but not 32, of 32, and a row of 131,075 values; M = 0 (nothing written), 1, 5,
// 9 (row chunks of 4 and a tail); the weights aligned (16-byte chunks), offset by 2 bytes and
// by 1 (element-wise, byte loads), x aligned and offset by one element. Each element within the
// FP64 bound, every offset's result byte-equal to the aligned one's (the order does not follow
// the alignment), the rows of M byte-equal to one-row calls (nor M), and the launch reports
// which path ran.
TEST(Cuda, QuantMatmulDenseWeights) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : kDenseQ)
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 576, 576}, {5, 37, 7}, {9, 130, 1544}, {4, 33, 4096}, {1, 3, 131075}, {0, 5, 64}}) {
        Buf x(dt, {M, K}), aligned(dt, {M, N});
        kstest::fill_normal(x);
        Buf w = make_packed(q, N, K);
        for (size_t woff : {size_t(0), size_t(2), size_t(1)}) {
          if (K > 100000 && woff == 2) continue;  // (the long row: aligned and by elements)
          SCOPED_TRACE(dense_trace(dt, q, M, N, K) + " weight offset " + std::to_string(woff));
          Buf got(dt, {M, N}), one(dt, {1, N});
          const size_t xoff = woff == 1 ? ks::dtype_size(dt) : 0;
          DBuf dx(dt, {M, K}, xoff), dw(DType::U8, w.shape, woff), dout(dt, {M, N}), done(dt, {1, N});
          dx.upload(x);
          dw.upload(w);
          dout.poison();
          ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          const std::string cfg = ks_last_launch_config("quant_matmul");
          CK(cudaDeviceSynchronize());
          dout.download(got);
          if (M == 0) continue;
          EXPECT_NE(cfg.find("dense_warp_per_column"), std::string::npos) << cfg;
          const bool vec = woff == 0 && K % 8 == 0;
          EXPECT_NE(cfg.find(vec ? "vector_loads=1" : "vector_loads=0"), std::string::npos) << cfg;
          EXPECT_EQ(count_outside_fp64_bound(got, x, decode_all(q, w, K), M, N, K), 0);
          // the sums' order depends on K alone: offset data (element-wise loads) gives the
          // aligned call's bits
          if (woff == 0)
            std::memcpy(aligned.data(), got.data(), got.nbytes());
          else
            EXPECT_EQ(0, std::memcmp(got.data(), aligned.data(), got.nbytes())) << "offset data vs aligned";
          const size_t row = size_t(N) * ks::dtype_size(dt);
          for (int64_t r : {int64_t(0), M - 1}) {
            done.poison();
            ks::quant_matmul(done.view(), dx.view().slice(r, 1), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
            CK(cudaDeviceSynchronize());
            done.download(one);
            EXPECT_EQ(0, std::memcmp(one.data(), static_cast<const char*>(got.data()) + size_t(r) * row, row))
                << "row " << r << " of M differs from a one-row call";
          }
        }
      }
}

// Dense weights, hostile values: a NaN in x reaches exactly its row, an infinite weight exactly its
// column (±inf or NaN), a row of M = 0 writes nothing, and the block-format-only variants refuse
// dense weights when pinned, naming the limit, while the default takes them; ks_which with a
// dense block format names the variant that runs (routing cells list block-only ones first).
TEST(Cuda, QuantMatmulDenseWeightsNonFiniteAndRefusals) {
  NEED_GPU();
  using namespace kstest::gguf;
  {
    const char* variant = nullptr;
    const char* reason = nullptr;
    for (const char* dt : {"fp32:f16", "bf16:bf16", "fp16:f32"})
      for (int64_t rows : {int64_t(1), int64_t(8), int64_t(64)}) {
        ASSERT_EQ(ks_which_shape("quant_matmul", dt, KS_BACKEND_CUDA, rows, 576 * 576, &variant, &reason), KS_SUCCESS)
            << ks_last_error();
        EXPECT_STREQ(variant, "cuda_warp_per_column") << dt << " rows " << rows << ": " << reason;
      }
    ASSERT_EQ(ks_which_shape("fused_add_rms_norm_quant_matmul_rope_kv_append", "bf16:f16", KS_BACKEND_CUDA, 1,
                             960 * 576, &variant, &reason),
              KS_SUCCESS)
        << ks_last_error();
    EXPECT_STREQ(variant, "cuda_composed") << reason;
    ASSERT_EQ(ks_which_shape("silu_and_mul_quant_matmul", "fp32:bf16", KS_BACKEND_CUDA, 32, 576 * 1536, &variant,
                             &reason),
              KS_SUCCESS)
        << ks_last_error();
    EXPECT_STREQ(variant, "cuda_warp_per_column") << reason;
  }
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : kDenseQ) {
      SCOPED_TRACE(dense_trace(dt, q, 3, 40, 264));
      const int64_t M = 3, N = 40, K = 264;
      Buf x(dt, {M, K}), got(dt, {M, N});
      kstest::fill_normal(x);
      x.set(1 * K + 100, std::numeric_limits<double>::quiet_NaN());
      Buf w = make_packed(q, N, K);
      // weight (column 7, element 5) = +inf in the format's bits
      uint8_t* w7 = static_cast<uint8_t*>(w.data()) + 7 * w.shape[1];
      if (q == KS_QTYPE_F32) {
        const float inf = std::numeric_limits<float>::infinity();
        std::memcpy(w7 + 4 * 5, &inf, 4);
      } else {
        put16(w7 + 2 * 5, q == KS_QTYPE_F16 ? uint16_t(0x7C00) : uint16_t(0x7F80));
      }
      cuda_quant_matmul(got, x, w, q);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          const double g = got.get(m * N + n);
          if (m == 1)
            EXPECT_TRUE(std::isnan(g)) << "row 1 (NaN x), column " << n << ": " << g;
          else if (n == 7)
            EXPECT_FALSE(std::isfinite(g)) << "row " << m << ", column 7 (an infinite weight): " << g;
          else
            EXPECT_TRUE(std::isfinite(g)) << "row " << m << ", column " << n << ": " << g;
        }
      for (const char* variant : {"cuda_bulk_stream", "cuda_mma_rows", "cuda_staged_x", "cuda_warp_per_column_m16"}) {
        kstest::ScopedVariant pin("quant_matmul", variant);
        ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
        try {
          cuda_quant_matmul(got, x, w, q);
          ADD_FAILURE() << variant << " took dense weights";
        } catch (const ks::Error& e) {
          EXPECT_NE(std::string(e.what()).find("only the GGUF block formats"), std::string::npos) << e.what();
        }
      }
    }
}

// silu_and_mul_quant_matmul with dense weights (its default variant runs dense_matmul_kernel with
// the SiLU prologue): bit for bit silu_and_mul then quant_matmul on CUDA (h at gate_up's alignment
// and at the other one), and within the CPU's bound. K = 576 (16-byte chunks) and K = 100
// (element-wise), inputs aligned and offset by one element. (The norm fusion's dense cases:
// FusedNormQuantMatmulAgainstCpu and FusedNormQuantMatmulRowDoesNotDependOnMAndNoColumns.)
TEST(Cuda, SiluQuantMatmulDenseWeights) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : kDenseQ)
      for (int64_t K : {int64_t(576), int64_t(100)})
        for (size_t off : {size_t(0), size_t(1)}) {
          const int64_t M = 9, N = 70;
          SCOPED_TRACE(dense_trace(dt, q, M, N, K) + " offset " + std::to_string(off));
          const size_t eo = off ? ks::dtype_size(dt) : 0;
          Buf w = make_packed(q, N, K);
          DBuf dw(DType::U8, w.shape, off);
          dw.upload(w);
          Buf gu(dt, {M, 2 * K}), a(dt, {M, N}), b(dt, {M, N}), cpu(dt, {M, N});
          kstest::fill_normal(gu, 2.0);
          DBuf dgu(dt, {M, 2 * K}, eo), dh(dt, {M, K}, eo), da(dt, {M, N}, eo), db(dt, {M, N}, eo);
          dgu.upload(gu);
          da.poison();
          db.poison();
          ks::silu_and_mul_quant_matmul(da.view(), dgu.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          ks::silu_and_mul(dh.view(), dgu.view(), ks::Backend::Cuda);
          ks::quant_matmul(db.view(), dh.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          CK(cudaDeviceSynchronize());
          da.download(a);
          db.download(b);
          EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << "silu_and_mul_quant_matmul vs the two calls";
          {  // h at the other alignment (aligned weights: one call by 16-byte chunks, the other by
             // elements): the same bits, the order following K alone
            DBuf dh2(dt, {M, K}, eo ? 0 : ks::dtype_size(dt)), db2(dt, {M, N});
            CK(cudaMemcpy(dh2.data(), dh.data(), dh.nbytes(), cudaMemcpyDeviceToDevice));
            db2.poison();
            ks::quant_matmul(db2.view(), dh2.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
            CK(cudaDeviceSynchronize());
            db2.download(b);
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << "h at the other alignment";
          }
          ks::silu_and_mul_quant_matmul(cpu.view(), gu.view(), w.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
          EXPECT_TRUE(close_to_cpu(a, cpu, 16 * std::sqrt(double(K)) * 6e-8 * double(K) * 4)) << "silu vs the CPU";
        }
}

// quant_matmul's result for a row does not depend on M where the routing keeps one family of
// sums: by default below 8 rows (M = 5: the per-column kernels, whose sums are the one-row
// kernel's, so batched decode of up to 7 sequences equals each sequence alone), and in
// deterministic mode at any M (M = 9 and 33: from 8 rows sm_90.json routes fp32 to
// cuda_mma_rows, whose sums are batch-invariant on their own but not the one-row kernel's;
// deterministic mode's first cell keeps cuda_staged_x). Dense F16 / BF16 weights too (the dense
// kernel, whatever the mode). Every row of the batch against the same row alone, bitwise.
TEST(Cuda, QuantMatmulRowDoesNotDependOnM) {
  NEED_GPU();
  using namespace kstest::gguf;
  struct Mode {
    int64_t m;
    bool deterministic;
  };
  for (const Mode mode : {Mode{5, false}, Mode{9, true}, Mode{33, true}})
    for (DType dt : kstest::float_dtypes())
      for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0, KS_QTYPE_F16, KS_QTYPE_BF16}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M " +
                     std::to_string(mode.m) + (mode.deterministic ? " deterministic" : " default"));
        struct ModeGuard {  // (the caller's mode restored however the case ends)
          int before = ks_deterministic();
          explicit ModeGuard(bool on) { ks_set_deterministic(on ? 1 : 0); }
          ~ModeGuard() { ks_set_deterministic(before); }
        } guard(mode.deterministic);
        const int64_t M = mode.m, N = 130, K = 1536;
        Buf x(dt, {M, K}), all(dt, {M, N}), one(dt, {1, N});
        kstest::fill_normal(x);
        Buf w = make_packed(q, N, K);
        DBuf dx(dt, {M, K}), dw(DType::U8, w.shape), dall(dt, {M, N});
        dx.upload(x);
        dw.upload(w);
        dall.poison();
        ks::quant_matmul(dall.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dall.download(all);
        const size_t row_bytes = size_t(N) * ks::dtype_size(dt);
        for (int64_t r = 0; r < M; ++r) {
          Buf xr(dt, {1, K});
          std::memcpy(xr.data(), static_cast<const char*>(x.data()) + size_t(r * K) * ks::dtype_size(dt),
                      xr.nbytes());
          DBuf dxr(dt, {1, K}), done(dt, {1, N});
          dxr.upload(xr);
          done.poison();
          ks::quant_matmul(done.view(), dxr.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          CK(cudaDeviceSynchronize());
          done.download(one);
          EXPECT_EQ(0, std::memcmp(one.data(), static_cast<const char*>(all.data()) + size_t(r) * row_bytes, row_bytes))
              << "row " << r;
        }
      }
}

// Wide matrices of short rows (an lm_head's shape): warps own 2 or 4 consecutive columns
// (N >= 64 * 2 * SMs; the grid is then too large for weight staging, which is off). N odd, so
// the last CTA is partial; weights aligned, offset by one byte (byte-wise decode) and by two
// (the 16-bit word path of Q4_0 / Q8_0). Against the CPU, and the rows of M = 5 byte-equal to
// M = 1 (the row does not depend on M here either).
TEST(Cuda, QuantMatmulWideMatricesAgainstCpu) {
  NEED_GPU();
  using namespace kstest::gguf;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t N = 64 * 2 * int64_t(sms) + 129;
  for (DType dt : {DType::F32, DType::BF16})
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (int64_t K : {int64_t(64), int64_t(576)})
        for (size_t off : {size_t(0), size_t(1), size_t(2)}) {
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " K=" + std::to_string(K) +
                       " weight offset " + std::to_string(off));
          const int64_t M = 5;
          Buf x(dt, {M, K}), ref(dt, {M, N}), got(dt, {M, N}), one(dt, {1, N});
          kstest::fill_normal(x);
          Buf w = make_packed(q, N, K);
          ks::quant_matmul(ref.view(), x.view(), w.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
          DBuf dx(dt, {M, K}), dw(DType::U8, w.shape, off), dout(dt, {M, N}), done(dt, {1, N});
          // (pinned: sm_90.json sends bf16 calls of one row and this N x K to cuda_mma_blocks,
          // whose sums round differently)
          kstest::ScopedVariant pin("quant_matmul", "cuda_warp_per_column");
          ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
          dx.upload(x);
          dw.upload(w);
          dout.poison();
          done.poison();
          ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          ks::quant_matmul(done.view(), dx.view().slice(0, 1), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          CK(cudaDeviceSynchronize());
          dout.download(got);
          done.download(one);
          EXPECT_TRUE(close_to_cpu(got, ref, 16 * std::sqrt(double(K)) * 6e-8 * double(K)));
          EXPECT_EQ(0, std::memcmp(one.data(), got.data(), one.nbytes())) << "row 0 of M = 5 differs from M = 1";
        }
}

// quant_matmul's cuda_warp_per_column_m16 (16 rows per decoded block) gives the same bytes as
// cuda_warp_per_column (4): the same per-row sums in the same order. Both pinned; M from 8 to
// 64 (full and partial chunks), aligned (word / 16-byte loads) and offset (byte-wise loads).
TEST(Cuda, QuantMatmulM16VariantEqualsTheDefault) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (int64_t M : {int64_t(8), int64_t(9), int64_t(33), int64_t(64)})
        for (size_t off : {size_t(0), size_t(1)}) {
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M=" + std::to_string(M) +
                       " offset " + std::to_string(off));
          const int64_t N = 70, K = 576;
          Buf x(dt, {M, K}), a(dt, {M, N}), b(dt, {M, N});
          kstest::fill_normal(x);
          Buf w = make_packed(q, N, K);
          DBuf dx(dt, {M, K}, off ? ks::dtype_size(dt) : 0), dw(DType::U8, w.shape, off), da(dt, {M, N}), db(dt, {M, N});
          dx.upload(x);
          dw.upload(w);
          da.poison();
          db.poison();
          for (auto [variant, out] : {std::pair{"cuda_warp_per_column_m16", &da}, {"cuda_warp_per_column", &db}}) {
            {
              kstest::ScopedVariant pin("quant_matmul", variant);
              ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
              ks::quant_matmul(out->view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
            }
          }
          CK(cudaDeviceSynchronize());
          da.download(a);
          db.download(b);
          EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
        }
}

// cuda_staged_x (x's rows staged in shared memory, 16 per decoded block where they fit) gives
// cuda_warp_per_column's bits: M from 2 to 64 (the 16-row and 4-row chunks and their tails),
// K = 576 (16 rows fit), 1536 and 2720 (4 rows), a grid with and without weight staging
// (N = 70; 4 x 132 x 8 + 3 columns: more than 2 CTAs per SM), and cuda_warp_per_column_m16 at
// M >= 8 as well. Where x or the weights are misaligned the variant declines (its launch config
// is never recorded for such a call).
TEST(Cuda, QuantMatmulStagedXVariantEqualsTheDefault) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {2, 70, 576}, {5, 70, 576}, {16, 70, 576}, {33, 70, 576}, {64, 4227, 576}, {8, 70, 1536},
               {17, 130, 2720}, {3, 4227, 256}}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M=" + std::to_string(M) +
                     " N=" + std::to_string(N) + " K=" + std::to_string(K));
        Buf x(dt, {M, K}), a(dt, {M, N}), b(dt, {M, N});
        kstest::fill_normal(x);
        Buf w = make_packed(q, N, K);
        DBuf dx(dt, {M, K}), dw(DType::U8, w.shape), da(dt, {M, N}), db(dt, {M, N}), dc(dt, {M, N});
        dx.upload(x);
        dw.upload(w);
        da.poison(), db.poison(), dc.poison();
        std::vector<std::pair<const char*, DBuf*>> runs = {{"cuda_staged_x", &da}, {"cuda_warp_per_column", &db}};
        if (M >= 8) runs.push_back({"cuda_warp_per_column_m16", &dc});
        for (auto [variant, out] : runs) {
          {
            kstest::ScopedVariant pin("quant_matmul", variant);
            ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
            ks::quant_matmul(out->view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          }
          if (std::string(variant) == "cuda_staged_x") {
            const std::string cfg = ks_last_launch_config("quant_matmul");
            EXPECT_NE(cfg.find("staged_rows=1"), std::string::npos) << cfg;
            EXPECT_NE(cfg.find(M >= 16 && K <= 576 ? "m_chunk=16" : "m_chunk=4"), std::string::npos) << cfg;
          }
        }
        CK(cudaDeviceSynchronize());
        da.download(a);
        db.download(b);
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << "cuda_staged_x vs cuda_warp_per_column";
        if (M >= 8) {
          Buf c(dt, {M, N});
          dc.download(c);
          EXPECT_EQ(0, std::memcmp(c.data(), b.data(), c.nbytes())) << "m16 vs cuda_warp_per_column";
        }
      }
  // misaligned x: the variant declines, naming why
  const int64_t M = 4, N = 16, K = 64;
  Buf w = make_packed(KS_QTYPE_Q8_0, N, K);
  DBuf dx(DType::F32, {M, K}, 4), dw(DType::U8, w.shape), out(DType::F32, {M, N});
  dw.upload(w);
  kstest::ScopedVariant pin("quant_matmul", "cuda_staged_x");
  ASSERT_EQ(pin.status(), KS_SUCCESS);
  const ks::TensorView ov = out.view(), xv = dx.view(), wv = dw.view();  // (dl() points into the view)
  DLTensor o = ov.dl(), xx = xv.dl(), ww = wv.dl();
  const ks_status_t st = ks_quant_matmul(&o, &xx, &ww, KS_QTYPE_Q8_0, KS_BACKEND_CUDA, nullptr);
  const std::string msg = ks_last_error();
  EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << msg;
  EXPECT_NE(msg.find("aligned"), std::string::npos) << msg;
}

// Weight staging (the CTA's weight rows copied to shared memory with cp.async before the
// dependency wait; on for grids of at most 3 CTAs per SM) changes no bits: the first 64
// columns computed with 64 columns of weight (8 CTAs: staged) equal those columns inside a
// matrix of 32 x SMs + 8 columns (a grid over 4 CTAs per SM: read from global memory). For
// quant_matmul (M = 1 and 5) and both fused forms (M = 3), weights aligned and offset by 1 and
// 2 bytes (the head read by plain loads). Then SiLU + down at K = 2656, M = 3: the staged rows
// and weights come within 32 bytes of 48 KB next to the kernel's static shared memory (a
// launch that needed more would fail).
TEST(Cuda, WeightStagingGivesTheSameBits) {
  NEED_GPU();
  using namespace kstest::gguf;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t K = 576, NS = 64, NB = 32 * int64_t(sms) + 8;
  // the launch really staged (or not): the test compares the two paths, not one with itself
  auto expect_staged = [](const char* op, bool on) {
    const std::string cfg = ks_last_launch_config(op);
    EXPECT_NE(cfg.find(on ? "staged_weights=1" : "staged_weights=0"), std::string::npos) << op << ": " << cfg;
  };
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (size_t off : {size_t(0), size_t(1), size_t(2)}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " weight offset " +
                     std::to_string(off));
        const auto qt = static_cast<ks::QType>(q);
        Buf w = make_packed(q, NB, K);
        DBuf dw(DType::U8, w.shape, off);
        dw.upload(w);
        const ks::TensorView wbig = dw.view(), wsmall = dw.view().slice(0, NS);
        // columns [0, NS) of out_big [M, N] (N = NB unless given) against out_small [M, NS], row by row
        auto same_columns = [&](const Buf& small, const Buf& big, int64_t M, int64_t N = 0) {
          const size_t es = ks::dtype_size(dt);
          if (N == 0) N = NB;
          for (int64_t m = 0; m < M; ++m)
            EXPECT_EQ(0, std::memcmp(static_cast<const char*>(small.data()) + size_t(m * NS) * es,
                                     static_cast<const char*>(big.data()) + size_t(m * N) * es, size_t(NS) * es))
                << "row " << m << " of " << N << " columns";
        };
        for (int64_t M : {int64_t(1), int64_t(5)}) {
          Buf x(dt, {M, K}), small(dt, {M, NS}), big(dt, {M, NB});
          kstest::fill_normal(x);
          DBuf dx(dt, {M, K}), ds(dt, {M, NS}), db(dt, {M, NB});
          dx.upload(x);
          ds.poison();
          db.poison();
          ks::quant_matmul(ds.view(), dx.view(), wsmall, qt, ks::Backend::Cuda);
          expect_staged("quant_matmul", true);
          ks::quant_matmul(db.view(), dx.view(), wbig, qt, ks::Backend::Cuda);
          expect_staged("quant_matmul", false);
          CK(cudaDeviceSynchronize());
          ds.download(small);
          db.download(big);
          SCOPED_TRACE("quant_matmul M=" + std::to_string(M));
          same_columns(small, big, M);
          // a grid of exactly 3 CTAs per SM (24 x SMs columns of one per warp): staged since
          // 6c20047 (2 per SM before; SmolLM2's gate|up, 384 CTAs, is such a grid), the same bits
          const int64_t NM = 24 * int64_t(sms);
          Buf mid(dt, {M, NM});
          DBuf dm(dt, {M, NM});
          dm.poison();
          {  // (pinned: the routing tables may send this N x K to another variant)
            kstest::ScopedVariant pin("quant_matmul", "cuda_warp_per_column");
            ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
            ks::quant_matmul(dm.view(), dx.view(), dw.view().slice(0, NM), qt, ks::Backend::Cuda);
            expect_staged("quant_matmul", true);
          }
          CK(cudaDeviceSynchronize());
          dm.download(mid);
          same_columns(small, mid, M, NM);
        }
        const int64_t M = 3;
        Buf x(dt, {M, K}), res(dt, {M, K}), nw(dt, {K}), gu(dt, {M, 2 * K}), small(dt, {M, NS}), big(dt, {M, NB}),
            ro_s(dt, {M, K}), ro_b(dt, {M, K});
        kstest::fill_normal(x);
        kstest::fill_normal(res);
        kstest::fill_normal(nw);
        kstest::fill_normal(gu, 2.0);
        DBuf dx(dt, {M, K}), dres(dt, {M, K}), dnw(dt, {K}), dgu(dt, {M, 2 * K}), ds(dt, {M, NS}), db(dt, {M, NB}),
            dro_s(dt, {M, K}), dro_b(dt, {M, K});
        dx.upload(x);
        dres.upload(res);
        dnw.upload(nw);
        dgu.upload(gu);
        ds.poison();
        db.poison();
        dro_s.poison();
        dro_b.poison();
        ks::fused_add_rms_norm_quant_matmul(ds.view(), dro_s.view(), dx.view(), dres.view(), dnw.view(), 1e-5, wsmall, qt,
                                            ks::Backend::Cuda);
        expect_staged("fused_add_rms_norm_quant_matmul", true);
        ks::fused_add_rms_norm_quant_matmul(db.view(), dro_b.view(), dx.view(), dres.view(), dnw.view(), 1e-5, wbig, qt,
                                            ks::Backend::Cuda);
        expect_staged("fused_add_rms_norm_quant_matmul", false);
        CK(cudaDeviceSynchronize());
        ds.download(small);
        db.download(big);
        dro_s.download(ro_s);
        dro_b.download(ro_b);
        {
          SCOPED_TRACE("fused_add_rms_norm_quant_matmul");
          same_columns(small, big, M);
          EXPECT_EQ(0, std::memcmp(ro_s.data(), ro_b.data(), ro_s.nbytes())) << "residual_out";
        }
        ds.poison();
        db.poison();
        // gate_up [M, 2 K] feeds the same [NB, K] weights as a down projection would
        ks::silu_and_mul_quant_matmul(ds.view(), dgu.view(), wsmall, qt, ks::Backend::Cuda);
        expect_staged("silu_and_mul_quant_matmul", true);
        ks::silu_and_mul_quant_matmul(db.view(), dgu.view(), wbig, qt, ks::Backend::Cuda);
        expect_staged("silu_and_mul_quant_matmul", false);
        CK(cudaDeviceSynchronize());
        ds.download(small);
        db.download(big);
        SCOPED_TRACE("silu_and_mul_quant_matmul");
        same_columns(small, big, M);
      }
  // the 48 KB edge: SiLU + down, K = 2656 (83 Q4_1 blocks), M = 3, N = 2048 against the two CUDA steps
  for (DType dt : kstest::float_dtypes()) {
    SCOPED_TRACE(std::string("edge ") + ks::dtype_name(dt));
    const int64_t M = 3, N = 2048, KE = 2656;
    Buf gu(dt, {M, 2 * KE}), a(dt, {M, N}), b(dt, {M, N});
    kstest::fill_normal(gu, 2.0);
    Buf w = make_packed(KS_QTYPE_Q4_1, N, KE);
    DBuf dgu(dt, {M, 2 * KE}), dw(DType::U8, w.shape), dh(dt, {M, KE}), da(dt, {M, N}), db(dt, {M, N});
    dgu.upload(gu);
    dw.upload(w);
    da.poison();
    db.poison();
    ks::silu_and_mul_quant_matmul(da.view(), dgu.view(), dw.view(), ks::QType::Q4_1, ks::Backend::Cuda);
    ks::silu_and_mul(dh.view(), dgu.view(), ks::Backend::Cuda);
    ks::quant_matmul(db.view(), dh.view(), dw.view(), ks::QType::Q4_1, ks::Backend::Cuda);
    CK(cudaDeviceSynchronize());
    da.download(a);
    db.download(b);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
  }
}

// The one-row streaming variants give the same bytes as cuda_warp_per_column, and are close to
// the CPU: every block format, rows of one block to 20480 elements (more blocks than
// cuda_bulk_stream has threads), more columns than the grid has warps. cuda_row_stream (each
// warp streams rows through two shared-memory buffers): weights aligned and offset by 1 and 2
// bytes (head bytes by plain loads; byte-wise and 16-bit decode). cuda_bulk_stream (a CTA per SM
// streams its rows through a ring of bulk-copied stages): weights at 0 and 16 bytes in (it
// declines others), matrices whose byte size is not a multiple of 16 (the tail by plain loads),
// more stages than ring slots (14336 x 4096), one row per CTA (N = 7), short rows a thread per row
// (20000 x 576 and the output head's 49152 x 576: stages of >= 64 rows, bulk_thread_rows; Q4_0 and
// Q8_0 2 lanes per row, Q4_1 one, bulk_lanes_per_row; KS_QMM_BULK_TPR=1, 2 or 4 forces them) and in
// warp groups (576 x 576, 6341 x 576). M = 2 is refused by both.
TEST(Cuda, QuantMatmulStreamVariantsEqualTheDefault) {
  NEED_GPU();
  using namespace kstest::gguf;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t many = 4 * 4 * int64_t(sms) * 3 + 5;  // 3 or 4 rows per warp at 4 CTAs of 4 warps per SM
  // (blocks per row: 1, 18, 18, 33 with one row, 32, 90, 128, 128, 448, 640, 18)
  const std::vector<std::pair<int64_t, int64_t>> shapes{{7, 32},    {576, 576},  {many, 576},   {1, 1056},
                                                        {265, 1024}, {133, 2880}, {300, 4096},   {14336, 4096},
                                                        {33, 14336}, {5, 20480},   {20000, 576},
                                                        {49152, 576}};
  for (const char* variant : {"cuda_row_stream", "cuda_bulk_stream"}) {
    const bool bulk = std::string(variant) == "cuda_bulk_stream";
    for (DType dt : kstest::float_dtypes())
      for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
        for (auto [N, K] : shapes)
          for (size_t off : bulk ? std::vector<size_t>{0, 16} : std::vector<size_t>{0, 1, 2}) {
            if (!bulk && K > 4096) continue;  // rows over 5.9 KB: cuda_row_stream declines them
            if (N * K > 4096 * 4096 && (dt != DType::BF16 || off != 0)) continue;  // the big shape once per format
            SCOPED_TRACE(std::string(variant) + " " + ks::dtype_name(dt) + " qtype " + std::to_string(int(q)) +
                         " N=" + std::to_string(N) + " K=" + std::to_string(K) + " offset " + std::to_string(off));
            Buf x(dt, {1, K}), ref(dt, {1, N}), a(dt, {1, N}), b(dt, {1, N});
            kstest::fill_normal(x);
            const bool nonfinite = N == 133;  // x[5] = inf: every column is inf or NaN, in both kernels alike
            if (nonfinite) x.set(5, INFINITY);
            Buf w = make_packed(q, N, K);
            ks::quant_matmul(ref.view(), x.view(), w.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
            DBuf dx(dt, {1, K}), dw(DType::U8, w.shape, off), da(dt, {1, N}), db(dt, {1, N});
            dx.upload(x);
            dw.upload(w);
            da.poison();
            db.poison();
            for (auto [v, out] : {std::pair{variant, &da}, {"cuda_warp_per_column", &db}}) {
              {
                kstest::ScopedVariant pin("quant_matmul", v);
                ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
                ks::quant_matmul(out->view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
              }
              const std::string cfg = ks_last_launch_config("quant_matmul");
              if (out == &da && !bulk && N == many) {  // the grid leaves several rows to each warp (both buffers used)
                const size_t at = cfg.find("grid=");
                ASSERT_NE(at, std::string::npos) << cfg;
                EXPECT_GE(N, 3 * 4 * std::stoll(cfg.substr(at + 5))) << cfg;
              }
              if (out == &da && bulk && K == 576) {  // a thread per short row where stages hold >= 64 rows
                const size_t tr = cfg.find("thread_rows=");
                ASSERT_NE(tr, std::string::npos) << cfg;
                const char* e = std::getenv("KS_QMM_BULK_THREAD_ROWS");  // (=0: warp groups always)
                const bool groups = e && std::string(e) == "0";
                const bool rows_by_threads = N >= 20000 && !groups;
                EXPECT_EQ(cfg.substr(tr + 12, 1), rows_by_threads ? "1" : "0") << cfg;
                const size_t tp = cfg.find("threads_per_row=");
                ASSERT_NE(tp, std::string::npos) << cfg;
                const char* f = std::getenv("KS_QMM_BULK_TPR");  // (honoured as 1, 2 or 4 only, as bulk_tpr)
                const bool forced = f && (std::string(f) == "1" || std::string(f) == "2" || std::string(f) == "4");
                const int lanes = forced ? std::atoi(f) : ks::cuda::bulk_lanes_per_row(q == KS_QTYPE_Q4_0 ? 18 : q == KS_QTYPE_Q4_1 ? 20 : 34);
                EXPECT_EQ(std::stoi(cfg.substr(tp + 16)), rows_by_threads ? lanes : 0) << cfg;
              }
              if (out == &da && bulk && N == 14336) {  // more stages per CTA than ring slots: the ring wraps
                const size_t rs = cfg.find("rows_per_stage="), sl = cfg.find("slots="), gr = cfg.find("grid=");
                ASSERT_TRUE(rs != std::string::npos && sl != std::string::npos && gr != std::string::npos) << cfg;
                const int64_t rows_cta = (N + std::stoll(cfg.substr(gr + 5)) - 1) / std::stoll(cfg.substr(gr + 5));
                const int64_t rps = std::stoll(cfg.substr(rs + 15));
                EXPECT_GT((rows_cta + rps - 1) / rps, std::stoll(cfg.substr(sl + 6))) << cfg;
              }
            }
            CK(cudaDeviceSynchronize());
            da.download(a);
            db.download(b);
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
            if (nonfinite) {
              for (int64_t n = 0; n < N; ++n) EXPECT_FALSE(std::isfinite(a.get(n))) << "column " << n;
            } else {
              EXPECT_TRUE(close_to_cpu(a, ref, 16 * std::sqrt(double(K)) * 6e-8 * double(K)));
            }
          }
    // M = 2: the pinned variant cannot run the call, and says so
    DBuf dx(DType::F32, {2, 64}), dw(DType::U8, {3, 2 * 20}), dout(DType::F32, {2, 3});
    kstest::ScopedVariant pin("quant_matmul", variant);
    ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
    EXPECT_THROW(ks::quant_matmul(dout.view(), dx.view(), dw.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  }
  // cuda_bulk_stream declines weights that are not 16-byte aligned, naming why
  DBuf dx(DType::BF16, {1, 64}), dw(DType::U8, {3, 2 * 20}, 4), dout(DType::BF16, {1, 3});
  kstest::ScopedVariant pin("quant_matmul", "cuda_bulk_stream");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  try {
    ks::quant_matmul(dout.view(), dx.view(), dw.view(), ks::QType::Q4_1, ks::Backend::Cuda);
    ADD_FAILURE() << "a 4-byte offset weight ran through cuda_bulk_stream";
  } catch (const ks::Error&) {
    EXPECT_NE(std::string(ks_last_error()).find("16-byte"), std::string::npos) << ks_last_error();
  }
}

namespace {
// One call of a pinned tensor-core quant_matmul variant (cuda_mma_blocks, cuda_mma_stream, ...) against
// an FP64 dot product of the decoded weights (gguf_blocks_fp64's independent decode) and the CPU.
// Each element within the factored sums' bound: 128 u (sum over blocks of sum |x w| + 2 |m| sum |x|
// (Q4_1), + 30 |d| sum |x| (Q8_0: the nibble split), then the output's half ulp. The first and last
// rows of M equal one-row calls (the last through an offset view) byte for byte (a row's sums do
// not depend on M). `w_offset`: the weights' byte offset in their allocation; `random_codes`:
// every Q8_0 code byte drawn uniformly (-128..127, not only the encoder's -127..127).
void check_mma_variant(const char* variant, DType dt, ks_qtype_t q, int64_t M, int64_t N, int64_t K, size_t w_offset,
                       bool random_codes = false) {
  using namespace kstest::gguf;
  SCOPED_TRACE(std::string(variant) + " " + ks::dtype_name(dt) + " qtype " + std::to_string(int(q)) + " M=" +
               std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) + " weight offset " +
               std::to_string(w_offset));
  Buf x(dt, {M, K}), ref(dt, {M, N}), got(dt, {M, N}), first(dt, {1, N}), last(dt, {1, N});
  kstest::fill_normal(x);
  Buf w = make_packed(q, N, K);
  const int64_t nb = K / 32, bbytes = q == KS_QTYPE_Q4_1 ? 20 : q == KS_QTYPE_Q4_0 ? 18 : 34;
  if (random_codes && q == KS_QTYPE_Q8_0) {
    std::mt19937 gen(unsigned(N * 7 + K));
    for (int64_t r = 0; r < N; ++r)
      for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < 32; ++j) static_cast<uint8_t*>(w.data())[r * nb * 34 + b * 34 + 2 + j] = uint8_t(gen());
  }
  ks::quant_matmul(ref.view(), x.view(), w.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
  DBuf dx(dt, {M, K}), dw(DType::U8, w.shape, w_offset), dout(dt, {M, N}), dfirst(dt, {1, N}), dlast(dt, {1, N});
  dx.upload(x);
  dw.upload(w);
  dout.poison();
  dfirst.poison();
  dlast.poison();
  {
    kstest::ScopedVariant pin("quant_matmul", variant);
    ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
    ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
    const std::string tag = std::string(variant).substr(5);  // "mma_blocks", "mma_stream"
    EXPECT_NE(std::string(ks_last_launch_config("quant_matmul")).find(tag), std::string::npos)
        << ks_last_launch_config("quant_matmul");
    ks::quant_matmul(dfirst.view(), dx.view().slice(0, 1), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
    ks::quant_matmul(dlast.view(), dx.view().slice(M - 1, 1), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
  }
  CK(cudaDeviceSynchronize());
  dout.download(got);
  dfirst.download(first);
  dlast.download(last);
  // FP64 of the decoded weights, and each element's bound for the factored FP32 sums
  const std::vector<double> wd = decode_all(q, w, K);
  const double half_ulp = dt == DType::BF16 ? std::ldexp(1.0, -8) : dt == DType::F16 ? std::ldexp(1.0, -11)
                                                                                      : std::ldexp(1.0, -24);
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0, bound = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = static_cast<const uint8_t*>(w.data()) + n * (nb * bbytes) + b * bbytes;
        const double mn = q == KS_QTYPE_Q4_1 ? std::abs(f16_to_double(get16(blk + 2))) : 0.0;
        const double d8 = q == KS_QTYPE_Q8_0 ? std::abs(f16_to_double(get16(blk))) : 0.0;
        double xw = 0, xa = 0;
        for (int64_t k = b * 32; k < b * 32 + 32; ++k) {
          const double xv = x.get(m * K + k), wv = wd[size_t(n * K + k)];
          acc += xv * wv;
          xw += std::abs(xv * wv);
          xa += std::abs(xv);
        }
        bound += xw + 2 * mn * xa + 30 * d8 * xa;
      }
      bound *= 128 * std::ldexp(1.0, -24);
      // (+ 1e-7 for 16-bit outputs: fp16's subnormal spacing near 0)
      const double g = got.get(m * N + n), lim = bound + half_ulp * (std::abs(acc) + bound) + (dt == DType::F32 ? 1e-30 : 1e-7);
      if (!(std::abs(g - acc) <= lim) && bad++ < 5)
        ADD_FAILURE() << "row " << m << " column " << n << ": " << g << " vs FP64 " << acc << " (bound " << lim << ")";
    }
  EXPECT_EQ(bad, 0);
  EXPECT_TRUE(close_to_cpu(got, ref, 16 * std::sqrt(double(K)) * 6e-8 * double(K)));
  const size_t row = size_t(N) * ks::dtype_size(dt);
  EXPECT_EQ(0, std::memcmp(first.data(), got.data(), row)) << "M = 1 differs from row 0 of M";
  EXPECT_EQ(0, std::memcmp(last.data(), static_cast<const char*>(got.data()) + size_t(M - 1) * row, row))
      << "an offset one-row view differs from the last row of M";
}

// Non-finite x through a pinned tensor-core variant: a NaN in row 1 and +inf in row 2 (fp32:
// M = 2, one call each) reach exactly those rows (every column: no zero weight in a random
// block); row 0 stays finite.
void check_mma_variant_nonfinite(const char* variant, DType dt, ks_qtype_t q) {
  using namespace kstest::gguf;
  SCOPED_TRACE(std::string(variant) + " " + ks::dtype_name(dt) + " qtype " + std::to_string(int(q)) + ", non-finite x");
  const int64_t N = 40, K = 256;
  const bool two = dt == DType::F32;  // fp32 x: at most 2 rows
  for (int pass = 0; pass < (two ? 2 : 1); ++pass) {
    const int64_t M = two ? 2 : 3;
    Buf x(dt, {M, K}), got(dt, {M, N});
    kstest::fill_normal(x);
    if (!two || pass == 0) x.set(1 * K + 77, std::nan(""));
    if (!two) x.set(2 * K + 200, INFINITY);
    if (two && pass == 1) x.set(1 * K + 200, INFINITY);
    Buf w = make_packed(q, N, K);
    DBuf dx(dt, {M, K}), dw(DType::U8, w.shape), dout(dt, {M, N});
    dx.upload(x);
    dw.upload(w);
    dout.poison();
    kstest::ScopedVariant pin("quant_matmul", variant);
    ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
    ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
    CK(cudaDeviceSynchronize());
    dout.download(got);
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_TRUE(std::isfinite(got.get(n))) << n;
      if (!two || pass == 0) EXPECT_TRUE(std::isnan(got.get(N + n))) << n;
      if (!two) EXPECT_FALSE(std::isfinite(got.get(2 * N + n))) << n;  // inf, or NaN where inf * w meets -inf
      if (two && pass == 1) EXPECT_FALSE(std::isfinite(got.get(N + n))) << n;
    }
  }
}
}  // namespace

// quant_matmul's cuda_mma_blocks (bf16 / fp16 x, M <= 8, Q4_0 / Q4_1; block sums on the tensor
// cores), by check_mma_variant: M 1..8 (the MMA's unused columns), N not a multiple of the CTA's 16
// rows, K of one block, an odd block count (the warps' ranges unequal, some empty) and 4096; the
// weights offset by 2 bytes (Q4_0's 2-byte words) and 4. NaN and inf in x reach exactly their rows.
TEST(Cuda, QuantMatmulMmaBlocksVariant) {
  NEED_GPU();
  for (DType dt : {DType::BF16, DType::F16})
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1}) {
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 1, 32}, {1, 37, 416}, {3, 16, 64}, {8, 50, 576}, {5, 4096 + 9, 4096}, {1, 600, 4096}, {7, 33, 1536}})
        for (size_t off : {size_t(0), size_t(2), size_t(4)}) {
          if (q == KS_QTYPE_Q4_1 && off == 2) continue;  // Q4_1's words need 4-byte alignment (declined; below)
          check_mma_variant("cuda_mma_blocks", dt, q, M, N, K, off);
        }
      check_mma_variant_nonfinite("cuda_mma_blocks", dt, q);
    }
  // What it declines, and says so: fp32, M = 9, Q8_0, Q4_1 weights at a 2-byte offset, Q4_0
  // weights at a 1-byte offset, x one element (2 bytes) past 8-byte alignment
  kstest::ScopedVariant pin("quant_matmul", "cuda_mma_blocks");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  DBuf x32(DType::F32, {1, 64}), o32(DType::F32, {1, 3}), x9(DType::BF16, {9, 64}), o9(DType::BF16, {9, 3});
  DBuf x1(DType::BF16, {1, 64}), o1(DType::BF16, {1, 3}), x1off(DType::BF16, {1, 64}, 2);
  DBuf w41(DType::U8, {3, 2 * 20}), w80(DType::U8, {3, 2 * 34}), w41off(DType::U8, {3, 2 * 20}, 2);
  DBuf w40off(DType::U8, {3, 2 * 18}, 1);
  EXPECT_THROW(ks::quant_matmul(o32.view(), x32.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_THROW(ks::quant_matmul(o9.view(), x9.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_THROW(ks::quant_matmul(o1.view(), x1.view(), w80.view(), ks::QType::Q8_0, ks::Backend::Cuda), ks::Error);
  EXPECT_THROW(ks::quant_matmul(o1.view(), x1.view(), w41off.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("aligned"), std::string::npos) << ks_last_error();
  EXPECT_THROW(ks::quant_matmul(o1.view(), x1.view(), w40off.view(), ks::QType::Q4_0, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("aligned"), std::string::npos) << ks_last_error();
  EXPECT_THROW(ks::quant_matmul(o1.view(), x1off.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("x not 8-byte aligned"), std::string::npos) << ks_last_error();
}

// quant_matmul's cuda_mma_stream (bf16 / fp16 x at M <= 8, fp32 x at M <= 2 as three bf16 pieces;
// Q4_0 / Q4_1 / Q8_0; persistent CTAs streaming the rows through a cp.async ring), by
// check_mma_variant: the cuda_mma_blocks shapes, plus groups of 2 and 4 tiles per stage with a
// partial last tile (N = 8200 and 16400 at K = 576), rows in many chunks with a partial last one
// (K = 14336; K = 4192: 131 blocks), several groups per CTA, weights 16 bytes into their
// allocation, Q8_0 with every code byte drawn (including -128). NaN and inf in x reach exactly
// their rows. fp32 x runs at most 2 rows.
TEST(Cuda, QuantMatmulMmaStreamVariant) {
  NEED_GPU();
  for (DType dt : {DType::BF16, DType::F16, DType::F32})
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0}) {
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 1, 32}, {1, 37, 416}, {3, 16, 64}, {8, 50, 576}, {5, 4096 + 9, 4096}, {1, 600, 4096},
               {7, 33, 1536}, {1, 16400, 576}, {2, 8200, 576}, {1, 300, 14336}, {2, 70, 4192}})
        for (size_t off : {size_t(0), size_t(16)})
          check_mma_variant("cuda_mma_stream", dt, q, dt == DType::F32 ? std::min<int64_t>(M, 2) : M, N, K, off,
                            /*random_codes=*/true);
      check_mma_variant_nonfinite("cuda_mma_stream", dt, q);
    }
  // What it declines, and says so: fp32 x of 3 rows, bf16 of 9, weights 4 bytes past 16-byte
  // alignment; it takes x at any element offset (its pairs are staged by element loads)
  kstest::ScopedVariant pin("quant_matmul", "cuda_mma_stream");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  DBuf x3(DType::F32, {3, 64}), o3(DType::F32, {3, 3}), x9(DType::BF16, {9, 64}), o9(DType::BF16, {9, 3});
  DBuf x1(DType::BF16, {1, 64}), o1(DType::BF16, {1, 3}), w41(DType::U8, {3, 2 * 20}), w41off(DType::U8, {3, 2 * 20}, 4);
  EXPECT_THROW(ks::quant_matmul(o3.view(), x3.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("three"), std::string::npos) << ks_last_error();
  EXPECT_THROW(ks::quant_matmul(o9.view(), x9.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_THROW(ks::quant_matmul(o1.view(), x1.view(), w41off.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("16-byte aligned"), std::string::npos) << ks_last_error();
}

// quant_matmul_a8 (x quantized to int8 per block; docs/contracts.md#quant_matmul_a8): the contract
// fixes every rounding and the summation order, so the automatic choice and each CUDA variant must
// give the CPU reference's bits (NaN rows: NaN, whatever the payload). Shapes: one block, partial pairs and lone last
// rows (N odd, N < and > the SM count), K = 576 (18 blocks: lanes idle), 4096 and 14336 (several
// blocks per lane), 14336 x 4096 (more stages than ring slots: 19 on 8 for Q8_0, 4-5 on 3 for
// Q4_x; 20000 x 576 fills 1-3 slots once), 600005 x 32 (a
// 20-byte or 18-byte row per output); weights 0, 16, 4 and 2 bytes into their allocation (4:
// cuda_a8_resident's rows as in memory, where 0 and 16 pad Q4_0 / Q8_0 rows of a multiple of 16
// bytes: K 1536, 4096, 14336, 32768, and 1280, whose Q8_0 rows end in a partial group of 8 of
// the 16 blocks; 2: no bulk copies, and for the 2-byte aligned formats the byte-load path of
// cuda_a8_warp); M 1 and 3
// (cuda_a8_bulk_stream and cuda_a8_resident decline M > 1 and say so; cuda_a8_resident: 1 to 16 rows
// per CTA, N below its grid, a lone last row per CTA). A NaN in one row's block and an inf in
// another's make those rows NaN and leave the third finite.
// The linear ops on CUDA take x [..., K] -> out [..., N]: a [2, 3, K] call gives the bits of the
// same memory viewed as [6, K] (the same M, so the same routing), and a 1-D x those of [1, K].
TEST(Cuda, LinearOpsTakeLeadingDims) {
  NEED_GPU();
  const int64_t K = 576, N = 72;
  for (DType dt : kstest::float_dtypes())
    for (const std::string op : {"gemm", "quant_matmul", "quant_matmul_a8"}) {
      SCOPED_TRACE(op + " " + ks::dtype_name(dt));
      Buf hx(dt, {2, 3, K});
      kstest::fill_normal(hx);
      Buf hw = op == "gemm" ? Buf(dt, {N, K}) : kstest::gguf::make_packed(KS_QTYPE_Q4_1, N, K);
      if (op == "gemm") kstest::fill_normal(hw);
      DBuf x(dt, {2, 3, K}), w(hw.dtype, hw.shape), out3(dt, {2, 3, N}), out2(dt, {6, N}), o1(dt, {N}), o11(dt, {1, N});
      x.upload(hx);
      w.upload(hw);
      out3.poison(), out2.poison(), o1.poison(), o11.poison();
      const ks::TensorView x2(x.data(), dt, {6, K}, DLDevice{kDLCUDA, 0}), x1(x.data(), dt, {K}, DLDevice{kDLCUDA, 0}),
          x11(x.data(), dt, {1, K}, DLDevice{kDLCUDA, 0});
      auto call = [&](const ks::TensorView& o, const ks::TensorView& a) {
        if (op == "gemm") ks::gemm(o, a, w.view(), ks::Backend::Cuda);
        else if (op == "quant_matmul") ks::quant_matmul(o, a, w.view(), ks::QType::Q4_1, ks::Backend::Cuda);
        else ks::quant_matmul_a8(o, a, w.view(), ks::QType::Q4_1, ks::Backend::Cuda);
      };
      call(out3.view(), x.view());
      call(out2.view(), x2);
      call(o1.view(), x1);
      call(o11.view(), x11);
      CK(cudaDeviceSynchronize());
      Buf h3(dt, {2, 3, N}), h2(dt, {6, N}), h1(dt, {N}), h11(dt, {1, N});
      out3.download(h3), out2.download(h2), o1.download(h1), o11.download(h11);
      EXPECT_EQ(std::memcmp(h3.data(), h2.data(), h2.nbytes()), 0);
      EXPECT_EQ(std::memcmp(h1.data(), h11.data(), h1.nbytes()), 0);
      double nonzero = 0;
      for (int64_t i = 0; i < 6 * N; ++i) nonzero += std::fabs(h2.get(i));
      EXPECT_GT(nonzero, 0.0);  // (outputs written, not the poison's NaN: a NaN makes the sum NaN, not > 0)
    }
}

TEST(Cuda, QuantMatmulA8MatchesTheCpuBitForBit) {
  NEED_GPU();
  using namespace kstest::gguf;
  auto same = [](const Buf& a, const Buf& b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const double x = a.get(i), y = b.get(i);
      const bool both_nan = std::isnan(x) && std::isnan(y);
      if (!both_nan && !(x == y && std::signbit(x) == std::signbit(y)))
        return ::testing::AssertionFailure() << "element " << i << ": " << x << " vs CPU " << y;
    }
    return ::testing::AssertionSuccess();
  };
  struct Case {
    int64_t M, N, K;
  };
  const std::vector<Case> cases{{1, 1, 32},     {1, 7, 64},      {1, 131, 576},  {1, 133, 576}, {1, 4096 + 9, 4096},
                                {1, 300, 14336}, {1, 14336, 4096}, {1, 20000, 576}, {1, 600005, 32}, {3, 50, 576},
                                {3, 33, 1536}, {1, 50, 32768},  // (32768: x's 16-byte staging takes two rounds)
                                {1, 77, 1280}, {1, 260, 1536}};
  for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
    for (const Case& c : cases)
      for (size_t off : {size_t(0), size_t(16), size_t(4), size_t(2)}) {
        if (c.N * c.K > 4096 * 4096 && (off == 4 || off == 2)) continue;  // large shapes: 16-byte aligned only
        Buf w = make_packed(q, c.N, c.K, nullptr, off);  // made and uploaded once for the three dtypes
        DBuf dw(DType::U8, w.shape, off);
        dw.upload(w);
        for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " " + qfmt(q).name + " M " + std::to_string(c.M) + " N " +
                       std::to_string(c.N) + " K " + std::to_string(c.K) + " weight offset " + std::to_string(off));
          Buf x(dt, {c.M, c.K}), ref(dt, {c.M, c.N}), got(dt, {c.M, c.N});
          kstest::fill_normal(x);
          if (c.M == 3) {
            x.set(0 * c.K + 5, std::nan(""));
            x.set(2 * c.K + c.K - 1, -INFINITY);
          }
          // hostile blocks of one row (the bulk stream's x staging, value by value or by 16-byte
          // pieces): N 131 a NaN and an infinity (every output NaN, which `same` accepts on both
          // sides); N 133 a block of values under FLT_MIN * 127 (scale 0) and one of equal
          // magnitudes (finite outputs, compared bit for bit)
          const bool nonfinite = c.M == 1 && c.N == 131;
          if (nonfinite) {
            x.set(32 + 9, std::nan(""));
            x.set(64 + 31, INFINITY);
          }
          if (c.M == 1 && c.N == 133) {
            for (int i = 0; i < 32; ++i) x.set(96 + i, (i % 2 ? -1 : 1) * 1e-39);
            for (int i = 0; i < 32; ++i) x.set(128 + i, i % 3 ? 0.5 : -0.5);
          }
          ks::quant_matmul_a8(ks::TensorView(ref.data(), dt, ref.shape, DLDevice{kDLCPU, 0}),
                              ks::TensorView(x.data(), dt, x.shape, DLDevice{kDLCPU, 0}),
                              ks::TensorView(w.data(), DType::U8, w.shape, DLDevice{kDLCPU, 0}),
                              static_cast<ks::QType>(q), ks::Backend::Cpu);
          // x two elements past a 16-byte boundary where the weights are at 16: the bulk stream's
          // value-by-value staging
          DBuf dx(dt, x.shape, off == 16 ? 2 * ks::dtype_size(dt) : 0), dout(dt, ref.shape);
          dx.upload(x);
          for (const char* v : {"", "cuda_a8_warp", "cuda_a8_bulk_stream", "cuda_a8_resident"}) {
            SCOPED_TRACE(*v ? v : "auto");
            kstest::ScopedVariant pin("quant_matmul_a8", v);
            ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
            dout.poison();
            const ks::TensorView vo = dout.view(), va = dx.view(), vb = dw.view();  // own the shapes
            DLTensor o = vo.dl(), a = va.dl(), b = vb.dl();
            const ks_status_t st = ks_quant_matmul_a8(&o, &a, &b, q, KS_BACKEND_CUDA, nullptr);
            const bool bulk_declines = c.M > 1 || off == 4 || off == 2 || w.shape[1] % 4 != 0;
            if (std::string(v) == "cuda_a8_bulk_stream" && bulk_declines) {
              EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << ks_last_error();
              continue;
            }
            // the resident kernel: one row, 4-byte word loads, and matrices that fit the SMs' shared
            // memory in one wave (an H100 / H200's 132 x 228 KB: every case up to 18 MB here
            // fits, every larger one, 33 MB and up, does not)
            const bool resident_declines = c.M > 1 || off == 2 || w.shape[1] % 4 != 0 || c.N * w.shape[1] > (24 << 20);
            if (std::string(v) == "cuda_a8_resident" && resident_declines) {
              EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << ks_last_error();
              continue;
            }
            ASSERT_EQ(st, KS_SUCCESS) << ks_last_error();
            if (std::string(v) == "cuda_a8_resident" && !std::getenv("KS_QMM_A8_RES_BULK")) {
              // padded rows (KS_QMM_A8_RES_PAD=1) exactly where a8_row_pad has a layout and the rows
              // are 16-byte pieces
              const char* pad_env = std::getenv("KS_QMM_A8_RES_PAD");
              const bool padded = pad_env && std::atoi(pad_env) != 0 && q != KS_QTYPE_Q4_1 && off % 16 == 0 &&
                                  w.shape[1] % 16 == 0;
              EXPECT_NE(std::string(ks_last_launch_config("quant_matmul_a8")).find(padded ? "padded=1" : "padded=0"),
                        std::string::npos)
                  << ks_last_launch_config("quant_matmul_a8");
            }
            CK(cudaDeviceSynchronize());
            dout.download(got);
            EXPECT_TRUE(same(got, ref, c.M * c.N));
            if (nonfinite) EXPECT_TRUE(std::isnan(got.get(0)) && std::isnan(got.get(c.N - 1)));
            if (c.M == 3)
              for (int64_t n = 0; n < c.N; ++n) {
                EXPECT_TRUE(std::isnan(got.get(n)) && std::isnan(got.get(2 * c.N + n)) && !std::isnan(got.get(c.N + n)))
                    << n;
              }
          }
        }
      }
}

// cuda_a8_resident lets the next kernel launch at its entry, before its own reads of x and its
// writes: a chain of calls, each reading the previous one's output as x (N = K), enqueued back to
// back with no synchronization between them, must still give the CPU reference's bits at every
// step (the next call's griddepcontrol.wait covers the previous grid's completion). Also under a
// CUDA graph, replayed twice: the second replay's first call reads the first replay's last output
// (the ping-pong buffers alias across replays).
TEST(Cuda, QuantMatmulA8ResidentChainKeepsTheOrder) {
  NEED_GPU();
  using namespace kstest::gguf;
  constexpr int64_t K = 4096, kSteps = 6;
  for (ks_qtype_t q : {KS_QTYPE_Q4_1, KS_QTYPE_Q8_0, KS_QTYPE_Q4_0}) {  // (Q8_0, Q4_0: padded rows)
    SCOPED_TRACE(qfmt(q).name);
    kstest::ScopedVariant pin("quant_matmul_a8", "cuda_a8_resident");
    ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
    std::vector<Buf> w;
    std::vector<std::unique_ptr<DBuf>> dw;
    for (int i = 0; i < 2; ++i) {  // two matrices, alternating, so consecutive calls differ
      w.push_back(make_packed(q, K, K, nullptr, 0));
      dw.push_back(std::make_unique<DBuf>(DType::U8, w.back().shape));
      dw.back()->upload(w.back());
    }
    Buf x0(DType::BF16, {1, K});
    kstest::fill_normal(x0);
    // the CPU chain: y_{i+1} = W_{i mod 2} y_i
    std::vector<Buf> ref;
    ref.push_back(x0);
    for (int i = 0; i < 2 * kSteps; ++i) {
      Buf y(DType::BF16, {1, K});
      Buf& xi = ref.back();
      ks::quant_matmul_a8(ks::TensorView(y.data(), DType::BF16, y.shape, DLDevice{kDLCPU, 0}),
                          ks::TensorView(xi.data(), DType::BF16, xi.shape, DLDevice{kDLCPU, 0}),
                          ks::TensorView(w[i % 2].data(), DType::U8, w[i % 2].shape, DLDevice{kDLCPU, 0}),
                          static_cast<ks::QType>(q), ks::Backend::Cpu);
      ref.push_back(y);
    }
    std::vector<std::unique_ptr<DBuf>> act;  // x0, then each step's output in its own buffer
    for (int i = 0; i <= kSteps; ++i) act.push_back(std::make_unique<DBuf>(DType::BF16, std::vector<int64_t>{1, K}));
    auto enqueue = [&](cudaStream_t st, int first) {
      for (int i = 0; i < kSteps; ++i) {
        const ks::TensorView vo = act[i + 1]->view(), va = act[i]->view(), vb = dw[(first + i) % 2]->view();
        DLTensor o = vo.dl(), a = va.dl(), b = vb.dl();
        ASSERT_EQ(ks_quant_matmul_a8(&o, &a, &b, q, KS_BACKEND_CUDA, st), KS_SUCCESS) << ks_last_error();
      }
    };
    auto expect_steps = [&](int base) {
      Buf got(DType::BF16, {1, K});
      for (int i = 1; i <= kSteps; ++i) {
        act[i]->download(got);
        for (int64_t n = 0; n < K; ++n)
          ASSERT_EQ(got.get(n), ref[base + i].get(n)) << "step " << base + i << " element " << n;
      }
    };
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    act[0]->upload(x0);
    for (int i = 1; i <= kSteps; ++i) act[i]->poison();
    CK(cudaDeviceSynchronize());  // (the poison, on the legacy stream, before st's work)
    enqueue(st, 0);
    CK(cudaStreamSynchronize(st));
    expect_steps(0);
    // a graph of the same chain, but its x is step kSteps' output: replayed after copying that
    // output to act[0] in the stream (each replay continues the chain by kSteps)
    act[0]->upload(x0);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    enqueue(st, 0);
    CK(cudaMemcpyAsync(act[0]->data(), act[kSteps]->data(), K * 2, cudaMemcpyDeviceToDevice, st));
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 1; i <= kSteps; ++i) act[i]->poison();
    CK(cudaDeviceSynchronize());
    CK(cudaGraphLaunch(exec, st));
    CK(cudaStreamSynchronize(st));
    expect_steps(0);
    CK(cudaGraphLaunch(exec, st));  // steps kSteps + 1 .. 2 kSteps (kSteps is even: W alternates alike)
    CK(cudaStreamSynchronize(st));
    expect_steps(kSteps);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(st));
  }
}

// quant_matmul's cuda_mma_diag (M = 1: B's 8 columns carry 8 blocks of the one row; bf16 / fp16 x;
// Q4_0 / Q4_1 / Q8_0; per-warp rings of bulk copies), by check_mma_variant: one block (7 of the
// group's 8 columns empty), 13 and 18 blocks (a partial last group), rows whose 8-block groups
// start anywhere within a 16-byte piece (K = 416, 576, 1536, 4192), several units per warp, so
// ring slots reused over several barrier phases (on an H200's plan: 5-6 units per warp of 24 at
// 16384 x 4096, about 12 at 600000 x 32 and 6 at 300000 x 96, every format), more tiles per CTA
// than one batch of row sums holds (600000 x 32: 285 tiles against 256), N not a multiple
// of 16 (a partial last tile; the weights' last row ends in a partial 16-byte piece where
// N x row bytes is not a multiple of 16, copied by plain loads), 448 blocks (K = 14336: x's
// staging by several passes), weights 16 bytes into their allocation, Q8_0 with every code byte
// drawn (including -128). A NaN in x makes every output NaN, an inf every output non-finite, in
// separate calls after a finite one (no state carried between calls); x at a 2-byte offset gives
// the same bits.
TEST(Cuda, QuantMatmulMmaDiagVariant) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : {DType::BF16, DType::F16})
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0}) {
      for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 32}, {37, 416}, {50, 576}, {4096 + 9, 4096}, {600, 4096}, {33, 1536}, {16400, 576}, {8200, 576},
               {300, 14336}, {70, 4192}, {2048, 4096}, {16384, 4096}, {600000 + 5, 32}, {300000, 96}})
        for (size_t off : {size_t(0), size_t(16)})
          check_mma_variant("cuda_mma_diag", dt, q, 1, N, K, off, /*random_codes=*/true);
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + ", non-finite x");
      const int64_t N = 40, K = 256;
      Buf w = make_packed(q, N, K);
      DBuf dw(DType::U8, w.shape), dx(dt, {1, K}), dout(dt, {1, N});
      dw.upload(w);
      kstest::ScopedVariant pin("quant_matmul", "cuda_mma_diag");
      ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
      for (int pass = 0; pass < 3; ++pass) {  // finite, a NaN at 77, +inf at 200
        Buf x(dt, {1, K}), got(dt, {1, N});
        kstest::fill_normal(x);
        if (pass == 1) x.set(77, std::nan(""));
        if (pass == 2) x.set(200, INFINITY);
        dx.upload(x);
        dout.poison();
        ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        for (int64_t n = 0; n < N; ++n) {
          if (pass == 0) EXPECT_TRUE(std::isfinite(got.get(n))) << n;
          if (pass == 1) EXPECT_TRUE(std::isnan(got.get(n))) << n;
          if (pass == 2) EXPECT_FALSE(std::isfinite(got.get(n))) << n;  // inf, or NaN where inf * w meets -inf
        }
      }
    }
  // x one element past any alignment: its values are staged by element loads, the same bits
  {
    using namespace kstest::gguf;
    const int64_t N = 100, K = 576;
    Buf x(DType::BF16, {1, K}), a(DType::BF16, {1, N}), b(DType::BF16, {1, N});
    kstest::fill_normal(x);
    Buf w = make_packed(KS_QTYPE_Q4_1, N, K);
    DBuf dx(DType::BF16, {1, K}), dxoff(DType::BF16, {1, K}, 2), dw(DType::U8, w.shape), da(DType::BF16, {1, N}),
        db(DType::BF16, {1, N});
    dx.upload(x);
    dxoff.upload(x);
    dw.upload(w);
    da.poison();
    db.poison();
    kstest::ScopedVariant pin("quant_matmul", "cuda_mma_diag");
    ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
    ks::quant_matmul(da.view(), dx.view(), dw.view(), ks::QType::Q4_1, ks::Backend::Cuda);
    ks::quant_matmul(db.view(), dxoff.view(), dw.view(), ks::QType::Q4_1, ks::Backend::Cuda);
    CK(cudaDeviceSynchronize());
    da.download(a);
    db.download(b);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), size_t(N) * 2)) << "x at a 2-byte offset differs";
  }
  // What it declines, and says so: two rows of x, fp32 x, weights 4 bytes past 16-byte alignment
  kstest::ScopedVariant pin("quant_matmul", "cuda_mma_diag");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  DBuf x2(DType::BF16, {2, 64}), o2(DType::BF16, {2, 3}), x32(DType::F32, {1, 64}), o32(DType::F32, {1, 3});
  DBuf x1(DType::BF16, {1, 64}), o1(DType::BF16, {1, 3}), w41(DType::U8, {3, 2 * 20}), w41off(DType::U8, {3, 2 * 20}, 4);
  EXPECT_THROW(ks::quant_matmul(o2.view(), x2.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("M != 1"), std::string::npos) << ks_last_error();
  EXPECT_THROW(ks::quant_matmul(o32.view(), x32.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_THROW(ks::quant_matmul(o1.view(), x1.view(), w41off.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("16-byte aligned"), std::string::npos) << ks_last_error();
}

// quant_matmul's cuda_mma_rows (any M; bf16 / fp16 / fp32 x; Q4_0 / Q4_1 / Q8_0), by
// check_mma_variant (every element against FP64 with the factored sums' bound, the CPU, and row 0
// and row M - 1 bit for bit against one-row calls, which always run one group per CTA:
// batch-invariant): M = 1 (one group, 7 columns of zeros), 2, 9 (a second group, mostly empty),
// 16, 17, 32, 33, 100 and 257 (several CTAs of rows); N not a multiple of 16, N = 4105 (2 tiles
// per CTA), 8200 (4) and 16400 (8: one warp per tile, K unsplit); K of one block, 13 blocks (the
// splits' shares unequal), 48, and 131 (fp32 on the H200: chunks of 56-64 blocks); Q8_0 codes over
// all 256 byte values; weights at 2- and 4-byte offsets where the format's words allow. The
// default plan gives most of these one group per CTA, so 33, 100 and 257 rows also run at 2, 3
// and 4 groups per CTA (KS_QMM_ROWS_GROUPS), once with stages of 8 blocks and the grid's y capped
// at 2 (each CTA loops over several row ranges). NaN and inf in x reach exactly their rows.
TEST(Cuda, QuantMatmulMmaRowsVariant) {
  NEED_GPU();
  for (DType dt : {DType::BF16, DType::F16, DType::F32})
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0}) {
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 1, 32}, {2, 37, 416}, {9, 16, 64}, {16, 50, 576}, {17, 33, 1536}, {32, 576, 576}, {33, 200, 576},
               {100, 70, 4192}, {257, 24, 256}, {12, 4105, 576}, {40, 8200, 64}, {3, 16400, 576}})
        for (size_t off : {size_t(0), size_t(2), size_t(4)}) {
          if (off == 2 && (q == KS_QTYPE_Q4_1 || N > 1000)) continue;  // Q4_1's words: 4-byte alignment
          if (off == 4 && N > 1000) continue;
          check_mma_variant("cuda_mma_rows", dt, q, M, N, K, off, /*random_codes=*/true);
        }
      for (const char* groups : {"2", "3", "4"}) {
        kstest::ScopedEnv g("KS_QMM_ROWS_GROUPS", groups);
        for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{33, 200, 576}, {100, 70, 4192}, {257, 24, 256}}) {
          check_mma_variant("cuda_mma_rows", dt, q, M, N, K, 0, /*random_codes=*/true);
          // the M-row call ran that many groups per CTA (its launch record; values do not matter)
          const int64_t bb = q == KS_QTYPE_Q4_1 ? 20 : q == KS_QTYPE_Q4_0 ? 18 : 34;
          DBuf px(dt, {M, K}), pw(DType::U8, {N, K / 32 * bb}), po(dt, {M, N});
          px.poison();
          pw.poison();
          kstest::ScopedVariant pin("quant_matmul", "cuda_mma_rows");
          ks::quant_matmul(po.view(), px.view(), pw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          CK(cudaDeviceSynchronize());
          const std::string cfg = ks_last_launch_config("quant_matmul");
          EXPECT_NE(cfg.find(std::string("x_groups_per_cta=") + groups + " "), std::string::npos) << cfg;
        }
      }
      {
        kstest::ScopedEnv g("KS_QMM_ROWS_GROUPS", "3"), st("KS_QMM_ROWS_STAGE_KB", "8"), y("KS_QMM_ROWS_MAX_GRID_Y", "2");
        check_mma_variant("cuda_mma_rows", dt, q, 100, 70, 576, 0, /*random_codes=*/true);
      }
      check_mma_variant_nonfinite("cuda_mma_rows", dt, q);
    }
  // What it declines, and says so: fp32 x 4 bytes past 8-byte alignment, Q4_1 weights at a 2-byte
  // offset
  kstest::ScopedVariant pin("quant_matmul", "cuda_mma_rows");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  DBuf xoff(DType::F32, {2, 64}, 4), o2(DType::F32, {2, 3}), w41(DType::U8, {3, 2 * 20}), w41off(DType::U8, {3, 2 * 20}, 2);
  DBuf x2(DType::F32, {2, 64});
  EXPECT_THROW(ks::quant_matmul(o2.view(), xoff.view(), w41.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("8-byte"), std::string::npos) << ks_last_error();
  EXPECT_THROW(ks::quant_matmul(o2.view(), x2.view(), w41off.view(), ks::QType::Q4_1, ks::Backend::Cuda), ks::Error);
  EXPECT_NE(std::string(ks_last_error()).find("aligned"), std::string::npos) << ks_last_error();
}

// cuda_mma_rows' plan switches (KS_QMM_ROWS_GROUPS, KS_QMM_ROWS_STAGE_KB, KS_QMM_ROWS_PREFETCH)
// change how the work is laid out, never a sum's order: the same bits as the default plan, for
// one group per CTA, stages of 8 blocks (K = 576 and 4192 in chunks) and the L2 prefetch.
TEST(Cuda, QuantMatmulMmaRowsPlanSwitchesKeepTheBits) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : {DType::F32, DType::BF16})
    for (ks_qtype_t q : {KS_QTYPE_Q4_1, KS_QTYPE_Q8_0, KS_QTYPE_Q4_0})
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{32, 3072, 576}, {19, 600, 4192}}) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M=" + std::to_string(M) +
                     " N=" + std::to_string(N) + " K=" + std::to_string(K));
        Buf x(dt, {M, K}), a(dt, {M, N}), b(dt, {M, N});
        kstest::fill_normal(x);
        Buf w = make_packed(q, N, K);
        DBuf dx(dt, {M, K}), dw(DType::U8, w.shape), dout(dt, {M, N});
        dx.upload(x);
        dw.upload(w);
        kstest::ScopedVariant pin("quant_matmul", "cuda_mma_rows");
        ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
        dout.poison();
        ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(a);
        {
          kstest::ScopedEnv groups("KS_QMM_ROWS_GROUPS", "1"), stage("KS_QMM_ROWS_STAGE_KB", "8"),
              prefetch("KS_QMM_ROWS_PREFETCH", "1");
          dout.poison();
          ks::quant_matmul(dout.view(), dx.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          const std::string cfg = ks_last_launch_config("quant_matmul");
          // (8 KB stages: 8 blocks of fp32 x or bf16 with Q4_1's X sums, 16 of bf16 otherwise)
          const int64_t kc = dt == DType::F32 || q == KS_QTYPE_Q4_1 ? 8 : 16;
          EXPECT_NE(cfg.find("x_groups_per_cta=1 blocks_per_chunk=" + std::to_string(kc) + " "), std::string::npos) << cfg;
          EXPECT_NE(cfg.find("prefetch=1"), std::string::npos) << cfg;
          CK(cudaDeviceSynchronize());
          dout.download(b);
        }
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
      }
}

// The routing on sm_90 (sm_90.json): fp32 quant_matmul of 8 rows and more runs cuda_mma_rows,
// 7 rows cuda_staged_x; at an output head's N x K (49152 x 576, Q8_0) cuda_mma_rows from 4 rows,
// cuda_staged_x at 3; and the plan's groups of x per CTA (fp32 x, K = 576): 1 group where 36
// CTAs of weight rows would leave SMs idle (576 x 576 at 32 rows); at 32 rows of 3072 x 576 (192
// CTAs of rows: a CTA per SM is enough for 4 groups) 4 groups would stage the row in chunks and
// 3 stage it whole, evened out to 2 + 2; 5 groups of 1536 x 576 (96 CTAs of rows): 3 + 2.
// Elsewhere the registry's order, so this only checks Hopper.
TEST(Cuda, QuantMatmulRowsRouting) {
  NEED_GPU();
  int major = 0;
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) GTEST_SKIP() << "sm_90.json's cells apply to Hopper only";
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Case {
    int64_t m, n;
    ks::QType q;
    std::string expect;
  };
  const std::vector<Case> cases{
      {7, 576, ks::QType::Q4_1, "staged_rows=1"},
      {8, 576, ks::QType::Q4_1, "mma_rows"},
      {64, 576, ks::QType::Q4_1, "mma_rows"},
      {3, 49152, ks::QType::Q8_0, "staged_rows=1"},
      {4, 49152, ks::QType::Q8_0, "mma_rows"},
      {32, 576, ks::QType::Q4_1, sms > 72 ? "x_groups_per_cta=1 " : "mma_rows"},  // (36 CTAs of rows)
      // (the two below hold on the H200's 132 SMs and on any device with 96 to 191)
      {32, 3072, ks::QType::Q4_1, sms >= 96 && sms < 192 ? "x_groups_per_cta=2 " : "mma_rows"},
      {40, 1536, ks::QType::Q4_1, sms >= 96 && sms < 192 ? "x_groups_per_cta=3 " : "mma_rows"},
  };
  for (const Case& c : cases) {
    const int64_t block_bytes = c.q == ks::QType::Q8_0 ? 34 : 20;
    DBuf x(DType::F32, {c.m, 576}), w(DType::U8, {c.n, 18 * block_bytes}), o(DType::F32, {c.m, c.n});
    x.poison();  // (values do not matter here: the launch record does)
    w.poison();
    ks::quant_matmul(o.view(), x.view(), w.view(), c.q, ks::Backend::Cuda);
    CK(cudaDeviceSynchronize());
    EXPECT_NE(std::string(ks_last_launch_config("quant_matmul")).find(c.expect), std::string::npos)
        << "M = " << c.m << ", N = " << c.n << ": " << ks_last_launch_config("quant_matmul");
  }
}

// The decode-step fusions on CUDA against the CPU (whose result is the unfused sequence's):
// fused_add_rms_norm_quant_matmul with and without x, aligned (vector loads) and offset by one
// element (scalar loads), M = 1 (the one-row kernel) and M = 5 (a 4-row chunk and a partial
// one), rows staged in shared memory and rows too wide for it. residual_out = round(x + residual) is the same FP32 sum on both: bit for bit.
// Dense F32 / F16 / BF16 weights too (dense_matmul_kernel with the prologue; also K = 100, by
// elements), their launch reporting that kernel.
TEST(Cuda, FusedNormQuantMatmulAgainstCpu) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0, KS_QTYPE_F32, KS_QTYPE_F16, KS_QTYPE_BF16})
      // K = 11008 at M = 1 and 4096 at M = 4: rows too wide to stage in shared memory (the
      // per-warp prologue kernel); the others stage them
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 576, 576}, {5, 37, 64}, {4, 130, 1536}, {1, 37, 11008}, {4, 9, 4096}, {9, 70, 100}})
        for (bool with_x : {true, false}) {
          const bool dense = q == KS_QTYPE_F32 || q == KS_QTYPE_F16 || q == KS_QTYPE_BF16;
          if (K % 32 != 0 && !dense) continue;  // (the block formats: whole blocks)
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M=" + std::to_string(M) +
                       " N=" + std::to_string(N) + " K=" + std::to_string(K) + (with_x ? " with x" : " residual only"));
          Buf res(dt, {M, K}), x(dt, {M, K}), nw(dt, {K}), ref(dt, {M, N}), ref_ro(dt, {M, K}), got(dt, {M, N}),
              got_ro(dt, {M, K});
          kstest::fill_normal(res);
          kstest::fill_normal(x);
          kstest::fill_normal(nw, 1.0, 1.0);
          Buf w = make_packed(q, N, K);
          const ks::TensorView none;
          ks::fused_add_rms_norm_quant_matmul(ref.view(), with_x ? ref_ro.view() : none, with_x ? x.view() : none,
                                              res.view(), nw.view(), 1e-5, w.view(), static_cast<ks::QType>(q),
                                              ks::Backend::Cpu);
          for (size_t off : {size_t(0), size_t(1)}) {
            const size_t eo = off ? ks::dtype_size(dt) : 0;
            DBuf dres(dt, {M, K}, eo), dx(dt, {M, K}, eo), dnw(dt, {K}, eo), dw(DType::U8, w.shape, off),
                dout(dt, {M, N}, eo), dro(dt, {M, K}, eo);
            dres.upload(res);
            dx.upload(x);
            dnw.upload(nw);
            dw.upload(w);
            dout.poison();
            dro.poison();
            ks::fused_add_rms_norm_quant_matmul(dout.view(), with_x ? dro.view() : none, with_x ? dx.view() : none,
                                                dres.view(), dnw.view(), 1e-5, dw.view(), static_cast<ks::QType>(q),
                                                ks::Backend::Cuda);
            if (dense)
              EXPECT_NE(std::string(ks_last_launch_config("fused_add_rms_norm_quant_matmul")).find("dense_warp_per_column"),
                        std::string::npos);
            CK(cudaDeviceSynchronize());
            dout.download(got);
            // the norm's sum in another order can move a normalized value across a rounding
            // boundary of the dtype: one unit of it per product, on top of quant_matmul's bound
            const double unit = dt == DType::BF16 ? 0x1p-8 : dt == DType::F16 ? 0x1p-11 : 0x1p-24;
            EXPECT_TRUE(close_to_cpu(got, ref, 16 * std::sqrt(double(K)) * 6e-8 * double(K) + 4 * unit * double(K)))
                << "offset " << off;
            if (with_x) {
              dro.download(got_ro);
              EXPECT_EQ(0, std::memcmp(got_ro.data(), ref_ro.data(), ref_ro.nbytes())) << "residual_out, offset " << off;
            }
          }
        }
}

// The norm fusion's row does not depend on M (M = 1 kernel vs the row inside M = 9), with rows
// staged in shared memory (K = 576) and not (K = 4096: the launcher decides by K alone, so the
// sum of squares keeps one order at every M; a review found it had depended on M; K = 100: dense
// BF16 weights, the dense kernel), and with no
// output column (N = 0) residual_out is still written.
TEST(Cuda, FusedNormQuantMatmulRowDoesNotDependOnMAndNoColumns) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (int64_t K : {int64_t(576), int64_t(4096), int64_t(100)})
      for (bool with_x : {true, false}) {
        // (K = 100: BF16 weights, the dense kernel by elements; else Q4_1)
        const ks_qtype_t qt = K % 32 ? KS_QTYPE_BF16 : KS_QTYPE_Q4_1;
        const ks::QType q = static_cast<ks::QType>(qt);
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " K=" + std::to_string(K) + (with_x ? " with x" : " residual only"));
        const int64_t M = 9, N = 70;
        Buf res(dt, {M, K}), x(dt, {M, K}), nw(dt, {K}), all(dt, {M, N}), one(dt, {1, N});
        kstest::fill_normal(res);
        kstest::fill_normal(x);
        kstest::fill_normal(nw, 1.0, 1.0);
        Buf w = make_packed(qt, N, K);
        DBuf dres(dt, {M, K}), dx(dt, {M, K}), dnw(dt, {K}), dw(DType::U8, w.shape), dall(dt, {M, N}), dro(dt, {M, K});
        dres.upload(res);
        dx.upload(x);
        dnw.upload(nw);
        dw.upload(w);
        const ks::TensorView none;
        ks::fused_add_rms_norm_quant_matmul(dall.view(), with_x ? dro.view() : none, with_x ? dx.view() : none, dres.view(),
                                            dnw.view(), 1e-6, dw.view(), q, ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dall.download(all);
        const size_t es = ks::dtype_size(dt);
        for (int64_t r = 0; r < M; ++r) {
          Buf rr(dt, {1, K}), xr(dt, {1, K});
          std::memcpy(rr.data(), static_cast<const char*>(res.data()) + size_t(r * K) * es, size_t(K) * es);
          std::memcpy(xr.data(), static_cast<const char*>(x.data()) + size_t(r * K) * es, size_t(K) * es);
          DBuf drr(dt, {1, K}), dxr(dt, {1, K}), done(dt, {1, N}), dro1(dt, {1, K});
          drr.upload(rr);
          dxr.upload(xr);
          done.poison();
          ks::fused_add_rms_norm_quant_matmul(done.view(), with_x ? dro1.view() : none, with_x ? dxr.view() : none,
                                              drr.view(), dnw.view(), 1e-6, dw.view(), q, ks::Backend::Cuda);
          CK(cudaDeviceSynchronize());
          done.download(one);
          EXPECT_EQ(0, std::memcmp(one.data(), static_cast<const char*>(all.data()) + size_t(r * N) * es, size_t(N) * es))
              << "row " << r;
        }
        if (!with_x || K != 576) continue;
        // N = 0: only residual_out = round(x + residual)
        Buf ro(dt, {M, K}), want(dt, {M, K});
        for (int64_t i = 0; i < M * K; ++i) want.set(i, double(float(res.get(i)) + float(x.get(i))));
        DBuf dw0(DType::U8, {0, w.shape[1]}), dout0(dt, {M, 0}), dro0(dt, {M, K});
        dro0.poison();
        ks::fused_add_rms_norm_quant_matmul(dout0.view(), dro0.view(), dx.view(), dres.view(), dnw.view(), 1e-6,
                                            dw0.view(), q, ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dro0.download(ro);
        EXPECT_EQ(0, std::memcmp(ro.data(), want.data(), want.nbytes())) << "residual_out with N = 0";
      }
}

// silu_and_mul_quant_matmul on CUDA is bit for bit silu_and_mul then quant_matmul on CUDA (the
// same expression, rounding and dot-product order), aligned and offset by one element.
TEST(Cuda, SiluQuantMatmulEqualsTheTwoCudaSteps) {
  NEED_GPU();
  using namespace kstest::gguf;
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {1, 576, 1536}, {6, 33, 96}, {1, 33, 11008}, {5, 9, 4096}})  // the last two: not staged
        for (size_t off : {size_t(0), size_t(1)}) {
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M=" + std::to_string(M) +
                       " offset " + std::to_string(off));
          Buf gu(dt, {M, 2 * K}), a(dt, {M, N}), b(dt, {M, N}), cpu(dt, {M, N});
          kstest::fill_normal(gu, 2.0);
          Buf w = make_packed(q, N, K);
          const size_t eo = off ? ks::dtype_size(dt) : 0;
          DBuf dgu(dt, {M, 2 * K}, eo), dw(DType::U8, w.shape, off), dh(dt, {M, K}, eo), da(dt, {M, N}, eo),
              db(dt, {M, N}, eo);
          dgu.upload(gu);
          dw.upload(w);
          da.poison();
          db.poison();
          ks::silu_and_mul_quant_matmul(da.view(), dgu.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          ks::silu_and_mul(dh.view(), dgu.view(), ks::Backend::Cuda);
          {  // the fused op's sums are the per-warp kernel's; sm_90.json sends bf16 calls of one row
             // and 576 x 1536 to cuda_mma_blocks, whose sums round differently
            kstest::ScopedVariant pin("quant_matmul", "cuda_warp_per_column");
            ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
            ks::quant_matmul(db.view(), dh.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
          }
          CK(cudaDeviceSynchronize());
          da.download(a);
          db.download(b);
          EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
          ks::silu_and_mul_quant_matmul(cpu.view(), gu.view(), w.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
          EXPECT_TRUE(close_to_cpu(a, cpu, 16 * std::sqrt(double(K)) * 6e-8 * double(K) * 4)) << "vs the CPU";
        }
}

// silu_and_mul_quant_matmul's variant cuda_mma_rows (pinned) is bit for bit silu_and_mul then
// quant_matmul's cuda_mma_rows (pinned) on its output: the same values staged, the same sums;
// rows of 1 to 64 (partial groups, 3 and 4 groups per CTA, a capped grid whose CTAs loop over
// row ranges, chunks of 8 blocks with a short last one), 3 dtypes x 3 formats, weights offset by 16 bytes, non-finite
// gate values; and within the CPU's bound (the per-column kernels' order is not this one's).
TEST(Cuda, SiluQuantMatmulMmaRowsVariant) {
  NEED_GPU();
  using namespace kstest::gguf;
  struct C {
    int64_t M, N, K;
    const char* cap_y;     // KS_QMM_ROWS_MAX_GRID_Y, or nullptr
    const char* stage_kb;  // KS_QMM_ROWS_STAGE_KB, or nullptr (8: chunks of 8 blocks)
    const char* groups;    // KS_QMM_ROWS_GROUPS, or nullptr
  };
  for (DType dt : kstest::float_dtypes())
    for (ks_qtype_t q : {KS_QTYPE_Q4_0, KS_QTYPE_Q4_1, KS_QTYPE_Q8_0})
      for (const C c : {C{1, 576, 1536, nullptr, nullptr, nullptr}, C{9, 130, 64, nullptr, nullptr, nullptr},
                        C{33, 576, 1536, nullptr, nullptr, nullptr}, C{64, 37, 576, "2", nullptr, nullptr},
                        C{17, 96, 1536, nullptr, "8", nullptr},
                        // several groups per CTA (the last partial), and chunks of 8, 8 and 2 blocks
                        C{33, 576, 576, nullptr, nullptr, "4"}, C{17, 96, 576, nullptr, "8", "3"}})
        for (size_t woff : {size_t(0), size_t(16)}) {
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " qtype " + std::to_string(int(q)) + " M=" +
                       std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) +
                       " weight offset " + std::to_string(woff));
          std::optional<kstest::ScopedEnv> cap, stage;
          if (c.cap_y) cap.emplace("KS_QMM_ROWS_MAX_GRID_Y", c.cap_y);
          if (c.stage_kb) stage.emplace("KS_QMM_ROWS_STAGE_KB", c.stage_kb);
          std::optional<kstest::ScopedEnv> groups;
          if (c.groups) groups.emplace("KS_QMM_ROWS_GROUPS", c.groups);
          const int64_t M = c.M, N = c.N, K = c.K;
          Buf gu(dt, {M, 2 * K}), a(dt, {M, N}), b(dt, {M, N}), cpu(dt, {M, N});
          kstest::fill_normal(gu, 2.0);
          if (M > 2) {  // a non-finite gate (its row's outputs go non-finite alike) and a huge one
            gu.set(2 * (2 * K) + 5, std::numeric_limits<double>::infinity());
            gu.set(1 * (2 * K) + 7, 60.0);
          }
          Buf w = make_packed(q, N, K);
          DBuf dgu(dt, {M, 2 * K}), dw(DType::U8, w.shape, woff), dh(dt, {M, K}), da(dt, {M, N}), db(dt, {M, N});
          dgu.upload(gu);
          dw.upload(w);
          da.poison();
          db.poison();
          {
            kstest::ScopedVariant pin("silu_and_mul_quant_matmul", "cuda_mma_rows");
            ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
            ks::silu_and_mul_quant_matmul(da.view(), dgu.view(), dw.view(), static_cast<ks::QType>(q),
                                          ks::Backend::Cuda);
            CK(cudaDeviceSynchronize());
            const std::string cfg = ks_last_launch_config("silu_and_mul_quant_matmul");
            EXPECT_NE(cfg.find("mma_rows "), std::string::npos) << cfg;
            EXPECT_NE(cfg.find("silu=1"), std::string::npos) << cfg;
          }
          ks::silu_and_mul(dh.view(), dgu.view(), ks::Backend::Cuda);
          {
            kstest::ScopedVariant pin("quant_matmul", "cuda_mma_rows");
            ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
            ks::quant_matmul(db.view(), dh.view(), dw.view(), static_cast<ks::QType>(q), ks::Backend::Cuda);
            CK(cudaDeviceSynchronize());
            EXPECT_NE(std::string(ks_last_launch_config("quant_matmul")).find("silu=0"), std::string::npos);
          }
          da.download(a);
          db.download(b);
          EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
          if (M <= 2) {  // (finite rows only: the CPU check's bound)
            ks::silu_and_mul_quant_matmul(cpu.view(), gu.view(), w.view(), static_cast<ks::QType>(q), ks::Backend::Cpu);
            EXPECT_TRUE(close_to_cpu(a, cpu, 16 * std::sqrt(double(K)) * 6e-8 * double(K) * 4)) << "vs the CPU";
          }
        }
}

// rotary_embedding_kv_append on CUDA is bit for bit rotary_embedding (under each CUDA
// variant, pinned) then kv_cache_append on CUDA: q, k and both caches, with slots skipped
// (-1), rotary_dim < head_dim, decode (1 token) and prefill-sized calls, int32 and int64
// positions; every variant rotates with the same sincosf angle and rope_rotate.
TEST(Cuda, RotaryKvAppendEqualsRotaryThenAppend) {
  NEED_GPU();
  struct C { int64_t T, H, KVH, D, rd, blocks, bs; };
  for (DType dt : kstest::float_dtypes())
    for (bool neox : {false, true})
      for (const C c : {C{1, 9, 3, 64, 64, 8, 16}, C{37, 8, 2, 128, 64, 6, 16}, C{5, 4, 1, 66, 32, 3, 7}})
        for (const char* variant : {"cuda_vec16", "cuda_token_cta"}) {
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + (neox ? " neox" : " interleaved") + " T=" + std::to_string(c.T) +
                       " D=" + std::to_string(c.D) + " rotary " + variant);
          Buf q(dt, {c.T, c.H, c.D}), k(dt, {c.T, c.KVH, c.D}), v(dt, {c.T, c.KVH, c.D}),
              pos(c.T % 2 ? DType::I64 : DType::I32, {c.T}), slots(DType::I64, {c.T});
          kstest::fill_normal(q);
          kstest::fill_normal(k);
          kstest::fill_normal(v);
          for (int64_t t = 0; t < c.T; ++t) {
            pos.set(t, double(1000 * t + 17));
            slots.set(t, double(t % 4 == 2 ? -1 : (t * 5) % (c.blocks * c.bs)));
          }
          const std::vector<int64_t> cs = {c.blocks, c.bs, c.KVH, c.D};
          DBuf dq(dt, q.shape), dk(dt, k.shape), dv(dt, v.shape), dpos(pos.dtype, pos.shape), dsl(DType::I64, {c.T}),
              dkc(dt, cs), dvc(dt, cs), eq(dt, q.shape), ek(dt, k.shape), ekc(dt, cs), evc(dt, cs);
          dq.upload(q), eq.upload(q), dk.upload(k), ek.upload(k), dv.upload(v), dpos.upload(pos), dsl.upload(slots);
          dkc.poison(), dvc.poison(), ekc.poison(), evc.poison();
          ks::rotary_embedding_kv_append(dq.view(), dk.view(), dv.view(), dpos.view(), c.rd, 10000.0, neox, dkc.view(),
                                         dvc.view(), dsl.view(), ks::Backend::Cuda);
          if (ks_force_variant("rotary_embedding", variant) != KS_SUCCESS) FAIL() << ks_last_error();
          const ks_status_t st = [&] {
            const ks::TensorView qv = eq.view(), kv = ek.view(), pv = dpos.view();  // (dl() points into the view)
            DLTensor a = qv.dl(), b = kv.dl(), p = pv.dl();
            return ks_rotary_embedding(&a, &b, &p, c.rd, 10000.0, neox, KS_BACKEND_CUDA, nullptr);
          }();
          ks_force_variant("rotary_embedding", nullptr);
          if (st == KS_ERROR_BACKEND_UNAVAILABLE) continue;  // the pinned variant cannot take this shape
          ASSERT_EQ(st, KS_SUCCESS) << ks_last_error();
          ks::kv_cache_append(ekc.view(), evc.view(), ek.view(), dv.view(), dsl.view(), ks::Backend::Cuda);
          CK(cudaDeviceSynchronize());
          for (auto [got, want, name] : {std::tuple{&dq, &eq, "q"}, {&dk, &ek, "k"}, {&dkc, &ekc, "k_cache"},
                                         {&dvc, &evc, "v_cache"}}) {
            Buf a(dt, got->shape), b(dt, want->shape);
            got->download(a);
            want->download(b);
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << name;
          }
        }
}

// rotary_embedding_kv_append_paged_attention on CUDA against the two calls it fuses
// (rotary_embedding_kv_append, then paged_attention, both on CUDA), bit for bit: out, q and k
// (rotated in place), both caches; under the automatic choice (the fused cuda_gqa_cluster
// kernel where it serves: its launch config says rope=1) and pinned cuda_composed. Decode steps
// of rope_attention_case.hpp (full, one-key and empty contexts, a skipped append, shuffled
// sequences and blocks), with contexts long enough for clusters of 16 CTAs (several of them
// taking keys, merged by the pushed states), the SmolLM2 shape (9 / 3 heads of 64), one and
// eight query heads per kv head, NeoX pairs, rotary_dim < head_dim, and a misaligned view
// (the fused kernel declines it: the composed calls run).
TEST(Cuda, RopeAppendAttentionEqualsTheTwoCalls) {
  NEED_GPU();
  const char* op = "rotary_embedding_kv_append_paged_attention";
  using kstest::RopeAttnCase;
  for (DType dt : kstest::float_dtypes())
    for (bool neox : {false, true})
      for (RopeAttnCase c : {RopeAttnCase{1, 9, 3, 64, 64, 16, 128, neox, false},   // SmolLM2, 2048 keys
                             RopeAttnCase{1, 9, 3, 64, 64, 16, 8, neox, false},     // 128 keys: one or two CTAs
                             RopeAttnCase{5, 9, 3, 64, 64, 16, 40, neox, true},     // a decode batch
                             RopeAttnCase{3, 8, 1, 128, 96, 16, 260, neox, true},  // 8 heads per kv head, 4160 keys
                             RopeAttnCase{4, 4, 4, 32, 32, 7, 9, neox, false},     // one head per kv head, odd block
                             RopeAttnCase{2, 6, 2, 64, 64, 16, 4, neox, true, 4}})  // misaligned: composed
        for (const char* pin : {"", "cuda_composed"}) {
          SCOPED_TRACE(c.name(dt) + (*pin ? std::string(" pinned ") + pin : std::string(" auto")));
          kstest::RopeAttnInputs in = kstest::make_rope_attn_inputs(dt, c);
          const size_t off = c.offset_bytes;
          DBuf dq(dt, in.q.shape, off), dk(dt, in.k.shape, off), dv(dt, in.v.shape, off), dpos(in.pos.dtype, in.pos.shape),
              dsl(in.slots.dtype, in.slots.shape), dkc(dt, in.k_cache.shape, off), dvc(dt, in.v_cache.shape, off),
              dbt(DType::I32, in.block_tables.shape), dsid(DType::I32, in.seq_ids.shape),
              dcl(DType::I32, in.context_lens.shape), dout(dt, in.q.shape, off);
          DBuf eq(dt, in.q.shape, off), ek(dt, in.k.shape, off), ekc(dt, in.k_cache.shape, off),
              evc(dt, in.v_cache.shape, off), eout(dt, in.q.shape, off);
          dq.upload(in.q), eq.upload(in.q), dk.upload(in.k), ek.upload(in.k), dv.upload(in.v);
          dpos.upload(in.pos), dsl.upload(in.slots), dbt.upload(in.block_tables), dsid.upload(in.seq_ids);
          dcl.upload(in.context_lens), dkc.upload(in.k_cache), ekc.upload(in.k_cache), dvc.upload(in.v_cache);
          evc.upload(in.v_cache), dout.poison(), eout.poison();
          const ks::TensorView sid = c.with_seq_ids ? dsid.view() : ks::TensorView();
          if (*pin && ks_force_variant(op, pin) != KS_SUCCESS) FAIL() << ks_last_error();
          ks::rotary_embedding_kv_append_paged_attention(dout.view(), dq.view(), dk.view(), dv.view(), dpos.view(),
                                                         c.rotary_dim, 10000.0, neox, dkc.view(), dvc.view(),
                                                         dsl.view(), dbt.view(), sid, dcl.view(), in.scale,
                                                         ks::Backend::Cuda);
          if (*pin) ks_force_variant(op, nullptr);
          const std::string fused_config = ks_last_launch_config(op);
          ks::rotary_embedding_kv_append(eq.view(), ek.view(), dv.view(), dpos.view(), c.rotary_dim, 10000.0, neox,
                                         ekc.view(), evc.view(), dsl.view(), ks::Backend::Cuda);
          // (the fused kernel's attention is cuda_gqa_cluster's; automatic routing may send 16-bit
          // calls to cuda_mma_cluster, whose sums differ)
          const bool fused = !*pin && off == 0;
          if (fused && ks_force_variant("paged_attention", "cuda_gqa_cluster") != KS_SUCCESS) FAIL() << ks_last_error();
          ks::paged_attention(eout.view(), eq.view(), ekc.view(), evc.view(), dbt.view(), sid, dcl.view(), in.scale,
                              ks::Backend::Cuda);
          if (fused) ks_force_variant("paged_attention", nullptr);
          CK(cudaDeviceSynchronize());
          if (fused)  // the fused kernel ran
            EXPECT_NE(fused_config.find("rope=1"), std::string::npos) << fused_config;
          for (auto [got, want, name] : {std::tuple{&dout, &eout, "out"}, {&dq, &eq, "q"}, {&dk, &ek, "k"},
                                         {&dkc, &ekc, "k_cache"}, {&dvc, &evc, "v_cache"}}) {
            Buf a(dt, got->shape), b(dt, want->shape);
            got->download(a);
            want->download(b);
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << name;
          }
        }
}

// fused_add_rms_norm_quant_matmul_rope_kv_append on CUDA against the two calls it fuses
// (fused_add_rms_norm_quant_matmul, then rotary_embedding_kv_append on out's slices), bit for
// bit: out (q and k rotated, v), residual_out and both caches (poisoned first, so a cache row
// written by one and not the other shows). Interleaved pairs take the one-kernel variant
// (its launch config says rope_epilogue=1), NeoX pairs the composed one (the one-kernel
// variant, pinned, refuses them); rotary_dim below head_dim, a large position, int32 / int64
// indices, slot -1, a device slot past the cache (skipped: nothing written), no slot at all
// (slot_mapping of 0 entries), a model-sized row (K = 576, 9 / 3 heads of 64: the weights
// staged in shared memory), misaligned tensors (composed), head_dim 130, and odd head_dims
// (35; 3, with N = 9 odd: composed, since the one kernel's column pairs would straddle heads).
TEST(Cuda, FusedNormQkvRopeAppendEqualsTheTwoCalls) {
  NEED_GPU();
  using namespace kstest::gguf;
  struct C { int64_t H, KVH, D, rd, K; ks_qtype_t q; };
  for (DType dt : kstest::float_dtypes())
    for (const C c : {C{9, 3, 64, 64, 576, KS_QTYPE_Q4_1}, C{4, 2, 32, 16, 256, KS_QTYPE_Q8_0},
                      C{2, 1, 130, 64, 1536, KS_QTYPE_Q4_0}, C{2, 1, 35, 16, 64, KS_QTYPE_Q8_0},
                      C{1, 1, 3, 2, 64, KS_QTYPE_Q8_0},
                      // 2 and 4 columns per warp (N >= 4224 / 8448 on 132 SMs, short rows), the
                      // staging limit K = 2720 and one past it (per-warp kernel: composed),
                      // rotary_dim 1024 (the parameter table's limit)
                      C{64, 2, 64, 64, 576, KS_QTYPE_Q4_1}, C{128, 4, 64, 64, 256, KS_QTYPE_Q8_0},
                      C{4, 2, 32, 32, 2720, KS_QTYPE_Q8_0}, C{4, 2, 32, 32, 2752, KS_QTYPE_Q8_0},
                      C{1, 1, 1024, 1024, 64, KS_QTYPE_Q8_0}})
      for (bool neox : {false, true})
        for (bool with_x : {true, false})
          for (int slot_case = 0; slot_case < 5; ++slot_case) {
            // 0: slot 37; 1: slot -1; 2: no slot; 3: misaligned tensors (composed); 4: a device slot past
            // the cache (skipped: both caches stay poisoned)
            const size_t off = slot_case == 3 ? ks::dtype_size(dt) : 0;
            SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " H=" + std::to_string(c.H) + " KVH=" +
                         std::to_string(c.KVH) + " D=" + std::to_string(c.D) + " rotary_dim=" + std::to_string(c.rd) +
                         (neox ? " neox" : " interleaved") + (with_x ? " with x" : " residual only") + " slot case " +
                         std::to_string(slot_case));
            const int64_t N = (c.H + 2 * c.KVH) * c.D, blocks = 5, bs = 16;
            Buf res(dt, {1, c.K}), x(dt, {1, c.K}), nw(dt, {c.K});
            kstest::fill_normal(res);
            kstest::fill_normal(x);
            kstest::fill_normal(nw, 1.0, 1.0);
            Buf w = make_packed(c.q, N, c.K);
            const DType pdt = slot_case % 2 ? DType::I32 : DType::I64;
            Buf pos(pdt, {1}), slots(pdt, {slot_case == 2 ? int64_t(0) : int64_t(1)});
            pos.set(0, 123457.0);
            if (slot_case != 2) slots.set(0, slot_case == 1 ? -1.0 : slot_case == 4 ? 1e9 : 37.0);
            const std::vector<int64_t> cs = {blocks, bs, c.KVH, c.D};
            DBuf dres(dt, {1, c.K}, off), dx(dt, {1, c.K}, off), dnw(dt, {c.K}, off), dw(DType::U8, w.shape),
                dpos(pdt, {1}), dsl(pdt, slots.shape), got(dt, {1, N}, off), got_ro(dt, {1, c.K}, off),
                got_kc(dt, cs), got_vc(dt, cs), want(dt, {1, N}, off), want_ro(dt, {1, c.K}, off), want_kc(dt, cs),
                want_vc(dt, cs);
            dres.upload(res), dx.upload(x), dnw.upload(nw), dw.upload(w), dpos.upload(pos), dsl.upload(slots);
            for (DBuf* b : {&got, &got_ro, &got_kc, &got_vc, &want, &want_ro, &want_kc, &want_vc}) b->poison();
            const ks::TensorView none;
            const auto qt = static_cast<ks::QType>(c.q);
            ks::fused_add_rms_norm_quant_matmul_rope_kv_append(
                got.view(), with_x ? got_ro.view() : none, with_x ? dx.view() : none, dres.view(), dnw.view(), 1e-5,
                dw.view(), qt, c.H, c.KVH, dpos.view(), c.rd, 10000.0, neox, got_kc.view(), got_vc.view(),
                dsl.view(), ks::Backend::Cuda);
            CK(cudaDeviceSynchronize());
            const char* fused_op = "fused_add_rms_norm_quant_matmul_rope_kv_append";
            const bool one_kernel = !neox && off == 0 && c.D % 2 == 0 && c.K <= 2720;  // else composed
            if (one_kernel) {
              const std::string cfg = ks_last_launch_config(fused_op);
              EXPECT_NE(cfg.find("rope_epilogue=1"), std::string::npos) << cfg;
              EXPECT_NE(cfg.find("rope_early_trigger=1"), std::string::npos) << cfg;  // (the default)
            } else {  // the composed variant ran: the one-kernel variant, pinned, refuses the call
              ASSERT_EQ(ks_force_variant(fused_op, "cuda_warp_per_column"), KS_SUCCESS) << ks_last_error();
              bool refused = false;
              try {
                ks::fused_add_rms_norm_quant_matmul_rope_kv_append(
                    want.view(), with_x ? want_ro.view() : none, with_x ? dx.view() : none, dres.view(), dnw.view(),
                    1e-5, dw.view(), static_cast<ks::QType>(c.q), c.H, c.KVH, dpos.view(), c.rd, 10000.0, neox,
                    want_kc.view(), want_vc.view(), dsl.view(), ks::Backend::Cuda);
              } catch (const std::exception&) {
                refused = true;
              }
              ks_force_variant(fused_op, nullptr);
              EXPECT_TRUE(refused) << "cuda_warp_per_column took a call it cannot implement";
              want.poison(), want_ro.poison(), want_kc.poison(), want_vc.poison();  // (nothing was written)
            }
            ks::fused_add_rms_norm_quant_matmul(want.view(), with_x ? want_ro.view() : none, with_x ? dx.view() : none,
                                                dres.view(), dnw.view(), 1e-5, dw.view(), qt, ks::Backend::Cuda);
            const size_t es = ks::dtype_size(dt);
            char* base = static_cast<char*>(want.view().data());
            ks::TensorView q(base, dt, {1, c.H, c.D}, want.view().device()),
                k(base + c.H * c.D * es, dt, {1, c.KVH, c.D}, want.view().device()),
                v(base + (c.H + c.KVH) * c.D * es, dt, {1, c.KVH, c.D}, want.view().device());
            ks::rotary_embedding_kv_append(q, k, v, dpos.view(), c.rd, 10000.0, neox, want_kc.view(), want_vc.view(),
                                           dsl.view(), ks::Backend::Cuda);
            CK(cudaDeviceSynchronize());
            for (auto [g, e, name] : {std::tuple{&got, &want, "out"}, {&got_kc, &want_kc, "k_cache"},
                                      {&got_vc, &want_vc, "v_cache"}, {&got_ro, &want_ro, "residual_out"}}) {
              Buf a(dt, g->shape), b(dt, e->shape);
              g->download(a);
              e->download(b);
              EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << name;
            }
            if (one_kernel && slot_case == 0) {  // without the early trigger (KS_QMM_ROPE_EARLY_TRIGGER=0): the same bits
              kstest::ScopedEnv early("KS_QMM_ROPE_EARLY_TRIGGER", "0");
              for (DBuf* b : {&got, &got_ro, &got_kc, &got_vc}) b->poison();
              ks::fused_add_rms_norm_quant_matmul_rope_kv_append(
                  got.view(), with_x ? got_ro.view() : none, with_x ? dx.view() : none, dres.view(), dnw.view(), 1e-5,
                  dw.view(), qt, c.H, c.KVH, dpos.view(), c.rd, 10000.0, neox, got_kc.view(), got_vc.view(),
                  dsl.view(), ks::Backend::Cuda);
              CK(cudaDeviceSynchronize());
              const std::string cfg = ks_last_launch_config(fused_op);
              EXPECT_NE(cfg.find("rope_early_trigger=0"), std::string::npos) << cfg;
              for (auto [g, e, name] : {std::tuple{&got, &want, "out"}, {&got_kc, &want_kc, "k_cache"},
                                        {&got_vc, &want_vc, "v_cache"}, {&got_ro, &want_ro, "residual_out"}}) {
                Buf a(dt, g->shape), b(dt, e->shape);
                g->download(a);
                e->download(b);
                EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << name << " (early trigger)";
              }
            }
            if (slot_case == 4) {  // nothing appended anywhere
              DBuf fresh(dt, cs);
              fresh.poison();
              Buf p0(dt, cs), a(dt, cs), b(dt, cs);
              fresh.download(p0);
              got_kc.download(a);
              got_vc.download(b);
              EXPECT_EQ(0, std::memcmp(a.data(), p0.data(), a.nbytes())) << "k_cache written for a slot past it";
              EXPECT_EQ(0, std::memcmp(b.data(), p0.data(), b.nbytes())) << "v_cache written for a slot past it";
            }
          }
}

// Under programmatic dependent launch the fusion reads positions and slot_mapping only after
// its dependency wait: argmax writes the position (and the slot) on the same stream right
// before each call, 24 times with a new value each time; every result must equal the two calls
// run on host-uploaded copies of those values (a stale read would rotate by the previous angle).
TEST(Cuda, FusedNormQkvRopeAppendReadsPositionsWrittenJustBefore) {
  NEED_GPU();
  using namespace kstest::gguf;
  const DType dt = DType::F32;
  const int64_t H = 9, KVH = 3, D = 64, K = 576, N = (H + 2 * KVH) * D, V = 1000;
  Buf res(dt, {1, K}), nw(dt, {K});
  kstest::fill_normal(res);
  kstest::fill_normal(nw, 1.0, 1.0);
  Buf w = make_packed(KS_QTYPE_Q4_1, N, K);
  const std::vector<int64_t> cs = {32, 16, KVH, D};  // 512 slots: every slot below is inside
  DBuf dres(dt, {1, K}), dnw(dt, {K}), dw(DType::U8, w.shape), logits(dt, {1, V}), pos(DType::I64, {1}),
      slot(DType::I64, {1}), hpos(DType::I64, {1}), got(dt, {1, N}), want(dt, {1, N}), kc(dt, cs), vc(dt, cs),
      ekc(dt, cs), evc(dt, cs);
  dres.upload(res), dnw.upload(nw), dw.upload(w);
  const ks::TensorView none;
  for (int it = 0; it < 24; ++it) {
    Buf l(dt, {1, V}), p(DType::I64, {1});
    for (int64_t i = 0; i < V; ++i) l.set(i, i == 17 * it + 5 ? 100.0 : double(i % 7));
    logits.upload(l);
    p.set(0, double(17 * it + 5));
    hpos.upload(p);
    got.poison(), want.poison();
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    ks::argmax(pos.view(), logits.view(), ks::Backend::Cuda, st);  // position = 17 it + 5
    ks::argmax(slot.view(), logits.view(), ks::Backend::Cuda, st);  // slot = the same (< 512)
    ks::fused_add_rms_norm_quant_matmul_rope_kv_append(got.view(), none, none, dres.view(), dnw.view(), 1e-5, dw.view(),
                                                       ks::QType::Q4_1, H, KVH, pos.view(), D, 10000.0, false,
                                                       kc.view(), vc.view(), slot.view(), ks::Backend::Cuda, st);
    CK(cudaStreamSynchronize(st));
    CK(cudaStreamDestroy(st));
    ASSERT_NE(std::string(ks_last_launch_config("fused_add_rms_norm_quant_matmul_rope_kv_append")).find("rope_epilogue=1"),
              std::string::npos);
    ks::fused_add_rms_norm_quant_matmul(want.view(), none, none, dres.view(), dnw.view(), 1e-5, dw.view(),
                                        ks::QType::Q4_1, ks::Backend::Cuda);
    char* base = static_cast<char*>(want.view().data());
    const DLDevice dev = want.view().device();
    ks::rotary_embedding_kv_append(ks::TensorView(base, dt, {1, H, D}, dev), ks::TensorView(base + H * D * 4, dt, {1, KVH, D}, dev),
                                   ks::TensorView(base + (H + KVH) * D * 4, dt, {1, KVH, D}, dev), hpos.view(), D, 10000.0,
                                   false, ekc.view(), evc.view(), hpos.view(), ks::Backend::Cuda);
    CK(cudaDeviceSynchronize());
    Buf a(dt, {1, N}), b(dt, {1, N}), ka(dt, cs), kb(dt, cs);
    got.download(a);
    want.download(b);
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << "iteration " << it << ": out";
    kc.download(ka);
    ekc.download(kb);
    const size_t row = size_t(KVH * D) * 4, at = size_t(17 * it + 5) * row;
    ASSERT_EQ(0, std::memcmp(static_cast<char*>(ka.data()) + at, static_cast<char*>(kb.data()) + at, row))
        << "iteration " << it << ": the k_cache row of the slot argmax wrote";
  }
}

// The paged_attention tests run under every CUDA variant (pinned per test):
// cuda_gqa_cluster (sm_90: K/V read once per kv head, keys split over a cluster),
// cuda_mma_cluster (the same split, tensor cores; bf16 and fp16) and cuda_cta_per_head.
class CudaAttention : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(ks_force_variant("paged_attention", GetParam()), KS_SUCCESS) << ks_last_error();
  }
  void TearDown() override { ks_force_variant("paged_attention", nullptr); }
  // cuda_mma_cluster takes bf16 and fp16 only (tensor cores); the other variants every dtype
  bool takes(DType dt) const { return !(std::string(GetParam()) == "cuda_mma_cluster" && dt == DType::F32); }
  // the variants that split a unit's keys over a thread-block cluster
  bool clustered() const { return std::string(GetParam()) != "cuda_cta_per_head"; }
};
INSTANTIATE_TEST_SUITE_P(Variants, CudaAttention,
                         ::testing::Values("cuda_gqa_cluster", "cuda_mma_cluster", "cuda_cta_per_head"),
                         [](const ::testing::TestParamInfo<const char*>& i) { return std::string(i.param); });

// paged_attention on CUDA against the CPU backend: decode (one query per sequence, GQA,
// scattered blocks, contexts from 0 to past one key tile) and causal prefill with seq_ids.
TEST_P(CudaAttention, DecodeAndPrefill) {
  NEED_GPU();
  for (DType dt : kstest::float_dtypes()) {
    if (!takes(dt)) continue;
    for (auto [H, KVH, D] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{9, 3, 64}, {8, 8, 128}, {4, 1, 32}}) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " H=" + std::to_string(H) + " KVH=" + std::to_string(KVH) + " D=" +
                   std::to_string(D));
      const int64_t bs = 16, blocks = 40, seqs = 4, maxb = 10;
      Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      Buf bt(DType::I32, {seqs, maxb});
      for (int64_t i = 0; i < seqs * maxb; ++i) bt.set(i, double((i * 7 + 3) % blocks));  // scattered blocks
      DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, {seqs, maxb});
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      const double scale = 1.0 / std::sqrt(double(D));
      // decode: token t is sequence t
      {
        const int64_t T = seqs;
        Buf q(dt, {T, H, D}), cl(DType::I32, {T}), ref(dt, {T, H, D}), got(dt, {T, H, D});
        kstest::fill_normal(q);
        const int64_t lens[4] = {1, 0, 129, 160};
        for (int64_t t = 0; t < T; ++t) cl.set(t, double(lens[t]));
        DBuf dq(dt, {T, H, D}), dcl(DType::I32, {T}), dout(dt, {T, H, D});
        dq.upload(q);
        dcl.upload(cl);
        dout.poison();
        ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), ks::TensorView(), dcl.view(),
                            scale, ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), ks::TensorView(), cl.view(), scale,
                            ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << "decode";
      }
      // causal prefill of 37 tokens of sequence 2 (positions 0..36), then 5 tokens of sequence 0
      {
        const int64_t T = 42;
        Buf q(dt, {T, H, D}), cl(DType::I32, {T}), sid(DType::I32, {T}), ref(dt, {T, H, D}), got(dt, {T, H, D});
        kstest::fill_normal(q);
        for (int64_t t = 0; t < T; ++t) {
          sid.set(t, t < 37 ? 2.0 : 0.0);
          cl.set(t, double(t < 37 ? t + 1 : t - 37 + 1));
        }
        DBuf dq(dt, {T, H, D}), dcl(DType::I32, {T}), dsid(DType::I32, {T}), dout(dt, {T, H, D});
        dq.upload(q);
        dcl.upload(cl);
        dsid.upload(sid);
        dout.poison();
        ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), dsid.view(), dcl.view(), scale,
                            ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), sid.view(), cl.view(), scale,
                            ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << "prefill";
      }
    }
  }
}

// paged_attention without seq_ids on the device tensors (out poisoned first), downloaded into
// got, and the CPU reference on the host copies into ref.
void paged_cuda_and_cpu(DBuf& dout, DBuf& dq, DBuf& dkc, DBuf& dvc, DBuf& dbt, DBuf& dcl, Buf& q, Buf& kc, Buf& vc,
                        Buf& bt, Buf& cl, double scale, Buf& got, Buf& ref) {
  dout.poison();
  ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), ks::TensorView(), dcl.view(), scale,
                      ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  dout.download(got);
  ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), ks::TensorView(), cl.view(), scale,
                      ks::Backend::Cpu);
}

// paged_attention on CUDA with non-finite scores, as the CPU (two-pass softmax): a NaN in
// q, or a first key tile (128 keys) whose K rows are all NaN, gives a NaN row (the online
// softmax gave such keys weight 0 when the tile's maximum was -inf, hiding the NaN);
// a first tile of -inf scores followed by finite ones gives the softmax of the finite keys;
// scores that are all -inf give a NaN row (exp(-inf - -inf)), not a zero row. head_dim 40
// is not a multiple of 32.
TEST_P(CudaAttention, NonFiniteScoresAsOnCpu) {
  NEED_GPU();
  for (DType dt : kstest::float_dtypes()) {
    if (!takes(dt)) continue;
    SCOPED_TRACE(ks::dtype_name(dt));
    const int64_t H = 4, KVH = 2, D = 40, bs = 16, seqs = 4, maxb = 16, blocks = seqs * maxb;
    const int64_t row = bs * KVH * D;  // elements per cache block
    Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D});
    kstest::fill_normal(kc);
    kstest::fill_normal(vc);
    Buf bt(DType::I32, {seqs, maxb});
    for (int64_t i = 0; i < seqs * maxb; ++i) bt.set(i, double(i));  // sequence s owns blocks s*maxb ...
    // sequence 1: the first 128 keys (8 blocks) have NaN K rows; keys 128..199 are finite
    for (int64_t i = 0; i < 8 * row; ++i) kc.set(1 * maxb * row + i, std::nan(""));
    // sequence 2: the first 128 keys have -inf K rows (scores -inf against a positive q)
    for (int64_t i = 0; i < 8 * row; ++i) kc.set(2 * maxb * row + i, -INFINITY);
    // sequence 3: all of its 20 keys -inf
    for (int64_t i = 0; i < 2 * row; ++i) kc.set(3 * maxb * row + i, -INFINITY);
    const int64_t T = seqs;
    Buf q(dt, {T, H, D}), cl(DType::I32, {T}), ref(dt, {T, H, D}), got(dt, {T, H, D});
    kstest::fill_normal(q);
    for (int64_t d = 0; d < D; ++d) q.set(0 * H * D + 1 * D + d, std::nan(""));  // token 0, head 1: all scores NaN
    for (int64_t i = 0; i < 2 * H * D; ++i) q.set(2 * H * D + i, 0.25 + 0.01 * double(i % 7));  // tokens 2, 3: q > 0
    const int64_t lens[4] = {50, 200, 130, 20};
    for (int64_t t = 0; t < T; ++t) cl.set(t, double(lens[t]));
    DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt.shape), dq(dt, q.shape), dcl(DType::I32, {T}),
        dout(dt, q.shape);
    dkc.upload(kc);
    dvc.upload(vc);
    dbt.upload(bt);
    dq.upload(q);
    dcl.upload(cl);
    const double scale = 1.0 / std::sqrt(double(D));
    ASSERT_NO_FATAL_FAILURE(paged_cuda_and_cpu(dout, dq, dkc, dvc, dbt, dcl, q, kc, vc, bt, cl, scale, got, ref));
    for (int64_t d = 0; d < D; ++d) {
      EXPECT_TRUE(std::isnan(ref.get(1 * D + d)) && std::isnan(got.get(1 * D + d))) << "token 0 head 1 (NaN q)";
      EXPECT_TRUE(std::isnan(ref.get((1 * H + 2) * D + d)) && std::isnan(got.get((1 * H + 2) * D + d)))
          << "token 1 (first key tile NaN)";
      EXPECT_TRUE(std::isfinite(ref.get((2 * H + 3) * D + d)) && std::isfinite(got.get((2 * H + 3) * D + d)))
          << "token 2 (first key tile -inf, then finite keys)";
      EXPECT_TRUE(std::isnan(ref.get((3 * H + 0) * D + d)) && std::isnan(got.get((3 * H + 0) * D + d)))
          << "token 3 (all scores -inf)";
    }
    EXPECT_TRUE(close_to_cpu(got, ref, 1e-5));
  }
}

// paged_attention on the device with index tensors the kernel must survive (bt_dev, sid_dev,
// len_dev: out of range, negative, past the capacity) and on the CPU with their in-range
// equivalents (bt_cpu, sid_cpu, len_cpu); got / ref receive the [T, H, D] outputs.
void paged_device_vs_cpu(DType dt, Buf& q, Buf& kc, Buf& vc, Buf& bt_dev, Buf& bt_cpu, const std::vector<int64_t>& sid_dev,
                         const std::vector<int64_t>& len_dev, const std::vector<int64_t>& sid_cpu,
                         const std::vector<int64_t>& len_cpu, double scale, Buf& got, Buf& ref) {
  const int64_t T = int64_t(sid_dev.size());
  Buf sid(DType::I32, {T}), cl(DType::I32, {T}), sid_c(DType::I32, {T}), cl_c(DType::I32, {T});
  for (int64_t t = 0; t < T; ++t) {
    sid.set(t, double(sid_dev[size_t(t)]));
    cl.set(t, double(len_dev[size_t(t)]));
    sid_c.set(t, double(sid_cpu[size_t(t)]));
    cl_c.set(t, double(len_cpu[size_t(t)]));
  }
  DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt_dev.shape), dq(dt, q.shape), dsid(DType::I32, {T}),
      dcl(DType::I32, {T}), dout(dt, q.shape);
  dkc.upload(kc);
  dvc.upload(vc);
  dbt.upload(bt_dev);
  dq.upload(q);
  dsid.upload(sid);
  dcl.upload(cl);
  dout.poison();
  ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), dsid.view(), dcl.view(), scale,
                      ks::Backend::Cuda);
  CK(cudaDeviceSynchronize());
  dout.download(got);
  ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt_cpu.view(), sid_c.view(), cl_c.view(), scale,
                      ks::Backend::Cpu);
}

// paged_attention with device index tensors that the host cannot check: a block id outside
// [0, num_blocks) drops its keys, a seq id outside [0, num_seqs) or a negative length gives a
// zero row, a length past the table's capacity is clamped to it (docs/contracts.md). Compared
// with the CPU on the equivalent valid inputs.
TEST_P(CudaAttention, DeviceIndicesOutOfRange) {
  NEED_GPU();
  for (DType dt : kstest::float_dtypes()) {
    if (!takes(dt)) continue;
    SCOPED_TRACE(ks::dtype_name(dt));
    const int64_t H = 6, KVH = 3, D = 72, bs = 16, seqs = 4, maxb = 16, blocks = seqs * maxb, cap = maxb * bs;
    Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D});
    kstest::fill_normal(kc);
    kstest::fill_normal(vc);
    Buf bt(DType::I32, {seqs, maxb}), bad_bt(DType::I32, {seqs, maxb});
    for (int64_t i = 0; i < seqs * maxb; ++i) bt.set(i, double((i * 5 + 1) % blocks));
    bad_bt.raw = bt.raw;
    bad_bt.set(0 * maxb + 2, -1.0);           // seq 0: block 2 (keys 32..47) dropped
    bad_bt.set(3 * maxb + 0, double(blocks));  // seq 3: every block of its context out of range
    bad_bt.set(3 * maxb + 1, 1000.0);
    const int64_t T = 5;
    //                      t0: seq 0, 40 keys (32..39 dropped); t1: seq 99; t2: length -3;
    //                      t3: length past the capacity; t4: seq 3, all keys dropped
    const std::vector<int64_t> sid_dev = {0, 99, 1, 2, 3}, len_dev = {40, 10, -3, 100000, 20};
    const std::vector<int64_t> sid_cpu = {0, 0, 1, 2, 0}, len_cpu = {32, 0, 0, cap, 0};
    Buf q(dt, {T, H, D}), got(dt, {T, H, D}), ref(dt, {T, H, D});
    kstest::fill_normal(q);
    ASSERT_NO_FATAL_FAILURE(
        paged_device_vs_cpu(dt, q, kc, vc, bad_bt, bt, sid_dev, len_dev, sid_cpu, len_cpu, 0.125, got, ref));
    EXPECT_TRUE(close_to_cpu(got, ref, 1e-5));
    for (int64_t t : {1, 2, 4})
      for (int64_t i = 0; i < H * D; ++i)
        ASSERT_EQ(got.get(t * H * D + i), 0.0) << "token " << t << " must be a zero row";
  }
}

// The cluster size cuda_gqa_cluster recorded for its last launch ("... cluster=C ..."), 0 if none.
// The CTAs that share a (token, kv head) unit in the last paged_attention launch: the cluster
// size, times cuda_mma_cluster's splits (clusters of one merged through a workspace)
int64_t last_attention_cluster() {
  const std::string cfg = ks_last_launch_config("paged_attention");
  const size_t at = cfg.find("cluster="), sp = cfg.find("splits=");
  const int64_t c = at == std::string::npos ? 0 : std::stoll(cfg.substr(at + 8));
  return sp == std::string::npos ? c : c * std::stoll(cfg.substr(sp + 7));
}

// The cluster path of cuda_gqa_cluster (the other tests' block tables hold at most 256 keys,
// which keeps C <= 4): a table of 5120 keys lets a (token, kv head)'s keys be split over up to
// 16 CTAs merged through distributed shared memory; 3 to 100 tokens give clusters of 16, 8,
// 4 and 2 on a 132-SM H200. Lengths not multiples of C * 64, smaller than C, 0 and the full
// capacity; GQA groups of 3 and 8 (more query heads than the CTA's 4 warps); decode and
// prefill with seq_ids. The three dtypes run one after the other in one process: a cluster of
// 16 must launch for each (the non-portable cluster attribute was set only for the first
// dtype launched: the three kernels shared one once_flag).
TEST_P(CudaAttention, LongContextsSplitOverClusters) {
  NEED_GPU();
  const bool gqa = clustered();
  const int64_t bs = 16, maxb = 320, cap = bs * maxb, blocks = 700;
  const int64_t lens[] = {cap, cap - 1, 4097, 4096, 1025, 1000, 321, 65, 64, 63, 17, 15, 3, 1, 0};
  const int64_t nlens = int64_t(sizeof(lens) / sizeof(lens[0]));
  std::mt19937 gen(7);
  for (auto [H, KVH, D] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{6, 2, 64}, {16, 2, 128}})
    for (DType dt : kstest::float_dtypes()) {
      if (!takes(dt)) continue;
      Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      DBuf dkc(dt, kc.shape), dvc(dt, vc.shape);
      dkc.upload(kc);
      dvc.upload(vc);
      const double scale = 1.0 / std::sqrt(double(D));
      auto run = [&](int64_t T, int64_t seqs, const std::vector<int64_t>& sids, const std::vector<int64_t>& cls,
                     const char* what) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " H=" + std::to_string(H) + " KVH=" + std::to_string(KVH) +
                     " D=" + std::to_string(D) + " T=" + std::to_string(T) + " " + what);
        Buf q(dt, {T, H, D}), bt(DType::I32, {seqs, maxb}), cl(DType::I32, {T}), sid(DType::I32, {T}),
            ref(dt, {T, H, D}), got(dt, {T, H, D});
        kstest::fill_normal(q);
        for (int64_t i = 0; i < seqs * maxb; ++i) bt.set(i, double(gen() % blocks));
        for (int64_t t = 0; t < T; ++t) {
          cl.set(t, double(cls[size_t(t)]));
          if (!sids.empty()) sid.set(t, double(sids[size_t(t)]));
        }
        DBuf dq(dt, q.shape), dbt(DType::I32, bt.shape), dcl(DType::I32, {T}), dsid(DType::I32, {T}), dout(dt, q.shape);
        dq.upload(q);
        dbt.upload(bt);
        dcl.upload(cl);
        dsid.upload(sid);
        dout.poison();
        const bool has_sid = !sids.empty();
        ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(),
                            has_sid ? dsid.view() : ks::TensorView(), dcl.view(), scale, ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        const int64_t C = last_attention_cluster();
        std::printf("paged_attention %s %s T=%lld KVH=%lld: %s\n", GetParam(), ks::dtype_name(dt), (long long)T,
                    (long long)KVH, ks_last_launch_config("paged_attention"));
        if (gqa && T * KVH <= 8) EXPECT_GT(C, 1) << "a few (token, kv head) units over a long table take the cluster path";
        dout.download(got);
        ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), has_sid ? sid.view() : ks::TensorView(),
                            cl.view(), scale, ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << "cluster=" << C;
        for (int64_t t = 0; t < T; ++t)
          if (cls[size_t(t)] == 0)
            for (int64_t i = 0; i < H * D; ++i) ASSERT_EQ(got.get(t * H * D + i), 0.0) << "token " << t << ": context 0";
      };
      // decode: token t is sequence t
      for (int64_t T : {3, 20, 50, 100}) {
        std::vector<int64_t> cls;
        for (int64_t t = 0; t < T; ++t) cls.push_back(lens[(t * 5 + T) % nlens]);
        run(T, T, {}, cls, "decode");
      }
      // prefill: 8 tokens of two sequences (16 units at KVH 2: a cluster of 16 on the H200)
      run(8, 2, {1, 0, 1, 1, 0, 1, 0, 1}, {cap, cap - 7, 4000, 2049, 300, 64, 2, 1}, "prefill");
    }
}

// Non-finite scores and dropped keys on the cluster path: whole CTA ranges of keys whose
// scores are NaN (the NaN must survive the merge of a CTA whose maximum stayed -inf), or
// -inf followed by finite keys (the softmax of the finite keys), all -inf (a NaN row), and a
// device block table whose first 160 blocks and one middle block are out of range (the
// softmax of the rest, compared with the CPU on a table of the kept blocks). Lengths of 3
// and 0 (fewer keys than CTAs) and a seq id out of range (a zero row). The table holds 20480
// keys, so cuda_mma_cluster splits each unit beyond its cluster (14 units: 9 CTAs each on the
// H200), and splits whose keys are all dropped leave states that saw no key.
TEST_P(CudaAttention, NonFiniteAndDroppedKeysAcrossClusters) {
  NEED_GPU();
  const bool gqa = clustered();
  for (DType dt : kstest::float_dtypes()) {
    if (!takes(dt)) continue;
    SCOPED_TRACE(ks::dtype_name(dt));
    const int64_t H = 4, KVH = 2, D = 40, bs = 16, seqs = 5, maxb = 1280, blocks = seqs * maxb;
    const int64_t row = bs * KVH * D;  // elements per cache block
    Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D});
    kstest::fill_normal(kc);
    kstest::fill_normal(vc);
    Buf bt(DType::I32, {seqs, maxb}), bt_cpu(DType::I32, {seqs, maxb});
    for (int64_t i = 0; i < seqs * maxb; ++i) bt.set(i, double(i));  // sequence s owns blocks s*maxb ...
    bt_cpu.raw = bt.raw;
    // sequence 0: keys 0..2559 (blocks 0..159: the first CTA's range for every C >= 2) NaN
    for (int64_t i = 0; i < 160 * row; ++i) kc.set(0 * maxb * row + i, std::nan(""));
    // sequence 1: keys 0..2559 -inf (scores -inf against a positive q), then finite keys
    for (int64_t i = 0; i < 160 * row; ++i) kc.set(1 * maxb * row + i, -INFINITY);
    // sequence 2: every key -inf
    for (int64_t i = 0; i < maxb * row; ++i) kc.set(2 * maxb * row + i, -INFINITY);
    // sequence 3 on the device: blocks 0..159 and 200 out of range; 5000 keys = 312 blocks + 8
    for (int64_t b = 0; b < 160; ++b) bt.set(3 * maxb + b, b % 2 ? -1.0 : double(blocks + b));
    bt.set(3 * maxb + 200, -7.0);
    // ... on the CPU: the kept blocks 160..199, 201..312 (the last one holding 8 keys)
    {
      int64_t n = 0;
      for (int64_t b = 160; b <= 312; ++b)
        if (b != 200) bt_cpu.set(3 * maxb + n++, double(3 * maxb + b));
      for (; n < maxb; ++n) bt_cpu.set(3 * maxb + n, 0.0);
    }
    const int64_t T = 7;
    //                         t0..t3: sequences 0..3; t4: 3 keys; t5: length 0; t6: seq id 99
    const std::vector<int64_t> sid_dev = {0, 1, 2, 3, 4, 4, 99}, len_dev = {5000, 5000, 4321, 5000, 3, 0, 4000};
    const std::vector<int64_t> sid_cpu = {0, 1, 2, 3, 4, 4, 4}, len_cpu = {5000, 5000, 4321, 151 * bs + 8, 3, 0, 0};
    Buf q(dt, {T, H, D}), got(dt, {T, H, D}), ref(dt, {T, H, D});
    kstest::fill_normal(q);
    for (int64_t i = 0; i < 2 * H * D; ++i) q.set(1 * H * D + i, 0.25 + 0.01 * double(i % 7));  // tokens 1, 2: q > 0
    ASSERT_NO_FATAL_FAILURE(paged_device_vs_cpu(dt, q, kc, vc, bt, bt_cpu, sid_dev, len_dev, sid_cpu, len_cpu,
                                                1.0 / std::sqrt(double(D)), got, ref));
    const int64_t C = last_attention_cluster();  // the device call's (the CPU call records no launch)
    const std::string cfg = ks_last_launch_config("paged_attention");
    if (gqa) EXPECT_GT(C, 1) << cfg;
    if (std::string(GetParam()) == "cuda_mma_cluster") EXPECT_NE(cfg.find("cluster=1 "), std::string::npos) << cfg;
    for (int64_t i = 0; i < H * D; ++i) {
      EXPECT_TRUE(std::isnan(ref.get(0 * H * D + i)) && std::isnan(got.get(0 * H * D + i))) << "token 0 (NaN keys) " << i;
      EXPECT_TRUE(std::isfinite(ref.get(1 * H * D + i)) && std::isfinite(got.get(1 * H * D + i)))
          << "token 1 (-inf keys, then finite ones) " << i;
      EXPECT_TRUE(std::isnan(ref.get(2 * H * D + i)) && std::isnan(got.get(2 * H * D + i))) << "token 2 (all -inf) " << i;
      ASSERT_EQ(got.get(5 * H * D + i), 0.0) << "token 5: context 0";
      ASSERT_EQ(got.get(6 * H * D + i), 0.0) << "token 6: seq id out of range";
    }
    EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << "cluster=" << C;
  }
}

// Sums of one sign over 131072 keys (the CPU variants' running sums exceeded the contract's
// 8 sqrt(K) 2^-24 sum|a b| bound there by 4-10x until 2026-12-05; tests/cpp/test_hostile_regressions.cpp):
// every key but the first scores 0.3, the first 1, every V element is v, so the weights sum to 1
// and the exact output is v (as the dtype holds it). Every CUDA variant, and varlen_attention, must
// stay within the dtype's tolerance plus that bound. (Not yet run on a GPU when written.)
TEST_P(CudaAttention, LongEqualSignSumsWithinTheContract) {
  NEED_GPU();
  const int64_t L = 131072, bs = 16, nb = L / bs, H = 4, KVH = 1, D = 64;
  for (DType dt : kstest::float_dtypes()) {
    if (!takes(dt)) continue;
    for (auto [kv, vv] : {std::pair<double, double>{0.3, 0.7}, {0.99, 0.1}}) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " k " + std::to_string(kv) + " v " + std::to_string(vv));
      Buf q(dt, {1, H, D}), kc(dt, {nb, bs, KVH, D}), vc(dt, {nb, bs, KVH, D}), bt(DType::I32, {1, nb}),
          cl(DType::I32, {1}), got(dt, {1, H, D});
      for (int64_t i = 0; i < q.numel(); ++i) q.set(i, i % D == 0 ? 1.0 : 0.0);
      for (int64_t i = 0; i < kc.numel(); ++i) kc.set(i, i == 0 ? 1.0 : kv), vc.set(i, vv);
      for (int64_t b = 0; b < nb; ++b) bt.set(b, double(b));
      cl.set(0, double(L));
      const double ref = vc.get(0);  // v as the dtype holds it
      DBuf dq(dt, q.shape), dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt.shape), dcl(DType::I32, {1}),
          dout(dt, got.shape);
      dq.upload(q);
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      dcl.upload(cl);
      dout.poison();
      ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), ks::TensorView(), dcl.view(), 1.0,
                          ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      dout.download(got);
      const double allowed = kstest::tol(dt) * (1.0 + ref) + 8.0 * std::sqrt(double(L)) * std::ldexp(1.0, -24) * ref;
      for (int64_t i = 0; i < H * D; ++i)
        ASSERT_LE(std::fabs(got.get(i) - ref), allowed) << GetParam() << " element " << i << ": "
                                                        << ks_last_launch_config("paged_attention");
      if (std::string(GetParam()) != "cuda_cta_per_head") continue;  // (varlen once per dtype)
      Buf bq(DType::I32, {2}), bk(DType::I32, {2}), vgot(dt, {1, H, D});
      bq.set(0, 0), bq.set(1, 1), bk.set(0, 0), bk.set(1, double(L));
      DBuf dbq(DType::I32, {2}), dbk(DType::I32, {2}), dk(dt, {L, KVH, D}), dv(dt, {L, KVH, D}), dvout(dt, vgot.shape);
      dbq.upload(bq);
      dbk.upload(bk);
      ASSERT_EQ(cudaMemcpy(dk.data(), dkc.data(), dk.nbytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dv.data(), dvc.data(), dv.nbytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
      dvout.poison();
      ks::varlen_attention(dvout.view(), dq.view(), dk.view(), dv.view(), dbq.view(), dbk.view(), 1.0, false,
                           ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      dvout.download(vgot);
      for (int64_t i = 0; i < H * D; ++i) ASSERT_LE(std::fabs(vgot.get(i) - ref), allowed) << "varlen element " << i;
    }
  }
}

// Random contexts past the fallback's folds (cuda_cta_per_head sums 64 tiles of 128 keys before
// it folds them into the outer level, attn_cascade_add): lengths just below, at and past 8192
// and 16384 keys, one decode token each, against the CPU under every variant; then head_dim 4096,
// cuda_cta_per_head's limit (48 KB of shared memory, by opt-in), where the variant takes it.
TEST_P(CudaAttention, LongRandomContextsAndTheHeadDimLimit) {
  NEED_GPU();
  std::mt19937 gen(29);
  for (auto [KVH, D, lens] : std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>>>{
           {2, 64, {20000, 16385, 16384, 8193, 8192, 8191, 4097}}, {1, 4096, {300, 1}}}) {
    const bool fits = D <= 128 || std::string(GetParam()) == "cuda_cta_per_head";
    const int64_t H = 2 * KVH, bs = 16, T = int64_t(lens.size());
    const int64_t maxb = (*std::max_element(lens.begin(), lens.end()) + bs - 1) / bs, blocks = maxb + 9;
    for (DType dt : kstest::float_dtypes()) {
      if (!takes(dt) || !fits) continue;
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " D=" + std::to_string(D));
      Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D}), q(dt, {T, H, D}), bt(DType::I32, {T, maxb}),
          cl(DType::I32, {T}), ref(dt, {T, H, D}), got(dt, {T, H, D});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      kstest::fill_normal(q);
      for (int64_t i = 0; i < T * maxb; ++i) bt.set(i, double(gen() % blocks));
      for (int64_t t = 0; t < T; ++t) cl.set(t, double(lens[size_t(t)]));
      DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dq(dt, q.shape), dbt(DType::I32, bt.shape), dcl(DType::I32, {T}),
          dout(dt, q.shape);
      dkc.upload(kc);
      dvc.upload(vc);
      dq.upload(q);
      dbt.upload(bt);
      dcl.upload(cl);
      paged_cuda_and_cpu(dout, dq, dkc, dvc, dbt, dcl, q, kc, vc, bt, cl, 1.0 / std::sqrt(double(D)), got, ref);
      EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << ks_last_launch_config("paged_attention");
    }
  }
}

// cuda_gqa_cluster's small-table rule (KS_ATTN_ONE_CTA_KEYS=N, default 256; 0: off): block tables
// of at most N keys run one CTA per (token, kv head) unit, no cluster, whatever the live length;
// other tables (and every table when it is off) take the capacity rule, a cluster of several CTAs
// for 256, 512 and 528 keys and SmolLM2's 3 units. Both against the CPU, SmolLM2's heads (9 / 3 of
// 64), one token per call, lengths from 1 key to the whole table (up to 9 steps of 64 keys in one
// CTA). The switch is read once per process: GPU scripts run this test again with it set.
TEST(Cuda, AttentionSmallTablesOneCtaRule) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_gqa_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  const int64_t H = 9, KVH = 3, D = 64, bs = 16;
  const char* env = std::getenv("KS_ATTN_ONE_CTA_KEYS");
  const int64_t one_cta_keys = env ? std::atoll(env) : 256;
  std::mt19937 gen(23);
  for (DType dt : kstest::float_dtypes())
    for (int64_t maxb : {int64_t(16), int64_t(32), int64_t(33)}) {
      const int64_t cap = maxb * bs, blocks = maxb + 5;
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " table of " + std::to_string(cap) + " keys");
      Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D}), bt(DType::I32, {1, maxb});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      for (int64_t i = 0; i < maxb; ++i) bt.set(i, double(gen() % blocks));
      DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt.shape), dq(dt, {1, H, D}), dcl(DType::I32, {1}),
          dout(dt, {1, H, D});
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      Buf q(dt, {1, H, D});
      kstest::fill_normal(q);
      dq.upload(q);
      const double scale = 1.0 / std::sqrt(double(D));
      for (int64_t len : {int64_t(1), int64_t(64), int64_t(65), int64_t(192), cap / 2 + 3, cap - 1, cap}) {
        SCOPED_TRACE("length " + std::to_string(len));
        Buf cl(DType::I32, {1}), ref(dt, q.shape), got(dt, q.shape);
        cl.set(0, double(len));
        dcl.upload(cl);
        ASSERT_NO_FATAL_FAILURE(paged_cuda_and_cpu(dout, dq, dkc, dvc, dbt, dcl, q, kc, vc, bt, cl, scale, got, ref));
        const int64_t C = last_attention_cluster();
        EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << "cluster=" << C;
        if (cap <= one_cta_keys)
          EXPECT_EQ(C, 1) << ks_last_launch_config("paged_attention");
        else
          EXPECT_GT(C, 1) << ks_last_launch_config("paged_attention");
      }
    }
}

// bt's first `entries` entries: distinct blocks of [0, blocks) in an order drawn from gen
void shuffled_blocks(Buf& bt, int64_t entries, int64_t blocks, std::mt19937& gen) {
  std::vector<int32_t> perm(static_cast<size_t>(blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), gen);
  for (int64_t i = 0; i < entries; ++i) bt.set(i, double(perm[size_t(i)]));
}

// The after-append tests' setting: cuda_mma_cluster pinned, the GPU's SM count, a non-blocking
// stream (destroyed with it)
struct MmaPinnedOnAStream {
  kstest::ScopedVariant pin{"paged_attention", "cuda_mma_cluster"};
  int sms = 0;
  cudaStream_t st = nullptr;
  MmaPinnedOnAStream() {
    EXPECT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
    EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  }
  ~MmaPinnedOnAStream() {
    if (st) cudaStreamDestroy(st);
  }
};

// Whether cuda_mma_cluster's launch record cfg takes the early reads of
// paged_attention_after_append: 8 warps and a grid of at most one CTA per SM (sms SMs)
bool mma_early_reads(const std::string& cfg, int sms) {
  const size_t g = cfg.find("grid=");
  EXPECT_NE(g, std::string::npos) << cfg;
  return g != std::string::npos && cfg.find("warps=8") != std::string::npos && std::atoll(cfg.c_str() + g + 5) <= sms;
}

// A decode step's inputs for append_then_attention: fresh normal q, k and v, then q, k, v, the
// lengths and the slots uploaded on stream st; the host caches kc / vc get token t's k and v rows
// at slot[t] (the append the CPU reference sees), while the device caches' rows there and both
// outputs are set to NaN bytes (a row read before the append writes it would show).
void stage_append_step(Buf& q, Buf& k, Buf& v, const Buf& cl, const Buf& slot, Buf& kc, Buf& vc, DBuf& dq, DBuf& dk,
                       DBuf& dv, DBuf& dcl, DBuf& dslot, DBuf& dkc, DBuf& dvc, DBuf& da, DBuf& db, cudaStream_t st) {
  kstest::fill_normal(q);
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  for (auto [d, h] : {std::pair<DBuf*, const Buf*>{&dq, &q}, {&dk, &k}, {&dv, &v}, {&dcl, &cl}, {&dslot, &slot}})
    CK(cudaMemcpyAsync(d->data(), h->data(), d->nbytes(), cudaMemcpyHostToDevice, st));
  const size_t row = size_t(k.numel() / k.shape[0]) * ks::dtype_size(k.dtype);  // one token's K (or V) row
  for (int64_t t = 0; t < slot.numel(); ++t) {
    const int64_t sl = int64_t(slot.get(t));
    std::memcpy(static_cast<char*>(kc.data()) + size_t(sl) * row, static_cast<const char*>(k.data()) + size_t(t) * row, row);
    std::memcpy(static_cast<char*>(vc.data()) + size_t(sl) * row, static_cast<const char*>(v.data()) + size_t(t) * row, row);
    CK(cudaMemsetAsync(static_cast<char*>(dkc.data()) + size_t(sl) * row, 0xFF, row, st));
    CK(cudaMemsetAsync(static_cast<char*>(dvc.data()) + size_t(sl) * row, 0xFF, row, st));
  }
  CK(cudaMemsetAsync(da.data(), 0xFF, da.nbytes(), st));
  CK(cudaMemsetAsync(db.data(), 0xFF, db.nbytes(), st));
}

// A decode step's tail on stream st: kv_cache_append of k, v at the slots, then
// paged_attention_after_append (fresh_keys) into da and paged_attention into db, both
// downloaded (ga, gb) once the stream is done; returns the after_append call's launch
// configuration. seq_ids: none (token t is sequence t) or a device tensor.
std::string append_then_attention(DBuf& dkc, DBuf& dvc, const DBuf& dk, const DBuf& dv, const DBuf& dslot,
                                  const DBuf& dq, const DBuf& dbt, const DBuf& dcl, DBuf& da, DBuf& db, double scale,
                                  cudaStream_t st, Buf& ga, Buf& gb, int64_t fresh_keys = 1,
                                  ks::TensorView seq_ids = ks::TensorView()) {
  const auto stream = static_cast<ks_stream_t>(st);
  ks::kv_cache_append(dkc.view(), dvc.view(), dk.view(), dv.view(), dslot.view(), ks::Backend::Cuda, stream);
  ks::paged_attention_after_append(da.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), seq_ids, dcl.view(),
                                   scale, fresh_keys, ks::Backend::Cuda, stream);
  const std::string with = ks_last_launch_config("paged_attention");
  ks::paged_attention(db.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), seq_ids, dcl.view(), scale,
                      ks::Backend::Cuda, stream);
  EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  da.download(ga);
  db.download(gb);
  return with;
}

// paged_attention_after_append (fresh_keys = 1): with one CTA per unit, cuda_gqa_cluster reads
// the context, the first two steps' block-table entries and their keys but the last before
// griddepcontrol.wait, trusting that the kernel before it writes only each token's last context
// position. A decode loop as the model's on one stream: each step's key and value appended by
// kv_cache_append (a one-CTA grid: it lets its dependent launch early) right before the attention,
// the slot's rows first set to NaN bytes, so a copy of the fresh key made before the wait would
// show. Each step's output must equal, bit for bit, paged_attention's launched after it, and the
// last step's the CPU's within tolerance. Tables of 256 keys (one CTA per unit: prewait=1) and
// 1024 (clusters: the promise unused, prewait=0), SmolLM2's heads, distinct blocks (no slot read
// under two positions).
TEST(Cuda, AttentionAfterAppendSameBits) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_gqa_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  const int64_t H = 9, KVH = 3, D = 64, bs = 16;
  const char* env = std::getenv("KS_ATTN_ONE_CTA_KEYS");  // (AttentionSmallTablesOneCtaRule's rule)
  const int64_t one_cta_keys = env ? std::atoll(env) : 256;
  cudaStream_t st = nullptr;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::mt19937 gen(31);
  for (DType dt : kstest::float_dtypes())
    for (int64_t maxb : {int64_t(16), int64_t(64)}) {
      const int64_t cap = maxb * bs, blocks = maxb + 3, steps = std::min<int64_t>(cap, 200);
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " table of " + std::to_string(cap) + " keys");
      Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D}), bt(DType::I32, {1, maxb});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      shuffled_blocks(bt, maxb, blocks, gen);
      DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt.shape), dq(dt, {1, H, D}), dcl(DType::I32, {1}),
          dslot(DType::I64, {1}), dk(dt, {1, KVH, D}), dv(dt, {1, KVH, D}), da(dt, {1, H, D}), db(dt, {1, H, D});
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      const double scale = 1.0 / std::sqrt(double(D));
      const size_t row = size_t(KVH * D) * ks::dtype_size(dt);
      Buf q(dt, {1, H, D}), k(dt, {1, KVH, D}), v(dt, {1, KVH, D}), cl(DType::I32, {1}), slot(DType::I64, {1});
      Buf ga(dt, q.shape), gb(dt, q.shape);
      for (int64_t len = 1; len <= steps; ++len) {
        const int64_t pos = len - 1, sl = int64_t(bt.get(pos / bs)) * bs + pos % bs;
        kstest::fill_normal(q);
        kstest::fill_normal(k);
        kstest::fill_normal(v);
        cl.set(0, double(len));
        slot.set(0, double(sl));
        // (copies on the stream itself: an upload by cudaMemcpy from pageable memory may still be in
        // flight when it returns, and the kernels run on a non-blocking stream)
        for (auto [d, h] : {std::pair{&dq, &q}, {&dk, &k}, {&dv, &v}, {&dcl, &cl}, {&dslot, &slot}})
          CK(cudaMemcpyAsync(d->data(), h->data(), d->nbytes(), cudaMemcpyHostToDevice, st));
        std::memcpy(static_cast<char*>(kc.data()) + size_t(sl) * row, k.data(), row);  // the host's append
        std::memcpy(static_cast<char*>(vc.data()) + size_t(sl) * row, v.data(), row);
        CK(cudaMemsetAsync(static_cast<char*>(dkc.data()) + size_t(sl) * row, 0xFF, row, st));
        CK(cudaMemsetAsync(static_cast<char*>(dvc.data()) + size_t(sl) * row, 0xFF, row, st));
        CK(cudaMemsetAsync(da.data(), 0xFF, da.nbytes(), st));
        CK(cudaMemsetAsync(db.data(), 0xFF, db.nbytes(), st));
        const std::string with = append_then_attention(dkc, dvc, dk, dv, dslot, dq, dbt, dcl, da, db, scale, st, ga, gb);
        ASSERT_NE(with.find(cap <= one_cta_keys ? "prewait=1" : "prewait=0"), std::string::npos) << with;
        ASSERT_EQ(0, std::memcmp(ga.data(), gb.data(), ga.nbytes())) << "length " << len << ": " << with;
      }
      Buf ref(dt, q.shape);
      ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), ks::TensorView(), cl.view(), scale,
                          ks::Backend::Cpu);
      EXPECT_TRUE(close_to_cpu(gb, ref, 1e-5)) << ks_last_launch_config("paged_attention");
    }
  CK(cudaStreamDestroy(st));
}

// One token's decode step behind the model's own predecessor of decode attention: the fused norm
// + q/k/v matmul (Q4_1, (H + 2 KVH) D rows over K) + RoPE + append, which lets its dependent
// launch early (its default) and stores the new key's cache row at its end, so the attention's
// early reads overlap the matmul (kv_cache_append is quicker and may hide a read made too early).
// A table of maxb 16-key blocks, distinct and shuffled (no slot read under two positions).
// step(len) appends position len - 1, its slot's cache rows and both outputs first set to NaN
// bytes (a copy of the fresh row made before the wait would show), then runs
// paged_attention_after_append (fresh_keys = 1) into da and paged_attention into db on one
// stream, and checks that both gave the same bits. With graph = true the fused call and the
// after_append call replay from a CUDA graph captured at the first such step (global capture
// mode; lengths and slots read from the same device buffers at every replay), as in the model's
// decode graph: there the attention follows the fused kernel directly, while eagerly a split's
// workspace zeroing (a memset) sits between them and nothing overlaps.
struct FusedAppendRig {
  DType dt;
  int64_t H, KVH, D, K, N, maxb, blocks;
  static constexpr int64_t bs = 16;
  std::vector<int64_t> cs;
  Buf res, nw, bt, kc, vc, w, cl, pos, slot, ga, gb;
  DBuf dres, dnw, dw, dkc, dvc, dbt, dcl, dpos, dslot, qkv, da, db;
  cudaStream_t st = nullptr;
  double scale;
  size_t row;
  ks::TensorView none, q;  // q: the fused output's first H * D columns as [1, H, D]
  std::string fused, after, plain;  // the last step's launch configurations (graph: the captured ones)
  cudaGraphExec_t exec = nullptr;

  FusedAppendRig(DType dt_, int64_t H_, int64_t KVH_, int64_t D_, int64_t K_, int64_t maxb_, unsigned seed,
                 double nw_mean)
      : dt(dt_), H(H_), KVH(KVH_), D(D_), K(K_), N((H_ + 2 * KVH_) * D_), maxb(maxb_), blocks(maxb_ + 3),
        cs{blocks, bs, KVH_, D_}, res(dt, {1, K}), nw(dt, {K}), bt(DType::I32, {1, maxb}), kc(dt, cs), vc(dt, cs),
        w(kstest::gguf::make_packed(KS_QTYPE_Q4_1, N, K)), cl(DType::I32, {1}), pos(DType::I64, {1}),
        slot(DType::I64, {1}), ga(dt, {1, H, D}), gb(dt, {1, H, D}), dres(dt, {1, K}), dnw(dt, {K}),
        dw(DType::U8, w.shape), dkc(dt, cs), dvc(dt, cs), dbt(DType::I32, bt.shape), dcl(DType::I32, {1}),
        dpos(DType::I64, {1}), dslot(DType::I64, {1}), qkv(dt, {1, N}), da(dt, {1, H, D}), db(dt, {1, H, D}),
        scale(1.0 / std::sqrt(double(D))), row(size_t(KVH * D) * ks::dtype_size(dt)),
        q(qkv.data(), dt, {1, H, D}, qkv.view().device()) {
    kstest::fill_normal(nw, 1.0, nw_mean);  // (stddev 1, mean nw_mean)
    kstest::fill_normal(kc);
    kstest::fill_normal(vc);
    std::mt19937 gen(seed);
    shuffled_blocks(bt, maxb, blocks, gen);
    dnw.upload(nw);
    dw.upload(w);
    dkc.upload(kc);
    dvc.upload(vc);
    dbt.upload(bt);
    EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  }
  ~FusedAppendRig() {
    if (exec) cudaGraphExecDestroy(exec);
    if (st) cudaStreamDestroy(st);
  }
  void launch_pair(double sc) {
    const auto stream = static_cast<ks_stream_t>(st);
    ks::fused_add_rms_norm_quant_matmul_rope_kv_append(qkv.view(), none, none, dres.view(), dnw.view(), 1e-5, dw.view(),
                                                       ks::QType::Q4_1, H, KVH, dpos.view(), D, 10000.0, false,
                                                       dkc.view(), dvc.view(), dslot.view(), ks::Backend::Cuda, stream);
    fused = ks_last_launch_config("fused_add_rms_norm_quant_matmul_rope_kv_append");
    ks::paged_attention_after_append(da.view(), q, dkc.view(), dvc.view(), dbt.view(), none, dcl.view(), sc,
                                     /*fresh_keys=*/1, ks::Backend::Cuda, stream);
    after = ks_last_launch_config("paged_attention");
  }
  void step(int64_t len, double sc, bool graph = false) {
    const auto stream = static_cast<ks_stream_t>(st);
    const int64_t p = len - 1, sl = int64_t(bt.get(p / bs)) * bs + p % bs;
    kstest::fill_normal(res);
    cl.set(0, double(len));
    pos.set(0, double(p));
    slot.set(0, double(sl));
    // (the inputs by copies on the stream itself, ordered before its kernels)
    CK(cudaMemcpyAsync(dres.data(), res.data(), dres.nbytes(), cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(dcl.data(), cl.data(), dcl.nbytes(), cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(dpos.data(), pos.data(), dpos.nbytes(), cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(dslot.data(), slot.data(), dslot.nbytes(), cudaMemcpyHostToDevice, st));
    CK(cudaMemsetAsync(static_cast<char*>(dkc.data()) + size_t(sl) * row, 0xFF, row, st));
    CK(cudaMemsetAsync(static_cast<char*>(dvc.data()) + size_t(sl) * row, 0xFF, row, st));
    CK(cudaMemsetAsync(da.data(), 0xFF, da.nbytes(), st));
    CK(cudaMemsetAsync(db.data(), 0xFF, db.nbytes(), st));
    if (!graph) {
      launch_pair(sc);
    } else {
      if (!exec) {
        cudaGraph_t g = nullptr;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        launch_pair(sc);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&exec, g, 0));
        CK(cudaGraphDestroy(g));
      }
      CK(cudaGraphLaunch(exec, st));
    }
    ks::paged_attention(db.view(), q, dkc.view(), dvc.view(), dbt.view(), none, dcl.view(), sc, ks::Backend::Cuda,
                        stream);
    plain = ks_last_launch_config("paged_attention");
    CK(cudaStreamSynchronize(st));
    da.download(ga);
    db.download(gb);
    EXPECT_EQ(0, std::memcmp(ga.data(), gb.data(), ga.nbytes())) << "length " << len << ": " << after;
  }
  // the GPU's q, caches (as the steps left them) and the CPU backend's output at scale sc
  void download(Buf& hq, Buf& hk, Buf& hv, Buf& ref, double sc) {
    qkv.download(hq);
    dkc.download(hk);
    dvc.download(hv);
    ks::paged_attention(ref.view(), ks::TensorView(hq.data(), dt, {1, H, D}), hk.view(), hv.view(), bt.view(),
                        ks::TensorView(), cl.view(), sc, ks::Backend::Cpu);
  }
  // The last step's output (gb: paged_attention on the GPU) and the CPU backend's against FP64, on
  // the caches and q as the GPU left them, within the bound of an FP32 computation
  // (kstest::paged_attention_fp64): the projections' q and k give scores of large magnitude, so a
  // fixed tolerance is too tight for some draws (a sharded run's fp32 inputs differed by 2.2e-5
  // relative from the CPU's at 5f64647, 10x close_to_cpu's FP32 tolerance; at bf4835d an fp16 row
  // of cuda_mma_cluster 0.0049 from the CPU's at 0.78, 10 ulp, where 2 x the fp16 tolerance is
  // 0.0036). At this scale the softmax is nearly one-hot, so that bound is loose (about 10% of
  // sum p |v|, a reviewer's estimate); the same buffers at a scale 512 times smaller (scores of a
  // few units) weigh every key and tighten it to about 3e-4 of the outputs: a dropped or
  // misplaced key (weight ~1/len) is far outside it.
  void expect_last_step_matches_fp64() {
    Buf hq(dt, {1, N}), hk(dt, cs), hv(dt, cs), ref(dt, {1, H, D});
    download(hq, hk, hv, ref, scale);
    std::vector<double> qv = hq.values();
    qv.resize(size_t(H * D));  // q: the row's first H * D values
    const std::vector<double> kv = hk.values(), vv = hv.values();
    const std::vector<int64_t> ctx = {int64_t(cl.get(0))};
    const auto slot_of = [&](int64_t, int64_t j) { return int64_t(bt.get(j / bs)) * bs + j % bs; };
    const kstest::AttnRef r64 = kstest::paged_attention_fp64(qv, kv, vv, 1, H, KVH, D, ctx, scale, slot_of);
    EXPECT_TRUE(kstest::attention_matches(gb, r64, ctx, H, D)) << plain;
    EXPECT_TRUE(kstest::attention_matches(ref, r64, ctx, H, D)) << "the CPU backend";
    const double small = scale / 512;
    Buf gs(dt, {1, H, D}), cs_ref(dt, {1, H, D});
    ks::paged_attention(db.view(), q, dkc.view(), dvc.view(), dbt.view(), none, dcl.view(), small, ks::Backend::Cuda,
                        static_cast<ks_stream_t>(st));
    CK(cudaStreamSynchronize(st));
    db.download(gs);
    ks::paged_attention(cs_ref.view(), ks::TensorView(hq.data(), dt, {1, H, D}), hk.view(), hv.view(), bt.view(),
                        ks::TensorView(), cl.view(), small, ks::Backend::Cpu);
    const kstest::AttnRef s64 = kstest::paged_attention_fp64(qv, kv, vv, 1, H, KVH, D, ctx, small, slot_of);
    EXPECT_TRUE(kstest::attention_matches(gs, s64, ctx, H, D)) << "scale / 512: " << plain;
    EXPECT_TRUE(kstest::attention_matches(cs_ref, s64, ctx, H, D)) << "the CPU backend, scale / 512";
  }
};

// paged_attention_after_append behind FusedAppendRig on cuda_gqa_cluster (SmolLM2's shapes, fp32,
// a 256-key table: one CTA per unit, so the early reads apply), one token per step from 1 to 200
// keys; each output equal, bit for bit, to paged_attention's launched after it, and the last one
// the CPU's within tolerance.
TEST(Cuda, AttentionAfterFusedQkvAppendSameBits) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_gqa_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  const char* env = std::getenv("KS_ATTN_ONE_CTA_KEYS");
  const int64_t one_cta_keys = env ? std::atoll(env) : 256;
  const char* early_env = std::getenv("KS_QMM_ROPE_EARLY_TRIGGER");
  const bool early = !(early_env && std::string(early_env) == "0");
  const DType dt = DType::F32;
  const int64_t H = 9, KVH = 3, D = 64, maxb = 16;
  FusedAppendRig rig(dt, H, KVH, D, 576, maxb, 41, 1.0);
  for (int64_t len = 1; len <= 200; ++len) {
    ASSERT_NO_FATAL_FAILURE(rig.step(len, rig.scale));
    ASSERT_FALSE(::testing::Test::HasFailure()) << "length " << len;
    ASSERT_NE(rig.fused.find(early ? "rope_early_trigger=1" : "rope_early_trigger=0"), std::string::npos) << rig.fused;
    ASSERT_NE(rig.after.find(16 * maxb <= one_cta_keys ? "prewait=1" : "prewait=0"), std::string::npos) << rig.after;
  }
  rig.expect_last_step_matches_fp64();
}

// paged_attention_after_append on cuda_mma_cluster (bf16 / fp16, the tensor-core kernel) behind
// FusedAppendRig: with fresh_keys = 1 each CTA reads the context, its first tiles' block-table
// entries and those tiles' older keys before griddepcontrol.wait, and the fresh key's row after
// it. Each step's output must equal, bit for bit, paged_attention's launched after it (same
// variant, no early reads), and the last step's within the FP64 bound (expect_last_step_matches_fp64).
// Shapes: 32 / 8 heads
// of 128 at tables of 1024 keys (clusters of 4) and 8192 (the split beyond a cluster, its last CTA
// merging), 9 / 3 heads of 64 at 32768 (split), 16 / 2 heads of 32 and of 64 (8 query heads per kv
// head: unpacked pieces) at 1024 and 16384; lengths at tile and split edges.
TEST(CudaAttentionMma, AfterFusedAppendSameBits) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_mma_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Case {
    int64_t H, KVH, D, K, maxb;
    const char* expect;  // in the attention's launch configuration on a GPU of 132 SMs (the H200)
  };
  // (the last two: 8 query heads per kv head, so P's pieces unpacked, at head_dim 32 and 64)
  for (const Case c : {Case{32, 8, 128, 1024, 64, "cluster=4 splits=1"}, Case{32, 8, 128, 1024, 512, "splits=16"},
                       Case{9, 3, 64, 576, 2048, "splits=44"}, Case{16, 2, 32, 512, 64, "packed=0"},
                       Case{16, 2, 64, 512, 1024, "packed=0"}})
    for (DType dt : {DType::BF16, DType::F16}) {
      const int64_t cap = c.maxb * FusedAppendRig::bs;
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " " + std::to_string(c.H) + "/" + std::to_string(c.KVH) +
                   " heads of " + std::to_string(c.D) + ", a table of " + std::to_string(cap) + " keys");
      FusedAppendRig rig(dt, c.H, c.KVH, c.D, c.K, c.maxb, 43, 0.1);
      // eagerly, then replayed from a graph (a split's early reads overlap the fused kernel only there)
      for (bool graph : {false, true})
        for (int64_t len : {int64_t(1), int64_t(2), int64_t(15), int64_t(16), int64_t(17), int64_t(255), int64_t(256),
                            int64_t(257), int64_t(1000), cap / 2 + 5, cap - 17, cap - 1, cap}) {
          if (len > cap) continue;
          ASSERT_NO_FATAL_FAILURE(rig.step(len, rig.scale, graph));
          ASSERT_FALSE(::testing::Test::HasFailure()) << "length " << len << (graph ? ", graph" : "");
          // the early reads: 8 warps and a grid of at most one CTA per SM
          const bool early = mma_early_reads(rig.after, sms);
          ASSERT_NE(rig.after.find(early ? "prewait=1" : "prewait=0"), std::string::npos) << rig.after;
          if (sms == 132) {
            ASSERT_TRUE(early) << rig.after;
            ASSERT_NE(rig.after.find(c.expect), std::string::npos) << rig.after;
          }
          ASSERT_NE(rig.plain.find("prewait=0"), std::string::npos) << rig.plain;
        }
      // the last step (a full table) against FP64 on the caches and q as the GPU left them
      rig.expect_last_step_matches_fp64();
    }
}

// paged_attention_after_append on cuda_mma_cluster with a batch: 2 sequences (16 units of 32 / 8
// heads of 128: 8 warps per CTA, a grid of at most one CTA per SM, so the early reads apply), 4
// (32 units: 4 warps per CTA, prewait=0) and 32 (a grid of 256 CTAs, prewait=0). A decode loop of kv_cache_append (every
// token's new row, the slots first set to NaN bytes) then the attention, at lengths that differ
// per sequence; each step's output equal, bit for bit, to paged_attention's after it, and the
// last step's the CPU's within tolerance.
TEST(CudaAttentionMma, AfterAppendBatchSameBits) {
  NEED_GPU();
  MmaPinnedOnAStream on;
  ASSERT_FALSE(::testing::Test::HasFailure());
  const int sms = on.sms;
  cudaStream_t st = on.st;
  const int64_t H = 32, KVH = 8, D = 128, bs = 16, maxb = 32, cap = maxb * bs;
  std::mt19937 gen(47);
  for (int64_t B : {int64_t(2), int64_t(4), int64_t(32)})
    for (DType dt : {DType::BF16, DType::F16}) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " batch " + std::to_string(B));
      const int64_t blocks = B * maxb + 5;
      const std::vector<int64_t> cs = {blocks, bs, KVH, D};
      Buf kc(dt, cs), vc(dt, cs), bt(DType::I32, {B, maxb});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      shuffled_blocks(bt, B * maxb, blocks, gen);
      DBuf dkc(dt, cs), dvc(dt, cs), dbt(DType::I32, bt.shape), dq(dt, {B, H, D}), dk(dt, {B, KVH, D}),
          dv(dt, {B, KVH, D}), dcl(DType::I32, {B}), dslot(DType::I64, {B}), da(dt, {B, H, D}), db(dt, {B, H, D});
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      const double scale = 1.0 / std::sqrt(double(D));
      Buf q(dt, {B, H, D}), k(dt, {B, KVH, D}), v(dt, {B, KVH, D}), cl(DType::I32, {B}), slot(DType::I64, {B});
      Buf ga(dt, q.shape), gb(dt, q.shape);
      std::string cfg;
      for (int64_t step : {int64_t(1), int64_t(17), int64_t(200), cap - 40, cap - 8}) {
        for (int64_t b = 0; b < B; ++b) {  // sequence b holds step + 5 b keys (at most cap)
          const int64_t len = std::min(cap, step + 5 * b), p = len - 1;
          cl.set(b, double(len));
          slot.set(b, double(int64_t(bt.get(b * maxb + p / bs)) * bs + p % bs));
        }
        ASSERT_NO_FATAL_FAILURE(stage_append_step(q, k, v, cl, slot, kc, vc, dq, dk, dv, dcl, dslot, dkc, dvc, da, db, st));
        cfg = append_then_attention(dkc, dvc, dk, dv, dslot, dq, dbt, dcl, da, db, scale, st, ga, gb);
        const bool eight = cfg.find("warps=8") != std::string::npos;
        ASSERT_NE(cfg.find(mma_early_reads(cfg, sms) ? "prewait=1" : "prewait=0"), std::string::npos) << cfg;
        if (sms == 132) {  // (the H200: 8 warps for units * 16 < 2 SMs)
          EXPECT_EQ(eight, B == 2) << cfg;
        }
        ASSERT_EQ(0, std::memcmp(ga.data(), gb.data(), ga.nbytes())) << "step " << step << ": " << cfg;
      }
      Buf ref(dt, q.shape);
      ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), ks::TensorView(), cl.view(), scale,
                          ks::Backend::Cpu);
      EXPECT_TRUE(close_to_cpu(gb, ref, 1e-5)) << cfg;
    }
}

// paged_attention_after_append on cuda_mma_cluster with two tokens of one sequence per step
// (seq_ids [0, 0]; 16 / 4 heads: 8 units, 8 warps per CTA, so the early reads apply), both
// appended by one kv_cache_append right before, the promise fresh_keys = 2 (token 0 reads
// len - 1 keys, the last fresh; token 1 reads len, the last two fresh), head_dim 96 (padded to
// 128 in shared memory), tables of 512 keys (a cluster of 2) and 8192 (clusters of 8, then the
// split: 16 CTAs per unit on the H200; with 32 / 8 heads there it would be 256 CTAs of clusters of
// 16 and no early reads, a reviewer's count). Each step's rows equal, bit
// for bit, paged_attention's after them, and the last step's the CPU's within tolerance.
TEST(CudaAttentionMma, AfterAppendTwoFreshKeysSameBits) {
  NEED_GPU();
  MmaPinnedOnAStream on;
  ASSERT_FALSE(::testing::Test::HasFailure());
  const int sms = on.sms;
  cudaStream_t st = on.st;
  const int64_t T = 2, H = 16, KVH = 4, D = 96, bs = 16;
  std::mt19937 gen(53);
  for (int64_t maxb : {int64_t(32), int64_t(512)})
    for (DType dt : {DType::BF16, DType::F16}) {
      const int64_t cap = maxb * bs, blocks = maxb + 5;
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + ", a table of " + std::to_string(cap) + " keys");
      const std::vector<int64_t> cs = {blocks, bs, KVH, D};
      Buf kc(dt, cs), vc(dt, cs), bt(DType::I32, {1, maxb}), sid(DType::I32, {T});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      shuffled_blocks(bt, maxb, blocks, gen);
      sid.set(0, 0.0);
      sid.set(1, 0.0);
      DBuf dkc(dt, cs), dvc(dt, cs), dbt(DType::I32, bt.shape), dsid(DType::I32, {T}), dq(dt, {T, H, D}),
          dk(dt, {T, KVH, D}), dv(dt, {T, KVH, D}), dcl(DType::I32, {T}), dslot(DType::I64, {T}), da(dt, {T, H, D}),
          db(dt, {T, H, D});
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      dsid.upload(sid);
      const double scale = 1.0 / std::sqrt(double(D));
      Buf q(dt, {T, H, D}), k(dt, {T, KVH, D}), v(dt, {T, KVH, D}), cl(DType::I32, {T}), slot(DType::I64, {T});
      Buf ga(dt, q.shape), gb(dt, q.shape);
      std::string cfg;
      for (int64_t len : {int64_t(2), int64_t(3), int64_t(16), int64_t(17), int64_t(257), cap / 2 + 1, cap}) {
        for (int64_t t = 0; t < T; ++t) {  // token t at position len - 2 + t, reading len - 1 + t keys
          const int64_t p = len - 2 + t;
          cl.set(t, double(p + 1));
          slot.set(t, double(int64_t(bt.get(p / bs)) * bs + p % bs));
        }
        ASSERT_NO_FATAL_FAILURE(stage_append_step(q, k, v, cl, slot, kc, vc, dq, dk, dv, dcl, dslot, dkc, dvc, da, db, st));
        cfg = append_then_attention(dkc, dvc, dk, dv, dslot, dq, dbt, dcl, da, db, scale, st, ga, gb, /*fresh_keys=*/2,
                                    dsid.view());
        const bool early = mma_early_reads(cfg, sms);
        ASSERT_NE(cfg.find(early ? "prewait=1" : "prewait=0"), std::string::npos) << cfg;
        if (sms == 132) {
          EXPECT_TRUE(early) << cfg;
          if (maxb == 512) EXPECT_NE(cfg.find("splits=16"), std::string::npos) << cfg;
        }
        ASSERT_EQ(0, std::memcmp(ga.data(), gb.data(), ga.nbytes())) << "length " << len << ": " << cfg;
      }
      Buf ref(dt, q.shape);
      ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), sid.view(), cl.view(), scale,
                          ks::Backend::Cpu);
      EXPECT_TRUE(close_to_cpu(gb, ref, 1e-5)) << cfg;
    }
}

// paged_attention_after_append on cuda_mma_cluster (batch 1, 32 / 8 heads of 128: 8 units, 8 warps
// per CTA, an 8192-key table split over 16 CTAs per unit on the H200, so the early reads apply)
// with block sizes other than 16 (8: a 16-key tile spans two blocks; 48: some tiles straddle a
// block boundary, and the block index is a division by a non-power of two; 32: a block holds
// two tiles) and with the split's states merged by the unit's last CTA (the default) or by
// attention_combine_kernel (KS_ATTN_LAST_COMBINE=0: the early-read instantiation without the
// merge, then the combine kernel). A decode loop of kv_cache_append (the slot's rows first set to
// NaN bytes) then the attention; each step's rows equal, bit for bit, paged_attention's after
// them, and the last step's the CPU's within tolerance.
TEST(CudaAttentionMma, AfterAppendBlockSizesAndCombineKernel) {
  NEED_GPU();
  MmaPinnedOnAStream on;
  ASSERT_FALSE(::testing::Test::HasFailure());
  const int sms = on.sms;
  cudaStream_t st = on.st;
  const int64_t H = 32, KVH = 8, D = 128, keys = 8192;
  std::mt19937 gen(59);
  for (int64_t bs : {int64_t(8), int64_t(48), int64_t(32)})
    for (const char* lc : {"1", "0"}) {
      kstest::ScopedEnv last_combine("KS_ATTN_LAST_COMBINE", lc);
      const DType dt = bs == 32 ? DType::F16 : DType::BF16;
      const int64_t maxb = (keys + bs - 1) / bs, cap = maxb * bs, blocks = maxb + 5;
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + ", blocks of " + std::to_string(bs) +
                   ", KS_ATTN_LAST_COMBINE=" + lc);
      const std::vector<int64_t> cs = {blocks, bs, KVH, D};
      Buf kc(dt, cs), vc(dt, cs), bt(DType::I32, {1, maxb});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      shuffled_blocks(bt, maxb, blocks, gen);
      DBuf dkc(dt, cs), dvc(dt, cs), dbt(DType::I32, bt.shape), dq(dt, {1, H, D}), dk(dt, {1, KVH, D}),
          dv(dt, {1, KVH, D}), dcl(DType::I32, {1}), dslot(DType::I64, {1}), da(dt, {1, H, D}), db(dt, {1, H, D});
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      const double scale = 1.0 / std::sqrt(double(D));
      Buf q(dt, {1, H, D}), k(dt, {1, KVH, D}), v(dt, {1, KVH, D}), cl(DType::I32, {1}), slot(DType::I64, {1});
      Buf ga(dt, q.shape), gb(dt, q.shape);
      std::string cfg;
      for (int64_t len : {int64_t(1), int64_t(17), bs * 7 + 5, int64_t(1000), cap / 2 + 3, cap - 1, cap}) {
        const int64_t p = len - 1;
        cl.set(0, double(len));
        slot.set(0, double(int64_t(bt.get(p / bs)) * bs + p % bs));
        ASSERT_NO_FATAL_FAILURE(stage_append_step(q, k, v, cl, slot, kc, vc, dq, dk, dv, dcl, dslot, dkc, dvc, da, db, st));
        cfg = append_then_attention(dkc, dvc, dk, dv, dslot, dq, dbt, dcl, da, db, scale, st, ga, gb);
        const bool early = mma_early_reads(cfg, sms);
        ASSERT_NE(cfg.find(early ? "prewait=1" : "prewait=0"), std::string::npos) << cfg;
        if (sms == 132) {
          EXPECT_TRUE(early) << cfg;
          EXPECT_NE(cfg.find("splits=16"), std::string::npos) << cfg;
          EXPECT_NE(cfg.find(std::string("last_combine=") + lc), std::string::npos) << cfg;
        }
        ASSERT_EQ(0, std::memcmp(ga.data(), gb.data(), ga.nbytes())) << "length " << len << ": " << cfg;
      }
      Buf ref(dt, q.shape);
      ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), ks::TensorView(), cl.view(), scale,
                          ks::Backend::Cpu);
      EXPECT_TRUE(close_to_cpu(gb, ref, 1e-5)) << cfg;
    }
}

// A short live context in a block table sized for many more keys (the model's decode step:
// a cluster sized at capture for the capacity, replayed at every length): only the first
// ceil(len / keys per step) CTAs take keys, so a token's row depends on its own length only.
// Each sequence decoded alone (a cluster of 16 on the H200) must give the same bits as inside
// a batch of 24 (a smaller cluster), and match the CPU; lengths up to 64 keys (one step of
// every instantiation here) and one of 1000 (several CTAs) against the CPU.
TEST_P(CudaAttention, ShortContextsInALargeTableAloneAndBatched) {
  NEED_GPU();
  const int64_t H = 9, KVH = 3, D = 64, bs = 16, maxb = 256, seqs = 24, blocks = seqs * maxb;
  for (DType dt : kstest::float_dtypes()) {
    if (!takes(dt)) continue;
    SCOPED_TRACE(ks::dtype_name(dt));
    Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D}), bt(DType::I32, {seqs, maxb});
    kstest::fill_normal(kc);
    kstest::fill_normal(vc);
    std::mt19937 gen(11);
    for (int64_t i = 0; i < seqs * maxb; ++i) bt.set(i, double(gen() % blocks));
    DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt.shape);
    dkc.upload(kc);
    dvc.upload(vc);
    dbt.upload(bt);
    const double scale = 1.0 / std::sqrt(double(D));
    const int64_t short_lens[] = {1, 2, 17, 33, 63, 64};
    Buf q(dt, {seqs, H, D}), cl(DType::I32, {seqs}), sid(DType::I32, {seqs}), ref(dt, q.shape), got(dt, q.shape);
    kstest::fill_normal(q);
    for (int64_t t = 0; t < seqs; ++t) {
      cl.set(t, double(t == seqs - 1 ? 1000 : short_lens[t % 6]));
      sid.set(t, double(t));
    }
    DBuf dq(dt, q.shape), dcl(DType::I32, {seqs}), dsid(DType::I32, {seqs}), dout(dt, q.shape);
    dq.upload(q);
    dcl.upload(cl);
    dsid.upload(sid);
    dout.poison();
    ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), dsid.view(), dcl.view(), scale,
                        ks::Backend::Cuda);
    CK(cudaDeviceSynchronize());
    const int64_t c_batch = last_attention_cluster();
    dout.download(got);
    ks::paged_attention(ref.view(), q.view(), kc.view(), vc.view(), bt.view(), sid.view(), cl.view(), scale,
                        ks::Backend::Cpu);
    EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << "batch of " << seqs << ", cluster=" << c_batch;
    // each short one alone: token t of the batch as a one-token call on its own sequence
    for (int64_t t = 0; t + 1 < seqs; ++t) {
      Buf q1(dt, {1, H, D}), cl1(DType::I32, {1}), sid1(DType::I32, {1}), got1(dt, {1, H, D});
      for (int64_t i = 0; i < H * D; ++i) q1.set(i, q.get(t * H * D + i));
      cl1.set(0, cl.get(t));
      sid1.set(0, double(t));
      DBuf dq1(dt, q1.shape), dcl1(DType::I32, {1}), dsid1(DType::I32, {1}), dout1(dt, q1.shape);
      dq1.upload(q1);
      dcl1.upload(cl1);
      dsid1.upload(sid1);
      dout1.poison();
      ks::paged_attention(dout1.view(), dq1.view(), dkc.view(), dvc.view(), dbt.view(), dsid1.view(), dcl1.view(),
                          scale, ks::Backend::Cuda);
      CK(cudaDeviceSynchronize());
      const int64_t c_alone = last_attention_cluster();
      if (clustered()) EXPECT_GE(c_alone, c_batch);
      dout1.download(got1);
      for (int64_t i = 0; i < H * D; ++i)
        ASSERT_EQ(std::memcmp(static_cast<const uint8_t*>(got1.data()) + size_t(i) * ks::dtype_size(dt),
                              static_cast<const uint8_t*>(got.data()) + size_t(t * H * D + i) * ks::dtype_size(dt),
                              ks::dtype_size(dt)),
                  0)
            << "token " << t << " (length " << cl.get(t) << ") element " << i << ": alone (cluster " << c_alone
            << ") differs from the batch (cluster " << c_batch << ")";
    }
  }
}

// cuda_mma_cluster beyond the shared tests: 16 query heads per kv head (rows 0..15 of its
// MMA tiles, which cuda_gqa_cluster declines) at head_dim 128 and 96 (zero-padded to 128),
// head_dim 8, and 16 (token, kv head) units over a long table, against the CPU; then the
// precision of its weights against an FP64 reference computed here: two keys per query, so each output is (p0 v0 + p1 v1) / (p0 + p1) with no averaging of
// rounding errors over many keys. With the FP32 weights of the contract, carried as three
// bf16 / fp16 pieces, the output rounds to the FP64 value's nearest T in practically every
// case; weights rounded once to T (one piece) get about 89% right in a simulation of this
// test (numpy, 4000 rows), so the 99% bar fails if the split is lost.
TEST(CudaAttentionMma, SixteenHeadsPerKvHeadAndFp32Weights) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_mma_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  // (tokens, heads, kv heads, head_dim, block-table capacity, context lengths): 16 heads per kv
  // head at head_dim 128 and 96; head_dim 8 (three of the padded row's four 16-byte chunks
  // zero-filled); 16 units (2 tokens x 8 kv heads: 8 warps per CTA, more units than clusters of
  // 16 that fit at once on the H200, so the launcher's fallback cluster size) over 5000 keys
  struct Shape {
    int64_t T, H, KVH, D, cap;
    std::vector<int64_t> lens;
  };
  const std::vector<Shape> shapes = {{3, 32, 2, 128, 3200, {1, 700, 3181}},
                                     {3, 32, 2, 96, 3200, {1, 700, 3181}},
                                     {3, 4, 2, 8, 512, {392, 257, 257}},
                                     {2, 32, 8, 128, 5120, {5000, 2561}}};
  for (DType dt : {DType::BF16, DType::F16}) {
    for (const Shape& sh : shapes) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " T=" + std::to_string(sh.T) + " H=" + std::to_string(sh.H) +
                   " KVH=" + std::to_string(sh.KVH) + " D=" + std::to_string(sh.D));
      const int64_t bs = 16, maxb = sh.cap / bs, blocks = sh.T * maxb;
      Buf kc(dt, {blocks, bs, sh.KVH, sh.D}), vc(dt, {blocks, bs, sh.KVH, sh.D}), bt(DType::I32, {sh.T, maxb});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      for (int64_t i = 0; i < sh.T * maxb; ++i) bt.set(i, double((i * 37 + 11) % blocks));
      Buf q(dt, {sh.T, sh.H, sh.D}), ref(dt, q.shape), got(dt, q.shape);
      kstest::fill_normal(q);
      std::vector<int64_t> sids(size_t(sh.T));
      for (int64_t t = 0; t < sh.T; ++t) sids[size_t(t)] = t;
      ASSERT_NO_FATAL_FAILURE(paged_device_vs_cpu(dt, q, kc, vc, bt, bt, sids, sh.lens, sids, sh.lens,
                                                  1.0 / std::sqrt(double(sh.D)), got, ref));
      const std::string cfg = ks_last_launch_config("paged_attention");  // the device call's
      std::printf("cuda_mma_cluster %s: %s\n", ks::dtype_name(dt), cfg.c_str());
      if (sh.H / sh.KVH == 16)
        EXPECT_TRUE(cfg.find("variant=cuda_mma_cluster") != std::string::npos && cfg.find("group=16") != std::string::npos)
            << cfg;
      EXPECT_TRUE(close_to_cpu(got, ref, 1e-5));
    }
    // two keys per query; 2048 queries (sequences); 1, 4 and 16 query heads per kv head (packed
    // pieces at 1 and 4, all rows of the packed MMA; three MMAs at 16)
    for (auto [H, KVH] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {16, 4}, {32, 2}}) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " two keys per query, H=" + std::to_string(H) +
                   " KVH=" + std::to_string(KVH));
      const int64_t T = 2048, D = 64, bs = 16, G = H / KVH;
      Buf kc(dt, {T, bs, KVH, D}), vc(dt, {T, bs, KVH, D}), bt(DType::I32, {T, 1}), q(dt, {T, H, D}),
          got(dt, {T, H, D}), cpu(dt, {T, H, D}), want(dt, {T, H, D});
      kstest::fill_normal(kc);
      kstest::fill_uniform(vc, -1.0, 1.0);
      kstest::fill_normal(q, 2.8);  // scores of about N(0, 2.8^2) at scale 1/8: the smaller weight spans 1 to ~e^-12
      std::vector<int64_t> sids(static_cast<size_t>(T)), lens(static_cast<size_t>(T), 2);
      for (int64_t t = 0; t < T; ++t) bt.set(t, double(t)), sids[size_t(t)] = t;
      const double scale = 0.125;
      std::vector<double> exact(size_t(T * H * D));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t g = h / G;
          double sc[2];
          for (int64_t j = 0; j < 2; ++j) {
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += q.get((t * H + h) * D + d) * kc.get(((t * bs + j) * KVH + g) * D + d);
            sc[j] = scale * dot;
          }
          const double mx = std::max(sc[0], sc[1]), p0 = std::exp(sc[0] - mx), p1 = std::exp(sc[1] - mx);
          for (int64_t d = 0; d < D; ++d) {
            const double v0 = vc.get(((t * bs + 0) * KVH + g) * D + d), v1 = vc.get(((t * bs + 1) * KVH + g) * D + d);
            const int64_t i = (t * H + h) * D + d;
            exact[size_t(i)] = (p0 * v0 + p1 * v1) / (p0 + p1);
            want.set(i, exact[size_t(i)]);  // rounded to nearest T
          }
        }
      ASSERT_NO_FATAL_FAILURE(paged_device_vs_cpu(dt, q, kc, vc, bt, bt, sids, lens, sids, lens, scale, got, cpu));
      const std::string cfg = ks_last_launch_config("paged_attention");
      EXPECT_NE(cfg.find(G <= 4 ? "packed=1" : "packed=0"), std::string::npos) << cfg;
      const double ulp = dt == DType::BF16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
      int64_t same = 0;
      for (int64_t i = 0; i < T * H * D; ++i) {
        const double e = exact[size_t(i)], gv = got.get(i);
        same += gv == want.get(i);
        ASSERT_LE(std::fabs(gv - e), ulp * std::fabs(e) + 1e-6) << "element " << i << " (one ulp of " << e << ")";
      }
      const double frac = double(same) / double(T * H * D);
      std::printf("cuda_mma_cluster %s G=%lld: %.4f of the outputs are the FP64 value rounded to nearest\n",
                  ks::dtype_name(dt), (long long)G, frac);
      EXPECT_GE(frac, 0.99);
    }
  }
}

// The inputs of the cuda_mma_tma tests: shape sh, each sequence its own (shuffled) blocks, random
// q / K / V, lengths from a list cycled over the tokens (0, 1, 15, 16, 17, the capacity, ...),
// and NaN in every cache row past a sequence's length in its last block; then body(...).
// (Shapes of 2 tokens get the capacity and capacity - 1: a partial last tile at every length.)
struct TmaShape {
  int64_t T, H, KVH, D, bs, cap;
};
struct TmaCase {
  Buf q, kc, vc, bt, cl;
  DBuf dq, dkc, dvc, dbt, dcl, dout;
  int64_t maxb, blocks;
  double scale;
};
void with_tma_case(DType dt, const TmaShape& sh, std::mt19937& gen, const std::function<void(TmaCase&)>& body) {
  const int64_t maxb = sh.cap / sh.bs, blocks = sh.T * maxb + 5, row = sh.KVH * sh.D;  // elements per cache row
  TmaCase c{Buf(dt, {sh.T, sh.H, sh.D}), Buf(dt, {blocks, sh.bs, sh.KVH, sh.D}), Buf(dt, {blocks, sh.bs, sh.KVH, sh.D}),
            Buf(DType::I32, {sh.T, maxb}), Buf(DType::I32, {sh.T}),
            DBuf(dt, {sh.T, sh.H, sh.D}), DBuf(dt, {blocks, sh.bs, sh.KVH, sh.D}), DBuf(dt, {blocks, sh.bs, sh.KVH, sh.D}),
            DBuf(DType::I32, {sh.T, maxb}), DBuf(DType::I32, {sh.T}), DBuf(dt, {sh.T, sh.H, sh.D}),
            maxb, blocks, 1.0 / std::sqrt(double(sh.D))};
  kstest::fill_normal(c.kc);
  kstest::fill_normal(c.vc);
  kstest::fill_normal(c.q);
  shuffled_blocks(c.bt, sh.T * maxb, blocks, gen);
  const std::vector<int64_t> pick = {sh.cap, sh.cap - 1, 0, 1, 15, 16, 17, sh.cap / 2 + 9, 300 % sh.cap};
  for (int64_t t = 0; t < sh.T; ++t) {
    const int64_t len = pick[size_t(t % int64_t(pick.size()))];
    c.cl.set(t, double(len));
    const int64_t e = len % sh.bs ? int64_t(c.bt.get(t * maxb + len / sh.bs)) : -1;
    if (e >= 0)  // the rest of the last block: NaN rows
      for (int64_t r = len % sh.bs; r < sh.bs; ++r)
        for (int64_t i = 0; i < row; ++i) {
          c.kc.set((e * sh.bs + r) * row + i, std::nan(""));
          c.vc.set((e * sh.bs + r) * row + i, std::nan(""));
        }
  }
  c.dkc.upload(c.kc), c.dvc.upload(c.vc), c.dbt.upload(c.bt), c.dq.upload(c.q), c.dcl.upload(c.cl);
  body(c);
}
// One paged_attention call on c's device buffers captured in a CUDA graph and replayed twice:
// each replay must equal `eager` bit for bit.
void expect_graph_replays_equal(TmaCase& c, const Buf& eager) {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  ks::paged_attention(c.dout.view(), c.dq.view(), c.dkc.view(), c.dvc.view(), c.dbt.view(), ks::TensorView(), c.dcl.view(),
                      c.scale, ks::Backend::Cuda, st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    c.dout.poison();
    CK(cudaGraphLaunch(exec, st));
    CK(cudaStreamSynchronize(st));
    Buf replay(eager.dtype, eager.shape);
    c.dout.download(replay);
    EXPECT_EQ(std::memcmp(replay.data(), eager.data(), eager.nbytes()), 0) << "graph replay " << rep;
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
}

// cuda_mma_cluster's shared-memory rows are unpadded, their 16-byte chunks XOR-swizzled by the
// row (7d1de62): chunk c of row r at c ^ (r mod 8) in 128-byte half-rows (head_dim padded to 64 or
// 128), at c ^ (r / 2 mod 4) in 64-byte rows (padded to 32). A chunk copied to one place and read
// from another pairs a key's elements with another key's, or with a zero-filled chunk: every
// head_dim the variant takes (the multiples of 8 up to 128, so every zero-filled tail of each
// padding) at 1, 3 and 8 query heads per kv head (packed and unpacked pieces), against the CPU.
// Two batches: 5 tokens in 2048-key tables, lengths 0, 1, 17, 100 (partial last tiles) and 1500
// (few units: 8 warps per CTA, the 1500 keys over a cluster's CTAs), and 18 tokens in 320-key
// tables, lengths up to 300 (18 or more units: 4 warps per CTA). Each token's blocks are its own,
// scattered; every cache row past its length holds NaN (rows the kernel must not copy).
TEST(CudaAttentionMma, EveryHeadDimThroughTheSwizzledRows) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_mma_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  struct Batch {
    std::vector<int64_t> lens;
    int64_t maxb;  // blocks of 16 keys per table
  };
  std::vector<int64_t> many(18);
  for (size_t t = 0; t < many.size(); ++t) many[t] = int64_t(t * 53 % 301);  // 0 .. 300
  const std::vector<Batch> batches{{{0, 1, 17, 100, 1500}, 128}, {many, 20}};
  const double nan = std::nan("");
  const int64_t bs = 16;
  for (const Batch& batch : batches) {
    const int64_t T = int64_t(batch.lens.size()), maxb = batch.maxb, blocks = T * maxb;
    std::vector<int64_t> sids(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) sids[size_t(t)] = t;
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t D = 8; D <= 128; D += 8)
        for (auto [H, KVH] : std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {6, 2}, {8, 1}}) {
          SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " T=" + std::to_string(T) + " H=" + std::to_string(H) +
                       " KVH=" + std::to_string(KVH) + " D=" + std::to_string(D));
          Buf kc(dt, {blocks, bs, KVH, D}), vc(dt, {blocks, bs, KVH, D}), bt(DType::I32, {T, maxb});
          kstest::fill_normal(kc);
          kstest::fill_normal(vc);
          for (int64_t t = 0; t < T; ++t)  // (7 is prime to both table sizes: a permutation)
            for (int64_t b = 0; b < maxb; ++b) bt.set(t * maxb + b, double(t * maxb + (b * 7 + 3) % maxb));
          for (int64_t t = 0; t < T; ++t)
            for (int64_t pos = batch.lens[size_t(t)]; pos < maxb * bs; ++pos) {
              const int64_t slot = int64_t(bt.get(t * maxb + pos / bs)) * bs + pos % bs;
              for (int64_t e = 0; e < KVH * D; ++e) kc.set(slot * KVH * D + e, nan), vc.set(slot * KVH * D + e, nan);
            }
          Buf q(dt, {T, H, D}), ref(dt, q.shape), got(dt, q.shape);
          kstest::fill_normal(q);
          ASSERT_NO_FATAL_FAILURE(paged_device_vs_cpu(dt, q, kc, vc, bt, bt, sids, batch.lens, sids, batch.lens,
                                                      1.0 / std::sqrt(double(D)), got, ref));
          const std::string cfg = ks_last_launch_config("paged_attention");  // (the device call's)
          EXPECT_TRUE(close_to_cpu(got, ref, 1e-5)) << cfg;
          // the launch paths the comment names: 8 warps and clusters for the few units, 4 warps for the many
          EXPECT_NE(cfg.find(T < 18 ? "warps=8" : "warps=4"), std::string::npos) << cfg;
          if (T < 18) EXPECT_EQ(cfg.find("cluster=1 "), std::string::npos) << cfg;
        }
  }
}

// cuda_mma_tma is cuda_mma_cluster with the tiles brought by the TMA unit (tensor maps of the
// caches, 128-byte swizzled rows, one mbarrier per stage): the same arithmetic in the same order,
// so its rows must equal cuda_mma_cluster's bit for bit, and the CPU's within the usual bound.
// Shapes that take each launch path: 2 tokens over 32K keys (the split beyond a cluster, 8 warps,
// its last CTA's merge), clusters, 4 warps, blocks of 32 (two tiles per block), 16 heads per kv
// head (unpacked pieces) at head_dim 128 and 64, with 8 and 4 warps. Each sequence has its own blocks, and every cache row past a sequence's
// length in its last block is NaN (the partial tile's V rows must be zeroed, not multiplied by
// 0). Lengths 0, 1, 15, 16, 17, the capacity and in between. Then each call captured in a CUDA
// graph and replayed: the eager bits. Then device block tables with unmapped entries (-1 and
// past the cache: the CPU refuses them in host tables; on the device such keys weigh 0, and the
// TMA unit reads zero rows for them): the two variants' bits again. Last, the shapes it
// declines, by name.
TEST(CudaAttentionMma, TmaTilesGiveTheSameBits) {
  NEED_GPU();
  // (2 tokens over 32K keys: the split, its last CTA's merge and a partial last tile at cap - 1)
  const std::vector<TmaShape> shapes = {{2, 32, 8, 128, 16, 32768}, {2, 9, 3, 64, 16, 32768}, {5, 32, 8, 128, 16, 2048},
                                        {7, 9, 3, 64, 32, 1024},    {3, 16, 1, 128, 16, 3200}, {40, 8, 8, 64, 16, 512},
                                        {2, 32, 2, 64, 16, 4096},   {24, 64, 4, 64, 16, 512}};
  std::mt19937 gen(11);
  for (DType dt : {DType::BF16, DType::F16})
    for (const TmaShape& sh : shapes) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " T=" + std::to_string(sh.T) + " H=" + std::to_string(sh.H) +
                   " KVH=" + std::to_string(sh.KVH) + " D=" + std::to_string(sh.D) + " bs=" + std::to_string(sh.bs) +
                   " cap=" + std::to_string(sh.cap));
      with_tma_case(dt, sh, gen, [&](TmaCase& c) {
        std::vector<Buf> rows;
        for (const char* variant : {"cuda_mma_cluster", "cuda_mma_tma"}) {
          SCOPED_TRACE(variant);
          kstest::ScopedVariant pin("paged_attention", variant);
          ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
          Buf got(dt, c.q.shape), ref(dt, c.q.shape);
          ASSERT_NO_FATAL_FAILURE(paged_cuda_and_cpu(c.dout, c.dq, c.dkc, c.dvc, c.dbt, c.dcl, c.q, c.kc, c.vc, c.bt, c.cl,
                                                     c.scale, got, ref));
          const std::string cfg = ks_last_launch_config("paged_attention");
          std::printf("%s %s T=%lld H=%lld KVH=%lld D=%lld bs=%lld: %s\n", variant, ks::dtype_name(dt), (long long)sh.T,
                      (long long)sh.H, (long long)sh.KVH, (long long)sh.D, (long long)sh.bs, cfg.c_str());
          EXPECT_NE(cfg.find(std::string("variant=") + variant + " "), std::string::npos) << cfg;
          EXPECT_TRUE(close_to_cpu(got, ref, 1e-5));
          for (int64_t t = 0; t < sh.T; ++t)
            if (c.cl.get(t) == 0)
              for (int64_t i = 0; i < sh.H * sh.D; ++i) ASSERT_EQ(got.get(t * sh.H * sh.D + i), 0.0) << "context 0";
          rows.push_back(got);
          if (rows.size() == 2) {
            EXPECT_EQ(std::memcmp(rows[0].data(), rows[1].data(), rows[0].nbytes()), 0) << "cuda_mma_tma's bits";
            expect_graph_replays_equal(c, got);
          }
        }
        // unmapped entries in the device table: both variants' bits (no CPU reference)
        Buf bt2 = c.bt;
        for (int64_t i = 0; i < sh.T * c.maxb; ++i) {
          if (i % 97 == 13) bt2.set(i, -1.0);
          if (i % 89 == 7) bt2.set(i, double(c.blocks + 3));
        }
        c.dbt.upload(bt2);
        std::vector<Buf> unmapped;
        for (const char* variant : {"cuda_mma_cluster", "cuda_mma_tma"}) {
          kstest::ScopedVariant pin("paged_attention", variant);
          ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
          c.dout.poison();
          ks::paged_attention(c.dout.view(), c.dq.view(), c.dkc.view(), c.dvc.view(), c.dbt.view(), ks::TensorView(),
                              c.dcl.view(), c.scale, ks::Backend::Cuda);
          CK(cudaDeviceSynchronize());
          Buf got(dt, c.q.shape);
          c.dout.download(got);
          unmapped.push_back(got);
        }
        EXPECT_EQ(std::memcmp(unmapped[0].data(), unmapped[1].data(), unmapped[0].nbytes()), 0) << "unmapped blocks";
        EXPECT_NE(std::memcmp(unmapped[1].data(), rows[1].data(), rows[1].nbytes()), 0) << "the unmapped keys changed nothing";
      });
    }
  // declined by name: head_dim 96 (not 64 or 128) and blocks of 8 keys
  for (auto [D, bs, why] : std::vector<std::tuple<int64_t, int64_t, const char*>>{
           {96, 16, "head_dim must be 64 or 128"}, {64, 8, "block_size must be a multiple of 16"}}) {
    kstest::ScopedVariant pin("paged_attention", "cuda_mma_tma");
    ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
    DBuf dkc(DType::BF16, {4, bs, 2, D}), dvc(DType::BF16, {4, bs, 2, D}), dbt(DType::I32, {1, 4}),
        dq(DType::BF16, {1, 4, D}), dcl(DType::I32, {1}), dout(DType::BF16, {1, 4, D});
    try {
      ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), ks::TensorView(), dcl.view(), 0.125,
                          ks::Backend::Cuda);
      ADD_FAILURE() << "cuda_mma_tma took head_dim " << D << ", block_size " << bs;
    } catch (const ks::Error& e) {
      EXPECT_EQ(e.status(), KS_ERROR_BACKEND_UNAVAILABLE);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
}

// cuda_mma_cluster moves its exponentials' base only when a score passes it by more than 8, and
// then rescales what the warp has accumulated. Scores here climb a staircase: 2048 keys per
// step, each step 9 above the one before, the rise 24 keys before the step's end (inside a
// 16-key tile, and inside any CTA range of 256 keys), so a warp meets it with keys of the lower
// step already accumulated; an accumulator left unscaled would weigh those e^9 times too much.
// Every score is exact in bf16 and fp16 (multiples of 9 up to 72). Against the CPU, 4 (packed)
// and 16 (three MMAs) heads per kv head.
TEST(CudaAttentionMma, LazyBaseRescalesAccumulatedKeys) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_mma_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  for (DType dt : {DType::BF16, DType::F16})
    for (auto [H, KVH] : std::vector<std::pair<int64_t, int64_t>>{{4, 1}, {16, 1}}) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " H=" + std::to_string(H));
      const int64_t D = 64, bs = 16, len = 16384, maxb = len / bs, rise = 24;  // rise: keys before a step's end
      Buf kc(dt, {maxb, bs, KVH, D}), vc(dt, {maxb, bs, KVH, D}), bt(DType::I32, {1, maxb}), q(dt, {1, H, D}),
          cl(DType::I32, {1}), got(dt, q.shape), ref(dt, q.shape);
      kstest::fill_normal(kc, 0.05);
      kstest::fill_uniform(vc, -1.0, 1.0);
      for (int64_t i = 0; i < H * D; ++i) q.set(i, i % D == 0 ? 8.0 : 0.0);  // score = scale * 8 * K[0]
      // K[0] of key j = its score: 9 * (its step), one step more for the last `rise` keys of each
      const double scale = 1.0 / 8.0;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t st = j / 2048 + (j % 2048 >= 2048 - rise ? 1 : 0);
        kc.set(j * KVH * D, 9.0 * double(st) / (scale * 8.0));
      }
      for (int64_t i = 0; i < maxb; ++i) bt.set(i, double(i));
      cl.set(0, double(len));
      DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt.shape), dq(dt, q.shape), dcl(DType::I32, {1}),
          dout(dt, q.shape);
      dkc.upload(kc), dvc.upload(vc), dbt.upload(bt), dq.upload(q), dcl.upload(cl);
      ASSERT_NO_FATAL_FAILURE(paged_cuda_and_cpu(dout, dq, dkc, dvc, dbt, dcl, q, kc, vc, bt, cl, scale, got, ref));
      std::printf("lazy base %s H=%lld: %s\n", ks::dtype_name(dt), (long long)H, ks_last_launch_config("paged_attention"));
      EXPECT_TRUE(close_to_cpu(got, ref, 1e-5));
    }
}

// cuda_mma_cluster's split beyond a cluster: few (token, kv head) units over a long table (batch
// 1) give each unit S CTAs of one SM each, whose states meet in a workspace (stream-ordered
// eagerly, owned by the graph under capture) and attention_combine_kernel. Against the CPU at lengths that leave the last CTA a partial tile,
// one CTA's worth (no combine: the CTA writes the row itself) and 0; 16 heads per kv head
// (unpacked pieces) and 3 and 4 (packed); then the same call captured in a CUDA graph (under
// global capture mode), cloned, both instantiated and replayed in turn with new lengths
// written into the device tensor between replays: every replay equals the eager call's bits;
// last, NaN K rows in split 0's first block make every output NaN. (The split is taken where a
// cluster CTA would read >= 256 KB of K and V: the table capacities here are chosen for that.)
// All of it twice: with attention_combine_kernel (KS_ATTN_LAST_COMBINE=0), and with the default
// (KS_ATTN_LAST_COMBINE=1: each unit's last split CTA merges, through a counter per unit that it sets back to 0: a counter left
// nonzero would leave a replay's rows unwritten), whose eager rows must equal the first pass's
// bit for bit (the same merge code and order).
TEST(CudaAttentionMma, SplitBeyondAClusterEagerAndInAGraph) {
  NEED_GPU();
  kstest::ScopedVariant pin("paged_attention", "cuda_mma_cluster");
  ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
  struct Shape {
    int64_t H, KVH, D, cap;
  };
  const std::vector<Shape> shapes = {{32, 8, 128, 16384}, {9, 3, 64, 32768}, {16, 1, 128, 8192}, {8, 2, 40, 32768}};
  std::mt19937 gen(5);
  for (DType dt : {DType::BF16, DType::F16})
    for (const Shape& sh : shapes) {
      SCOPED_TRACE(std::string(ks::dtype_name(dt)) + " H=" + std::to_string(sh.H) + " KVH=" + std::to_string(sh.KVH) +
                   " D=" + std::to_string(sh.D) + " cap=" + std::to_string(sh.cap));
      const int64_t bs = 16, maxb = sh.cap / bs, blocks = maxb + 7;
      Buf kc(dt, {blocks, bs, sh.KVH, sh.D}), vc(dt, {blocks, bs, sh.KVH, sh.D}), bt(DType::I32, {1, maxb});
      kstest::fill_normal(kc);
      kstest::fill_normal(vc);
      for (int64_t i = 0; i < maxb; ++i) bt.set(i, double(gen() % blocks));
      DBuf dkc(dt, kc.shape), dvc(dt, vc.shape), dbt(DType::I32, bt.shape), dq(dt, {1, sh.H, sh.D}),
          dcl(DType::I32, {1}), dout(dt, {1, sh.H, sh.D});
      dkc.upload(kc);
      dvc.upload(vc);
      dbt.upload(bt);
      Buf q(dt, {1, sh.H, sh.D});
      kstest::fill_normal(q);
      dq.upload(q);
      const double scale = 1.0 / std::sqrt(double(sh.D));
      const std::vector<int64_t> lens = {sh.cap, sh.cap - 1, sh.cap / 2 + 17, 300, 255, 1, 0};
      std::vector<Buf> first_pass;  // the combine kernel's eager rows
      for (const char* lc : {"0", "1"}) {  // (the same inputs in both passes)
        kstest::ScopedEnv last_combine("KS_ATTN_LAST_COMBINE", lc);
        SCOPED_TRACE(std::string("KS_ATTN_LAST_COMBINE=") + lc);
        std::vector<Buf> eager;
        for (int64_t len : lens) {
          SCOPED_TRACE("length " + std::to_string(len));
          Buf cl(DType::I32, {1}), ref(dt, q.shape), got(dt, q.shape);
          cl.set(0, double(len));
          dcl.upload(cl);
          ASSERT_NO_FATAL_FAILURE(paged_cuda_and_cpu(dout, dq, dkc, dvc, dbt, dcl, q, kc, vc, bt, cl, scale, got, ref));
          const std::string cfg = ks_last_launch_config("paged_attention");  // the device call's
          if (len == sh.cap) std::printf("split %s H=%lld KVH=%lld: %s\n", ks::dtype_name(dt), (long long)sh.H, (long long)sh.KVH, cfg.c_str());
          // 1 to 8 units over a long table: more CTAs per unit than the cluster that fits (8 or 16)
          EXPECT_NE(cfg.find("cluster=1 "), std::string::npos) << cfg;
          EXPECT_GE(last_attention_cluster(), 16) << cfg;
          EXPECT_NE(cfg.find(sh.H / sh.KVH <= 4 ? "packed=1" : "packed=0"), std::string::npos) << cfg;
          if (len == sh.cap) EXPECT_NE(cfg.find(std::string("last_combine=") + lc), std::string::npos) << cfg;
          EXPECT_TRUE(close_to_cpu(got, ref, 1e-5));
          if (*lc == '1')
            EXPECT_EQ(std::memcmp(got.data(), first_pass[eager.size()].data(), got.nbytes()), 0)
                << "the last CTA's merge, length " << len;
          if (len == 0)
            for (int64_t i = 0; i < sh.H * sh.D; ++i) ASSERT_EQ(got.get(i), 0.0) << "context 0";
          eager.push_back(got);
        }
        if (*lc == '0') first_pass = eager;
        // the same calls replayed from one graph captured at the first length
        cudaStream_t st;
        CK(cudaStreamCreate(&st));
        Buf cl0(DType::I32, {1});
        cl0.set(0, double(lens[0]));
        dcl.upload(cl0);
        CK(cudaDeviceSynchronize());
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        ks::paged_attention(dout.view(), dq.view(), dkc.view(), dvc.view(), dbt.view(), ks::TensorView(), dcl.view(), scale,
                            ks::Backend::Cuda, st);
        CK(cudaStreamEndCapture(st, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        // the graph holds no memory nodes: it can be cloned and instantiated again
        cudaGraph_t clone;
        cudaGraphExec_t exec2;
        CK(cudaGraphClone(&clone, graph));
        CK(cudaGraphInstantiate(&exec2, clone, 0));
        for (size_t k = 0; k < lens.size(); ++k) {
          Buf cl(DType::I32, {1}), got(dt, q.shape);
          cl.set(0, double(lens[k]));
          dcl.upload(cl);
          dout.poison();
          CK(cudaDeviceSynchronize());
          CK(cudaGraphLaunch(k % 2 ? exec2 : exec, st));
          CK(cudaStreamSynchronize(st));
          dout.download(got);
          EXPECT_EQ(std::memcmp(got.data(), eager[k].data(), got.nbytes()), 0)
              << "graph replay at length " << lens[k] << (k % 2 ? " (the clone)" : "");
        }
        CK(cudaGraphExecDestroy(exec2));
        CK(cudaGraphDestroy(clone));
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));  // its workspace is freed by a later call
        CK(cudaStreamDestroy(st));
      }  // both passes
      // NaN K rows in the first key block (split 0's range): every output NaN, as on the CPU
      // (the combine must not let the other splits' finite states hide it)
      const int64_t row = bs * sh.KVH * sh.D;
      const int64_t b0 = int64_t(bt.get(0));
      for (int64_t i = 0; i < row; ++i) kc.set(b0 * row + i, std::nan(""));
      dkc.upload(kc);
      Buf cl(DType::I32, {1}), ref(dt, q.shape), got(dt, q.shape);
      cl.set(0, double(sh.cap));
      dcl.upload(cl);
      ASSERT_NO_FATAL_FAILURE(paged_cuda_and_cpu(dout, dq, dkc, dvc, dbt, dcl, q, kc, vc, bt, cl, scale, got, ref));
      for (int64_t i = 0; i < sh.H * sh.D; ++i)
        ASSERT_TRUE(std::isnan(got.get(i)) && std::isnan(ref.get(i))) << "NaN keys in split 0: element " << i;
    }
}

// The FP32 attention kernels over millions of keys, against FP64 within the contract's bound
// tol (1 + |out|) + 8 sqrt(L) 2^-24 sum_j p_j |v_j| (V >= 0 here, so the sum is out itself):
//  - 4,194,304 keys of one sign (scores 1 and 0.99; V 0.1 and 0.3): where the fallback kernels
//    kept one running sum over the tiles' sums (no fold: attn_cascade_add), an emulation of
//    varlen_attention came to 1.6e-4 against the bound's 9.9e-5;
//  - 2,097,152 keys whose scores rise by 2^-18 a key (8 in all: a new maximum in every tile), V 1
//    on the first half in even dims and on the second half in odd ones: rescaled at every tile, an
//    emulation came to 64% of the bound (the lazy base, attn_next_base, rescales once);
// through varlen_attention and paged_attention's FP32 variants (cuda_cta_per_head and
// cuda_gqa_cluster pinned, and the automatic choice), two query heads on one kv head (q = e0 and
// e0 / 2).
TEST(Cuda, Fp32AttentionMillionsOfKeys) {
  NEED_GPU();
  const int64_t H = 2, KVH = 1, D = 8, bs = 16;
  for (const bool rising : {false, true}) {
    const int64_t L = rising ? 2097152 : 4194304, nb = L / bs;
    SCOPED_TRACE(rising ? "rising scores" : "one sign");
    Buf q(DType::F32, {1, H, D}), k(DType::F32, {L, KVH, D}), v(DType::F32, {L, KVH, D}), bt(DType::I32, {1, nb}),
        cl(DType::I32, {1}), got(DType::F32, {1, H, D});
    float* qp = static_cast<float*>(q.data());
    float* kp = static_cast<float*>(k.data());
    float* vp = static_cast<float*>(v.data());
    for (int64_t i = 0; i < H * D; ++i) qp[i] = i % D == 0 ? (i < D ? 1.f : 0.5f) : 0.f;
    for (int64_t j = 0; j < L; ++j)
      for (int64_t d = 0; d < D; ++d) {
        kp[j * D + d] = d > 0 ? 0.25f : rising ? std::ldexp(float(j), -18) : j == 0 ? 1.f : 0.99f;
        vp[j * D + d] = rising ? ((d % 2 == 0) == (j < L / 2) ? 1.f : 0.f) : d % 2 ? 0.3f : 0.1f;
      }
    int32_t* btp = static_cast<int32_t*>(bt.data());
    for (int64_t b = 0; b < nb; ++b) btp[b] = int32_t(b);
    cl.set(0, double(L));
    // FP64: head h's scores q_h0 k_j0 (scale 1)
    std::vector<double> want(size_t(H * D));
    for (int64_t h = 0; h < H; ++h) {
      const double qh = qp[h * D];
      double m = -INFINITY;
      for (int64_t j = 0; j < L; ++j) m = std::max(m, qh * kp[j * D]);
      std::vector<double> num(size_t(D), 0.0);
      double den = 0.0;
      for (int64_t j = 0; j < L; ++j) {
        const double w = std::exp(qh * kp[j * D] - m);
        den += w;
        for (int64_t d = 0; d < D; ++d) num[size_t(d)] += w * vp[j * D + d];
      }
      for (int64_t d = 0; d < D; ++d) want[size_t(h * D + d)] = num[size_t(d)] / den;
    }
    DBuf dq(DType::F32, q.shape), dk(DType::F32, k.shape), dv(DType::F32, v.shape), dbt(DType::I32, bt.shape),
        dcl(DType::I32, {1}), dout(DType::F32, got.shape);
    ASSERT_NE(dk.base, nullptr);
    ASSERT_NE(dv.base, nullptr);
    dq.upload(q);
    dk.upload(k);
    dv.upload(v);
    dbt.upload(bt);
    dcl.upload(cl);
    auto check = [&](const std::string& what) {
      CK(cudaDeviceSynchronize());
      dout.download(got);
      for (int64_t i = 0; i < H * D; ++i) {
        const double w = want[size_t(i)];
        const double allowed = kstest::tol(DType::F32) * (1.0 + w) + 8.0 * std::sqrt(double(L)) * std::ldexp(1.0, -24) * w;
        ASSERT_LE(std::fabs(got.get(i) - w), allowed) << what << " element " << i << ": got " << got.get(i) << ", FP64 " << w;
      }
    };
    Buf bq(DType::I32, {2}), bk(DType::I32, {2});
    bq.set(0, 0), bq.set(1, 1), bk.set(0, 0), bk.set(1, double(L));
    DBuf dbq(DType::I32, {2}), dbk(DType::I32, {2});
    dbq.upload(bq);
    dbk.upload(bk);
    dout.poison();
    ks::varlen_attention(dout.view(), dq.view(), dk.view(), dv.view(), dbq.view(), dbk.view(), 1.0, false,
                         ks::Backend::Cuda);
    check("varlen_attention");
    // the same rows as a paged cache of nb blocks in order ([L, 1, D] is [nb, bs, 1, D])
    const ks::TensorView kc(dk.data(), DType::F32, {nb, bs, KVH, D}, DLDevice{kDLCUDA, 0}),
        vc(dv.data(), DType::F32, {nb, bs, KVH, D}, DLDevice{kDLCUDA, 0});
    for (const char* variant : {"cuda_cta_per_head", "cuda_gqa_cluster", ""}) {
      kstest::ScopedVariant pin("paged_attention", variant);
      ASSERT_EQ(pin.status(), KS_SUCCESS) << ks_last_error();
      dout.poison();
      ks::paged_attention(dout.view(), dq.view(), kc, vc, dbt.view(), ks::TensorView(), dcl.view(), 1.0,
                          ks::Backend::Cuda);
      check(std::string("paged_attention ") + (*variant ? variant : "(automatic)") + ": " +
            ks_last_launch_config("paged_attention"));
    }
  }
}

// Past every CUDA variant's head_dim (4096: cuda_cta_per_head's and varlen_attention's shared
// memory), the call is refused naming head_dim, and out keeps its poison.
TEST(Cuda, AttentionPastTheHeadDimLimit) {
  NEED_GPU();
  const int64_t D = 4104, bs = 16;  // (a multiple of 8: only the limit refuses it)
  for (DType dt : kstest::float_dtypes()) {
    SCOPED_TRACE(ks::dtype_name(dt));
    DBuf q(dt, {1, 1, D}), kc(dt, {2, bs, 1, D}), vc(dt, {2, bs, 1, D}), bt(DType::I32, {1, 2}), cl(DType::I32, {1}),
        out(dt, {1, 1, D}), cq(DType::I32, {2}), ck(DType::I32, {2}), k(dt, {3, 1, D}), v(dt, {3, 1, D});
    Buf hbt(DType::I32, {1, 2}), hcl(DType::I32, {1}), hcq(DType::I32, {2}), hck(DType::I32, {2}), before(dt, out.shape),
        after(dt, out.shape);
    hbt.set(0, 0), hbt.set(1, 1), hcl.set(0, 20), hcq.set(0, 0), hcq.set(1, 1), hck.set(0, 0), hck.set(1, 3);
    bt.upload(hbt);
    cl.upload(hcl);
    cq.upload(hcq);
    ck.upload(hck);
    for (DBuf* b : {&q, &kc, &vc, &k, &v}) ASSERT_EQ(cudaMemset(b->data(), 0, b->nbytes()), cudaSuccess);
    out.poison();
    out.download(before);
    const ks::TensorView ov = out.view(), qv = q.view(), kcv = kc.view(), vcv = vc.view(), btv = bt.view(),
                         clv = cl.view(), kv = k.view(), vv = v.view(), cqv = cq.view(), ckv = ck.view();
    DLTensor o = ov.dl(), qq = qv.dl(), kk = kcv.dl(), vvv = vcv.dl(), bb = btv.dl(), cc = clv.dl(), k2 = kv.dl(),
             v2 = vv.dl(), q0 = cqv.dl(), k0 = ckv.dl();
    ks_status_t st = ks_paged_attention(&o, &qq, &kk, &vvv, &bb, nullptr, &cc, 1.0, KS_BACKEND_CUDA, nullptr);
    std::string msg = ks_last_error();
    EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << msg;
    EXPECT_NE(msg.find("head_dim > 4096"), std::string::npos) << msg;
    st = ks_varlen_attention(&o, &qq, &k2, &v2, &q0, &k0, 1.0, 1, KS_BACKEND_CUDA, nullptr);
    msg = ks_last_error();
    EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << msg;
    EXPECT_NE(msg.find("head_dim > 4096"), std::string::npos) << msg;
    CK(cudaDeviceSynchronize());
    out.download(after);
    EXPECT_EQ(0, std::memcmp(before.data(), after.data(), before.nbytes())) << "a refused call wrote out";
  }
}

// varlen_attention on CUDA against the CPU reference: packed prefill, chunked prefill
// (fewer queries than keys), an empty sequence, GQA, causal and not.
TEST(Cuda, VarlenAttentionAgainstCpu) {
  NEED_GPU();
  struct P {
    int64_t H, KVH, D;
    std::vector<int32_t> lq, lk;
  };
  // (the last two: keys past the kernel's folds of 64 tiles of 64 keys, attn_cascade_add; head_dim
  // 4096, its limit: 48 KB of shared memory by opt-in)
  const std::vector<P> problems = {{4, 2, 32, {5, 0, 17, 1}, {5, 0, 17, 1}}, {9, 3, 64, {3, 200}, {70, 200}},
                                   {8, 8, 128, {4}, {2}}, {4, 2, 64, {2, 3}, {9000, 4097}},
                                   {2, 1, 4096, {2}, {300}}};
  for (DType dt : kstest::float_dtypes())
    for (bool causal : {true, false})
      for (const P& p : problems) {
        SCOPED_TRACE(std::string(ks::dtype_name(dt)) + (causal ? " causal" : "") + " H=" + std::to_string(p.H));
        std::vector<int32_t> cq{0}, ck{0};
        for (size_t s = 0; s < p.lq.size(); ++s) cq.push_back(cq.back() + p.lq[s]), ck.push_back(ck.back() + p.lk[s]);
        const int64_t S = int64_t(p.lq.size()), TQ = cq.back(), TK = ck.back();
        Buf q(dt, {TQ, p.H, p.D}), k(dt, {TK, p.KVH, p.D}), v(dt, {TK, p.KVH, p.D}), ref(dt, {TQ, p.H, p.D}),
            got(dt, {TQ, p.H, p.D}), bq(DType::I32, {S + 1}), bk(DType::I32, {S + 1});
        kstest::fill_normal(q);
        kstest::fill_normal(k);
        kstest::fill_normal(v);
        for (int64_t i = 0; i <= S; ++i) bq.set(i, cq[size_t(i)]), bk.set(i, ck[size_t(i)]);
        DBuf dq(dt, q.shape), dk(dt, k.shape), dv(dt, v.shape), dout(dt, got.shape), dbq(DType::I32, {S + 1}),
            dbk(DType::I32, {S + 1});
        dq.upload(q);
        dk.upload(k);
        dv.upload(v);
        dbq.upload(bq);
        dbk.upload(bk);
        dout.poison();
        const double scale = 1.0 / std::sqrt(double(p.D));
        ks::varlen_attention(dout.view(), dq.view(), dk.view(), dv.view(), dbq.view(), dbk.view(), scale, causal,
                             ks::Backend::Cuda);
        CK(cudaDeviceSynchronize());
        dout.download(got);
        ks::varlen_attention(ref.view(), q.view(), k.view(), v.view(), bq.view(), bk.view(), scale, causal,
                             ks::Backend::Cpu);
        EXPECT_TRUE(close_to_cpu(got, ref, 1e-5));
      }
}

TEST(Cuda, GraphCaptureAndReplay) {
  NEED_GPU();
  const int64_t R = 8, H = 4096, N = 1024;
  const DType dt = DType::BF16;
  Buf x(dt, {R, H}), w(dt, {H}), g(dt, {R, 2 * H}), wm(dt, {N, H});
  kstest::fill_normal(x);
  kstest::fill_normal(w);
  kstest::fill_normal(g);
  kstest::fill_normal(wm);
  DBuf dx(dt, {R, H}), dw(dt, {H}), dres(dt, {R, H}), dg(dt, {R, 2 * H}), dwm(dt, {N, H}), o1(dt, {R, H}),
      o2(dt, {R, H}), o3(dt, {R, H}), o4(dt, {N});
  dx.upload(x);
  dw.upload(w);
  dg.upload(g);
  dwm.upload(wm);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto body = [&] {
    ks::rms_norm(o1.view(), dx.view(), dw.view(), 1e-6, ks::Backend::Cuda, s);
    ks::softmax(o2.view(), o1.view(), ks::Backend::Cuda, s);
    ks::silu_and_mul(o3.view(), dg.view(), ks::Backend::Cuda, s);
    ks::gemv(o4.view(), ks::TensorView(o3.data(), dt, {H}, DLDevice{kDLCUDA, 0}), dwm.view(), ks::Backend::Cuda, s);
  };
  body();
  CK(cudaStreamSynchronize(s));
  Buf e1(dt, {R, H}), e2(dt, {R, H}), e3(dt, {R, H}), e4(dt, {N});
  o1.download(e1);
  o2.download(e2);
  o3.download(e3);
  o4.download(e4);
  for (DBuf* b : {&o1, &o2, &o3, &o4}) b->poison();
  CK(cudaDeviceSynchronize());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  // fused_add in place inside the graph too
  CK(cudaMemcpyAsync(dres.data(), dx.data(), dx.nbytes(), cudaMemcpyDeviceToDevice, s));
  ks::fused_add_rms_norm(o1.view(), dres.view(), dw.view(), 1e-6, ks::Backend::Cuda, s);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
  }
  Buf r2(dt, {R, H}), r3(dt, {R, H}), r4(dt, {N});
  o2.download(r2);
  o3.download(r3);
  o4.download(r4);
  EXPECT_EQ(std::memcmp(r2.data(), e2.data(), e2.nbytes()), 0);
  EXPECT_EQ(std::memcmp(r3.data(), e3.data(), e3.nbytes()), 0);
  EXPECT_EQ(std::memcmp(r4.data(), e4.data(), e4.nbytes()), 0);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
}

}  // namespace
