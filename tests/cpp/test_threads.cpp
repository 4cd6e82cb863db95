// Concurrency: many threads calling ops at once, half of them failing
// validation. Each thread must see its own error message (thread-local), and
// successful calls must give the single-threaded result bitwise. Also calls from
// inside the caller's own OpenMP team.
#include <gtest/gtest.h>
#include <kernscope/kernscope.h>

#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

namespace {

TEST(Threads, ConcurrentCallsAndThreadLocalErrors) {
  using kstest::Buf;
  const int64_t R = 64, H = 512;
  Buf x(ks::DType::F32, {R, H}), w(ks::DType::F32, {H}), want(ks::DType::F32, {R, H});
  kstest::fill_normal(x);
  kstest::fill_normal(w);
  ks::rms_norm(want.view(), x.view(), w.view(), 1e-6, ks::Backend::Cpu);
  std::atomic<int> bad_msgs{0}, bad_values{0};
  auto worker = [&](int id) {
    Buf out(ks::DType::F32, {R, H}), gout(ks::DType::F32, {7});
    Buf gw(ks::DType::F32, {7, 3});  // gemv weight of the wrong width: an error
    kstest::fill_normal(gw);
    for (int it = 0; it < 200; ++it) {
      if ((it + id) % 2) {
        DLTensor o = gout.dl(), xx = x.dl(), ww = gw.dl();
        xx.ndim = 1;
        xx.shape = &x.shape[1];
        const ks_status_t s = ks_gemv(&o, &xx, &ww, KS_BACKEND_CPU, nullptr);
        const std::string msg = ks_last_error();
        if (s != KS_ERROR_INVALID_ARGUMENT || msg.rfind("gemv: weight must have shape", 0) != 0) ++bad_msgs;
      } else {
        DLTensor o = out.dl(), xx = x.dl(), ww = w.dl();
        const ks_status_t s = ks_rms_norm(&o, &xx, &ww, 1e-6, KS_BACKEND_CPU, nullptr);
        if (s != KS_SUCCESS || std::strcmp(ks_last_error(), "") != 0 ||
            std::memcmp(out.data(), want.data(), want.nbytes()) != 0)
          ++bad_values;
      }
    }
  };
  std::vector<std::thread> ts;
  for (int i = 0; i < 16; ++i) ts.emplace_back(worker, i);
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad_msgs.load(), 0);
  EXPECT_EQ(bad_values.load(), 0);
}

// Ops called from inside the caller's own OpenMP parallel region. Before the fix the CPU
// reference ran a small call's orphaned `omp for` loops inline, so they bound to the caller's
// team: with each team thread normalizing its own tensor, each call did only its thread's share of
// the rows (the rest kept the poison), and a call made by one thread of the team alone waited at
// the loop's barrier for threads that never came (a hang: here a watchdog fails the test).
// Small calls (under the parallel threshold) and large ones; rms_norm, softmax, silu_and_mul.
TEST(Threads, CallsFromInsideTheCallersOpenMPTeam) {
  using kstest::Buf;
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 600 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!done) {
      std::fprintf(stderr, "CallsFromInsideTheCallersOpenMPTeam: no progress in 60 s (a call waiting at a barrier)\n");
      std::abort();
    }
  });
  for (int64_t R : {int64_t(8), int64_t(512)}) {
    const int64_t H = R == 8 ? 16 : 256;  // 128 or 131072 elements (the threshold is 65536)
    SCOPED_TRACE("rows " + std::to_string(R));
    Buf x(ks::DType::F32, {R, H}), w(ks::DType::F32, {H}), norm(ks::DType::F32, {R, H}), soft(ks::DType::F32, {R, H}),
        silu(ks::DType::F32, {R, H / 2});
    kstest::fill_normal(x);
    kstest::fill_normal(w);
    ks::rms_norm(norm.view(), x.view(), w.view(), 1e-6, ks::Backend::Cpu);
    ks::softmax(soft.view(), x.view(), ks::Backend::Cpu);
    ks::silu_and_mul(silu.view(), x.view(), ks::Backend::Cpu);
    constexpr int kTeam = 4;
    std::vector<Buf> n_out, s_out, g_out;
    for (int t = 0; t < kTeam; ++t) {
      n_out.emplace_back(ks::DType::F32, std::vector<int64_t>{R, H});
      s_out.emplace_back(ks::DType::F32, std::vector<int64_t>{R, H});
      g_out.emplace_back(ks::DType::F32, std::vector<int64_t>{R, H / 2});
      n_out.back().poison(), s_out.back().poison(), g_out.back().poison();
    }
    std::atomic<int> errors{0};
#pragma omp parallel num_threads(kTeam)
    {
      const int t = omp_get_thread_num();
      try {
        ks::rms_norm(n_out[size_t(t)].view(), x.view(), w.view(), 1e-6, ks::Backend::Cpu);
        ks::softmax(s_out[size_t(t)].view(), x.view(), ks::Backend::Cpu);
        ks::silu_and_mul(g_out[size_t(t)].view(), x.view(), ks::Backend::Cpu);
      } catch (...) {
        ++errors;
      }
    }
    EXPECT_EQ(errors.load(), 0);
    for (int t = 0; t < kTeam; ++t) {
      EXPECT_EQ(std::memcmp(n_out[size_t(t)].data(), norm.data(), norm.nbytes()), 0) << "rms_norm, team thread " << t;
      EXPECT_EQ(std::memcmp(s_out[size_t(t)].data(), soft.data(), soft.nbytes()), 0) << "softmax, team thread " << t;
      EXPECT_EQ(std::memcmp(g_out[size_t(t)].data(), silu.data(), silu.nbytes()), 0) << "silu_and_mul, team thread " << t;
    }
    // one thread of the team calls, the others go on without it
    Buf lone(ks::DType::F32, {R, H});
    lone.poison();
#pragma omp parallel num_threads(kTeam)
    {
      if (omp_get_thread_num() == 0) {
        try {
          ks::rms_norm(lone.view(), x.view(), w.view(), 1e-6, ks::Backend::Cpu);
        } catch (...) {
          ++errors;
        }
      }
    }
    EXPECT_EQ(errors.load(), 0);
    EXPECT_EQ(std::memcmp(lone.data(), norm.data(), norm.nbytes()), 0) << "rms_norm by one thread of the team";
  }
  done = true;
  watchdog.join();
}

}  // namespace
