// Concurrency: many threads calling ops at once, half of them failing
// validation. Each thread must see its own error message (thread-local), and
// successful calls must give the single-threaded result bitwise.
#include <gtest/gtest.h>
#include <kernscope/kernscope.h>

#include <atomic>
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

}  // namespace
