// Per-thread FP32 scratch for the CPU kernels' OpenMP teams.
//
// Allocated by the calling thread before a team starts, so running out of memory
// throws std::bad_alloc where the op's guard() turns it into
// KS_ERROR_OUT_OF_MEMORY. (An exception that escapes an OpenMP region terminates
// the process, and a thread that throws before a `#pragma omp for` would leave
// the others waiting at its barrier.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ks::cpu {

class Scratch {
 public:
  // `arrays` arrays of `per_thread` floats for each thread of a team that the
  // calling thread would start; a single set when `parallel` is false (the body
  // then runs inline on the calling thread, whatever team that thread is in).
  Scratch(bool parallel, size_t per_thread, int arrays = 1)
      : parallel_(parallel), n_(per_thread), arrays_(size_t(arrays)) {
    size_t threads = 1;
#ifdef _OPENMP
    if (parallel) threads = size_t(omp_get_max_threads() > 0 ? omp_get_max_threads() : 1);
#endif
    const size_t max = std::numeric_limits<size_t>::max() / sizeof(float);
    if (n_ != 0 && (threads * arrays_ > max / n_)) throw std::bad_alloc();
    buf_.reset(new float[threads * arrays_ * n_ + 1]);  // uninitialized: each kernel writes before it reads
  }
  // Array k of the calling thread (inside the team when parallel).
  float* get(int k = 0) const {
    size_t t = 0;
#ifdef _OPENMP
    if (parallel_) t = size_t(omp_get_thread_num());
#endif
    return buf_.get() + (t * arrays_ + size_t(k)) * n_;
  }

 private:
  bool parallel_;
  size_t n_, arrays_;
  std::unique_ptr<float[]> buf_;
};

inline constexpr int64_t kParallelWork = 1 << 16;  // elements; below this stay single-threaded

// Runs body on an OpenMP team when the call is big enough, inline otherwise:
// even `#pragma omp parallel if (false)` starts a team (~1500 instructions),
// which would dominate small calls. body's `#pragma omp for` loops bind to the
// team, or run serially when body is called outside one. Called from inside the
// caller's own parallel region, inline would bind those loops to the caller's
// team (each caller thread doing only its share of its own call, and a lone
// caller waiting at the loop's barrier for threads that never come): there the
// body gets a team of its own (of one thread, unless nested parallelism is on).
template <class F>
void team(bool parallel, F&& body) {
#ifdef _OPENMP
  if (!parallel && omp_in_parallel()) {
#pragma omp parallel num_threads(1)
    body();
    return;
  }
#endif
  if (parallel) {
#pragma omp parallel
    body();
  } else {
    body();
  }
}

}  // namespace ks::cpu
