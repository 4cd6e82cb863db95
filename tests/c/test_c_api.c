/* The C ABI called from plain C99: version, a successful op against a
 * double-precision reference, one error per status class with its message,
 * thread-local last error, the registry queries. */
#include <kernscope/kernscope.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

static DLTensor f32_tensor(float* data, int ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.device.device_id = 0;
  t.ndim = ndim;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = NULL;
  t.byte_offset = 0;
  return t;
}

int main(void) {
  /* version */
  CHECK(strcmp(ks_version(), "0.1.0") == 0);
  CHECK(strcmp(ks_status_name(KS_ERROR_INVALID_ARGUMENT), "KS_ERROR_INVALID_ARGUMENT") == 0);
  CHECK(ks_backend_available(KS_BACKEND_CPU) == 1);

  /* rms_norm on 2 x 5 against a double reference */
  float x[10] = {0.5f, -1.25f, 2.0f, 3.5f, -0.75f, 1.0f, 2.0f, -3.0f, 4.0f, 0.125f};
  float w[5] = {1.0f, 0.5f, -2.0f, 1.5f, 0.25f};
  float out[10];
  for (int i = 0; i < 10; ++i) out[i] = NAN;
  int64_t xs[2] = {2, 5}, ws[1] = {5}, os[2] = {2, 5};
  DLTensor tx = f32_tensor(x, 2, xs), tw = f32_tensor(w, 1, ws), to = f32_tensor(out, 2, os);
  CHECK(ks_rms_norm(&to, &tx, &tw, 1e-6, KS_BACKEND_AUTO, NULL) == KS_SUCCESS);
  CHECK(strcmp(ks_last_error(), "") == 0);
  for (int r = 0; r < 2; ++r) {
    double ss = 0;
    for (int i = 0; i < 5; ++i) ss += (double)x[r * 5 + i] * x[r * 5 + i];
    const double scale = 1.0 / sqrt(ss / 5 + 1e-6);
    for (int i = 0; i < 5; ++i) {
      const double ref = x[r * 5 + i] * scale * w[i];
      CHECK(fabs(out[r * 5 + i] - ref) <= 1e-6 + 1e-6 * fabs(ref));
    }
  }

  /* invalid argument: eps = 0; out untouched, message names op and argument */
  float before[10];
  memcpy(before, out, sizeof out);
  CHECK(ks_rms_norm(&to, &tx, &tw, 0.0, KS_BACKEND_CPU, NULL) == KS_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(ks_last_error(), "rms_norm") != NULL && strstr(ks_last_error(), "eps") != NULL);
  CHECK(memcmp(before, out, sizeof out) == 0);

  /* unsupported dtype: float64 x */
  DLTensor bad = tx;
  bad.dtype.bits = 64;
  CHECK(ks_rms_norm(&to, &bad, &tw, 1e-6, KS_BACKEND_CPU, NULL) == KS_ERROR_UNSUPPORTED_DTYPE);
  CHECK(strstr(ks_last_error(), "x") != NULL);

  /* unsupported device: weight claims to live on a CUDA device */
  DLTensor wdev = tw;
  wdev.device.device_type = kDLCUDA;
  CHECK(ks_rms_norm(&to, &tx, &wdev, 1e-6, KS_BACKEND_CPU, NULL) == KS_ERROR_UNSUPPORTED_DEVICE);
  CHECK(strstr(ks_last_error(), "weight") != NULL);
  /* calls that return no status leave the message as it is (the header's rule) */
  CHECK(ks_version()[0] != '\0' && ks_backend_available(KS_BACKEND_CPU) == 1);
  CHECK(strstr(ks_last_error(), "weight") != NULL);

  /* a success clears the previous error */
  CHECK(ks_softmax(&to, &tx, KS_BACKEND_CPU, NULL) == KS_SUCCESS);
  CHECK(strcmp(ks_last_error(), "") == 0);
  /* ks_set_deterministic returns a status, so it clears it too (it left it before 2026-12-05) */
  CHECK(ks_rms_norm(&to, &tx, &wdev, 1e-6, KS_BACKEND_CPU, NULL) == KS_ERROR_UNSUPPORTED_DEVICE);
  CHECK(ks_set_deterministic(ks_deterministic()) == KS_SUCCESS && strcmp(ks_last_error(), "") == 0);

  /* registry */
  CHECK(ks_variant_count() > 0);
  ks_variant_info_t info;
  CHECK(ks_variant_info(0, &info) == KS_SUCCESS && info.op != NULL && info.name != NULL);
  CHECK(ks_variant_info(ks_variant_count(), &info) == KS_ERROR_INVALID_ARGUMENT);
  const char* variant = NULL;
  const char* reason = NULL;
  CHECK(ks_which("rms_norm", "bf16", KS_BACKEND_CPU, &variant, &reason) == KS_SUCCESS);
  CHECK(variant != NULL && strcmp(variant, "cpu_reference") == 0 && reason != NULL);
  CHECK(ks_which("no_such_op", "fp32", KS_BACKEND_CPU, &variant, &reason) == KS_ERROR_INVALID_ARGUMENT);
  /* dtype in any case, and torch's names; another dtype is KS_ERROR_UNSUPPORTED_DTYPE naming it */
  CHECK(ks_which("rms_norm", "BF16", KS_BACKEND_CPU, &variant, &reason) == KS_SUCCESS);
  CHECK(ks_which("rms_norm", "bfloat16", KS_BACKEND_CPU, &variant, &reason) == KS_SUCCESS);
  CHECK(ks_which("softmax", "Half", KS_BACKEND_CPU, &variant, &reason) == KS_SUCCESS);
  CHECK(ks_which("softmax", "float32", KS_BACKEND_CPU, &variant, &reason) == KS_SUCCESS);
  CHECK(ks_which("softmax", "float", KS_BACKEND_CPU, &variant, &reason) == KS_SUCCESS);
  CHECK(ks_which("quant_matmul", "Float16:Q4_1", KS_BACKEND_CPU, &variant, &reason) == KS_SUCCESS);
  CHECK(ks_which("softmax", "float64", KS_BACKEND_CPU, &variant, &reason) == KS_ERROR_UNSUPPORTED_DTYPE);
  CHECK(strstr(ks_last_error(), "'float64'") != NULL && strstr(ks_last_error(), "bfloat16") != NULL);
  /* an entry point without variants of its own names the op whose variants it runs */
  CHECK(ks_op_runs_variants_of("paged_attention_after_append") != NULL &&
        strcmp(ks_op_runs_variants_of("paged_attention_after_append"), "paged_attention") == 0);
  CHECK(ks_op_runs_variants_of("paged_attention") == NULL && ks_op_runs_variants_of("rms_norm") == NULL);
  CHECK(ks_op_runs_variants_of(NULL) == NULL);
  /* the ops whose routing key's cols is a product name its factors; entry points answer as the op they run */
  CHECK(ks_op_cols_factors("quant_matmul") != NULL && strncmp(ks_op_cols_factors("quant_matmul"), "N x K", 5) == 0);
  CHECK(ks_op_cols_factors("fused_add_rms_norm_quant_matmul_rope_kv_append") != NULL);
  CHECK(ks_op_cols_factors("paged_attention_after_append") != NULL &&
        strcmp(ks_op_cols_factors("paged_attention_after_append"), ks_op_cols_factors("paged_attention")) == 0);
  CHECK(ks_op_cols_factors("softmax") == NULL && ks_op_cols_factors("no_such_op") == NULL && ks_op_cols_factors(NULL) == NULL);
  CHECK(ks_which_shape("quant_matmul", "fp32", KS_BACKEND_CPU, 1, 576, &variant, &reason) == KS_SUCCESS);
  CHECK(variant != NULL && reason != NULL && strstr(reason, "rows 1, cols 576") != NULL);
  CHECK(ks_which_shape("quant_matmul", "fp32", KS_BACKEND_CPU, -1, 576, &variant, &reason) ==
        KS_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(ks_last_error(), "rows and cols") != NULL);
  CHECK(ks_which_shape(NULL, "fp32", KS_BACKEND_CPU, 1, 1, &variant, &reason) == KS_ERROR_INVALID_ARGUMENT);
  CHECK(ks_force_variant("rms_norm", "no_such_variant") == KS_ERROR_INVALID_ARGUMENT);
  const char* pinned = "untouched";
  CHECK(ks_forced_variant("rms_norm", &pinned) == KS_SUCCESS && pinned == NULL);
  CHECK(ks_force_variant("rms_norm", "cpu_reference") == KS_SUCCESS);
  CHECK(ks_forced_variant("rms_norm", &pinned) == KS_SUCCESS && pinned != NULL && strcmp(pinned, "cpu_reference") == 0);
  pinned = "untouched";
  CHECK(ks_forced_variant("no_such_op", &pinned) == KS_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(ks_last_error(), "no_such_op") != NULL && strcmp(pinned, "untouched") == 0);
  CHECK(ks_forced_variant(NULL, &pinned) == KS_ERROR_INVALID_ARGUMENT);
  CHECK(ks_forced_variant("rms_norm", NULL) == KS_ERROR_INVALID_ARGUMENT);
  CHECK(ks_rms_norm(&to, &tx, &tw, 1e-6, KS_BACKEND_CPU, NULL) == KS_SUCCESS);
  CHECK(ks_force_variant(NULL, "cpu_reference") == KS_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(ks_last_error(), "op is NULL but variant 'cpu_reference' is given") != NULL);
  CHECK(ks_force_variant(NULL, NULL) == KS_SUCCESS);
  CHECK(ks_forced_variant("rms_norm", &pinned) == KS_SUCCESS && pinned == NULL);

  int64_t bs = 0, bb = 0;
  CHECK(ks_qtype_info(KS_QTYPE_Q4_1, &bs, &bb) == KS_SUCCESS && bs == 32 && bb == 20);

  if (failures) {
    fprintf(stderr, "test_c_api: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_c_api: ok\n");
  return 0;
}
