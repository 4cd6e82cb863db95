#include "model/device.hpp"

#include <cstdlib>
#include <string>

#if defined(KS_MODEL_CUDA)
#include <cuda_runtime.h>
#if __has_include(<nvtx3/nvToolsExt.h>)  // header-only; a no-op unless a profiler is attached
#include <nvtx3/nvToolsExt.h>
#define KS_NVTX_RANGE_PUSH(name) nvtxRangePushA(name)
#define KS_NVTX_RANGE_POP() nvtxRangePop()
#else
#define KS_NVTX_RANGE_PUSH(name) ((void)0)
#define KS_NVTX_RANGE_POP() ((void)0)
#endif
#endif

namespace ks::model {

#if defined(KS_MODEL_CUDA)
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
  {
    const std::string msg = std::string("model: ") + what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    if (e == cudaErrorMemoryAllocation) throw ks::OutOfMemory(KS_ERROR_OUT_OF_MEMORY, msg);
    throw ks::CudaError(KS_ERROR_CUDA, msg);
  }
}
cudaStream_t cs(ks_stream_t s) { return static_cast<cudaStream_t>(s); }
}  // namespace

bool cuda_runtime_built() { return true; }

CudaBytes::CudaBytes(size_t bytes, Kind kind) : n_(bytes), kind_(kind) {
  if (kind == Kind::Device)
    check(cudaMalloc(&p_, bytes ? bytes : 16), "cudaMalloc");
  else
    check(cudaMallocHost(&p_, bytes ? bytes : 16), "cudaMallocHost");
}
void CudaBytes::release() noexcept {
  if (!p_) return;
  if (kind_ == Kind::Device)
    cudaFree(p_);
  else
    cudaFreeHost(p_);
}

DeviceStream::DeviceStream() {
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  s_ = s;
}
DeviceStream::~DeviceStream() {
  for (void* e : ev_)
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (s_) cudaStreamDestroy(cs(s_));
}
void DeviceStream::to_device(void* dst, const void* src, size_t bytes) {
  copy_unsynced_ = true;  // (also when the call fails: the next wait_for_copies() syncs)
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cs(s_)), "copy to the device");
}
void DeviceStream::to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cs(s_)), "copy to the host");
}
void DeviceStream::sync() {
  check(cudaStreamSynchronize(cs(s_)), "stream synchronize");
  copy_unsynced_ = false;
  if (timed_) {
    timed_ = false;
    float ms = 0.f;
    check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(ev_[0]), static_cast<cudaEvent_t>(ev_[1])),
          "read the step's timing events");
    replay_us_.push_back(ms * 1000.f);
  }
}
std::vector<float> DeviceStream::take_replay_us() {
  std::vector<float> out;
  out.swap(replay_us_);
  return out;
}
void DeviceStream::wait_for_copies() {
  if (copy_unsynced_) sync();
}
DeviceGraph DeviceStream::capture_graph(const std::function<void()>& fn) {
  check(cudaStreamBeginCapture(cs(s_), cudaStreamCaptureModeThreadLocal), "begin graph capture");
  try {
    fn();
  } catch (...) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(cs(s_), &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  cudaGraph_t g = nullptr;
  check(cudaStreamEndCapture(cs(s_), &g), "end graph capture");
  cudaGraphExec_t e = nullptr;
  const cudaError_t r = cudaGraphInstantiate(&e, g, 0);
  DeviceGraph out;  // (owns g and e from here, also when the upload throws)
  out.graph_ = g;
  check(r, "instantiate the graph");
  out.exec_ = e;
  // its first launch would otherwise upload it (milliseconds for a graph of many steps)
  check(cudaGraphUpload(e, cs(s_)), "upload the graph");
  return out;
}
void DeviceStream::launch(const DeviceGraph& g) {
  if (g.empty()) throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "model: launch of a graph that holds none");
  check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g.exec_), cs(s_)), "graph launch");
}
void DeviceStream::record(DeviceEvent& e) {
  if (!e.e_) {
    cudaEvent_t ev = nullptr;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "create an event");
    e.e_ = ev;
  }
  check(cudaEventRecord(static_cast<cudaEvent_t>(e.e_), cs(s_)), "record an event");
}
void DeviceEvent::wait() {
  if (e_) check(cudaEventSynchronize(static_cast<cudaEvent_t>(e_)), "wait for an event");
}
void DeviceEvent::reset() noexcept {
  if (e_) cudaEventDestroy(static_cast<cudaEvent_t>(e_));
  e_ = nullptr;
}
void DeviceGraph::reset() noexcept {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  exec_ = graph_ = nullptr;
}
// Each replay is an NVTX range "ks_decode_step", so a profiler can take the decode steps'
// kernels alone (ncu --nvtx --nvtx-include "ks_decode_step/": scripts/gpu_model_check.sh).
void DeviceStream::replay(const DeviceGraph& g) {
  if (g.empty()) throw ks::InvalidArgument(KS_ERROR_INVALID_ARGUMENT, "model: replay of a graph that holds none");
  static const bool timing = [] {
    const char* e = std::getenv("KS_MODEL_STEP_TIMING");
    return e && std::string(e) == "1";
  }();
  if (timing) {
    for (void*& e : ev_)
      if (!e) {
        cudaEvent_t ev = nullptr;
        check(cudaEventCreate(&ev), "create a timing event");
        e = ev;
      }
    check(cudaEventRecord(static_cast<cudaEvent_t>(ev_[0]), cs(s_)), "record the step's start");
  }
  KS_NVTX_RANGE_PUSH("ks_decode_step");
  const cudaError_t r = cudaGraphLaunch(static_cast<cudaGraphExec_t>(g.exec_), cs(s_));
  KS_NVTX_RANGE_POP();
  check(r, "graph launch");
  if (timing) {
    check(cudaEventRecord(static_cast<cudaEvent_t>(ev_[1]), cs(s_)), "record the step's end");
    timed_ = true;
  }
}
#else
namespace {
[[noreturn]] void unavailable() {
  throw ks::BackendUnavailable(KS_ERROR_BACKEND_UNAVAILABLE,
                               "model: this build has no CUDA runtime (the CUDA backend was not built)");
}
}  // namespace
bool cuda_runtime_built() { return false; }
CudaBytes::CudaBytes(size_t, Kind) { unavailable(); }
void CudaBytes::release() noexcept {}  // nothing is ever allocated here
DeviceStream::DeviceStream() { unavailable(); }
DeviceStream::~DeviceStream() = default;
void DeviceStream::to_device(void*, const void*, size_t) { unavailable(); }
void DeviceStream::to_host(void*, const void*, size_t) { unavailable(); }
void DeviceStream::sync() { unavailable(); }
void DeviceStream::wait_for_copies() {}  // no copy is ever queued here
DeviceGraph DeviceStream::capture_graph(const std::function<void()>&) { unavailable(); }
void DeviceStream::launch(const DeviceGraph&) { unavailable(); }
void DeviceStream::record(DeviceEvent&) { unavailable(); }
void DeviceStream::replay(const DeviceGraph&) { unavailable(); }
void DeviceEvent::wait() {}            // nothing is ever recorded here
void DeviceEvent::reset() noexcept {}  // nor created
void DeviceGraph::reset() noexcept {}  // nor captured
std::vector<float> DeviceStream::take_replay_us() { return {}; }
#endif

DeviceGraph& DeviceGraph::operator=(DeviceGraph&& o) noexcept {
  if (this != &o) {
    reset();
    graph_ = o.graph_, exec_ = o.exec_;
    o.graph_ = o.exec_ = nullptr;
  }
  return *this;
}
DeviceEvent& DeviceEvent::operator=(DeviceEvent&& o) noexcept {
  if (this != &o) {
    reset();
    e_ = o.e_;
    o.e_ = nullptr;
  }
  return *this;
}

CudaBytes& CudaBytes::operator=(CudaBytes&& o) noexcept {
  if (this != &o) {
    release();
    p_ = o.p_, n_ = o.n_, kind_ = o.kind_;
    o.p_ = nullptr, o.n_ = 0;
  }
  return *this;
}

ks::TensorView DeviceArray::view(ks::DType dtype, const std::vector<int64_t>& shape, size_t offset) const {
  return ks::TensorView(static_cast<char*>(data()) + offset, dtype, shape, DLDevice{kDLCUDA, 0});
}

}  // namespace ks::model
