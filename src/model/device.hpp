// Device memory, copies, streams and CUDA graphs for the model runner (the CUDA
// runtime, used the way any application of kernscope would). Built with the CUDA
// runtime when the CUDA backend is (KS_MODEL_CUDA); otherwise every call throws
// ks::BackendUnavailable, so CPU-only builds keep one code path.
#pragma once

#include <kernscope/kernscope.hpp>

#include <cstddef>
#include <functional>

namespace ks::model {

bool cuda_runtime_built();

class DeviceArray {  // cudaMalloc'd bytes on the current device; move-only
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t bytes);
  ~DeviceArray();
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceArray& operator=(DeviceArray&& o) noexcept;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void* data() const { return p_; }
  size_t bytes() const { return n_; }
  // A view of these bytes, from byte `offset` on, as dtype/shape on CUDA device 0.
  ks::TensorView view(ks::DType dtype, const std::vector<int64_t>& shape, size_t offset = 0) const;

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

class PinnedArray {  // page-locked host bytes (cudaMallocHost): async copies read them at run time; move-only
 public:
  PinnedArray() = default;
  explicit PinnedArray(size_t bytes);
  ~PinnedArray();
  PinnedArray(PinnedArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  PinnedArray& operator=(PinnedArray&& o) noexcept;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  void* data() const { return p_; }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

class DeviceStream {  // a non-blocking stream, and a CUDA graph captured on it
 public:
  DeviceStream();
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  ks_stream_t handle() const { return s_; }
  // async on this stream: src must stay valid and unchanged until the stream reaches the copy
  // (pinned memory is read then; pageable memory is staged at the call)
  void to_device(void* dst, const void* src, size_t bytes);
  void to_host(void* dst, const void* src, size_t bytes);    // async; call sync() before reading dst
  void sync();
  // Captures fn (launches on this stream only) into a graph; replay() launches it.
  void capture(const std::function<void()>& fn);
  bool captured() const { return exec_ != nullptr; }
  void replay();
  void drop_graph();

 private:
  ks_stream_t s_ = nullptr;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

}  // namespace ks::model
