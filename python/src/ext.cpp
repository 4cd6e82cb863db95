// kernscope._C: the nanobind extension under the Python package (python/kernscope).
//
// Every op binding takes a tuple of tensor objects in the C ABI's argument order
// (outputs first), imports each one zero-copy, calls the ks_* entry point with
// the GIL released, and raises the package's exception classes on failure.
// Nothing here allocates tensors: python/kernscope/_ops.py allocates outputs in
// the caller's framework and passes them in.
//
// How a tensor object is imported, fastest first:
//  1. type(obj).__dlpack_c_exchange_api__ (the DLPack >= 1.2 C exchange table,
//     e.g. torch >= 2.10): a DLTensor is filled in place (no allocation, no
//     sync), and the launch stream is the producer's current work stream on the
//     tensors' device, which is what CUDA-graph capture and torch streams need.
//  2. obj.__dlpack__(stream=S, max_version=(1, 0)), retried without max_version
//     for producers older than DLPack 1.0. S is the stream hint from Python (None
//     for host arrays): the producer orders its pending work before S, and the
//     op is launched on S (1 = the legacy default stream, 2 = per-thread).
//
// bf16 numpy arrays (ml_dtypes) cannot be exported through numpy's __dlpack__;
// Python passes them as uint16 views and sets their bit in `bf16_mask`, and the
// import relabels those tensors as bfloat16.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <kernscope/kernscope.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>

namespace nb = nanobind;

namespace {

// ---- DLPack 1.x structures ---------------------------------------------------
// The system dlpack.h may predate DLPack 1.0, so the versioned structures are
// declared here, with the layout fixed by the DLPack specification (1.0-1.3).
struct DLVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorV1 {
  DLVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorV1* self);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr uint64_t kFlagReadOnly = 1ull << 0;
constexpr uint64_t kFlagIsCopied = 1ull << 1;

struct ExchangeHeader {
  DLVersion version;
  ExchangeHeader* prev_api;
};
struct ExchangeAPI {  // DLPackExchangeAPI (DLPack 1.2+)
  ExchangeHeader header;
  int (*managed_tensor_allocator)(DLTensor*, DLManagedTensorV1**, void*, void (*)(void*, const char*, const char*));
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, DLManagedTensorV1** out);
  int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorV1* tensor, void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  int (*current_work_stream)(DLDeviceType device_type, int32_t device_id, void** out_stream);
};

// ---- errors --------------------------------------------------------------------
// Everything in this section touches Python objects and must run with the GIL
// held. The only code that runs without it is the body of run() below (the C
// call itself), which may neither raise nor touch a Python object.
// Python classes per ks_status_t, installed by kernscope._errors at import.
std::array<PyObject*, 8> g_error_class{};

// (bytes that are not UTF-8, e.g. a file name from KS_ROUTING_TABLE, become U+FFFD: PyErr_SetString
// decodes strictly and would raise UnicodeDecodeError instead of the error itself)
[[noreturn]] void raise(PyObject* cls, const std::string& msg) {
  PyObject* text = PyUnicode_DecodeUTF8(msg.data(), Py_ssize_t(msg.size()), "replace");
  if (text == nullptr) {
    PyErr_Clear();
    PyErr_SetString(cls, "(an error whose message could not be decoded)");
  } else {
    PyErr_SetObject(cls, text);
    Py_DECREF(text);
  }
  throw nb::python_error();
}

// msg: ks_last_error() as read on the calling thread right after the failing
// call (see run()); empty: the status name.
[[noreturn]] void raise_status(ks_status_t st, std::string msg) {
  if (msg.empty()) msg = ks_status_name(st);
  PyObject* cls = (st > 0 && size_t(st) < g_error_class.size() && g_error_class[st]) ? g_error_class[st]
                                                                                      : PyExc_RuntimeError;
  raise(cls, msg);
}
[[noreturn]] void raise_status(ks_status_t st) { raise_status(st, ks_last_error()); }

// The current Python exception as "Type: message" (no traceback), cleared.
// A producer that reports failure without setting an exception gets a plain
// message instead of nanobind's fatal "error indicator unset".
std::string take_python_error() {
  if (!PyErr_Occurred()) return "unknown error (no Python exception was set)";
  nb::python_error e;  // fetches and clears the error indicator
  std::string msg = Py_TYPE(e.value().ptr())->tp_name;
  PyObject* text = PyObject_Str(e.value().ptr());
  if (text == nullptr) {
    PyErr_Clear();
  } else {
    const char* s = PyUnicode_AsUTF8(text);
    if (s == nullptr) PyErr_Clear();
    else if (*s) msg += std::string(": ") + s;
    Py_DECREF(text);
  }
  // (torch's C++ errors carry their stack after the message: "Exception raised from ...", then a
  // frame per line; the message alone names the problem)
  const size_t stack = msg.find("\nException raised from ");
  if (stack != std::string::npos) msg.erase(stack);
  return msg;
}

// Backend codes are checked here, with the GIL held, before any call releases it.
ks_backend_t to_backend(int b) {
  if (b < 0 || b > 2) raise(PyExc_ValueError, "backend code must be 0 (auto), 1 (cpu) or 2 (cuda)");
  return static_cast<ks_backend_t>(b);
}

// An op or variant name for the C ABI: a str without NUL characters (C sees a name only up to its
// first NUL, so "rms_norm\0x" would silently mean rms_norm), or None where `none_ok`.
std::string c_name(nb::handle h, const char* fn, const char* arg, bool none_ok = false) {
  if (!nb::isinstance<nb::str>(h))
    raise(PyExc_TypeError, std::string(fn) + ": " + arg + " must be a str" + (none_ok ? " or None" : "") + "; got " +
                               nb::cast<std::string>(nb::str(h.type())));
  std::string s = nb::cast<std::string>(h);
  if (s.find('\0') != std::string::npos)
    raise(PyExc_ValueError, std::string(fn) + ": " + arg + " must not contain NUL characters");
  return s;
}

// ---- exchange API cache (per type) ---------------------------------------------
// Read and written with the GIL held only. The type and the attribute object
// that holds the table are both kept alive for the life of the process, so the
// cached table pointer can never dangle (a type's attribute may be a property
// that returns a fresh capsule owning its table).
struct ExchangeEntry {
  const ExchangeAPI* api;
  PyObject* owner;  // the __dlpack_c_exchange_api__ object (a strong reference), or nullptr
};
std::unordered_map<PyTypeObject*, ExchangeEntry> g_exchange;

const ExchangeAPI* exchange_api(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  if (auto it = g_exchange.find(type); it != g_exchange.end()) return it->second.api;
  // The lookup below can run Python code (a metaclass, a property, the garbage
  // collector) and so let other threads run and fill the cache for this type
  // first: look again before inserting, and keep the first entry.
  const ExchangeAPI* api = nullptr;
  PyObject* attr = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (attr == nullptr) {
    PyErr_Clear();
  } else {
    const void* p = nullptr;
    if (PyCapsule_CheckExact(attr))
      p = PyCapsule_GetPointer(attr, "dlpack_exchange_api");
    else if (PyLong_Check(attr) && !PyBool_Check(attr))
      p = PyLong_AsVoidPtr(attr);
    if (p == nullptr) PyErr_Clear();
    // The protocol's integer is an address the producer vouches for; one that cannot be a
    // table's (in the first 64 KB, where nothing is mapped, or not aligned for it) is ignored, so
    // a stray class attribute falls back to __dlpack__ instead of being read through.
    const uintptr_t pv = reinterpret_cast<uintptr_t>(p);
    if (pv < 65536 || pv % alignof(ExchangeHeader) != 0) p = nullptr;
    // Walk to a major-1 table (a newer major keeps older ones on prev_api).
    for (auto* h = static_cast<const ExchangeHeader*>(p); h != nullptr; h = h->prev_api) {
      if (h->version.major == 1) {
        auto* a = reinterpret_cast<const ExchangeAPI*>(h);
        if (a->current_work_stream && (a->dltensor_from_py_object_no_sync || a->managed_tensor_from_py_object_no_sync))
          api = a;
        break;
      }
    }
    if (api == nullptr) Py_CLEAR(attr);
  }
  auto [it, inserted] = g_exchange.try_emplace(type, ExchangeEntry{api, attr});
  if (inserted) {
    Py_INCREF(type);
  } else {
    Py_XDECREF(attr);  // another thread cached this type while the lookup ran
  }
  return it->second.api;
}

// ---- one call's imported tensors -----------------------------------------------
constexpr int kMaxTensors = 11;

struct OpSpec {
  const char* op;
  int count;
  std::array<const char*, kMaxTensors> names;
  uint32_t writable;  // bit i: tensor i is written (outputs, in-place arguments)
  uint32_t optional;  // bit i: tensor i may be None (passed to C as NULL)
};

PyObject* g_str_dlpack = nullptr;       // "__dlpack__"
PyObject* g_kw_stream_max = nullptr;    // ("stream", "max_version")
PyObject* g_kw_stream = nullptr;        // ("stream",)
PyObject* g_max_version = nullptr;      // (1, 0)

struct Slot {
  DLTensor t{};
  PyObject* capsule = nullptr;              // __dlpack__ export, alive until the call returns
  DLManagedTensorV1* managed = nullptr;     // exchange-API managed export, deleted at the end
  const ExchangeAPI* api = nullptr;
  bool present = false;
  Slot() = default;
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;
  ~Slot() {  // also runs when Call's constructor throws part-way
    if (managed && managed->deleter) managed->deleter(managed);
    Py_XDECREF(capsule);
  }
};

class Call {
 public:
  // stream_hint: 0 = none (host arrays: __dlpack__(stream=None), launch on NULL);
  // otherwise a CUDA stream handle (1 = legacy default, 2 = per-thread default).
  Call(const OpSpec& spec, nb::handle tensors, uintptr_t stream_hint, uint32_t bf16_mask) : spec_(spec) {
    nb::object hint = stream_hint ? nb::steal(PyLong_FromSize_t(stream_hint)) : nb::none();
    if (!hint.is_valid()) throw nb::python_error();
    if (!PyTuple_Check(tensors.ptr()) || PyTuple_GET_SIZE(tensors.ptr()) != spec.count)
      raise(PyExc_TypeError, std::string(spec.op) + ": internal: expected a tuple of " +
                                 std::to_string(spec.count) + " tensors");
    // Inputs first, then what is written: an input that cannot be imported is
    // named as itself, not as the output allocated from it.
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < spec.count; ++i) {
        if (((spec.writable >> i) & 1u) != unsigned(pass)) continue;
        PyObject* obj = PyTuple_GET_ITEM(tensors.ptr(), i);
        if (obj == Py_None) {
          if (spec.optional & (1u << i)) continue;
          raise(PyExc_TypeError, std::string(spec.op) + ": " + spec.names[i] + " must be a tensor, not None");
        }
        import(i, obj, hint.ptr(), (bf16_mask >> i) & 1u);
      }
    }
    // by the tensors themselves, not by what a producer's __dlpack_device__ said (a hint from one
    // that named a device for host memory: no stream for host tensors)
    for (int i = 0; i < spec.count && !on_device_; ++i) {
      const DLDeviceType dt = slots_[i].t.device.device_type;
      on_device_ = slots_[i].present && dt != kDLCPU && dt != kDLCUDAHost;
    }
    stream_ = on_device_ ? pick_stream(stream_hint) : nullptr;
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  DLTensor* operator[](int i) { return slots_[i].present ? &slots_[i].t : nullptr; }
  ks_stream_t stream() const { return stream_; }
  // The tensors the op writes (bit i: tensor i), of those given.
  uint32_t written() const {
    uint32_t w = 0;
    for (int i = 0; i < spec_.count; ++i)
      if (slots_[i].present && ((spec_.writable >> i) & 1u)) w |= 1u << i;
    return w;
  }
  // Whether any imported tensor is in device memory (not host or pinned host memory).
  bool on_device() const { return on_device_; }
  const char* op() const { return spec_.op; }

 private:
  std::string where(int i) const { return std::string(spec_.op) + ": " + spec_.names[i]; }

  void import(int i, PyObject* obj, PyObject* hint, bool as_bf16) {
    Slot& s = slots_[i];
    const bool writable = (spec_.writable >> i) & 1u;
    uint64_t flags = 0;
    if (const ExchangeAPI* api = exchange_api(obj)) {
      s.api = api;
      // A tensor the op writes goes through the managed export when the table has one: only it
      // carries the flags (read-only, copied); the bare DLTensor fill has none, so a read-only
      // tensor would be written (the adversarial tests' producer over a PROT_READ mapping).
      if (api->dltensor_from_py_object_no_sync && !(writable && api->managed_tensor_from_py_object_no_sync)) {
        if (api->dltensor_from_py_object_no_sync(obj, &s.t) != 0)
          raise(PyExc_TypeError, where(i) + " cannot be exported through DLPack: " + take_python_error());
      } else {
        if (api->managed_tensor_from_py_object_no_sync(obj, &s.managed) != 0 || s.managed == nullptr)
          raise(PyExc_TypeError, where(i) + " cannot be exported through DLPack: " + take_python_error());
        s.t = s.managed->dl_tensor;
        flags = s.managed->flags;
      }
    } else {
      s.capsule = export_capsule(i, obj, hint);
      if (PyCapsule_IsValid(s.capsule, "dltensor_versioned")) {
        auto* m = static_cast<DLManagedTensorV1*>(PyCapsule_GetPointer(s.capsule, "dltensor_versioned"));
        if (m->version.major != 1)
          raise(PyExc_TypeError, where(i) + ": unsupported DLPack major version " + std::to_string(m->version.major));
        s.t = m->dl_tensor;
        flags = m->flags;
      } else if (PyCapsule_IsValid(s.capsule, "dltensor")) {
        s.t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(s.capsule, "dltensor"))->dl_tensor;
      } else {
        raise(PyExc_TypeError, where(i) + ": __dlpack__ did not return a DLPack capsule");
      }
    }
    if (writable && (flags & kFlagReadOnly))
      raise(g_error_class[KS_ERROR_INVALID_ARGUMENT], where(i) + " is read-only; it is written by this op");
    if (writable && (flags & kFlagIsCopied))
      raise(g_error_class[KS_ERROR_INVALID_ARGUMENT], where(i) + " was exported as a copy; it is written by this op and must be shared");
    if (as_bf16) {
      const DLDataType u16{kDLUInt, 16, 1};
      if (s.t.dtype.code != u16.code || s.t.dtype.bits != u16.bits || s.t.dtype.lanes != u16.lanes)
        raise(PyExc_TypeError, where(i) + ": internal: bf16 view is not uint16");
      s.t.dtype = DLDataType{kDLBfloat, 16, 1};
    }
    s.present = true;
  }

  PyObject* export_capsule(int i, PyObject* obj, PyObject* hint) {
    PyObject* args[3] = {obj, hint, g_max_version};
    PyObject* cap = PyObject_VectorcallMethod(g_str_dlpack, args, 1, g_kw_stream_max);
    if (cap == nullptr && PyErr_ExceptionMatches(PyExc_TypeError)) {
      // A producer older than DLPack 1.0 rejects max_version: ask again without it.
      PyErr_Clear();
      cap = PyObject_VectorcallMethod(g_str_dlpack, args, 1, g_kw_stream);
    }
    if (cap == nullptr) {
      if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        raise(PyExc_TypeError, where(i) + " must be an array or tensor supporting DLPack (__dlpack__); got " +
                                   Py_TYPE(obj)->tp_name);
      }
      if (PyErr_ExceptionMatches(PyExc_BufferError))
        raise(PyExc_TypeError, where(i) + " cannot be exported through DLPack: " + take_python_error());
      // the producer's other errors (e.g. numpy's "only supports stream=None" for a host array
      // beside a device one): the same class for the standard ones, with the op and argument first
      // (anything else, KeyboardInterrupt or MemoryError among them, propagates as raised)
      for (PyObject* c : {PyExc_ValueError, PyExc_TypeError, PyExc_RuntimeError})
        if (PyErr_ExceptionMatches(c)) raise(c, where(i) + ": its __dlpack__ failed: " + take_python_error());
      throw nb::python_error();
    }
    return cap;
  }

  // The launch stream: the producer's current work stream (exchange API) for the
  // first device tensor, else the hint (0: NULL, the host or the default stream).
  ks_stream_t pick_stream(uintptr_t hint) {
    for (int i = 0; i < spec_.count; ++i) {
      const Slot& s = slots_[i];
      if (!s.present || !s.api) continue;
      const DLDeviceType dt = s.t.device.device_type;
      if (dt == kDLCPU || dt == kDLCUDAHost) continue;
      void* stream = nullptr;
      if (s.api->current_work_stream(dt, s.t.device.device_id, &stream) != 0)
        raise(PyExc_RuntimeError, where(i) + ": cannot query the producer's current stream: " + take_python_error());
      return stream;
    }
    return reinterpret_cast<ks_stream_t>(hint);
  }

  const OpSpec& spec_;
  std::array<Slot, kMaxTensors> slots_;
  ks_stream_t stream_ = nullptr;
  bool on_device_ = false;
};

// ---- CUDA stream sync for producers that keep no stream order with us ----------
// (jax: its buffers are ordered on its own streams; the op runs on the legacy
// stream, so the call waits for it.) Uses the driver API through dlopen, so the
// extension needs no CUDA toolkit at build time. The entry points are resolved
// once (a function-local static: initialised exactly once even if threads race).
struct CudaDriver {
  using SyncFn = int (*)(void*);
  using ErrFn = int (*)(int, const char**);
  SyncFn sync = nullptr;
  ErrFn err_name = nullptr;
  const char* error = nullptr;  // why sync is missing
  CudaDriver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      error = "cannot load libcuda.so.1 to synchronize the stream";
      return;
    }
    sync = reinterpret_cast<SyncFn>(dlsym(lib, "cuStreamSynchronize"));
    err_name = reinterpret_cast<ErrFn>(dlsym(lib, "cuGetErrorString"));
    if (sync == nullptr) error = "libcuda.so.1 has no cuStreamSynchronize";
  }
};

void cuda_stream_synchronize(ks_stream_t stream) {
  static const CudaDriver driver;
  if (driver.sync == nullptr) raise(g_error_class[KS_ERROR_CUDA], driver.error);
  int rc;
  {
    nb::gil_scoped_release nogil;
    rc = driver.sync(stream);
  }
  if (rc != 0) {
    const char* s = nullptr;
    if (driver.err_name) driver.err_name(rc, &s);
    raise(g_error_class[KS_ERROR_CUDA], std::string("cuStreamSynchronize failed: ") + (s ? s : std::to_string(rc)));
  }
}

// Runs one C call with the GIL released. body() must only call the C ABI: no
// Python object, no Python error, no nanobind call (anything that can raise is
// done before, with the GIL held, e.g. to_backend()). The failing call's
// message is read on this thread before the GIL is taken back, and the Python
// exception is built after. The stream is waited for only where a tensor is in
// device memory (sync_after comes from the first argument's __dlpack_device__,
// which a broken producer can get wrong: the op's outputs are written by then).
// Returns the tensors written (Call::written), for the caller's bookkeeping
// (torch's version counters).
template <class F>
uint32_t run(Call& c, bool sync_after, F&& body) {
  ks_status_t st;
  std::string err;
  {
    nb::gil_scoped_release nogil;
    st = body();
    if (st != KS_SUCCESS) err = ks_last_error();
  }
  if (st != KS_SUCCESS) raise_status(st, std::move(err));
  if (sync_after && c.on_device()) cuda_stream_synchronize(c.stream());
  return c.written();
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "kernscope C ABI bindings (internal; use the kernscope package)";
  g_str_dlpack = PyUnicode_InternFromString("__dlpack__");
  g_kw_stream_max = Py_BuildValue("(ss)", "stream", "max_version");
  g_kw_stream = Py_BuildValue("(s)", "stream");
  g_max_version = Py_BuildValue("(ii)", 1, 0);
  for (auto& c : g_error_class) c = PyExc_RuntimeError;

  m.def("_set_error_classes", [](nb::tuple classes) {
    if (classes.size() != g_error_class.size()) raise(PyExc_ValueError, "need one class per ks_status_t");
    for (size_t i = 0; i < g_error_class.size(); ++i) {
      PyObject* c = classes[i].ptr();
      Py_INCREF(c);
      g_error_class[i] = c;  // kept for the life of the process
    }
  });

  // ---- library --------------------------------------------------------------
  m.def("version", [] { return std::string(ks_version()); });
  m.def("last_error", [] { return std::string(ks_last_error()); });
  m.def("status_name", [](int s) { return std::string(ks_status_name(static_cast<ks_status_t>(s))); });
  m.def("backend_available", [](int b) { return ks_backend_available(to_backend(b)) != 0; });
  m.def("set_deterministic", [](bool on) { ks_set_deterministic(on ? 1 : 0); });
  m.def("deterministic", [] { return ks_deterministic() != 0; });
  m.def("qtype_info", [](int q) {
    int64_t bs = 0, bb = 0;
    const ks_status_t st = ks_qtype_info(static_cast<ks_qtype_t>(q), &bs, &bb);
    if (st != KS_SUCCESS) raise_status(st);
    return nb::make_tuple(bs, bb);
  });
  m.def("variants", [] {
    nb::list out;
    const size_t n = ks_variant_count();
    for (size_t i = 0; i < n; ++i) {
      ks_variant_info_t v{};
      const ks_status_t st = ks_variant_info(i, &v);
      if (st != KS_SUCCESS) raise_status(st);
      out.append(nb::make_tuple(v.op, v.backend, v.name, v.dtypes, v.summary));
    }
    return out;
  });
  m.def("which", [](nb::handle op_h, nb::handle dtype_h, int backend) {
    const std::string op = c_name(op_h, "which", "op"), dtype = c_name(dtype_h, "which", "dtype");
    const char* variant = nullptr;
    const char* reason = nullptr;
    const ks_status_t st = ks_which(op.c_str(), dtype.c_str(), to_backend(backend), &variant, &reason);
    if (st != KS_SUCCESS) raise_status(st);
    return nb::make_tuple(std::string(variant ? variant : ""), std::string(reason ? reason : ""));
  });
  m.def("which_shape", [](nb::handle op_h, nb::handle dtype_h, int backend, int64_t rows, int64_t cols) {
    const std::string op = c_name(op_h, "which", "op"), dtype = c_name(dtype_h, "which", "dtype");
    const char* variant = nullptr;
    const char* reason = nullptr;
    const ks_status_t st =
        ks_which_shape(op.c_str(), dtype.c_str(), to_backend(backend), rows, cols, &variant, &reason);
    if (st != KS_SUCCESS) raise_status(st);
    return nb::make_tuple(std::string(variant ? variant : ""), std::string(reason ? reason : ""));
  });
  m.def("routing_table", [] {
    const char* json = nullptr;
    const ks_status_t st = ks_routing_table(&json);
    if (st != KS_SUCCESS) raise_status(st);
    return std::string(json);
  });
  m.def("force_variant", [](nb::handle op, nb::handle variant) {
    std::string o, v;
    const char* op_c = nullptr;
    const char* var_c = nullptr;
    if (!op.is_none()) op_c = (o = c_name(op, "force_variant", "op", true)).c_str();
    if (!variant.is_none()) var_c = (v = c_name(variant, "force_variant", "variant", true)).c_str();
    const ks_status_t st = ks_force_variant(op_c, var_c);
    if (st != KS_SUCCESS) raise_status(st);
  }, nb::arg("op").none(), nb::arg("variant").none());
  m.def("forced_variant", [](nb::handle op_h) -> nb::object {
    const std::string op = c_name(op_h, "forced_variant", "op");
    const char* v = nullptr;
    const ks_status_t st = ks_forced_variant(op.c_str(), &v);
    if (st != KS_SUCCESS) raise_status(st);
    return v ? nb::object(nb::str(v)) : nb::none();
  });
  m.def("op_cols_factors", [](nb::handle op_h) -> nb::object {
    const std::string op = c_name(op_h, "which", "op");
    const char* f = ks_op_cols_factors(op.c_str());
    return f ? nb::object(nb::str(f)) : nb::none();
  });
  m.def("last_launch_config", [](nb::handle op_h) {
    const std::string op = c_name(op_h, "last_launch_config", "op");
    const char* s = ks_last_launch_config(op.c_str());
    return std::string(s ? s : "");
  });
  m.def("cuda_stream_synchronize", [](uintptr_t stream) { cuda_stream_synchronize(reinterpret_cast<void*>(stream)); });

  // ---- operators (tensors in C ABI order; see include/kernscope/kernscope.h) ---
  // Common trailing arguments: backend code, stream hint (0: none), bf16 mask,
  // sync_after (wait for the stream after the call).
#define KS_ARGS int backend, uintptr_t hint, uint32_t bf16, bool sync
  m.def("rms_norm", [](nb::tuple t, double eps, KS_ARGS) {
    static const OpSpec spec{"rms_norm", 3, {"out", "x", "weight"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_rms_norm(c[0], c[1], c[2], eps, be, c.stream()); });
  });
  m.def("fused_add_rms_norm", [](nb::tuple t, double eps, KS_ARGS) {
    static const OpSpec spec{"fused_add_rms_norm", 3, {"x", "residual", "weight"}, 0b11, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_fused_add_rms_norm(c[0], c[1], c[2], eps, be, c.stream()); });
  });
  m.def("silu_and_mul", [](nb::tuple t, KS_ARGS) {
    static const OpSpec spec{"silu_and_mul", 2, {"out", "x"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_silu_and_mul(c[0], c[1], be, c.stream()); });
  });
  m.def("gemv", [](nb::tuple t, KS_ARGS) {
    static const OpSpec spec{"gemv", 3, {"out", "x", "weight"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_gemv(c[0], c[1], c[2], be, c.stream()); });
  });
  m.def("softmax", [](nb::tuple t, KS_ARGS) {
    static const OpSpec spec{"softmax", 2, {"out", "x"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_softmax(c[0], c[1], be, c.stream()); });
  });
  m.def("argmax", [](nb::tuple t, KS_ARGS) {
    static const OpSpec spec{"argmax", 2, {"out", "x"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_argmax(c[0], c[1], be, c.stream()); });
  });
  m.def("sample", [](nb::tuple t, double temperature, int64_t top_k, double top_p, KS_ARGS) {
    static const OpSpec spec{"sample", 4, {"out", "valid", "logits", "seed_offset"}, 0b11, 0b10};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_sample(c[0], c[1], c[2], c[3], temperature, top_k, top_p, be, c.stream()); });
  });
  m.def("embedding", [](nb::tuple t, int table_format, KS_ARGS) {
    static const OpSpec spec{"embedding", 3, {"out", "ids", "table"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_embedding(c[0], c[1], c[2], static_cast<ks_qtype_t>(table_format), be, c.stream());
    });
  });
  m.def("dequantize", [](nb::tuple t, int qtype, KS_ARGS) {
    static const OpSpec spec{"dequantize", 2, {"out", "packed"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_dequantize(c[0], c[1], static_cast<ks_qtype_t>(qtype), be, c.stream());
    });
  });
  m.def("gemm", [](nb::tuple t, KS_ARGS) {
    static const OpSpec spec{"gemm", 3, {"out", "a", "b"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_gemm(c[0], c[1], c[2], be, c.stream()); });
  });
  m.def("quant_matmul", [](nb::tuple t, int qtype, KS_ARGS) {
    static const OpSpec spec{"quant_matmul", 3, {"out", "x", "weight"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_quant_matmul(c[0], c[1], c[2], static_cast<ks_qtype_t>(qtype), be, c.stream());
    });
  });
  // x quantized to int8 per block of 32 (W4A8 / W8A8); qtype Q4_0, Q4_1 or Q8_0.
  m.def("quant_matmul_a8", [](nb::tuple t, int qtype, KS_ARGS) {
    static const OpSpec spec{"quant_matmul_a8", 3, {"out", "x", "weight"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_quant_matmul_a8(c[0], c[1], c[2], static_cast<ks_qtype_t>(qtype), be, c.stream());
    });
  });
  // x and residual_out may be None (NULL): then the plain rms_norm of residual feeds the matmul.
  m.def("fused_add_rms_norm_quant_matmul", [](nb::tuple t, double eps, int qtype, KS_ARGS) {
    static const OpSpec spec{"fused_add_rms_norm_quant_matmul", 6,
                             {"out", "residual_out", "x", "residual", "norm_weight", "weight"}, 0b11, 0b110};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_fused_add_rms_norm_quant_matmul(c[0], c[1], c[2], c[3], c[4], eps, c[5],
                                                static_cast<ks_qtype_t>(qtype), be, c.stream());
    });
  });
  m.def("silu_and_mul_quant_matmul", [](nb::tuple t, int qtype, KS_ARGS) {
    static const OpSpec spec{"silu_and_mul_quant_matmul", 3, {"out", "gate_up", "weight"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_silu_and_mul_quant_matmul(c[0], c[1], c[2], static_cast<ks_qtype_t>(qtype), be, c.stream());
    });
  });
  m.def("rotary_embedding", [](nb::tuple t, int64_t rotary_dim, double theta, bool is_neox, KS_ARGS) {
    static const OpSpec spec{"rotary_embedding", 3, {"q", "k", "positions"}, 0b11, 0b10};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_rotary_embedding(c[0], c[1], c[2], rotary_dim, theta, is_neox ? 1 : 0, be,
                                 c.stream());
    });
  });
  m.def("kv_cache_append", [](nb::tuple t, KS_ARGS) {
    static const OpSpec spec{"kv_cache_append", 5, {"k_cache", "v_cache", "k", "v", "slot_mapping"}, 0b11, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_kv_cache_append(c[0], c[1], c[2], c[3], c[4], be, c.stream()); });
  });
  // k is required by the C ABI; None reaches it as NULL so that its own message names k.
  m.def("rotary_embedding_kv_append", [](nb::tuple t, int64_t rotary_dim, double theta, bool is_neox, KS_ARGS) {
    static const OpSpec spec{"rotary_embedding_kv_append", 7,
                             {"q", "k", "v", "positions", "k_cache", "v_cache", "slot_mapping"}, 0b110011, 0b10};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_rotary_embedding_kv_append(c[0], c[1], c[2], c[3], rotary_dim, theta, is_neox ? 1 : 0, c[4], c[5],
                                           c[6], be, c.stream());
    });
  });
  // One token: fused_add_rms_norm_quant_matmul's tensors (x and residual_out None together),
  // then rotary_embedding_kv_append's on out's q / k / v column slices.
  m.def("fused_add_rms_norm_quant_matmul_rope_kv_append",
        [](nb::tuple t, double eps, int qtype, int64_t num_heads, int64_t num_kv_heads, int64_t rotary_dim,
           double theta, bool is_neox, KS_ARGS) {
    static const OpSpec spec{"fused_add_rms_norm_quant_matmul_rope_kv_append", 10,
                             {"out", "residual_out", "x", "residual", "norm_weight", "weight", "positions", "k_cache",
                              "v_cache", "slot_mapping"},
                             0b110000011, 0b110};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
          c[0], c[1], c[2], c[3], c[4], eps, c[5], static_cast<ks_qtype_t>(qtype), num_heads, num_kv_heads, c[6],
          rotary_dim, theta, is_neox ? 1 : 0, c[7], c[8], c[9], be, c.stream());
    });
  });
  m.def("varlen_attention", [](nb::tuple t, double scale, bool causal, KS_ARGS) {
    static const OpSpec spec{"varlen_attention", 6, {"out", "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"}, 0b1, 0};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] { return ks_varlen_attention(c[0], c[1], c[2], c[3], c[4], c[5], scale, causal ? 1 : 0, be, c.stream()); });
  });
  // fresh_keys = 0: ks_paged_attention; otherwise ks_paged_attention_after_append (its own check
  // rejects fresh_keys < 0), and every error of the call names that op.
  m.def("paged_attention", [](nb::tuple t, double scale, int64_t fresh_keys, KS_ARGS) {
    static const OpSpec spec{"paged_attention", 7,
                             {"out", "q", "k_cache", "v_cache", "block_tables", "seq_ids", "context_lens"},
                             0b1, 0b100000};
    static const OpSpec spec_after{"paged_attention_after_append", 7,
                                   {"out", "q", "k_cache", "v_cache", "block_tables", "seq_ids", "context_lens"},
                                   0b1, 0b100000};
    const ks_backend_t be = to_backend(backend);
    Call c(fresh_keys == 0 ? spec : spec_after, t, hint, bf16);
    return run(c, sync, [&] {
      if (fresh_keys == 0) return ks_paged_attention(c[0], c[1], c[2], c[3], c[4], c[5], c[6], scale, be, c.stream());
      return ks_paged_attention_after_append(c[0], c[1], c[2], c[3], c[4], c[5], c[6], scale, fresh_keys, be,
                                             c.stream());
    });
  });
  // rotary_embedding_kv_append's tensors (k required by the C ABI: None reaches it as NULL so that
  // its own message names k), then paged_attention's (seq_ids may be None) and out.
  m.def("rotary_embedding_kv_append_paged_attention",
        [](nb::tuple t, int64_t rotary_dim, double theta, bool is_neox, double scale, KS_ARGS) {
    static const OpSpec spec{"rotary_embedding_kv_append_paged_attention", 11,
                             {"out", "q", "k", "v", "positions", "k_cache", "v_cache", "slot_mapping", "block_tables",
                              "seq_ids", "context_lens"},
                             0b1100111, 0b1000000100};
    const ks_backend_t be = to_backend(backend);
    Call c(spec, t, hint, bf16);
    return run(c, sync, [&] {
      return ks_rotary_embedding_kv_append_paged_attention(c[0], c[1], c[2], c[3], c[4], rotary_dim, theta,
                                                           is_neox ? 1 : 0, c[5], c[6], c[7], c[8], c[9], c[10], scale,
                                                           be, c.stream());
    });
  });
#undef KS_ARGS
}
