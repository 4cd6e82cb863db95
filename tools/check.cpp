// `ksctl check`: the backend sweep (after llama.cpp's test-backend-ops). Every
// registered variant of every op, on every backend present, for each dtype it
// declares, over a shape list and two layouts (aligned, and an offset view whose
// data pointer is 2 bytes off 16-byte alignment), is pinned with
// ks_force_variant, run on random inputs with poisoned outputs, and compared
// with an FP64 reference computed here from the same rounded inputs.
//
// Tolerance per element: |got - ref| <= tol * |ref| + tol_abs, where tol is the
// dtype's (fp16 1e-3, bf16 1e-2, fp32 1e-6) and, for ops that sum K products
// (gemv, gemm, quant_matmul, attention), tol_abs adds 8 * sqrt(K) * 2^-24 * S
// with S = sum |a_k b_k|: the usual bound for an FP32 sum in an unspecified
// order (random-walk rounding growth), since the contract fixes FP32 but not
// the order. A variant refusing a call (can_implement) counts as skipped.
#include <kernscope/kernscope.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "tune.hpp"

#ifdef KS_CHECK_CUDA
#include <cuda_runtime.h>
#endif
#include <stdexcept>

namespace {

using ks::DType;

std::mt19937_64 g_rng(20261129);

// Host tensor with an optional byte offset from a 64-byte aligned base.
struct HBuf {
  DType dt;
  std::vector<int64_t> shape;
  std::vector<uint8_t> raw;
  size_t off;
  HBuf(DType d, std::vector<int64_t> s, size_t offset) : dt(d), shape(std::move(s)), off(64 + offset) {
    raw.assign(off + nbytes() + 64, 0);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (auto x : shape) n *= x;
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * ks::dtype_size(dt); }
  void* data() { return raw.data() + off; }
  ks::TensorView view() { return ks::TensorView(data(), dt, shape); }
  double get(int64_t i) const {
    const uint8_t* p = raw.data() + off;
    uint16_t h;
    switch (dt) {
      case DType::F32: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
      case DType::F16: std::memcpy(&h, p + 2 * i, 2); return ks::half_to_float(h);
      case DType::BF16: std::memcpy(&h, p + 2 * i, 2); return ks::bf16_to_float(h);
      case DType::I32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
      case DType::I64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); return double(v); }
      case DType::U8: return p[i];
    }
    return 0;
  }
  void set(int64_t i, double v) {
    uint8_t* p = raw.data() + off;
    uint16_t h;
    switch (dt) {
      case DType::F32: { float f = float(v); std::memcpy(p + 4 * i, &f, 4); break; }
      case DType::F16: h = ks::float_to_half(float(v)); std::memcpy(p + 2 * i, &h, 2); break;
      case DType::BF16: h = ks::float_to_bf16(float(v)); std::memcpy(p + 2 * i, &h, 2); break;
      case DType::I32: { int32_t x = int32_t(v); std::memcpy(p + 4 * i, &x, 4); break; }
      case DType::I64: { int64_t x = int64_t(v); std::memcpy(p + 8 * i, &x, 8); break; }
      case DType::U8: p[i] = uint8_t(v); break;
    }
  }
  void randn(double sd = 1.0) {
    std::normal_distribution<double> d(0, sd);
    for (int64_t i = 0; i < numel(); ++i) set(i, d(g_rng));
  }
  void poison() { std::memset(data(), 0xFF, nbytes()); }
};

double dtol(DType d) { return d == DType::F16 ? 1e-3 : d == DType::BF16 ? 1e-2 : 1e-6; }

// Compares got with ref; sabs (optional) holds S per element for summed ops.
// extra: a per-element absolute term added to the bound (quant_matmul_a8: x's int8 rounding)
bool close(const HBuf& got, const std::vector<double>& ref, const std::vector<double>* sabs, double k, std::string* why,
           const std::vector<double>* extra = nullptr) {
  const double t = dtol(got.dt);
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.get(i), r = ref[size_t(i)];
    if (std::isnan(r) || std::isnan(g)) {
      if (std::isnan(r) && std::isnan(g)) continue;
    } else if (std::isinf(r) || std::isinf(g)) {
      if (g == r) continue;
    } else {
      double bound = t * std::fabs(r) + t;
      if (sabs) bound = t * std::fabs(r) + t * 1e-3 * (*sabs)[size_t(i)] + 8 * std::sqrt(k) * 5.96e-8 * (*sabs)[size_t(i)];
      if (extra) bound += (*extra)[size_t(i)];
      if (std::fabs(g - r) <= bound) continue;
    }
    char b[160];
    std::snprintf(b, sizeof b, "element %lld: got %.9g, want %.9g", (long long)i, g, r);
    *why = b;
    return false;
  }
  return true;
}

// ---- GGUF block formats: encoder and FP64 decoder for the sweep --------------
struct QFmt {
  ks::QType q;
  int64_t bs, bb;
};
const std::vector<QFmt> kQuantFormats = {{ks::QType::Q4_0, 32, 18}, {ks::QType::Q4_1, 32, 20},
                                         {ks::QType::Q8_0, 32, 34}, {ks::QType::F16, 1, 2},
                                         {ks::QType::F32, 1, 4},    {ks::QType::BF16, 1, 2}};

void put16(uint8_t* p, uint16_t v) { p[0] = uint8_t(v); p[1] = uint8_t(v >> 8); }
uint16_t get16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// Random packed rows [rows, cols] in format f (random codes and scales).
HBuf random_packed(const QFmt& f, int64_t rows, int64_t cols, size_t offset) {
  HBuf b(DType::U8, {rows, cols / f.bs * f.bb}, offset);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<double> nd(0, 1);
  uint8_t* p = static_cast<uint8_t*>(b.data());
  for (int64_t i = 0; i < b.numel(); ++i) p[i] = uint8_t(byte(g_rng));
  const int64_t nblk = rows * (cols / f.bs);
  for (int64_t k = 0; k < nblk; ++k) {
    uint8_t* blk = p + k * f.bb;
    switch (f.q) {
      case ks::QType::Q4_0: case ks::QType::Q8_0: put16(blk, ks::float_to_half(float(0.02 * nd(g_rng)))); break;
      case ks::QType::Q4_1:
        put16(blk, ks::float_to_half(float(0.02 * std::fabs(nd(g_rng)))));
        put16(blk + 2, ks::float_to_half(float(-0.15 * std::fabs(nd(g_rng)))));
        break;
      case ks::QType::F16: put16(blk, ks::float_to_half(float(nd(g_rng)))); break;
      case ks::QType::BF16: put16(blk, ks::float_to_bf16(float(nd(g_rng)))); break;
      case ks::QType::F32: { float v = float(nd(g_rng)); std::memcpy(blk, &v, 4); break; }
      default: break;
    }
  }
  return b;
}

// FP64 decode of row r.
std::vector<double> decode_row(const QFmt& f, HBuf& packed, int64_t r, int64_t cols) {
  std::vector<double> w(static_cast<size_t>(cols));
  const uint8_t* row = static_cast<const uint8_t*>(packed.data()) + r * packed.shape[1];
  for (int64_t b = 0; b < cols / f.bs; ++b) {
    const uint8_t* blk = row + b * f.bb;
    double* o = w.data() + b * f.bs;
    switch (f.q) {
      case ks::QType::Q4_0: {
        const double d = ks::half_to_float(get16(blk));
        for (int j = 0; j < 16; ++j) { o[j] = d * ((blk[2 + j] & 15) - 8); o[j + 16] = d * ((blk[2 + j] >> 4) - 8); }
        break;
      }
      case ks::QType::Q4_1: {
        const double d = ks::half_to_float(get16(blk)), m = ks::half_to_float(get16(blk + 2));
        for (int j = 0; j < 16; ++j) { o[j] = d * (blk[4 + j] & 15) + m; o[j + 16] = d * (blk[4 + j] >> 4) + m; }
        break;
      }
      case ks::QType::Q8_0: {
        const double d = ks::half_to_float(get16(blk));
        for (int j = 0; j < 32; ++j) o[j] = d * int8_t(blk[2 + j]);
        break;
      }
      case ks::QType::F16: o[0] = ks::half_to_float(get16(blk)); break;
      case ks::QType::BF16: o[0] = ks::bf16_to_float(get16(blk)); break;
      case ks::QType::F32: { float v; std::memcpy(&v, blk, 4); o[0] = v; break; }
      default: break;
    }
  }
  return w;
}

// ---- one case per (op, shape); returns 1 correct, 0 incorrect, -1 skipped ----
// One sweep case's context. On the CUDA backend, v(buf) mirrors a host buffer
// into device memory (keeping its byte offset, so offset views stay offset) and
// returns a device view; after the op every mirror is copied back for checking.
struct Ctx {
  DType dt;
  size_t off;  // byte offset of every tensor's data pointer
  ks::Backend be;
  std::string why;
  int reps = 0;       // > 0 (ksctl tune): a correct call is then timed, reps samples
  double us = -1;     // the median time per call in microseconds (tune)
  double spread = 0;  // (slowest - fastest) / median of those samples
  bool keep = false;  // while timing: each buffer is uploaded once and reused
  ks_stream_t stream = nullptr;  // while timing CUDA: the stream the calls are captured on
#ifdef KS_CHECK_CUDA
  std::vector<std::pair<HBuf*, char*>> mirrors;
#endif
  ks::TensorView v(HBuf& b) {
#ifdef KS_CHECK_CUDA
    if (be == ks::Backend::Cuda) {
      if (keep)
        for (auto& [h, d] : mirrors)
          if (h == &b) return ks::TensorView(d + b.off, b.dt, b.shape, DLDevice{kDLCUDA, 0});
      char* d = nullptr;
      if (cudaMalloc(&d, b.nbytes() + b.off) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
      mirrors.emplace_back(&b, d);
      if (cudaMemcpy(d + b.off, b.data(), b.nbytes(), cudaMemcpyHostToDevice) != cudaSuccess)
        throw std::runtime_error("cudaMemcpy to the device failed");
      return ks::TensorView(d + b.off, b.dt, b.shape, DLDevice{kDLCUDA, 0});
    }
#endif
    return b.view();
  }
  // Copies every mirror back into its host buffer and frees the device memory.
  void settle() {
#ifdef KS_CHECK_CUDA
    if (be != ks::Backend::Cuda) return;
    if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("CUDA error after the op");
    for (auto& [b, d] : mirrors) {
      cudaMemcpy(b->data(), d + b->off, b->nbytes(), cudaMemcpyDeviceToHost);
      cudaFree(d);
    }
    mirrors.clear();
#endif
  }
  Ctx() = default;
  Ctx(DType d, size_t o, ks::Backend b, std::string w) : dt(d), off(o), be(b), why(std::move(w)) {}
  Ctx(const Ctx&) = delete;
  Ctx& operator=(const Ctx&) = delete;
  // a case or a timing that threw before settle(): its device mirrors are freed here
  ~Ctx() {
#ifdef KS_CHECK_CUDA
    for (auto& m : mirrors) cudaFree(m.second);
#endif
  }
};

// Median microseconds per call of run (already known to succeed). CUDA: n calls captured in a
// CUDA graph on a stream of their own and the graph replayed, each sample timed with events
// (device time per call, as bench_ops measures it: no host launch cost; without that, kernels
// of a few microseconds all measure the host's launch rate). Should a call not be capturable,
// the calls are timed eagerly on that stream instead (c.why says so). No L2 rotation: a
// comparison of variants, not a benchmark. CPU: wall time of batches of about 200 us.
double time_call(const std::function<void()>& run, Ctx& c) {
  c.keep = true;
  std::vector<double> samples;
#ifdef KS_CHECK_CUDA
  if (c.be == ks::Backend::Cuda) {
    // Warm-up on the legacy stream, then the device synchronized: it uploads every buffer once
    // (a pageable cudaMemcpy may return before its copy lands, and the non-blocking stream
    // below is not ordered after the legacy stream).
    run();
    if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("CUDA error in the warm-up call");
    // everything this timing creates, released on every way out (an exception included): a
    // capture still open is ended, c.stream reset
    struct Timing {
      Ctx& c;
      cudaStream_t s = nullptr;
      cudaEvent_t e0 = nullptr, e1 = nullptr;
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      ~Timing() {
        cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
        if (s && cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
          cudaGraph_t g = nullptr;
          cudaStreamEndCapture(s, &g);
          if (g) cudaGraphDestroy(g);
        }
        if (exec) cudaGraphExecDestroy(exec);
        if (graph) cudaGraphDestroy(graph);
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
        if (s) {
          cudaStreamSynchronize(s);
          cudaStreamDestroy(s);
        }
        cudaGetLastError();  // a failed capture or launch leaves an error to clear
        c.stream = nullptr;
      }
    } t{c};
    if (cudaStreamCreateWithFlags(&t.s, cudaStreamNonBlocking) != cudaSuccess || cudaEventCreate(&t.e0) != cudaSuccess ||
        cudaEventCreate(&t.e1) != cudaSuccess)
      throw std::runtime_error("cudaStreamCreate / cudaEventCreate failed");
    const cudaStream_t s = t.s;
    c.stream = s;
    auto timed = [&](const std::function<void()>& work) {  // microseconds of work on s
      if (cudaEventRecord(t.e0, s) != cudaSuccess) throw std::runtime_error("cudaEventRecord failed");
      work();
      if (cudaEventRecord(t.e1, s) != cudaSuccess || cudaEventSynchronize(t.e1) != cudaSuccess)
        throw std::runtime_error("CUDA error while timing");
      float ms = 0;
      if (cudaEventElapsedTime(&ms, t.e0, t.e1) != cudaSuccess) throw std::runtime_error("cudaEventElapsedTime failed");
      return 1000.0 * double(ms);
    };
    auto eager = [&](int n) {
      return timed([&] {
               for (int i = 0; i < n; ++i) run();
             }) / n;
    };
    auto replay = [&] {
      if (cudaGraphLaunch(t.exec, s) != cudaSuccess) throw std::runtime_error("cudaGraphLaunch failed");
    };
    const double est = eager(3);
    const int n = int(std::min(1000.0, std::max(1.0, 200.0 / std::max(est, 1e-3))));
    bool captured = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (captured) {
      try {
        for (int i = 0; i < n; ++i) run();
      } catch (const std::exception&) {  // the capture is ended below all the same
        captured = false;
      }
      captured = cudaStreamEndCapture(s, &t.graph) == cudaSuccess && captured && t.graph &&
                 cudaGraphInstantiate(&t.exec, t.graph, 0) == cudaSuccess;
    }
    cudaGetLastError();  // a failed capture leaves an error to clear
    // the clocks first: an idle GPU (the FP64 check before ran on the CPU) clocks down, and
    // a few microseconds of work per sample would measure its ramp; replay for >= 20 ms
    {
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < 20.0) {
        if (captured) replay();
        else eager(n);
        if (cudaStreamSynchronize(s) != cudaSuccess) throw std::runtime_error("CUDA error while warming up");
      }
    }
    for (int r = 0; r < c.reps; ++r) samples.push_back(captured ? timed(replay) / n : eager(n));
    if (!captured) c.why = "timed eagerly (the call could not be captured in a CUDA graph)";
  }
#endif
  if (c.be != ks::Backend::Cuda) run();  // warm-up
  if (samples.empty()) {
    auto batch = [&](int n) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) run();
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    };
    // the batch size from the fastest of 3 single calls (one stalled call on a loaded machine
    // would otherwise make every sample a single call)
    const double est = std::min({batch(1), batch(1), batch(1)});
    const int n = int(std::min(1000.0, std::max(1.0, 200.0 / std::max(est, 1e-3))));
    for (int r = 0; r < c.reps; ++r) samples.push_back(batch(n));
  }
  c.keep = false;
  c.settle();
  std::sort(samples.begin(), samples.end());
  const double med = samples[samples.size() / 2];
  c.spread = med > 0 ? (samples.back() - samples.front()) / med : 0;
  return med;
}

int outcome(const std::function<void()>& run, const std::function<bool(std::string*)>& verify, Ctx& c) {
  try {
    run();
    c.settle();
  } catch (const ks::BackendUnavailable& e) {
    c.settle();
    c.why = e.what();
    return -1;
  } catch (const ks::Error& e) {
    c.settle();
    c.why = e.what();
    return 0;
  }
  const bool ok = verify(&c.why);
  if (ok && c.reps > 0) c.us = time_call(run, c);
  return ok ? 1 : 0;
}

using CaseFn = std::function<int(Ctx&, const std::vector<int64_t>&)>;

int case_rms_norm(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t R = s[0], H = s[1];
  HBuf x(c.dt, {R, H}, c.off), w(c.dt, {H}, c.off), o(c.dt, {R, H}, c.off);
  x.randn(); w.randn(); o.poison();
  std::vector<double> ref(size_t(R * H));
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += x.get(r * H + i) * x.get(r * H + i);
    const double sc = 1 / std::sqrt(ss / H + double(float(1e-6)));
    for (int64_t i = 0; i < H; ++i) ref[size_t(r * H + i)] = x.get(r * H + i) * sc * w.get(i);
  }
  return outcome([&] { ks::rms_norm(c.v(o), c.v(x), c.v(w), 1e-6, c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, nullptr, 0, why); }, c);
}

int case_fused_add(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t R = s[0], H = s[1];
  HBuf x(c.dt, {R, H}, c.off), res(c.dt, {R, H}, c.off), w(c.dt, {H}, c.off);
  x.randn(); res.randn(); w.randn();
  std::vector<double> rx(size_t(R * H)), rr(size_t(R * H));
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) {
      const double v = x.get(r * H + i) + res.get(r * H + i);
      rr[size_t(r * H + i)] = v;
      ss += v * v;
    }
    const double sc = 1 / std::sqrt(ss / H + double(float(1e-6)));
    for (int64_t i = 0; i < H; ++i) rx[size_t(r * H + i)] = rr[size_t(r * H + i)] * sc * w.get(i);
  }
  return outcome([&] { ks::fused_add_rms_norm(c.v(x), c.v(res), c.v(w), 1e-6, c.be, c.stream); },
                 [&](std::string* why) { return close(x, rx, nullptr, 0, why) && close(res, rr, nullptr, 0, why); }, c);
}

int case_silu(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t R = s[0], D = s[1];
  HBuf x(c.dt, {R, 2 * D}, c.off), o(c.dt, {R, D}, c.off);
  x.randn(2.0); o.poison();
  std::vector<double> ref(size_t(R * D));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < D; ++i) {
      const double g = x.get(r * 2 * D + i), u = x.get(r * 2 * D + D + i);
      ref[size_t(r * D + i)] = g / (1 + std::exp(-g)) * u;
    }
  return outcome([&] { ks::silu_and_mul(c.v(o), c.v(x), c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, nullptr, 0, why); }, c);
}

int case_gemv(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t N = s[0], H = s[1];
  HBuf x(c.dt, {H}, c.off), w(c.dt, {N, H}, c.off), o(c.dt, {N}, c.off);
  x.randn(); w.randn(); o.poison();
  std::vector<double> ref(static_cast<size_t>(N)), sa(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      ref[size_t(n)] += w.get(n * H + h) * x.get(h);
      sa[size_t(n)] += std::fabs(w.get(n * H + h) * x.get(h));
    }
  return outcome([&] { ks::gemv(c.v(o), c.v(x), c.v(w), c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, &sa, double(H), why); }, c);
}

int case_softmax(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t R = s[0], H = s[1];
  HBuf x(c.dt, {R, H}, c.off), o(c.dt, {R, H}, c.off);
  x.randn(3.0); o.poison();
  std::vector<double> ref(size_t(R * H));
  for (int64_t r = 0; r < R; ++r) {
    double mx = -INFINITY, sum = 0;
    for (int64_t i = 0; i < H; ++i) mx = std::max(mx, x.get(r * H + i));
    for (int64_t i = 0; i < H; ++i) sum += std::exp(x.get(r * H + i) - mx);
    for (int64_t i = 0; i < H; ++i) ref[size_t(r * H + i)] = std::exp(x.get(r * H + i) - mx) / sum;
  }
  return outcome([&] { ks::softmax(c.v(o), c.v(x), c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, nullptr, 0, why); }, c);
}

int case_argmax(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t R = s[0], V = s[1];
  HBuf x(c.dt, {R, V}, c.off), o(DType::I64, {R}, c.off);
  x.randn(); o.poison();
  // plant a tie of the row maximum at a later index: the first must win
  std::vector<double> ref(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (x.get(r * V + i) > x.get(r * V + best)) best = i;
    if (best + 1 < V) x.set(r * V + V - 1, x.get(r * V + best));
    ref[size_t(r)] = double(best);
  }
  return outcome([&] { ks::argmax(c.v(o), c.v(x), c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, nullptr, 0, why); }, c);
}

int case_gemm(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t M = s[0], N = s[1], K = s[2];
  HBuf a(c.dt, {M, K}, c.off), b(c.dt, {N, K}, c.off), o(c.dt, {M, N}, c.off);
  a.randn(); b.randn(); o.poison();
  std::vector<double> ref(size_t(M * N)), sa(size_t(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const double p = a.get(m * K + k) * b.get(n * K + k);
        ref[size_t(m * N + n)] += p;
        sa[size_t(m * N + n)] += std::fabs(p);
      }
  return outcome([&] { ks::gemm(c.v(o), c.v(a), c.v(b), c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, &sa, double(K), why); }, c);
}

// The FP64 dot products of the rows of h with the FP64-decoded weight rows, and in sa their sums of
// |products| (quant_matmul, quant_matmul_a8: h = x; the decode fusions: h the FP64 row (norm of x +
// residual, or silu(gate) * up) rounded to the dtype as the contract rounds it). qerr (for
// quant_matmul_a8): per output, over blocks of 32, 1.01 x max|h| / 127 / 2 x sum |w_k|.
std::vector<double> rounded_dots(HBuf& h, const QFmt& f, HBuf& w, int64_t M, int64_t N, int64_t K,
                                 std::vector<double>* sa, std::vector<double>* qerr = nullptr) {
  std::vector<double> ref(size_t(M * N));
  sa->assign(size_t(M * N), 0.0);
  if (qerr) qerr->assign(size_t(M * N), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const auto wr = decode_row(f, w, n, K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < K; b += 32) {  // (blocks of 32 for qerr; K is a multiple of 32 where it is asked)
        double amax = 0, wabs = 0;
        for (int64_t k = b; k < std::min(K, b + 32); ++k) {
          const double p = h.get(m * K + k) * wr[size_t(k)];
          ref[size_t(m * N + n)] += p;
          (*sa)[size_t(m * N + n)] += std::fabs(p);
          amax = std::max(amax, std::fabs(h.get(m * K + k)));
          wabs += std::fabs(wr[size_t(k)]);
        }
        if (qerr) (*qerr)[size_t(m * N + n)] += 1.01 * amax / 127 / 2 * wabs;
      }
  }
  return ref;
}

int case_quant_matmul(Ctx& c, const std::vector<int64_t>& s, const QFmt& f) {
  const int64_t M = s[0], N = s[1], K = s[2];
  HBuf x(c.dt, {M, K}, c.off), o(c.dt, {M, N}, c.off);
  HBuf w = random_packed(f, N, K, c.off);
  x.randn(); o.poison();
  std::vector<double> sa;
  const std::vector<double> ref = rounded_dots(x, f, w, M, N, K, &sa);
  return outcome([&] { ks::quant_matmul(c.v(o), c.v(x), c.v(w), f.q, c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, &sa, double(K), why); }, c);
}

// quant_matmul_a8 against the exact product of x and the decoded weights, in FP64: the contract
// rounds each block of 32 x values to int8 codes times d = max|x| / 127 (nearest, so each value
// moves by at most d / 2), so beside the FP32 sum's bound each output may differ by
// sum over blocks of d / 2 * sum |w_k| (both block formats' minimum terms included in |w_k|), with
// 1% slack for the FP32 rounding of d and of x * (127 / max). Integer formats only (Q4_0, Q4_1, Q8_0).
int case_quant_matmul_a8(Ctx& c, const std::vector<int64_t>& s, const QFmt& f) {
  const int64_t M = s[0], N = s[1], K = s[2];
  HBuf x(c.dt, {M, K}, c.off), o(c.dt, {M, N}, c.off);
  HBuf w = random_packed(f, N, K, c.off);
  x.randn(); o.poison();
  std::vector<double> sa, qerr;
  const std::vector<double> ref = rounded_dots(x, f, w, M, N, K, &sa, &qerr);
  return outcome([&] { ks::quant_matmul_a8(c.v(o), c.v(x), c.v(w), f.q, c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, &sa, double(K), why, &qerr); }, c);
}

int case_norm_quant_matmul(Ctx& c, const std::vector<int64_t>& s, const QFmt& f, bool with_x) {
  const int64_t M = s[0], N = s[1], K = s[2];
  HBuf res(c.dt, {M, K}, c.off), x(c.dt, {M, K}, c.off), nw(c.dt, {K}, c.off), o(c.dt, {M, N}, c.off),
      ro(c.dt, {M, K}, c.off), h(c.dt, {M, K}, 0);
  HBuf w = random_packed(f, N, K, c.off);
  res.randn(); x.randn(); nw.randn(); o.poison(); ro.poison();
  std::vector<double> rs(size_t(M * K));
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = res.get(m * K + k) + (with_x ? x.get(m * K + k) : 0.0);
      rs[size_t(m * K + k)] = v;
      ss += v * v;
    }
    const double r = 1.0 / std::sqrt(ss / double(K) + 1e-5);
    for (int64_t k = 0; k < K; ++k) h.set(m * K + k, rs[size_t(m * K + k)] * r * nw.get(k));
  }
  std::vector<double> sa;
  const std::vector<double> ref = rounded_dots(h, f, w, M, N, K, &sa);
  return outcome(
      [&] {
        const ks::TensorView none;
        ks::fused_add_rms_norm_quant_matmul(c.v(o), with_x ? c.v(ro) : none, with_x ? c.v(x) : none, c.v(res), c.v(nw),
                                            1e-5, c.v(w), f.q, c.be, c.stream);
      },
      [&](std::string* why) {
        // residual_out within half a unit of the dtype of x + residual (checked as an op with K = 1)
        return close(o, ref, &sa, double(K), why) && (!with_x || close(ro, rs, nullptr, 0, why));
      },
      c);
}

int case_silu_quant_matmul(Ctx& c, const std::vector<int64_t>& s, const QFmt& f) {
  const int64_t M = s[0], N = s[1], K = s[2];
  HBuf gu(c.dt, {M, 2 * K}, c.off), o(c.dt, {M, N}, c.off), h(c.dt, {M, K}, 0);
  HBuf w = random_packed(f, N, K, c.off);
  gu.randn(); o.poison();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const double g = gu.get(m * 2 * K + k), u = gu.get(m * 2 * K + K + k);
      h.set(m * K + k, g / (1.0 + std::exp(-g)) * u);
    }
  std::vector<double> sa;
  const std::vector<double> ref = rounded_dots(h, f, w, M, N, K, &sa);
  return outcome([&] { ks::silu_and_mul_quant_matmul(c.v(o), c.v(gu), c.v(w), f.q, c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, &sa, double(K), why); }, c);
}

// sample (rows, vocab, top_k): its contract is the CPU reference's ids bit for bit (Philox
// draws on exact integer selections), so the check is equality with the CPU backend's ids.
int case_sample(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t R = s[0], V = s[1], top_k = s[2];
  HBuf logits(c.dt, {R, V}, c.off), out(DType::I64, {R}, 0), want(DType::I64, {R}, 0), so(DType::I64, {2}, 0);
  logits.randn();
  out.poison();
  so.set(0, 1234);
  so.set(1, 7);
  ks::sample(want.view(), ks::TensorView(), logits.view(), so.view(), 0.8, top_k, 0.9, ks::Backend::Cpu);
  return outcome([&] { ks::sample(c.v(out), ks::TensorView(), c.v(logits), c.v(so), 0.8, top_k, 0.9, c.be, c.stream); },
                 [&](std::string* why) {
                   for (int64_t r = 0; r < R; ++r)
                     if (out.get(r) != want.get(r)) {
                       *why = "row " + std::to_string(r) + ": id " + std::to_string(int64_t(out.get(r))) +
                              ", the CPU reference draws " + std::to_string(int64_t(want.get(r)));
                       return false;
                     }
                   return true;
                 },
                 c);
}

int case_dequantize(Ctx& c, const std::vector<int64_t>& s, const QFmt& f) {
  const int64_t R = s[0], C = s[1];
  HBuf w = random_packed(f, R, C, c.off);
  HBuf o(c.dt, {R, C}, c.off);
  o.poison();
  std::vector<double> ref;
  for (int64_t r = 0; r < R; ++r) {
    auto row = decode_row(f, w, r, C);
    ref.insert(ref.end(), row.begin(), row.end());
  }
  return outcome([&] { ks::dequantize(c.v(o), c.v(w), f.q, c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, nullptr, 0, why); }, c);
}

int case_embedding(Ctx& c, const std::vector<int64_t>& s, const QFmt* f) {
  const int64_t T = s[0], V = s[1], H = s[2];
  HBuf ids(DType::I64, {T}, c.off), o(c.dt, {T, H}, c.off);
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  for (int64_t i = 0; i < T; ++i) ids.set(i, double(pick(g_rng)));
  o.poison();
  std::vector<double> ref(size_t(T * H));
  HBuf table = f ? random_packed(*f, V, H, c.off) : HBuf(c.dt, {V, H}, c.off);
  if (!f) table.randn();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = int64_t(ids.get(t));
    if (f) {
      auto row = decode_row(*f, table, id, H);
      for (int64_t j = 0; j < H; ++j) ref[size_t(t * H + j)] = row[size_t(j)];
    } else {
      for (int64_t j = 0; j < H; ++j) ref[size_t(t * H + j)] = table.get(id * H + j);
    }
  }
  return outcome([&] { ks::embedding(c.v(o), c.v(ids), c.v(table), f ? f->q : ks::QType::None, c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, nullptr, 0, why); }, c);
}

// b [T, heads, D] rotated in FP64 by the contract's FP32 angles (positions pos), as a vector
std::vector<double> rope_ref(HBuf& b, const HBuf& pos, int64_t T, int64_t heads, int64_t D, int64_t RD, bool neox,
                             double theta) {
  std::vector<double> ref(size_t(b.numel()));
  for (int64_t i = 0; i < b.numel(); ++i) ref[size_t(i)] = b.get(i);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < RD / 2; ++i) {
        const float inv = float(std::pow(theta, -double(2 * i) / double(RD)));
        const double ang = double(float(float(pos.get(t)) * inv));  // the contract's FP32 angle
        const int64_t base = (t * heads + h) * D;
        const int64_t i0 = neox ? base + i : base + 2 * i, i1 = neox ? base + i + RD / 2 : base + 2 * i + 1;
        const double x0 = b.get(i0), x1 = b.get(i1);
        ref[size_t(i0)] = x0 * std::cos(ang) - x1 * std::sin(ang);
        ref[size_t(i1)] = x1 * std::cos(ang) + x0 * std::sin(ang);
      }
  return ref;
}

int case_rotary(Ctx& c, const std::vector<int64_t>& s, bool neox) {
  const int64_t T = s[0], Hq = s[1], Hk = s[2], D = s[3], RD = s[4];
  const double theta = 10000.0;
  HBuf q(c.dt, {T, Hq, D}, c.off), k(c.dt, {T, Hk, D}, c.off), pos(DType::I32, {T}, c.off);
  q.randn(); k.randn();
  for (int64_t t = 0; t < T; ++t) pos.set(t, double((t * 37) % 4099));
  const auto rq = rope_ref(q, pos, T, Hq, D, RD, neox, theta), rk = rope_ref(k, pos, T, Hk, D, RD, neox, theta);
  return outcome([&] { ks::rotary_embedding(c.v(q), c.v(k), c.v(pos), RD, theta, neox, c.be, c.stream); },
                 [&](std::string* why) {
                   // sin/cos of an FP32 angle up to ~4e3 rad: FP32 evaluation is accurate to a few ulp.
                   return close(q, rq, nullptr, 0, why) && close(k, rk, nullptr, 0, why);
                 }, c);
}

// rotary_embedding_kv_append (T, Hq, Hk, D, RD, blocks, block_size): q and k rotated as
// case_rotary checks them, the rotated k rows and the v rows at their slots (every fifth
// token's slot -1: skipped), every other cache row untouched.
int case_rope_kv_append(Ctx& c, const std::vector<int64_t>& s, bool neox) {
  const int64_t T = s[0], Hq = s[1], Hk = s[2], D = s[3], RD = s[4], NB = s[5], BS = s[6];
  const double theta = 10000.0;
  HBuf q(c.dt, {T, Hq, D}, c.off), k(c.dt, {T, Hk, D}, c.off), v(c.dt, {T, Hk, D}, c.off), pos(DType::I64, {T}, c.off),
      kc(c.dt, {NB, BS, Hk, D}, c.off), vc(c.dt, {NB, BS, Hk, D}, c.off), slots(DType::I32, {T}, c.off);
  q.randn(); k.randn(); v.randn(); kc.randn(); vc.randn();
  for (int64_t t = 0; t < T; ++t) pos.set(t, double((t * 53) % 8191));
  const auto rq = rope_ref(q, pos, T, Hq, D, RD, neox, theta), rk = rope_ref(k, pos, T, Hk, D, RD, neox, theta);
  std::vector<int64_t> perm(size_t(NB * BS));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = int64_t(i);
  std::shuffle(perm.begin(), perm.end(), g_rng);
  std::vector<double> rkc(size_t(kc.numel())), rvc(size_t(vc.numel()));
  for (int64_t i = 0; i < kc.numel(); ++i) rkc[size_t(i)] = kc.get(i), rvc[size_t(i)] = vc.get(i);
  const int64_t row = Hk * D;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = t % 5 == 4 ? -1 : perm[size_t(t)];
    slots.set(t, double(slot));
    if (slot < 0) continue;
    for (int64_t j = 0; j < row; ++j) {
      rkc[size_t(slot * row + j)] = rk[size_t(t * row + j)];
      rvc[size_t(slot * row + j)] = v.get(t * row + j);
    }
  }
  return outcome(
      [&] {
        ks::rotary_embedding_kv_append(c.v(q), c.v(k), c.v(v), c.v(pos), RD, theta, neox, c.v(kc), c.v(vc), c.v(slots),
                                       c.be, c.stream);
      },
      [&](std::string* why) {
        return close(q, rq, nullptr, 0, why) && close(k, rk, nullptr, 0, why) && close(kc, rkc, nullptr, 0, why) &&
               close(vc, rvc, nullptr, 0, why);
      },
      c);
}

int case_kv_append(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t T = s[0], KVH = s[1], D = s[2], NB = s[3], BS = s[4];
  HBuf k(c.dt, {T, KVH, D}, c.off), v(c.dt, {T, KVH, D}, c.off), kc(c.dt, {NB, BS, KVH, D}, c.off),
      vc(c.dt, {NB, BS, KVH, D}, c.off), slots(DType::I64, {T}, c.off);
  k.randn(); v.randn(); kc.randn(); vc.randn();
  std::vector<int64_t> perm(size_t(NB * BS));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = int64_t(i);
  std::shuffle(perm.begin(), perm.end(), g_rng);
  std::vector<double> rk(size_t(kc.numel())), rv(size_t(vc.numel()));
  for (int64_t i = 0; i < kc.numel(); ++i) { rk[size_t(i)] = kc.get(i); rv[size_t(i)] = vc.get(i); }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = t % 5 == 4 ? -1 : perm[size_t(t)];
    slots.set(t, double(slot));
    if (slot < 0) continue;
    for (int64_t j = 0; j < KVH * D; ++j) {
      rk[size_t(slot * KVH * D + j)] = k.get(t * KVH * D + j);
      rv[size_t(slot * KVH * D + j)] = v.get(t * KVH * D + j);
    }
  }
  return outcome([&] { ks::kv_cache_append(c.v(kc), c.v(vc), c.v(k), c.v(v), c.v(slots), c.be, c.stream); },
                 [&](std::string* why) { return close(kc, rk, nullptr, 0, why) && close(vc, rv, nullptr, 0, why); }, c);
}

// The attention cases' block table: every entry of bt a distinct block of NB, in random order;
// and token t's context length: the whole capacity L for token 0, spread over [1, L] for the others.
void shuffled_block_table(HBuf& bt, int64_t NB) {
  std::vector<int64_t> blocks(static_cast<size_t>(NB));
  for (int64_t i = 0; i < NB; ++i) blocks[size_t(i)] = i;
  std::shuffle(blocks.begin(), blocks.end(), g_rng);
  for (int64_t i = 0; i < bt.numel(); ++i) bt.set(i, double(blocks[size_t(i)]));
}
int64_t case_context_len(int64_t t, int64_t L) { return t == 0 ? L : 1 + (t * 13) % L; }

// paged_attention in FP64 over the values qv(i) and the caches' kv(i) / vv(i), token t reading
// row t of the block table bt ([T, MB], sequence t) and cl(t) keys.
template <typename Q, typename KC, typename VC>
std::vector<double> attention_ref(Q qv, KC kv, VC vv, const HBuf& bt, const HBuf& cl, int64_t T, int64_t Hq,
                                  int64_t KVH, int64_t D, int64_t BS, int64_t MB, double scale) {
  std::vector<double> ref(size_t(T * Hq * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / KVH), len = int64_t(cl.get(t));
      std::vector<double> sc(static_cast<size_t>(len));
      double mx = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t slot = int64_t(bt.get(t * MB + j / BS)) * BS + j % BS;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qv((t * Hq + h) * D + d) * kv((slot * KVH + g) * D + d);
        sc[size_t(j)] = double(float(scale)) * dot;
        mx = std::max(mx, sc[size_t(j)]);
      }
      double sum = 0;
      for (auto& x : sc) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j < len; ++j) {
        const int64_t slot = int64_t(bt.get(t * MB + j / BS)) * BS + j % BS;
        for (int64_t d = 0; d < D; ++d) ref[size_t((t * Hq + h) * D + d)] += sc[size_t(j)] / sum * vv((slot * KVH + g) * D + d);
      }
    }
  return ref;
}

// fresh_keys >= 0: through paged_attention_after_append with that promise (called after nothing,
// so any promise holds); -1: paged_attention.
int case_attention(Ctx& c, const std::vector<int64_t>& s, int64_t fresh_keys = -1) {
  const int64_t T = s[0], Hq = s[1], KVH = s[2], D = s[3], BS = s[4], L = s[5];
  const int64_t MB = (L + BS - 1) / BS, NB = MB * T + 1;
  HBuf q(c.dt, {T, Hq, D}, c.off), o(c.dt, {T, Hq, D}, c.off), kc(c.dt, {NB, BS, KVH, D}, c.off),
      vc(c.dt, {NB, BS, KVH, D}, c.off), bt(DType::I32, {T, MB}, c.off), cl(DType::I32, {T}, c.off);
  q.randn(); kc.randn(); vc.randn(); o.poison();
  shuffled_block_table(bt, NB);
  for (int64_t t = 0; t < T; ++t) cl.set(t, double(case_context_len(t, L)));
  const double scale = 1 / std::sqrt(double(D));
  const std::vector<double> ref = attention_ref([&](int64_t i) { return q.get(i); }, [&](int64_t i) { return kc.get(i); },
                                                [&](int64_t i) { return vc.get(i); }, bt, cl, T, Hq, KVH, D, BS, MB, scale);
  // Outputs are convex combinations of V rows (|v| ~ 1): S = max|v| ~ 4 per element, K = context length.
  std::vector<double> sa(size_t(o.numel()), 4.0);
  return outcome([&] {
                   if (fresh_keys < 0)
                     ks::paged_attention(c.v(o), c.v(q), c.v(kc), c.v(vc), c.v(bt), ks::TensorView(), c.v(cl),
                                         scale, c.be, c.stream);
                   else
                     ks::paged_attention_after_append(c.v(o), c.v(q), c.v(kc), c.v(vc), c.v(bt), ks::TensorView(),
                                                      c.v(cl), scale, fresh_keys, c.be, c.stream);
                 },
                 [&](std::string* why) { return close(o, ref, &sa, double(L), why); }, c);
}

// rotary_embedding_kv_append_paged_attention (T, Hq, KVH, D, RD, BS, L): a decode step, token t
// the newest position (len - 1) of its own sequence (lengths as case_attention's), every fifth
// token's append skipped (slot -1: its last key is the cache's old row). q, k and the caches
// as case_rope_kv_append checks them; out against FP64 attention over q and k rotated in FP64
// and rounded to the dtype (the op rounds them where the first call stores them).
int case_rope_attention(Ctx& c, const std::vector<int64_t>& s, bool neox) {
  const int64_t T = s[0], Hq = s[1], KVH = s[2], D = s[3], RD = s[4], BS = s[5], L = s[6];
  const int64_t MB = (L + BS - 1) / BS, NB = MB * T + 1;
  const double theta = 10000.0, scale = 1 / std::sqrt(double(D));
  HBuf q(c.dt, {T, Hq, D}, c.off), k(c.dt, {T, KVH, D}, c.off), v(c.dt, {T, KVH, D}, c.off), o(c.dt, {T, Hq, D}, c.off),
      kc(c.dt, {NB, BS, KVH, D}, c.off), vc(c.dt, {NB, BS, KVH, D}, c.off), bt(DType::I32, {T, MB}, c.off),
      cl(DType::I32, {T}, c.off), pos(DType::I64, {T}, c.off), slots(DType::I64, {T}, c.off);
  q.randn(); k.randn(); v.randn(); kc.randn(); vc.randn(); o.poison();
  shuffled_block_table(bt, NB);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t len = case_context_len(t, L), p = len - 1;
    cl.set(t, double(len));
    pos.set(t, double(p));
    slots.set(t, t % 5 == 4 ? -1.0 : double(int64_t(bt.get(t * MB + p / BS)) * BS + p % BS));
  }
  const auto rq = rope_ref(q, pos, T, Hq, D, RD, neox, theta), rk = rope_ref(k, pos, T, KVH, D, RD, neox, theta);
  std::vector<double> rkc(size_t(kc.numel())), rvc(size_t(vc.numel()));
  for (int64_t i = 0; i < kc.numel(); ++i) rkc[size_t(i)] = kc.get(i), rvc[size_t(i)] = vc.get(i);
  const int64_t row = KVH * D;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = int64_t(slots.get(t));
    if (slot < 0) continue;
    for (int64_t j = 0; j < row; ++j) rkc[size_t(slot * row + j)] = rk[size_t(t * row + j)], rvc[size_t(slot * row + j)] = v.get(t * row + j);
  }
  // the rotated values as the dtype stores them
  HBuf tq(c.dt, {T, Hq, D}, 0), tkc(c.dt, {NB, BS, KVH, D}, 0);
  for (int64_t i = 0; i < tq.numel(); ++i) tq.set(i, rq[size_t(i)]);
  for (int64_t i = 0; i < tkc.numel(); ++i) tkc.set(i, rkc[size_t(i)]);
  const std::vector<double> ref = attention_ref([&](int64_t i) { return tq.get(i); }, [&](int64_t i) { return tkc.get(i); },
                                                [&](int64_t i) { return rvc[size_t(i)]; }, bt, cl, T, Hq, KVH, D, BS, MB, scale);
  std::vector<double> sa(size_t(o.numel()), 4.0);  // (case_attention's bound)
  return outcome(
      [&] {
        ks::rotary_embedding_kv_append_paged_attention(c.v(o), c.v(q), c.v(k), c.v(v), c.v(pos), RD, theta, neox, c.v(kc),
                                                       c.v(vc), c.v(slots), c.v(bt), ks::TensorView(), c.v(cl), scale,
                                                       c.be, c.stream);
      },
      [&](std::string* why) {
        return close(q, rq, nullptr, 0, why) && close(k, rk, nullptr, 0, why) && close(kc, rkc, nullptr, 0, why) &&
               close(vc, rvc, nullptr, 0, why) && close(o, ref, &sa, double(L), why);
      },
      c);
}

// Packed sequences: {num_seqs, Hq, KVH, D, max_len, causal}; sequence 1 is empty, odd
// sequences have 3 more keys than queries (chunked prefill), the rest len_q == len_k.
int case_varlen(Ctx& c, const std::vector<int64_t>& s) {
  const int64_t S = s[0], Hq = s[1], KVH = s[2], D = s[3], L = s[4];
  const bool causal = s[5] != 0;
  std::vector<int64_t> cq{0}, ck{0};
  for (int64_t i = 0; i < S; ++i) {
    const int64_t lq = i == 1 ? 0 : 1 + (i * 7 + 3) % L;
    cq.push_back(cq.back() + lq);
    ck.push_back(ck.back() + lq + (i % 2 ? 3 : 0));
  }
  const int64_t TQ = cq.back(), TK = ck.back();
  HBuf q(c.dt, {TQ, Hq, D}, c.off), o(c.dt, {TQ, Hq, D}, c.off), k(c.dt, {TK, KVH, D}, c.off), v(c.dt, {TK, KVH, D}, c.off),
      bq(DType::I32, {S + 1}, c.off), bk(DType::I32, {S + 1}, c.off);
  q.randn(); k.randn(); v.randn(); o.poison();
  for (int64_t i = 0; i <= S; ++i) bq.set(i, double(cq[size_t(i)])), bk.set(i, double(ck[size_t(i)]));
  const double scale = 1 / std::sqrt(double(D));
  std::vector<double> ref(size_t(o.numel()));
  for (int64_t sq = 0; sq < S; ++sq) {
    const int64_t lq = cq[size_t(sq) + 1] - cq[size_t(sq)], lk = ck[size_t(sq) + 1] - ck[size_t(sq)];
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t g = h / (Hq / KVH), row = cq[size_t(sq)] + i;
        const int64_t n = causal ? std::min(lk, std::max<int64_t>(0, i + lk - lq + 1)) : lk;
        std::vector<double> sc(static_cast<size_t>(n));
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q.get((row * Hq + h) * D + d) * k.get(((ck[size_t(sq)] + j) * KVH + g) * D + d);
          sc[size_t(j)] = double(float(scale)) * dot;
          mx = std::max(mx, sc[size_t(j)]);
        }
        for (auto& x : sc) sum += (x = std::exp(x - mx));
        for (int64_t j = 0; j < n; ++j)
          for (int64_t d = 0; d < D; ++d)
            ref[size_t((row * Hq + h) * D + d)] += sc[size_t(j)] / sum * v.get(((ck[size_t(sq)] + j) * KVH + g) * D + d);
      }
  }
  std::vector<double> sa(size_t(o.numel()), 4.0);  // convex combinations of V rows, as paged_attention
  return outcome([&] { ks::varlen_attention(c.v(o), c.v(q), c.v(k), c.v(v), c.v(bq), c.v(bk), scale, causal, c.be, c.stream); },
                 [&](std::string* why) { return close(o, ref, &sa, double(L + 3), why); }, c);
}

struct OpSweep {
  std::string op;
  std::vector<std::pair<std::string, CaseFn>> cases;  // label, fn(ctx) per shape
  // the op whose registered variants run this one (paged_attention_after_append dispatches to
  // paged_attention's); empty: op itself
  std::string variants_of;
};

std::string label(const std::vector<int64_t>& s) {
  std::string r;
  for (auto x : s) r += (r.empty() ? "" : "x") + std::to_string(x);
  return r;
}

std::vector<OpSweep> sweeps() {
  std::vector<OpSweep> v;
  auto add = [&](const std::string& op, const std::vector<std::vector<int64_t>>& shapes,
                 std::function<int(Ctx&, const std::vector<int64_t>&)> fn, const std::string& tag = "") {
    OpSweep* s = nullptr;
    for (auto& x : v)
      if (x.op == op) s = &x;
    if (!s) s = &v.emplace_back(OpSweep{op, {}});
    for (const auto& sh : shapes)
      s->cases.emplace_back(tag + label(sh), [fn, sh](Ctx& c, const std::vector<int64_t>&) { return fn(c, sh); });
  };
  add("rms_norm", {{1, 1}, {3, 127}, {2, 3420}, {1, 4097}, {1, 131072}, {33, 576}}, case_rms_norm);
  add("fused_add_rms_norm", {{1, 1}, {3, 127}, {2, 3420}, {1, 4097}, {17, 576}}, case_fused_add);
  add("silu_and_mul", {{1, 1}, {3, 127}, {2, 1536}, {5, 4097}}, case_silu);
  add("gemv", {{1, 1}, {7, 127}, {33, 576}, {5, 4097}}, case_gemv);
  add("softmax", {{1, 1}, {3, 127}, {2, 3420}, {1, 4097}, {1, 131072}, {4, 49152}}, case_softmax);
  add("argmax", {{1, 1}, {3, 127}, {2, 49152}}, case_argmax);
  add("gemm", {{1, 1, 1}, {3, 5, 7}, {17, 33, 64}, {4, 9, 576}}, case_gemm);
  for (const auto& f : kQuantFormats) {
    const std::string tag = std::string(f.q == ks::QType::Q4_0 ? "Q4_0" : f.q == ks::QType::Q4_1 ? "Q4_1"
                                        : f.q == ks::QType::Q8_0 ? "Q8_0" : f.q == ks::QType::F16 ? "F16"
                                        : f.q == ks::QType::BF16 ? "BF16" : "F32") + ":";
    add("quant_matmul", {{1, 7, 32}, {2, 9, 64}, {3, 33, 576}, {4, 17, 576}, {13, 41, 1536}},
        [f](Ctx& c, const std::vector<int64_t>& s) { return case_quant_matmul(c, s, f); }, tag);
    add("dequantize", {{1, 32}, {5, 576}}, [f](Ctx& c, const std::vector<int64_t>& s) { return case_dequantize(c, s, f); }, tag);
    if (f.bs == 32)  // (quant_matmul_a8 takes the integer block formats)
      add("quant_matmul_a8", {{1, 7, 32}, {2, 9, 64}, {1, 33, 576}, {3, 17, 1536}, {1, 4105, 4096}},
          [f](Ctx& c, const std::vector<int64_t>& s) { return case_quant_matmul_a8(c, s, f); }, tag);
    add("fused_add_rms_norm_quant_matmul", {{1, 7, 32}, {5, 33, 576}},
        [f](Ctx& c, const std::vector<int64_t>& s) { return case_norm_quant_matmul(c, s, f, true); }, tag + "add:");
    add("fused_add_rms_norm_quant_matmul", {{1, 9, 64}, {3, 17, 576}},
        [f](Ctx& c, const std::vector<int64_t>& s) { return case_norm_quant_matmul(c, s, f, false); }, tag + "norm:");
    add("silu_and_mul_quant_matmul", {{1, 7, 32}, {6, 33, 1536}},
        [f](Ctx& c, const std::vector<int64_t>& s) { return case_silu_quant_matmul(c, s, f); }, tag);
    add("embedding", {{3, 11, 64}, {5, 49, 576}},
        [f](Ctx& c, const std::vector<int64_t>& s) { return case_embedding(c, s, &f); }, tag);
  }
  add("embedding", {{3, 11, 64}, {4, 30, 577}}, [](Ctx& c, const std::vector<int64_t>& s) { return case_embedding(c, s, nullptr); }, "dense:");
  add("rotary_embedding", {{1, 9, 3, 64, 64}, {5, 4, 1, 128, 96}, {3, 8, 2, 66, 32}},
      [](Ctx& c, const std::vector<int64_t>& s) { return case_rotary(c, s, true); }, "neox:");
  add("rotary_embedding", {{1, 9, 3, 64, 64}, {5, 4, 1, 128, 96}, {3, 8, 2, 66, 32}},
      [](Ctx& c, const std::vector<int64_t>& s) { return case_rotary(c, s, false); }, "interleaved:");
  add("kv_cache_append", {{1, 3, 64, 4, 16}, {9, 2, 32, 3, 7}}, case_kv_append);
  add("rotary_embedding_kv_append", {{1, 9, 3, 64, 64, 4, 16}, {7, 4, 2, 66, 32, 3, 7}},
      [](Ctx& c, const std::vector<int64_t>& s) { return case_rope_kv_append(c, s, false); }, "interleaved:");
  add("rotary_embedding_kv_append", {{5, 8, 2, 128, 128, 4, 16}},
      [](Ctx& c, const std::vector<int64_t>& s) { return case_rope_kv_append(c, s, true); }, "neox:");
  // sample: the check is the CPU reference's ids, so the sweep runs it on CUDA only (the CPU
  // reference itself is checked against an FP64 model of the contract in test_sample)
  add("sample", {{1, 1000, 50}, {3, 49152, 1024}, {2, 4097, 1}, {4, 32000, 0}},
      [](Ctx& c, const std::vector<int64_t>& s) {
        if (c.be != ks::Backend::Cpu) return case_sample(c, s);
        c.why = "the CPU reference defines the ids (tests/cpp/test_sample.cpp checks it)";
        return -1;
      });
  const std::vector<std::vector<int64_t>> attention_shapes{
      {1, 9, 3, 64, 16, 37}, {4, 8, 2, 64, 7, 50}, {3, 12, 3, 128, 16, 300}, {2, 4, 1, 32, 1, 9}, {5, 9, 3, 64, 16, 1}};
  add("paged_attention", attention_shapes, [](Ctx& c, const std::vector<int64_t>& s) { return case_attention(c, s); });
  // paged_attention_after_append runs paged_attention's variants (its promise only lets older keys
  // be read before griddepcontrol.wait): the same cases with fresh_keys 1 and 0
  for (int64_t fresh : {1, 0})
    add("paged_attention_after_append", attention_shapes,
        [fresh](Ctx& c, const std::vector<int64_t>& s) { return case_attention(c, s, fresh); },
        "fresh" + std::to_string(fresh) + ":");
  v.back().variants_of = "paged_attention";
  add("rotary_embedding_kv_append_paged_attention", {{1, 9, 3, 64, 64, 16, 37}, {5, 8, 2, 64, 32, 7, 50}, {3, 12, 3, 128, 128, 16, 300}},
      [](Ctx& c, const std::vector<int64_t>& s) { return case_rope_attention(c, s, false); }, "interleaved:");
  add("rotary_embedding_kv_append_paged_attention", {{2, 4, 1, 32, 32, 1, 9}, {5, 9, 3, 64, 64, 16, 1}},
      [](Ctx& c, const std::vector<int64_t>& s) { return case_rope_attention(c, s, true); }, "neox:");
  add("varlen_attention", {{1, 9, 3, 64, 37, 1}, {4, 8, 2, 64, 50, 1}, {3, 12, 3, 128, 300, 1}, {4, 4, 1, 32, 9, 0},
                           {5, 8, 8, 80, 70, 0}},
      case_varlen);
  return v;
}

}  // namespace

// The entry points the check sweeps that run another op's variants (paged_attention_after_append):
// `ksctl ops` lists them under the variants' table, with the op the library names for them.
std::vector<std::string> check_entry_points() {
  std::vector<std::string> r;
  for (const OpSweep& sw : sweeps())
    if (!sw.variants_of.empty()) r.push_back(sw.op);
  return r;
}

namespace ks::tune {
namespace {
// The tuning grid: ops with more than one variant on some backend. Each shape's routing key
// (rows, cols) is the one src/ops/route_key.cpp computes for that call. The model's shapes
// (SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64) and larger ones.
struct TuneOp {
  std::string op, tag;
  std::vector<std::vector<int64_t>> shapes;
  std::function<int(Ctx&, const std::vector<int64_t>&)> fn;
  std::function<std::pair<int64_t, int64_t>(const std::vector<int64_t>&)> key;
};
std::vector<TuneOp> grid() {
  std::vector<TuneOp> v;
  std::vector<std::vector<int64_t>> qm, gm, pa, ro;
  for (int64_t m : {1, 8, 64})
    for (int64_t n : {576, 1536, 4096}) qm.push_back({m, n, 576}), gm.push_back({m, n, 576});
  for (int64_t m : {1, 8, 64}) qm.push_back({m, 49152, 576});  // SmolLM2's output head (vocab 49152)
  for (int64_t m : {1, 8, 64})  // the GEMV shapes (long rows), at every M of the grid: the
    for (int64_t n : {4096, 14336}) qm.push_back({m, n, 4096});  // cells need a full (M, N x K) grid
  for (int64_t t : {1, 8, 32})
    for (int64_t len : {256, 2048}) pa.push_back({t, 9, 3, 64, 16, len});
  for (int64_t t : {1, 64, 1024})
    for (int64_t h : {9, 32}) ro.push_back({t, h, h / 3, 64, 64});
  // quant_matmul per integer block format (the fastest variant differs by format, e.g. bf16 49152 x 576:
  // cuda_bulk_stream for Q4_1, cuda_mma_blocks for Q4_0 at c14fbe2); each format's cells carry its qtype
  for (int fi : {1, 0, 2}) {  // Q4_1 (SmolLM2's layers), Q4_0, Q8_0 (its output head)
    const QFmt& f = kQuantFormats[size_t(fi)];
    v.push_back({"quant_matmul", fi == 0 ? "Q4_0:" : fi == 1 ? "Q4_1:" : "Q8_0:", qm,
                 [f](Ctx& c, const std::vector<int64_t>& s) { return case_quant_matmul(c, s, f); },
                 [](const std::vector<int64_t>& s) { return std::pair<int64_t, int64_t>{s[0], s[1] * s[2]}; }});
  }
  v.push_back({"gemm", "", gm, case_gemm, [](const std::vector<int64_t>& s) { return std::pair<int64_t, int64_t>{s[0], s[1]}; }});
  v.push_back({"paged_attention", "", pa, [](Ctx& c, const std::vector<int64_t>& s) { return case_attention(c, s); },
               [](const std::vector<int64_t>& s) {
                 return std::pair<int64_t, int64_t>{s[0], (s[5] + s[4] - 1) / s[4] * s[4]};  // T, MB * BS
               }});
  std::vector<std::vector<int64_t>> sm;
  for (int64_t r : {1, 64, 256})
    for (int64_t cols : {4096, 32000, 128256}) sm.push_back({r, cols});
  std::vector<std::vector<int64_t>> sp;  // top-k / top-p sampling over SmolLM2's and Llama 3's vocabularies
  for (int64_t r : {1, 8, 64})
    for (int64_t vocab : {49152, 128256}) sp.push_back({r, vocab, 50});
  v.push_back({"sample", "", sp, case_sample, [](const std::vector<int64_t>& s) { return std::pair<int64_t, int64_t>{s[0], s[1]}; }});
  v.push_back({"softmax", "", sm, case_softmax, [](const std::vector<int64_t>& s) { return std::pair<int64_t, int64_t>{s[0], s[1]}; }});
  v.push_back({"rotary_embedding", "neox:", ro, [](Ctx& c, const std::vector<int64_t>& s) { return case_rotary(c, s, true); },
               [](const std::vector<int64_t>& s) { return std::pair<int64_t, int64_t>{s[0], s[1]}; }});
  return v;
}
}  // namespace

std::string grid_summary() {
  std::string r;
  for (const auto& t : grid()) {
    r += "  " + t.op + (t.tag.empty() ? "" : " (" + t.tag.substr(0, t.tag.size() - 1) + ")") + ":";
    for (const auto& s : t.shapes) r += " " + label(s);
    r += "\n";
  }
  return r;
}

std::vector<Row> measure(const std::string& backend, const std::string& op_filter, int reps, const Progress& progress) {
  const auto all = ks::variants();
  struct Job {  // one shape, every variant back to back (a passing load disturbs them alike)
    const TuneOp* t;
    std::vector<const ks_variant_info_t*> vs;
    DType dt;
    std::string be;
    std::vector<int64_t> shape;
  };
  const auto g = grid();
  std::vector<Job> jobs;
  size_t total = 0;
  for (const std::string be_name : {"cpu", "cuda"}) {
    if (backend != "all" && backend != be_name) continue;
    if (!ks::backend_available(be_name == "cpu" ? ks::Backend::Cpu : ks::Backend::Cuda)) continue;
    for (const auto& t : g) {
      if (!op_filter.empty() && t.op != op_filter) continue;
      for (DType dt : {DType::F16, DType::BF16, DType::F32}) {
        std::vector<const ks_variant_info_t*> vs;
        for (const auto& v : all)
          if (v.op == t.op && v.backend == be_name && std::string(v.dtypes).find(ks::dtype_name(dt)) != std::string::npos)
            vs.push_back(&v);
        if (vs.size() < 2) continue;  // one variant: nothing to choose
        for (const auto& sh : t.shapes) jobs.push_back({&t, vs, dt, be_name, sh}), total += vs.size();
      }
    }
  }
  std::vector<Row> rows;
  size_t done = 0;
  for (const Job& j : jobs)
    for (const ks_variant_info_t* variant : j.vs) {
      const auto& s = j.shape;
      const ks_variant_info_t* const jv = variant;
      Row r;
      r.backend = j.be;
      r.op = j.t->op;
      r.dtype = ks::dtype_name(j.dt);
      r.variant = jv->name;
      r.shape = j.t->tag + label(s);
      std::tie(r.rows, r.cols) = j.t->key(s);
      if (progress) progress(done, total, r.op + " " + r.backend + " " + r.variant + " " + r.dtype + " " + r.shape);
      Ctx c{j.dt, 0, j.be == "cpu" ? ks::Backend::Cpu : ks::Backend::Cuda, ""};
      c.reps = reps;
      ks::check(ks_force_variant(jv->op, jv->name));
      int res;
      try {
        res = j.t->fn(c, s);
      } catch (const std::exception& e) {  // a CUDA fault, say: this row fails, the run goes on
        res = -2;
        c.why = e.what();
      }
      ks::check(ks_force_variant(nullptr, nullptr));
      r.status = res == 1 ? "ok" : res == 0 ? "incorrect" : res == -1 ? "skipped" : "error";
      r.why = c.why;  // ok rows: a timing note, if any
      r.us = res == 1 ? c.us : -1;
      r.spread = c.spread;
      rows.push_back(std::move(r));
      ++done;
    }
  if (progress) progress(done, total, "");
  return rows;
}

}  // namespace ks::tune

int run_check(const std::string& backend, const std::string& op_filter, bool verbose) {
  const auto all = ks::variants();
  if (!op_filter.empty()) {
    bool known = false;
    for (const auto& sw : sweeps()) known = known || sw.op == op_filter;
    if (!known) {
      bool registered = false;
      for (const auto& v : all) registered = registered || op_filter == v.op;
      if (registered)  // (the fused decode ops whose results are their calls')
        std::fprintf(stderr,
                     "check: operator '%s' has no cases in the FP64 sweep; the test suite compares it bit for bit "
                     "with the calls it fuses (tests/cpp/test_decode_fusions.cpp, tests/cuda/test_cuda_ops.cpp)\n",
                     op_filter.c_str());
      else
        std::fprintf(stderr,
                     "check: unknown operator '%s' (the operators: `ksctl ops`; the backends: cpu, cuda, all; usage: "
                     "--help)\n",
                     op_filter.c_str());
      return 2;
    }
  }
  // A routing table that cannot be used fails every call before any kernel runs: said once here
  // (exit 2, as ksctl's other subcommands), not as every case's incorrect result
  {
    const char* json = nullptr;
    if (ks_routing_table(&json) != KS_SUCCESS) {
      std::fprintf(stderr, "check: the routing table cannot be used: %s\n", ks_last_error());
      return 2;
    }
  }
  std::map<std::string, std::array<int, 3>> totals;  // backend -> correct, incorrect, skipped
  int incorrect_total = 0;
  for (const std::string be_name : {"cpu", "cuda"}) {
    if (backend != "all" && backend != be_name) continue;
    const ks::Backend be = be_name == "cpu" ? ks::Backend::Cpu : ks::Backend::Cuda;
    auto& tot = totals[be_name];
    tot = {0, 0, 0};
    const bool present = ks::backend_available(be);
    for (const auto& sw : sweeps()) {
      if (!op_filter.empty() && sw.op != op_filter) continue;
      bool any = false;
      const std::string& vop = sw.variants_of.empty() ? sw.op : sw.variants_of;
      for (const auto& v : all) {
        if (vop != v.op || be_name != v.backend) continue;
        any = true;
        for (DType dt : {DType::F16, DType::BF16, DType::F32}) {
          if (std::string(v.dtypes).find(ks::dtype_name(dt)) == std::string::npos) continue;
          for (const auto& [lab, fn] : sw.cases)
            for (size_t off : {size_t(0), size_t(2)}) {
              Ctx c{dt, off, be, ""};
              int r = -1;
              if (present) {
                ks::check(ks_force_variant(v.op, v.name));
                r = fn(c, {});
                ks::check(ks_force_variant(nullptr, nullptr));
              } else {
                c.why = "no CUDA device";
              }
              tot[r == 1 ? 0 : r == 0 ? 1 : 2]++;
              if (r == 0) ++incorrect_total;
              if (verbose || r == 0)
                std::printf("%-9s %-4s %-18s %-13s %-5s %-26s off=%zu %s\n", r == 1 ? "correct" : r == 0 ? "INCORRECT" : "skipped",
                            be_name.c_str(), sw.op.c_str(), v.name, ks::dtype_name(dt), lab.c_str(), off, c.why.c_str());
            }
        }
      }
      if (!any && verbose) std::printf("(no %s variant of %s)\n", be_name.c_str(), sw.op.c_str());
    }
  }
  for (const auto& [be, t] : totals) {
    std::string note;
    if (be == "cuda" && !ks::backend_available(ks::Backend::Cuda)) note = "  (CUDA backend not available here)";
    else if (t[0] + t[1] + t[2] == 0) note = "  (no variants registered for this backend)";
    std::printf("%s: correct=%d incorrect=%d skipped=%d%s\n", be.c_str(), t[0], t[1], t[2], note.c_str());
  }
  if (incorrect_total) return 1;
  // asked for CUDA explicitly and nothing ran there: not a pass
  if (backend == "cuda" && !ks::backend_available(ks::Backend::Cuda)) {
    std::fprintf(stderr, "check: --backend cuda, but the CUDA backend is not available here: nothing was checked\n");
    return 3;
  }
  return 0;
}
