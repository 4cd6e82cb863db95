// Uses the installed C++ header: softmax of one row, checked, and a typed error.
#include <kernscope/kernscope.hpp>

#include <cmath>
#include <cstdio>

int main() {
  float x[4] = {1.f, 2.f, 3.f, 4.f}, y[4] = {};
  ks::softmax(ks::TensorView(y, ks::DType::F32, {1, 4}), ks::TensorView(x, ks::DType::F32, {1, 4}));
  double sum = 0;
  for (float v : y) sum += v;
  if (std::fabs(sum - 1.0) > 1e-6 || !(y[3] > y[2])) return 1;
  try {
    ks::rms_norm(ks::TensorView(y, ks::DType::F32, {1, 4}), ks::TensorView(x, ks::DType::F32, {1, 4}),
                 ks::TensorView(x, ks::DType::F32, {3}));
    return 1;  // must have thrown
  } catch (const ks::InvalidArgument& e) {
    std::printf("consumer ok (kernscope %s): %s\n", ks::version().c_str(), e.what());
  }
  return 0;
}
