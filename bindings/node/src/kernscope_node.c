/* Node-API addon over the kernscope C ABI. index.js wraps it: it builds the tensor objects
 * read here (data, code, bits, lanes, shape, strides, deviceType, deviceId, byteOffset) and
 * hands over the KernscopeError class. Every host tensor is checked to fit its typed array
 * before the library sees it; failing library calls throw KernscopeError(message, status). */
#define NAPI_VERSION 8
#include <node_api.h>

#include <kernscope/kernscope.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KSN_MAX_DIMS 8

/* The KernscopeError class, per environment (main thread and each worker). */
static napi_ref error_class(napi_env env) {
  void* data = NULL;
  if (napi_get_instance_data(env, &data) != napi_ok) return NULL;
  return (napi_ref)data;
}

static void delete_error_class(napi_env env, void* data, void* hint) {
  (void)hint;
  if (data != NULL) napi_delete_reference(env, (napi_ref)data);
}

/* ---- errors -------------------------------------------------------------- */

/* Throws KernscopeError(message, status) (a plain Error if the class was not set). */
static void throw_ks(napi_env env, int status, const char* message) {
  napi_value msg, code, err = NULL, ctor = NULL;
  napi_create_string_utf8(env, message, NAPI_AUTO_LENGTH, &msg);
  napi_create_int32(env, status, &code);
  napi_ref cls = error_class(env);
  if (cls != NULL && napi_get_reference_value(env, cls, &ctor) == napi_ok && ctor != NULL) {
    napi_value argv[2] = {msg, code};
    if (napi_new_instance(env, ctor, 2, argv, &err) != napi_ok) err = NULL;
  }
  if (err == NULL) {
    napi_create_error(env, NULL, msg, &err);
    napi_set_named_property(env, err, "status", code);
  }
  napi_throw(env, err);
}

static void throw_ksf(napi_env env, int status, const char* fmt, const char* a, const char* b, long long n1,
                      long long n2) {
  char buf[512];
  snprintf(buf, sizeof buf, fmt, a, b, n1, n2);
  throw_ks(env, status, buf);
}

/* Raises the pending JS exception for a failed Node-API call, or a TypeError. */
#define NAPI_OK(call)                                                                  \
  do {                                                                                 \
    if ((call) != napi_ok) {                                                           \
      bool pending_ = false;                                                           \
      napi_is_exception_pending(env, &pending_);                                       \
      if (!pending_) napi_throw_type_error(env, NULL, "kernscope: Node-API call failed: " #call); \
      return NULL;                                                                     \
    }                                                                                  \
  } while (0)

/* Turns a library status into undefined or a thrown KernscopeError. */
static napi_value finish(napi_env env, ks_status_t st) {
  if (st != KS_SUCCESS) {
    throw_ks(env, (int)st, ks_last_error());
    return NULL;
  }
  napi_value u;
  napi_get_undefined(env, &u);
  return u;
}

/* ---- argument helpers ------------------------------------------------------ */

typedef struct {
  DLTensor t;
  int64_t shape[KSN_MAX_DIMS];
  int64_t strides[KSN_MAX_DIMS];
} tensor_arg;

static int is_nullish(napi_env env, napi_value v) {
  napi_valuetype t;
  if (napi_typeof(env, v, &t) != napi_ok) return 0;
  return t == napi_undefined || t == napi_null;
}

/* An integral JS number or BigInt as int64; 0 on failure with a TypeError thrown. */
static int get_i64(napi_env env, napi_value v, int64_t* out, const char* what) {
  napi_valuetype t;
  napi_typeof(env, v, &t);
  if (t == napi_bigint) {
    bool lossless = false;
    if (napi_get_value_bigint_int64(env, v, out, &lossless) == napi_ok && lossless) return 1;
  } else if (t == napi_number) {
    double d;
    napi_get_value_double(env, v, &d);
    if (d == d && d >= -9007199254740991.0 && d <= 9007199254740991.0 && d == (double)(int64_t)d) {
      *out = (int64_t)d;
      return 1;
    }
  }
  char buf[160];
  snprintf(buf, sizeof buf, "kernscope: %s must be an integer (number or BigInt)", what);
  napi_throw_type_error(env, NULL, buf);
  return 0;
}

static int get_prop_i64(napi_env env, napi_value obj, const char* name, int64_t* out, const char* op, const char* arg) {
  napi_value v;
  if (napi_get_named_property(env, obj, name, &v) != napi_ok) return 0;
  char what[128];
  snprintf(what, sizeof what, "%s: %s.%s", op, arg, name);
  return get_i64(env, v, out, what);
}

static int get_dims(napi_env env, napi_value obj, const char* name, int64_t* dims, uint32_t* n, const char* op,
                    const char* arg) {
  napi_value arr;
  bool is_array = false;
  if (napi_get_named_property(env, obj, name, &arr) != napi_ok) return 0;
  if (napi_is_array(env, arr, &is_array) != napi_ok || !is_array) {
    char buf[160];
    snprintf(buf, sizeof buf, "kernscope: %s: %s.%s must be an array", op, arg, name);
    napi_throw_type_error(env, NULL, buf);
    return 0;
  }
  napi_get_array_length(env, arr, n);
  if (*n > KSN_MAX_DIMS) {
    throw_ksf(env, KS_ERROR_INVALID_ARGUMENT, "%s: %s has %lld dimensions, the Node binding takes up to %lld", op, arg,
              (long long)*n, KSN_MAX_DIMS);
    return 0;
  }
  for (uint32_t i = 0; i < *n; ++i) {
    napi_value e;
    char what[128];
    snprintf(what, sizeof what, "%s: %s.%s[%u]", op, arg, name, i);
    if (napi_get_element(env, arr, i, &e) != napi_ok || !get_i64(env, e, &dims[i], what)) return 0;
  }
  return 1;
}

/* Bytes from the base pointer to one past the last reachable element; -1 when a dimension or
 * stride is negative or the span overflows. */
static int64_t span_bytes(const tensor_arg* a) {
  const DLTensor* t = &a->t;
  const int64_t limit = INT64_C(1) << 62;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] < 0 || (t->strides && t->strides[i] < 0)) return -1;
    if (t->shape[i] == 0) return (int64_t)t->byte_offset;
  }
  int64_t elems = 1;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->strides) {
      if (t->shape[i] > 1 && t->strides[i] > limit / (t->shape[i] - 1)) return -1;
      elems += (t->shape[i] - 1) * t->strides[i];
    } else {
      if (t->shape[i] > limit / elems) return -1;
      elems *= t->shape[i];
    }
    if (elems > limit) return -1;
  }
  const int64_t size = ((int64_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
  if (size > 0 && elems > limit / size) return -1;
  if (t->byte_offset > (uint64_t)limit) return -1;
  return elems * size + (int64_t)t->byte_offset;
}

/* Reads the tensor object v into *a. Returns 0 with an exception pending on failure. */
static int get_tensor(napi_env env, napi_value v, tensor_arg* a, const char* op, const char* arg) {
  napi_valuetype vt;
  napi_typeof(env, v, &vt);
  if (vt != napi_object) {
    char buf[160];
    snprintf(buf, sizeof buf, "kernscope: %s: %s must be a tensor", op, arg);
    napi_throw_type_error(env, NULL, buf);
    return 0;
  }
  memset(a, 0, sizeof *a);
  int64_t code, bits, lanes, dev_type, dev_id, byte_offset;
  if (!get_prop_i64(env, v, "code", &code, op, arg) || !get_prop_i64(env, v, "bits", &bits, op, arg) ||
      !get_prop_i64(env, v, "lanes", &lanes, op, arg) || !get_prop_i64(env, v, "deviceType", &dev_type, op, arg) ||
      !get_prop_i64(env, v, "deviceId", &dev_id, op, arg) ||
      !get_prop_i64(env, v, "byteOffset", &byte_offset, op, arg))
    return 0;
  if (code < 0 || code > 255 || bits < 0 || bits > 255 || lanes < 0 || lanes > 65535 || byte_offset < 0) {
    throw_ksf(env, KS_ERROR_INVALID_ARGUMENT, "%s: %s: dtype (code %lld, bits %lld) or lanes/byte offset out of range", op,
              arg, (long long)code, (long long)bits);
    return 0;
  }
  a->t.dtype.code = (uint8_t)code;
  a->t.dtype.bits = (uint8_t)bits;
  a->t.dtype.lanes = (uint16_t)lanes;
  a->t.device.device_type = (DLDeviceType)dev_type;
  a->t.device.device_id = (int32_t)dev_id;
  a->t.byte_offset = (uint64_t)byte_offset;

  uint32_t ndim = 0, nstrides = 0;
  if (!get_dims(env, v, "shape", a->shape, &ndim, op, arg)) return 0;
  a->t.ndim = (int32_t)ndim;
  a->t.shape = a->shape;
  napi_value strides;
  if (napi_get_named_property(env, v, "strides", &strides) != napi_ok) return 0;
  if (!is_nullish(env, strides)) {
    if (!get_dims(env, v, "strides", a->strides, &nstrides, op, arg)) return 0;
    if (nstrides != ndim) {
      throw_ksf(env, KS_ERROR_INVALID_ARGUMENT, "%s: %s: %lld strides for %lld dimensions", op, arg, (long long)nstrides,
                (long long)ndim);
      return 0;
    }
    a->t.strides = a->strides;
  }

  napi_value data;
  napi_valuetype dt;
  if (napi_get_named_property(env, v, "data", &data) != napi_ok) return 0;
  napi_typeof(env, data, &dt);
  bool is_typed = false;
  napi_is_typedarray(env, data, &is_typed);
  if (is_typed) {
    napi_typedarray_type type;
    size_t length = 0, offset = 0;
    void* ptr = NULL;
    napi_value buffer;
    if (napi_get_typedarray_info(env, data, &type, &length, &ptr, &buffer, &offset) != napi_ok) return 0;
    size_t elem = 1;
    switch (type) {
      case napi_int16_array: case napi_uint16_array: elem = 2; break;
      case napi_int32_array: case napi_uint32_array: case napi_float32_array: elem = 4; break;
      case napi_float64_array: case napi_bigint64_array: case napi_biguint64_array: elem = 8; break;
      default: elem = 1; break;
    }
    const int64_t need = span_bytes(a);
    if (need < 0 || (uint64_t)need > (uint64_t)length * elem) {
      throw_ksf(env, KS_ERROR_INVALID_ARGUMENT, "%s: %s: shape, strides and byte offset reach %lld bytes, the typed array holds %lld",
                op, arg, (long long)need, (long long)(length * elem));
      return 0;
    }
    a->t.data = ptr;
  } else if (dt == napi_bigint) {
    uint64_t p = 0;
    bool lossless = false;
    if (napi_get_value_bigint_uint64(env, data, &p, &lossless) != napi_ok || !lossless) {
      napi_throw_range_error(env, NULL, "kernscope: a device pointer must fit in 64 bits");
      return 0;
    }
    a->t.data = (void*)(uintptr_t)p;
  } else {
    char buf[160];
    snprintf(buf, sizeof buf, "kernscope: %s: %s.data must be a typed array or a BigInt device pointer", op, arg);
    napi_throw_type_error(env, NULL, buf);
    return 0;
  }
  return 1;
}

static int get_double(napi_env env, napi_value v, double* out, const char* what) {
  napi_valuetype t;
  napi_typeof(env, v, &t);
  if (t != napi_number) {
    char buf[128];
    snprintf(buf, sizeof buf, "kernscope: %s must be a number", what);
    napi_throw_type_error(env, NULL, buf);
    return 0;
  }
  napi_get_value_double(env, v, out);
  return 1;
}

/* backend (number) and stream (BigInt, number or nullish) at argv[i], argv[i + 1]. */
static int get_exec(napi_env env, napi_value* argv, size_t i, ks_backend_t* backend, ks_stream_t* stream) {
  int64_t b = 0, s = 0;
  if (!is_nullish(env, argv[i]) && !get_i64(env, argv[i], &b, "backend")) return 0;
  if (!is_nullish(env, argv[i + 1]) && !get_i64(env, argv[i + 1], &s, "stream")) return 0;
  *backend = (ks_backend_t)b;
  *stream = (ks_stream_t)(uintptr_t)s;
  return 1;
}

static char* get_string(napi_env env, napi_value v, const char* what) {
  napi_valuetype t;
  napi_typeof(env, v, &t);
  if (t != napi_string) {
    char buf[128];
    snprintf(buf, sizeof buf, "kernscope: %s must be a string", what);
    napi_throw_type_error(env, NULL, buf);
    return NULL;
  }
  size_t n = 0;
  napi_get_value_string_utf8(env, v, NULL, 0, &n);
  char* s = (char*)malloc(n + 1);
  if (s == NULL) return NULL;
  napi_get_value_string_utf8(env, v, s, n + 1, &n);
  if (strlen(s) != n) {
    free(s);
    char buf[128];
    snprintf(buf, sizeof buf, "kernscope: %s contains a NUL character", what);
    napi_throw_type_error(env, NULL, buf);
    return NULL;
  }
  return s;
}

static napi_value str(napi_env env, const char* s) {
  napi_value v;
  napi_create_string_utf8(env, s ? s : "", NAPI_AUTO_LENGTH, &v);
  return v;
}

#define ARGS(n)                                                  \
  size_t argc = (n);                                             \
  napi_value argv[(n) > 0 ? (n) : 1];                            \
  NAPI_OK(napi_get_cb_info(env, info, &argc, argv, NULL, NULL)); \
  for (size_t i_ = argc; i_ < (n); ++i_) napi_get_undefined(env, &argv[i_])

#define TENSOR(var, idx, op, name) \
  tensor_arg var;                  \
  if (!get_tensor(env, argv[idx], &var, op, name)) return NULL

/* Optional tensor: NULL pointer when the argument is null/undefined. */
#define OPT_TENSOR(var, ptr, idx, op, name)                            \
  tensor_arg var;                                                      \
  DLTensor* ptr = NULL;                                                \
  if (!is_nullish(env, argv[idx])) {                                   \
    if (!get_tensor(env, argv[idx], &var, op, name)) return NULL;      \
    ptr = &var.t;                                                      \
  }

#define EXEC(idx)                            \
  ks_backend_t backend;                      \
  ks_stream_t stream;                        \
  if (!get_exec(env, argv, idx, &backend, &stream)) return NULL

#define DOUBLE(var, idx, what) \
  double var;                  \
  if (!get_double(env, argv[idx], &var, what)) return NULL

#define INT(var, idx, what) \
  int64_t var;              \
  if (!get_i64(env, argv[idx], &var, what)) return NULL

/* ---- library ------------------------------------------------------------- */

static napi_value js_set_error_class(napi_env env, napi_callback_info info) {
  ARGS(1);
  napi_valuetype t;
  napi_typeof(env, argv[0], &t);
  if (t != napi_function) {
    napi_throw_type_error(env, NULL, "kernscope: setErrorClass takes a class");
    return NULL;
  }
  napi_ref ref = NULL, old = error_class(env);
  NAPI_OK(napi_create_reference(env, argv[0], 1, &ref));
  NAPI_OK(napi_set_instance_data(env, ref, delete_error_class, NULL));
  if (old != NULL) napi_delete_reference(env, old);
  return NULL;
}

static napi_value js_version(napi_env env, napi_callback_info info) {
  (void)info;
  return str(env, ks_version());
}

static napi_value js_last_error(napi_env env, napi_callback_info info) {
  (void)info;
  return str(env, ks_last_error());
}

static napi_value js_status_name(napi_env env, napi_callback_info info) {
  ARGS(1);
  INT(s, 0, "status");
  return str(env, ks_status_name((ks_status_t)s));
}

static napi_value js_backend_available(napi_env env, napi_callback_info info) {
  ARGS(1);
  INT(b, 0, "backend");
  napi_value r;
  napi_get_boolean(env, ks_backend_available((ks_backend_t)b) != 0, &r);
  return r;
}

static napi_value js_set_deterministic(napi_env env, napi_callback_info info) {
  ARGS(1);
  bool on = false;
  if (napi_get_value_bool(env, argv[0], &on) != napi_ok) {
    napi_throw_type_error(env, NULL, "kernscope: setDeterministic: enabled must be a boolean");
    return NULL;
  }
  return finish(env, ks_set_deterministic(on ? 1 : 0));
}

static napi_value js_deterministic(napi_env env, napi_callback_info info) {
  (void)info;
  napi_value r;
  napi_get_boolean(env, ks_deterministic() != 0, &r);
  return r;
}

static napi_value js_qtype_info(napi_env env, napi_callback_info info) {
  ARGS(1);
  INT(q, 0, "qtype");
  int64_t bs = 0, bb = 0;
  if (!finish(env, ks_qtype_info((ks_qtype_t)q, &bs, &bb))) return NULL;
  napi_value r, a, b;
  napi_create_array_with_length(env, 2, &r);
  napi_create_int64(env, bs, &a);
  napi_create_int64(env, bb, &b);
  napi_set_element(env, r, 0, a);
  napi_set_element(env, r, 1, b);
  return r;
}

static napi_value js_variants(napi_env env, napi_callback_info info) {
  (void)info;
  const size_t n = ks_variant_count();
  napi_value arr;
  NAPI_OK(napi_create_array_with_length(env, n, &arr));
  for (size_t i = 0; i < n; ++i) {
    ks_variant_info_t vi;
    if (!finish(env, ks_variant_info(i, &vi))) return NULL;
    napi_value o;
    napi_create_object(env, &o);
    napi_set_named_property(env, o, "op", str(env, vi.op));
    napi_set_named_property(env, o, "backend", str(env, vi.backend));
    napi_set_named_property(env, o, "name", str(env, vi.name));
    napi_set_named_property(env, o, "dtypes", str(env, vi.dtypes));
    napi_set_named_property(env, o, "summary", str(env, vi.summary));
    napi_set_element(env, arr, (uint32_t)i, o);
  }
  return arr;
}

/* which / whichShape: op and dtype from argv[0..1]; shape NULL or {rows, cols} */
static napi_value which_common(napi_env env, napi_value* argv, ks_backend_t b, const int64_t* shape) {
  char* op = get_string(env, argv[0], "which: op");
  if (op == NULL) return NULL;
  char* dtype = get_string(env, argv[1], "which: dtype");
  if (dtype == NULL) {
    free(op);
    return NULL;
  }
  const char *variant = NULL, *reason = NULL;
  ks_status_t st = shape ? ks_which_shape(op, dtype, b, shape[0], shape[1], &variant, &reason)
                         : ks_which(op, dtype, b, &variant, &reason);
  free(op);
  free(dtype);
  if (!finish(env, st)) return NULL;
  napi_value o;
  napi_create_object(env, &o);
  napi_set_named_property(env, o, "variant", str(env, variant));
  napi_set_named_property(env, o, "reason", str(env, reason));
  return o;
}

static napi_value js_which(napi_env env, napi_callback_info info) {
  ARGS(3);
  INT(b, 2, "backend");
  return which_common(env, argv, (ks_backend_t)b, NULL);
}

static napi_value js_which_shape(napi_env env, napi_callback_info info) {
  ARGS(5);
  INT(b, 2, "backend");
  INT(rows, 3, "rows");
  INT(cols, 4, "cols");
  const int64_t shape[2] = {rows, cols};
  return which_common(env, argv, (ks_backend_t)b, shape);
}

static napi_value js_routing_table(napi_env env, napi_callback_info info) {
  (void)info;
  const char* json = NULL;
  if (!finish(env, ks_routing_table(&json))) return NULL;
  return str(env, json);
}

static napi_value js_force_variant(napi_env env, napi_callback_info info) {
  ARGS(2);
  char *op = NULL, *variant = NULL;
  if (!is_nullish(env, argv[0]) && (op = get_string(env, argv[0], "forceVariant: op")) == NULL) return NULL;
  if (!is_nullish(env, argv[1]) && (variant = get_string(env, argv[1], "forceVariant: variant")) == NULL) {
    free(op);
    return NULL;
  }
  ks_status_t st = ks_force_variant(op, variant);
  free(op);
  free(variant);
  return finish(env, st);
}

/* a static C string, or JS null for NULL */
static napi_value str_or_null(napi_env env, const char* v) {
  if (v == NULL) {
    napi_value n;
    napi_get_null(env, &n);
    return n;
  }
  return str(env, v);
}
static napi_value js_forced_variant(napi_env env, napi_callback_info info) {
  ARGS(1);
  char* op = get_string(env, argv[0], "forcedVariant: op");
  if (op == NULL) return NULL;
  const char* v = NULL;
  ks_status_t st = ks_forced_variant(op, &v);
  free(op);
  if (!finish(env, st)) return NULL;
  return str_or_null(env, v);
}

static napi_value js_op_runs_variants_of(napi_env env, napi_callback_info info) {
  ARGS(1);
  char* op = get_string(env, argv[0], "opRunsVariantsOf: op");
  if (op == NULL) return NULL;
  const char* v = ks_op_runs_variants_of(op);
  free(op);
  return str_or_null(env, v);
}
static napi_value js_op_cols_factors(napi_env env, napi_callback_info info) {
  ARGS(1);
  char* op = get_string(env, argv[0], "opColsFactors: op");
  if (op == NULL) return NULL;
  const char* v = ks_op_cols_factors(op);
  free(op);
  return str_or_null(env, v);
}

static napi_value js_last_launch_config(napi_env env, napi_callback_info info) {
  ARGS(1);
  char* op = get_string(env, argv[0], "lastLaunchConfig: op");
  if (op == NULL) return NULL;
  napi_value r = str(env, ks_last_launch_config(op));
  free(op);
  return r;
}

/* ---- ops ----------------------------------------------------------------- */

static napi_value js_rms_norm(napi_env env, napi_callback_info info) {
  ARGS(6);
  TENSOR(out, 0, "rms_norm", "out");
  TENSOR(x, 1, "rms_norm", "x");
  TENSOR(w, 2, "rms_norm", "weight");
  DOUBLE(eps, 3, "rms_norm: eps");
  EXEC(4);
  return finish(env, ks_rms_norm(&out.t, &x.t, &w.t, eps, backend, stream));
}

static napi_value js_fused_add_rms_norm(napi_env env, napi_callback_info info) {
  ARGS(6);
  TENSOR(x, 0, "fused_add_rms_norm", "x");
  TENSOR(r, 1, "fused_add_rms_norm", "residual");
  TENSOR(w, 2, "fused_add_rms_norm", "weight");
  DOUBLE(eps, 3, "fused_add_rms_norm: eps");
  EXEC(4);
  return finish(env, ks_fused_add_rms_norm(&x.t, &r.t, &w.t, eps, backend, stream));
}

static napi_value js_silu_and_mul(napi_env env, napi_callback_info info) {
  ARGS(4);
  TENSOR(out, 0, "silu_and_mul", "out");
  TENSOR(x, 1, "silu_and_mul", "x");
  EXEC(2);
  return finish(env, ks_silu_and_mul(&out.t, &x.t, backend, stream));
}

static napi_value js_gemv(napi_env env, napi_callback_info info) {
  ARGS(5);
  TENSOR(out, 0, "gemv", "out");
  TENSOR(x, 1, "gemv", "x");
  TENSOR(w, 2, "gemv", "weight");
  EXEC(3);
  return finish(env, ks_gemv(&out.t, &x.t, &w.t, backend, stream));
}

static napi_value js_softmax(napi_env env, napi_callback_info info) {
  ARGS(4);
  TENSOR(out, 0, "softmax", "out");
  TENSOR(x, 1, "softmax", "x");
  EXEC(2);
  return finish(env, ks_softmax(&out.t, &x.t, backend, stream));
}

static napi_value js_embedding(napi_env env, napi_callback_info info) {
  ARGS(6);
  TENSOR(out, 0, "embedding", "out");
  TENSOR(ids, 1, "embedding", "ids");
  TENSOR(table, 2, "embedding", "table");
  INT(fmt, 3, "embedding: table_format");
  EXEC(4);
  return finish(env, ks_embedding(&out.t, &ids.t, &table.t, (ks_qtype_t)fmt, backend, stream));
}

static napi_value js_dequantize(napi_env env, napi_callback_info info) {
  ARGS(5);
  TENSOR(out, 0, "dequantize", "out");
  TENSOR(packed, 1, "dequantize", "packed");
  INT(q, 2, "dequantize: qtype");
  EXEC(3);
  return finish(env, ks_dequantize(&out.t, &packed.t, (ks_qtype_t)q, backend, stream));
}

static napi_value js_gemm(napi_env env, napi_callback_info info) {
  ARGS(5);
  TENSOR(out, 0, "gemm", "out");
  TENSOR(a, 1, "gemm", "a");
  TENSOR(b, 2, "gemm", "b");
  EXEC(3);
  return finish(env, ks_gemm(&out.t, &a.t, &b.t, backend, stream));
}

static napi_value js_quant_matmul(napi_env env, napi_callback_info info) {
  ARGS(6);
  TENSOR(out, 0, "quant_matmul", "out");
  TENSOR(x, 1, "quant_matmul", "x");
  TENSOR(w, 2, "quant_matmul", "weight");
  INT(q, 3, "quant_matmul: qtype");
  EXEC(4);
  return finish(env, ks_quant_matmul(&out.t, &x.t, &w.t, (ks_qtype_t)q, backend, stream));
}

/* x quantized to int8 per block of 32 (W4A8 / W8A8); qtype Q4_0, Q4_1 or Q8_0. */
static napi_value js_quant_matmul_a8(napi_env env, napi_callback_info info) {
  ARGS(6);
  TENSOR(out, 0, "quant_matmul_a8", "out");
  TENSOR(x, 1, "quant_matmul_a8", "x");
  TENSOR(w, 2, "quant_matmul_a8", "weight");
  INT(q, 3, "quant_matmul_a8: qtype");
  EXEC(4);
  return finish(env, ks_quant_matmul_a8(&out.t, &x.t, &w.t, (ks_qtype_t)q, backend, stream));
}

/* x and residual_out may be null/undefined (NULL): then the rms_norm of residual feeds the matmul. */
static napi_value js_fused_add_rms_norm_quant_matmul(napi_env env, napi_callback_info info) {
  ARGS(10);
  TENSOR(out, 0, "fused_add_rms_norm_quant_matmul", "out");
  OPT_TENSOR(ro, rop, 1, "fused_add_rms_norm_quant_matmul", "residual_out");
  OPT_TENSOR(x, xp, 2, "fused_add_rms_norm_quant_matmul", "x");
  TENSOR(r, 3, "fused_add_rms_norm_quant_matmul", "residual");
  TENSOR(nw, 4, "fused_add_rms_norm_quant_matmul", "norm_weight");
  DOUBLE(eps, 5, "fused_add_rms_norm_quant_matmul: eps");
  TENSOR(w, 6, "fused_add_rms_norm_quant_matmul", "weight");
  INT(q, 7, "fused_add_rms_norm_quant_matmul: qtype");
  EXEC(8);
  return finish(env, ks_fused_add_rms_norm_quant_matmul(&out.t, rop, xp, &r.t, &nw.t, eps, &w.t, (ks_qtype_t)q,
                                                        backend, stream));
}

static napi_value js_silu_and_mul_quant_matmul(napi_env env, napi_callback_info info) {
  ARGS(6);
  TENSOR(out, 0, "silu_and_mul_quant_matmul", "out");
  TENSOR(g, 1, "silu_and_mul_quant_matmul", "gate_up");
  TENSOR(w, 2, "silu_and_mul_quant_matmul", "weight");
  INT(q, 3, "silu_and_mul_quant_matmul: qtype");
  EXEC(4);
  return finish(env, ks_silu_and_mul_quant_matmul(&out.t, &g.t, &w.t, (ks_qtype_t)q, backend, stream));
}

static napi_value js_rotary_embedding(napi_env env, napi_callback_info info) {
  ARGS(8);
  TENSOR(q, 0, "rotary_embedding", "q");
  OPT_TENSOR(k, kp, 1, "rotary_embedding", "k");
  TENSOR(pos, 2, "rotary_embedding", "positions");
  INT(rotary_dim, 3, "rotary_embedding: rotary_dim");
  DOUBLE(theta, 4, "rotary_embedding: theta");
  bool neox = false;
  if (napi_get_value_bool(env, argv[5], &neox) != napi_ok) {
    napi_throw_type_error(env, NULL, "kernscope: rotary_embedding: is_neox must be a boolean");
    return NULL;
  }
  EXEC(6);
  return finish(env, ks_rotary_embedding(&q.t, kp, &pos.t, rotary_dim, theta, neox ? 1 : 0, backend, stream));
}

static napi_value js_kv_cache_append(napi_env env, napi_callback_info info) {
  ARGS(7);
  TENSOR(kc, 0, "kv_cache_append", "k_cache");
  TENSOR(vc, 1, "kv_cache_append", "v_cache");
  TENSOR(k, 2, "kv_cache_append", "k");
  TENSOR(v, 3, "kv_cache_append", "v");
  TENSOR(slots, 4, "kv_cache_append", "slot_mapping");
  EXEC(5);
  return finish(env, ks_kv_cache_append(&kc.t, &vc.t, &k.t, &v.t, &slots.t, backend, stream));
}

/* k is required (rotated in place, and its rotated rows are what k_cache receives). */
static napi_value js_rotary_embedding_kv_append(napi_env env, napi_callback_info info) {
  ARGS(12);
  TENSOR(q, 0, "rotary_embedding_kv_append", "q");
  TENSOR(k, 1, "rotary_embedding_kv_append", "k");
  TENSOR(v, 2, "rotary_embedding_kv_append", "v");
  TENSOR(pos, 3, "rotary_embedding_kv_append", "positions");
  INT(rotary_dim, 4, "rotary_embedding_kv_append: rotary_dim");
  DOUBLE(theta, 5, "rotary_embedding_kv_append: theta");
  bool neox = false;
  if (napi_get_value_bool(env, argv[6], &neox) != napi_ok) {
    napi_throw_type_error(env, NULL, "kernscope: rotary_embedding_kv_append: is_neox must be a boolean");
    return NULL;
  }
  TENSOR(kc, 7, "rotary_embedding_kv_append", "k_cache");
  TENSOR(vc, 8, "rotary_embedding_kv_append", "v_cache");
  TENSOR(slots, 9, "rotary_embedding_kv_append", "slot_mapping");
  EXEC(10);
  return finish(env, ks_rotary_embedding_kv_append(&q.t, &k.t, &v.t, &pos.t, rotary_dim, theta, neox ? 1 : 0, &kc.t,
                                                   &vc.t, &slots.t, backend, stream));
}

/* One token: x and residual_out may be null/undefined together (NULL), as in
 * fused_add_rms_norm_quant_matmul; q, k and v are out's column slices. */
static napi_value js_fused_add_rms_norm_quant_matmul_rope_kv_append(napi_env env, napi_callback_info info) {
  ARGS(19);
  TENSOR(out, 0, "fused_add_rms_norm_quant_matmul_rope_kv_append", "out");
  OPT_TENSOR(ro, rop, 1, "fused_add_rms_norm_quant_matmul_rope_kv_append", "residual_out");
  OPT_TENSOR(x, xp, 2, "fused_add_rms_norm_quant_matmul_rope_kv_append", "x");
  TENSOR(r, 3, "fused_add_rms_norm_quant_matmul_rope_kv_append", "residual");
  TENSOR(nw, 4, "fused_add_rms_norm_quant_matmul_rope_kv_append", "norm_weight");
  DOUBLE(eps, 5, "fused_add_rms_norm_quant_matmul_rope_kv_append: eps");
  TENSOR(w, 6, "fused_add_rms_norm_quant_matmul_rope_kv_append", "weight");
  INT(q, 7, "fused_add_rms_norm_quant_matmul_rope_kv_append: qtype");
  INT(num_heads, 8, "fused_add_rms_norm_quant_matmul_rope_kv_append: num_heads");
  INT(num_kv_heads, 9, "fused_add_rms_norm_quant_matmul_rope_kv_append: num_kv_heads");
  TENSOR(pos, 10, "fused_add_rms_norm_quant_matmul_rope_kv_append", "positions");
  INT(rotary_dim, 11, "fused_add_rms_norm_quant_matmul_rope_kv_append: rotary_dim");
  DOUBLE(theta, 12, "fused_add_rms_norm_quant_matmul_rope_kv_append: theta");
  bool neox = false;
  if (napi_get_value_bool(env, argv[13], &neox) != napi_ok) {
    napi_throw_type_error(env, NULL, "kernscope: fused_add_rms_norm_quant_matmul_rope_kv_append: is_neox must be a boolean");
    return NULL;
  }
  TENSOR(kc, 14, "fused_add_rms_norm_quant_matmul_rope_kv_append", "k_cache");
  TENSOR(vc, 15, "fused_add_rms_norm_quant_matmul_rope_kv_append", "v_cache");
  TENSOR(slots, 16, "fused_add_rms_norm_quant_matmul_rope_kv_append", "slot_mapping");
  EXEC(17);
  return finish(env, ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
                         &out.t, rop, xp, &r.t, &nw.t, eps, &w.t, (ks_qtype_t)q, num_heads, num_kv_heads, &pos.t,
                         rotary_dim, theta, neox ? 1 : 0, &kc.t, &vc.t, &slots.t, backend, stream));
}

static napi_value js_paged_attention(napi_env env, napi_callback_info info) {
  ARGS(10);
  TENSOR(out, 0, "paged_attention", "out");
  TENSOR(q, 1, "paged_attention", "q");
  TENSOR(kc, 2, "paged_attention", "k_cache");
  TENSOR(vc, 3, "paged_attention", "v_cache");
  TENSOR(bt, 4, "paged_attention", "block_tables");
  OPT_TENSOR(si, sip, 5, "paged_attention", "seq_ids");
  TENSOR(cl, 6, "paged_attention", "context_lens");
  DOUBLE(scale, 7, "paged_attention: scale");
  EXEC(8);
  return finish(env, ks_paged_attention(&out.t, &q.t, &kc.t, &vc.t, &bt.t, sip, &cl.t, scale, backend, stream));
}

/* paged_attention plus fresh_keys (an integer, number or BigInt): the caller's promise about the
 * kernel launched just before on the stream; the same bits whatever it is. */
static napi_value js_paged_attention_after_append(napi_env env, napi_callback_info info) {
  static const char* op = "paged_attention_after_append";
  ARGS(11);
  TENSOR(out, 0, op, "out");
  TENSOR(q, 1, op, "q");
  TENSOR(kc, 2, op, "k_cache");
  TENSOR(vc, 3, op, "v_cache");
  TENSOR(bt, 4, op, "block_tables");
  OPT_TENSOR(si, sip, 5, op, "seq_ids");
  TENSOR(cl, 6, op, "context_lens");
  DOUBLE(scale, 7, "paged_attention_after_append: scale");
  INT(fresh_keys, 8, "paged_attention_after_append: fresh_keys");
  EXEC(9);
  return finish(env, ks_paged_attention_after_append(&out.t, &q.t, &kc.t, &vc.t, &bt.t, sip, &cl.t, scale, fresh_keys,
                                                     backend, stream));
}

/* k is required (as in rotary_embedding_kv_append); seq_ids may be null/undefined (NULL), as in
 * paged_attention. */
static napi_value js_rotary_embedding_kv_append_paged_attention(napi_env env, napi_callback_info info) {
  static const char* op = "rotary_embedding_kv_append_paged_attention";
  ARGS(17);
  TENSOR(out, 0, op, "out");
  TENSOR(q, 1, op, "q");
  TENSOR(k, 2, op, "k");
  TENSOR(v, 3, op, "v");
  TENSOR(pos, 4, op, "positions");
  INT(rotary_dim, 5, "rotary_embedding_kv_append_paged_attention: rotary_dim");
  DOUBLE(theta, 6, "rotary_embedding_kv_append_paged_attention: theta");
  bool neox = false;
  if (napi_get_value_bool(env, argv[7], &neox) != napi_ok) {
    napi_throw_type_error(env, NULL, "kernscope: rotary_embedding_kv_append_paged_attention: is_neox must be a boolean");
    return NULL;
  }
  TENSOR(kc, 8, op, "k_cache");
  TENSOR(vc, 9, op, "v_cache");
  TENSOR(slots, 10, op, "slot_mapping");
  TENSOR(bt, 11, op, "block_tables");
  OPT_TENSOR(si, sip, 12, op, "seq_ids");
  TENSOR(cl, 13, op, "context_lens");
  DOUBLE(scale, 14, "rotary_embedding_kv_append_paged_attention: scale");
  EXEC(15);
  return finish(env, ks_rotary_embedding_kv_append_paged_attention(&out.t, &q.t, &k.t, &v.t, &pos.t, rotary_dim, theta,
                                                                    neox ? 1 : 0, &kc.t, &vc.t, &slots.t, &bt.t, sip,
                                                                    &cl.t, scale, backend, stream));
}

static napi_value js_argmax(napi_env env, napi_callback_info info) {
  ARGS(4);
  TENSOR(out, 0, "argmax", "out");
  TENSOR(x, 1, "argmax", "x");
  EXEC(2);
  return finish(env, ks_argmax(&out.t, &x.t, backend, stream));
}

static napi_value js_varlen_attention(napi_env env, napi_callback_info info) {
  ARGS(10);
  TENSOR(out, 0, "varlen_attention", "out");
  TENSOR(q, 1, "varlen_attention", "q");
  TENSOR(k, 2, "varlen_attention", "k");
  TENSOR(v, 3, "varlen_attention", "v");
  TENSOR(cq, 4, "varlen_attention", "cu_seqlens_q");
  TENSOR(ck, 5, "varlen_attention", "cu_seqlens_k");
  DOUBLE(scale, 6, "varlen_attention: scale");
  bool causal = false;
  if (napi_get_value_bool(env, argv[7], &causal) != napi_ok) {
    napi_throw_type_error(env, NULL, "kernscope: varlen_attention: causal must be a boolean");
    return NULL;
  }
  EXEC(8);
  return finish(env, ks_varlen_attention(&out.t, &q.t, &k.t, &v.t, &cq.t, &ck.t, scale, causal ? 1 : 0, backend, stream));
}

static napi_value js_sample(napi_env env, napi_callback_info info) {
  ARGS(9);
  TENSOR(out, 0, "sample", "out");
  OPT_TENSOR(valid, vp, 1, "sample", "valid");
  TENSOR(logits, 2, "sample", "logits");
  TENSOR(so, 3, "sample", "seed_offset");
  DOUBLE(temperature, 4, "sample: temperature");
  INT(top_k, 5, "sample: top_k");
  DOUBLE(top_p, 6, "sample: top_p");
  EXEC(7);
  return finish(env, ks_sample(&out.t, vp, &logits.t, &so.t, temperature, top_k, top_p, backend, stream));
}

NAPI_MODULE_INIT() {
  const napi_property_descriptor props[] = {
      {"setErrorClass", NULL, js_set_error_class, NULL, NULL, NULL, napi_default, NULL},
      {"version", NULL, js_version, NULL, NULL, NULL, napi_default, NULL},
      {"lastError", NULL, js_last_error, NULL, NULL, NULL, napi_default, NULL},
      {"statusName", NULL, js_status_name, NULL, NULL, NULL, napi_default, NULL},
      {"backendAvailable", NULL, js_backend_available, NULL, NULL, NULL, napi_default, NULL},
      {"setDeterministic", NULL, js_set_deterministic, NULL, NULL, NULL, napi_default, NULL},
      {"deterministic", NULL, js_deterministic, NULL, NULL, NULL, napi_default, NULL},
      {"qtypeInfo", NULL, js_qtype_info, NULL, NULL, NULL, napi_default, NULL},
      {"variants", NULL, js_variants, NULL, NULL, NULL, napi_default, NULL},
      {"which", NULL, js_which, NULL, NULL, NULL, napi_default, NULL},
      {"routingTable", NULL, js_routing_table, NULL, NULL, NULL, napi_default, NULL},
      {"forceVariant", NULL, js_force_variant, NULL, NULL, NULL, napi_default, NULL},
      {"forcedVariant", NULL, js_forced_variant, NULL, NULL, NULL, napi_default, NULL},
      {"whichShape", NULL, js_which_shape, NULL, NULL, NULL, napi_default, NULL},
      {"lastLaunchConfig", NULL, js_last_launch_config, NULL, NULL, NULL, napi_default, NULL},
      {"opRunsVariantsOf", NULL, js_op_runs_variants_of, NULL, NULL, NULL, napi_default, NULL},
      {"opColsFactors", NULL, js_op_cols_factors, NULL, NULL, NULL, napi_default, NULL},
      {"rmsNorm", NULL, js_rms_norm, NULL, NULL, NULL, napi_default, NULL},
      {"fusedAddRmsNorm", NULL, js_fused_add_rms_norm, NULL, NULL, NULL, napi_default, NULL},
      {"siluAndMul", NULL, js_silu_and_mul, NULL, NULL, NULL, napi_default, NULL},
      {"gemv", NULL, js_gemv, NULL, NULL, NULL, napi_default, NULL},
      {"softmax", NULL, js_softmax, NULL, NULL, NULL, napi_default, NULL},
      {"embedding", NULL, js_embedding, NULL, NULL, NULL, napi_default, NULL},
      {"dequantize", NULL, js_dequantize, NULL, NULL, NULL, napi_default, NULL},
      {"gemm", NULL, js_gemm, NULL, NULL, NULL, napi_default, NULL},
      {"quantMatmul", NULL, js_quant_matmul, NULL, NULL, NULL, napi_default, NULL},
      {"quantMatmulA8", NULL, js_quant_matmul_a8, NULL, NULL, NULL, napi_default, NULL},
      {"fusedAddRmsNormQuantMatmul", NULL, js_fused_add_rms_norm_quant_matmul, NULL, NULL, NULL, napi_default, NULL},
      {"siluAndMulQuantMatmul", NULL, js_silu_and_mul_quant_matmul, NULL, NULL, NULL, napi_default, NULL},
      {"rotaryEmbedding", NULL, js_rotary_embedding, NULL, NULL, NULL, napi_default, NULL},
      {"kvCacheAppend", NULL, js_kv_cache_append, NULL, NULL, NULL, napi_default, NULL},
      {"rotaryEmbeddingKvAppend", NULL, js_rotary_embedding_kv_append, NULL, NULL, NULL, napi_default, NULL},
      {"fusedAddRmsNormQuantMatmulRopeKvAppend", NULL, js_fused_add_rms_norm_quant_matmul_rope_kv_append, NULL, NULL,
       NULL, napi_default, NULL},
      {"pagedAttention", NULL, js_paged_attention, NULL, NULL, NULL, napi_default, NULL},
      {"pagedAttentionAfterAppend", NULL, js_paged_attention_after_append, NULL, NULL, NULL, napi_default, NULL},
      {"rotaryEmbeddingKvAppendPagedAttention", NULL, js_rotary_embedding_kv_append_paged_attention, NULL, NULL, NULL,
       napi_default, NULL},
      {"argmax", NULL, js_argmax, NULL, NULL, NULL, napi_default, NULL},
      {"sample", NULL, js_sample, NULL, NULL, NULL, napi_default, NULL},
      {"varlenAttention", NULL, js_varlen_attention, NULL, NULL, NULL, napi_default, NULL},
  };
  if (napi_define_properties(env, exports, sizeof props / sizeof props[0], props) != napi_ok) return NULL;
  return exports;
}
