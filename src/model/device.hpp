// Device memory, copies, streams and CUDA graphs for the model runner (the CUDA
// runtime, used the way any application of kernscope would). Built with the CUDA
// runtime when the CUDA backend is (KS_MODEL_CUDA); otherwise every call throws
// ks::BackendUnavailable, so CPU-only builds keep one code path.
#pragma once

#include <kernscope/kernscope.hpp>

#include <cstddef>
#include <functional>
#include <vector>

namespace ks::model {

bool cuda_runtime_built();

// Bytes owned through the CUDA runtime, freed the way they were allocated; move-only. The two
// kinds below differ only in the allocation.
class CudaBytes {
 public:
  enum class Kind { Device, Pinned };  // cudaMalloc'd on the current device | cudaMallocHost (page-locked host)
  CudaBytes() = default;
  CudaBytes(size_t bytes, Kind kind);
  ~CudaBytes() { release(); }
  CudaBytes(CudaBytes&& o) noexcept : p_(o.p_), n_(o.n_), kind_(o.kind_) { o.p_ = nullptr, o.n_ = 0; }
  CudaBytes& operator=(CudaBytes&& o) noexcept;
  CudaBytes(const CudaBytes&) = delete;
  CudaBytes& operator=(const CudaBytes&) = delete;
  void* data() const { return p_; }
  size_t bytes() const { return n_; }

 private:
  void release() noexcept;
  void* p_ = nullptr;
  size_t n_ = 0;
  Kind kind_ = Kind::Device;
};

class DeviceArray : public CudaBytes {  // cudaMalloc'd bytes on the current device
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t bytes) : CudaBytes(bytes, Kind::Device) {}
  // A view of these bytes, from byte `offset` on, as dtype/shape on CUDA device 0.
  ks::TensorView view(ks::DType dtype, const std::vector<int64_t>& shape, size_t offset = 0) const;
};

class PinnedArray : public CudaBytes {  // page-locked host bytes: async copies read them at run time
 public:
  PinnedArray() = default;
  explicit PinnedArray(size_t bytes) : CudaBytes(bytes, Kind::Pinned) {}
};

// A CUDA graph instantiated for launch (DeviceStream::capture_graph); move-only.
class DeviceGraph {
 public:
  DeviceGraph() = default;
  ~DeviceGraph() { reset(); }
  DeviceGraph(DeviceGraph&& o) noexcept : graph_(o.graph_), exec_(o.exec_) { o.graph_ = o.exec_ = nullptr; }
  DeviceGraph& operator=(DeviceGraph&& o) noexcept;
  DeviceGraph(const DeviceGraph&) = delete;
  DeviceGraph& operator=(const DeviceGraph&) = delete;
  bool empty() const { return exec_ == nullptr; }
  void reset() noexcept;  // destroys the graph (empty afterwards)

 private:
  friend class DeviceStream;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

// A CUDA event without timing (the cheapest kind), for the host to wait on one point of a stream
// while later work stays queued behind it; move-only.
class DeviceEvent {
 public:
  DeviceEvent() = default;
  ~DeviceEvent() { reset(); }
  DeviceEvent(DeviceEvent&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  DeviceEvent& operator=(DeviceEvent&& o) noexcept;
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  void wait();  // blocks the host until the stream has reached the point last recorded

 private:
  friend class DeviceStream;
  void reset() noexcept;
  void* e_ = nullptr;
};

class DeviceStream {  // a non-blocking stream, and the CUDA graphs captured on it
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
  // sync() only if a to_device copy was queued since the last sync() that returned (its source
  // may still be read): free when every step ends in sync(), a wait after one that threw
  void wait_for_copies();
  // Captures fn (launches on this stream only) into a graph of its own; launch(g) queues it.
  DeviceGraph capture_graph(const std::function<void()>& fn);
  void launch(const DeviceGraph& g);
  // Marks the current end of the stream in e (created on first use); e.wait() blocks until then.
  void record(DeviceEvent& e);
  // launch(g) as a decode step: timed with KS_MODEL_STEP_TIMING=1 (below), an NVTX range.
  void replay(const DeviceGraph& g);
  // KS_MODEL_STEP_TIMING=1 (diagnostics): each replay(g) is timed on the GPU by two CUDA events
  // (the graph's first kernel to its last), read at the next sync(); take_replay_us() returns
  // the times collected so far, in microseconds, and clears them. Empty when the switch is off.
  std::vector<float> take_replay_us();

 private:
  ks_stream_t s_ = nullptr;
  bool copy_unsynced_ = false;  // a to_device copy queued since the last completed sync()
  void* ev_[2] = {nullptr, nullptr};  // KS_MODEL_STEP_TIMING: around the last replay
  bool timed_ = false;                // a timed replay not yet read
  std::vector<float> replay_us_;
};

}  // namespace ks::model
