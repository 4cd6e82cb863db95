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

}  // namespace ks::cpu
