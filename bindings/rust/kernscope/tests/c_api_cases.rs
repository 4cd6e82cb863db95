//! The cases of tests/c/test_c_api.c through the safe crate, against double-precision
//! references computed here: values, one error per validation class (message naming the op
//! and the argument, outputs unchanged), the registry.
use kernscope::half::{f16_bits_to_f32, f32_to_f16_bits};
use kernscope::{Backend, DType, Device, Exec, QType, Status, Tensor, TensorMut};

const X: [f32; 10] = [0.5, -1.25, 2.0, 3.5, -0.75, 1.0, 2.0, -3.0, 4.0, 0.125];
const W: [f32; 5] = [1.0, 0.5, -2.0, 1.5, 0.25];

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol + tol * want.abs()
}

fn rms_norm_ref(x: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
    let h = w.len();
    let mut out = Vec::new();
    for row in x.chunks(h) {
        let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
        let scale = 1.0 / (ss / h as f64 + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * scale * g as f64));
    }
    out
}

fn cpu() -> Exec {
    Exec::new(Backend::Cpu)
}

#[test]
fn version_status_backend() {
    assert_eq!(kernscope::version(), "0.1.0");
    assert_eq!(Status::InvalidArgument.name(), "KS_ERROR_INVALID_ARGUMENT");
    assert!(kernscope::backend_available(Backend::Cpu));
}

#[test]
fn rms_norm_matches_fp64() {
    let mut out = [f32::NAN; 10];
    kernscope::rms_norm(
        &mut TensorMut::f32(&mut out, &[2, 5]).unwrap(),
        &Tensor::f32(&X, &[2, 5]).unwrap(),
        &Tensor::f32(&W, &[5]).unwrap(),
        1e-6,
    )
    .unwrap();
    assert_eq!(kernscope::last_error(), "");
    for (g, r) in out.iter().zip(rms_norm_ref(&X, &W, 1e-6)) {
        assert!(close(*g as f64, r, 1e-6), "{} vs {}", g, r);
    }
}

#[test]
fn rms_norm_in_place_and_fp16_bits() {
    let mut x = X;
    kernscope::rms_norm_in_place(&mut TensorMut::f32(&mut x, &[2, 5]).unwrap(), &Tensor::f32(&W, &[5]).unwrap(), 1e-6)
        .unwrap();
    for (g, r) in x.iter().zip(rms_norm_ref(&X, &W, 1e-6)) {
        assert!(close(*g as f64, r, 1e-6));
    }
    // fp16 as u16 bits; the reference uses the rounded inputs.
    let xh: Vec<u16> = X.iter().map(|&v| f32_to_f16_bits(v)).collect();
    let wh: Vec<u16> = W.iter().map(|&v| f32_to_f16_bits(v)).collect();
    let mut oh = [0u16; 10];
    kernscope::rms_norm(
        &mut TensorMut::f16_bits(&mut oh, &[2, 5]).unwrap(),
        &Tensor::f16_bits(&xh, &[2, 5]).unwrap(),
        &Tensor::f16_bits(&wh, &[5]).unwrap(),
        1e-6,
    )
    .unwrap();
    let xr: Vec<f32> = xh.iter().map(|&b| f16_bits_to_f32(b)).collect();
    let wr: Vec<f32> = wh.iter().map(|&b| f16_bits_to_f32(b)).collect();
    for (g, r) in oh.iter().zip(rms_norm_ref(&xr, &wr, 1e-6)) {
        assert!(close(f16_bits_to_f32(*g) as f64, r, 1e-3));
    }
}

#[test]
fn softmax_silu_gemv_match_fp64() {
    let mut out = [f32::NAN; 10];
    cpu().softmax(&mut TensorMut::f32(&mut out, &[2, 5]).unwrap(), &Tensor::f32(&X, &[2, 5]).unwrap()).unwrap();
    assert_eq!(kernscope::last_error(), "");
    for r in 0..2 {
        let row = &X[r * 5..r * 5 + 5];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
        let sum: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        for i in 0..5 {
            assert!(close(out[r * 5 + i] as f64, (row[i] as f64 - m).exp() / sum, 1e-6));
        }
    }

    // silu_and_mul: x [2, 2*D] -> out [2, D], D = 5 (odd)
    let mut s = [f32::NAN; 10];
    let x2: Vec<f32> = X.iter().chain(X.iter()).map(|v| v * 0.75).collect();
    kernscope::silu_and_mul(&mut TensorMut::f32(&mut s, &[2, 5]).unwrap(), &Tensor::f32(&x2, &[2, 10]).unwrap())
        .unwrap();
    for r in 0..2 {
        for i in 0..5 {
            let g = x2[r * 10 + i] as f64;
            let u = x2[r * 10 + 5 + i] as f64;
            assert!(close(s[r * 5 + i] as f64, g / (1.0 + (-g).exp()) * u, 1e-6));
        }
    }

    // gemv: weight [2, 5] (X), x [5] (W)
    let mut g = [f32::NAN; 2];
    kernscope::gemv(
        &mut TensorMut::f32(&mut g, &[2]).unwrap(),
        &Tensor::f32(&W, &[5]).unwrap(),
        &Tensor::f32(&X, &[2, 5]).unwrap(),
    )
    .unwrap();
    for n in 0..2 {
        let (mut acc, mut abs) = (0.0f64, 0.0f64);
        for h in 0..5 {
            acc += X[n * 5 + h] as f64 * W[h] as f64;
            abs += (X[n * 5 + h] as f64 * W[h] as f64).abs();
        }
        let tol = 1e-6 + 1e-6 * acc.abs() + 8.0 * 5f64.sqrt() * 2f64.powi(-24) * abs;
        assert!((g[n] as f64 - acc).abs() <= tol, "gemv[{}] {} vs {}", n, g[n], acc);
    }
}

#[test]
fn fused_add_rms_norm_in_place() {
    let mut x = X;
    let mut res: Vec<f32> = X.iter().rev().map(|v| v * 0.5).collect();
    let res0 = res.clone();
    kernscope::fused_add_rms_norm(
        &mut TensorMut::f32(&mut x, &[2, 5]).unwrap(),
        &mut TensorMut::f32(&mut res, &[2, 5]).unwrap(),
        &Tensor::f32(&W, &[5]).unwrap(),
        1e-5,
    )
    .unwrap();
    for r in 0..2 {
        let s: Vec<f64> = (0..5).map(|i| X[r * 5 + i] as f64 + res0[r * 5 + i] as f64).collect();
        let scale = 1.0 / (s.iter().map(|v| v * v).sum::<f64>() / 5.0 + 1e-5).sqrt();
        for i in 0..5 {
            assert!(close(res[r * 5 + i] as f64, s[i], 1e-6));
            assert!(close(x[r * 5 + i] as f64, s[i] * scale * W[i] as f64, 1e-6));
        }
    }
}

#[test]
fn invalid_argument_eps_zero_leaves_out_untouched() {
    let mut out = [7.0f32; 10];
    let e = cpu()
        .rms_norm(
            &mut TensorMut::f32(&mut out, &[2, 5]).unwrap(),
            &Tensor::f32(&X, &[2, 5]).unwrap(),
            &Tensor::f32(&W, &[5]).unwrap(),
            0.0,
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("rms_norm") && e.message().contains("eps"), "{}", e);
    assert_eq!(e.to_string(), format!("KS_ERROR_INVALID_ARGUMENT: {}", e.message()));
    assert_eq!(kernscope::last_error(), e.message());
    assert!(out.iter().all(|&v| v == 7.0));
}

#[test]
fn unsupported_dtype_fp64_x() {
    let x64: Vec<f64> = X.iter().map(|&v| v as f64).collect();
    let mut out = [7.0f32; 10];
    let e = cpu()
        .rms_norm(
            &mut TensorMut::f32(&mut out, &[2, 5]).unwrap(),
            &Tensor::new(&x64, DType::F64, &[2, 5]).unwrap(),
            &Tensor::f32(&W, &[5]).unwrap(),
            1e-6,
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::UnsupportedDtype);
    assert!(e.message().contains("rms_norm") && e.message().contains("x"), "{}", e);
    assert!(out.iter().all(|&v| v == 7.0));
}

#[test]
fn unsupported_device_weight_on_cuda() {
    let mut out = [7.0f32; 10];
    // The library rejects the device before touching any memory.
    let w = unsafe { Tensor::f32(&W, &[5]).unwrap().on_device(Device::Cuda(0)) };
    let e = cpu()
        .rms_norm(&mut TensorMut::f32(&mut out, &[2, 5]).unwrap(), &Tensor::f32(&X, &[2, 5]).unwrap(), &w, 1e-6)
        .unwrap_err();
    assert_eq!(e.status(), Status::UnsupportedDevice);
    assert!(e.message().contains("rms_norm") && e.message().contains("weight"), "{}", e);
    assert!(out.iter().all(|&v| v == 7.0));
    // A success clears the previous error.
    cpu().softmax(&mut TensorMut::f32(&mut out, &[2, 5]).unwrap(), &Tensor::f32(&X, &[2, 5]).unwrap()).unwrap();
    assert_eq!(kernscope::last_error(), "");
}

#[test]
fn unknown_variant_and_registry() {
    assert!(!kernscope::variants().unwrap().is_empty());
    let c = kernscope::which("rms_norm", "bf16", Backend::Cpu).unwrap();
    assert_eq!(c.variant, "cpu_reference");
    assert!(!c.reason.is_empty());
    let rt = kernscope::routing_table().unwrap();
    assert!(rt.contains("\"kernscope-routing-active/1\"") && rt.contains("\"generic.json\""), "{}", rt);
    let s = kernscope::which_shape("quant_matmul", "fp32", Backend::Cpu, 1, 576).unwrap();
    assert!(s.variant == "cpu_avx512" || s.variant == "cpu_reference", "{}", s.variant);
    assert!(!s.reason.is_empty());
    assert!(kernscope::which_shape("quant_matmul", "fp32", Backend::Cpu, -1, 576).is_err());
    let e = kernscope::which("no_such_op", "fp32", Backend::Cpu).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("no_such_op"), "{}", e);

    let e = kernscope::force_variant(Some("rms_norm"), Some("no_such_variant")).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("rms_norm") && e.message().contains("no_such_variant"), "{}", e);
    // The failed pin changed nothing: selection is still automatic and ops run.
    let mut out = [7.0f32; 10];
    cpu()
        .rms_norm(
            &mut TensorMut::f32(&mut out, &[2, 5]).unwrap(),
            &Tensor::f32(&X, &[2, 5]).unwrap(),
            &Tensor::f32(&W, &[5]).unwrap(),
            1e-6,
        )
        .unwrap();

    assert_eq!(kernscope::forced_variant("rms_norm").unwrap(), None);
    kernscope::force_variant(Some("rms_norm"), Some("cpu_reference")).unwrap();
    assert_eq!(kernscope::forced_variant("rms_norm").unwrap().as_deref(), Some("cpu_reference"));
    let e = kernscope::forced_variant("no_such_op").unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(
        kernscope::op_runs_variants_of("paged_attention_after_append").unwrap().as_deref(),
        Some("paged_attention")
    );
    assert_eq!(kernscope::op_runs_variants_of("rms_norm").unwrap(), None);
    assert!(kernscope::op_cols_factors("quant_matmul").unwrap().unwrap().starts_with("N x K"));
    assert_eq!(kernscope::op_cols_factors("softmax").unwrap(), None);
    cpu()
        .rms_norm(
            &mut TensorMut::f32(&mut out, &[2, 5]).unwrap(),
            &Tensor::f32(&X, &[2, 5]).unwrap(),
            &Tensor::f32(&W, &[5]).unwrap(),
            1e-6,
        )
        .unwrap();
    kernscope::force_variant(None, None).unwrap();

    assert_eq!(kernscope::qtype_info(QType::Q4_1).unwrap(), (32, 20));
    // No CUDA launch on this thread: "".
    assert_eq!(kernscope::last_launch_config("rms_norm").unwrap(), "");
}

#[test]
fn argmax_and_embedding_ids() {
    let mut idx = [-1i64; 2];
    kernscope::argmax(&mut TensorMut::i64(&mut idx, &[2]).unwrap(), &Tensor::f32(&X, &[2, 5]).unwrap()).unwrap();
    assert_eq!(idx, [3, 3]);

    // Dense table [3, 2], int32 ids; an id out of range is rejected before any write.
    let table = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let mut out = [0.0f32; 4];
    kernscope::embedding(
        &mut TensorMut::f32(&mut out, &[2, 2]).unwrap(),
        &Tensor::i32(&[2, 0], &[2]).unwrap(),
        &Tensor::f32(&table, &[3, 2]).unwrap(),
        QType::None,
    )
    .unwrap();
    assert_eq!(out, [5.0, 6.0, 1.0, 2.0]);
    let e = kernscope::embedding(
        &mut TensorMut::f32(&mut out, &[2, 2]).unwrap(),
        &Tensor::i64(&[1, 3], &[2]).unwrap(),
        &Tensor::f32(&table, &[3, 2]).unwrap(),
        QType::None,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("embedding"), "{}", e);
    assert_eq!(out, [5.0, 6.0, 1.0, 2.0]);
}

#[test]
fn views_are_checked_against_their_slices() {
    let e = Tensor::f32(&X, &[3, 5]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(Tensor::f32(&X, &[2, 5]).unwrap().with_strides(&[5, 2]).is_err());
    assert!(Tensor::new(&X, DType::F16, &[10]).is_err());
    assert_eq!(Tensor::f32(&X, &[2, 5]).unwrap().reshape(&[10]).unwrap().shape(), &[10]);
    // Non-compact strides that fit the slice reach the library, which rejects them.
    let mut out = [7.0f32; 4];
    let x = Tensor::f32(&X, &[2, 2]).unwrap().with_strides(&[5, 1]).unwrap();
    let e = kernscope::softmax(&mut TensorMut::f32(&mut out, &[2, 2]).unwrap(), &x).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("softmax"), "{}", e);
    assert_eq!(out, [7.0; 4]);
}

#[test]
fn device_pointers_reach_the_library() {
    // Bogus addresses: every call here is rejected before any memory is touched.
    let mut o =
        unsafe { TensorMut::from_raw(0x10000 as *mut std::os::raw::c_void, DType::F32, &[2, 5], Device::Cuda(0), 0) };
    let x =
        unsafe { Tensor::from_raw(0x10000 as *const std::os::raw::c_void, DType::F32, &[2, 5], Device::Cuda(0), 0) };
    let w = unsafe { Tensor::from_raw(0x20000 as *const std::os::raw::c_void, DType::F32, &[5], Device::Cuda(0), 0) };
    let e = cpu().rms_norm(&mut o, &x, &w, 1e-6).unwrap_err();
    assert_eq!(e.status(), Status::UnsupportedDevice);
    assert!(e.message().contains("rms_norm"), "{}", e);
    if !kernscope::backend_available(Backend::Cuda) {
        let e = unsafe { Exec::new(Backend::Cuda).with_stream(std::ptr::null_mut()) }
            .rms_norm(&mut o, &x, &w, 1e-6)
            .unwrap_err();
        assert_eq!(e.status(), Status::BackendUnavailable);
        assert!(e.message().contains("rms_norm"), "{}", e);
    }
}

#[test]
fn sample_top_k_one_is_argmax_and_flags_invalid_rows() {
    let mut idx = [-1i64; 2];
    let mut valid = [9u8; 2];
    let so = [7i64, 1];
    kernscope::sample(
        &mut TensorMut::i64(&mut idx, &[2]).unwrap(),
        Some(&mut TensorMut::u8(&mut valid, &[2]).unwrap()),
        &Tensor::f32(&X, &[2, 5]).unwrap(),
        &Tensor::i64(&so, &[2]).unwrap(),
        1.0,
        1,
        1.0,
    )
    .unwrap();
    assert_eq!(idx, [3, 3]);
    assert_eq!(valid, [1, 1]);
    let mut nan = X;
    nan[6] = f32::NAN;
    kernscope::sample(
        &mut TensorMut::i64(&mut idx, &[2]).unwrap(),
        Some(&mut TensorMut::u8(&mut valid, &[2]).unwrap()),
        &Tensor::f32(&nan, &[2, 5]).unwrap(),
        &Tensor::i64(&so, &[2]).unwrap(),
        0.8,
        0,
        0.9,
    )
    .unwrap();
    assert_eq!((idx[1], valid[0], valid[1]), (0, 1, 0));
    let e = kernscope::sample(
        &mut TensorMut::i64(&mut idx, &[2]).unwrap(),
        None,
        &Tensor::f32(&X, &[2, 5]).unwrap(),
        &Tensor::i64(&so, &[2]).unwrap(),
        0.0,
        0,
        1.0,
    );
    assert!(e.is_err());
}

#[test]
fn varlen_attention_causal_rows_and_bad_offsets() {
    // One sequence of 2 queries over 2 keys (1 head, head_dim 2), causal: query 0 sees key 0
    // only (its output is v[0]); query 1 averages v[0] and v[1] with softmax weights.
    let q = [1.0f32, 0.0, 0.5, -1.0];
    let k = [2.0f32, 1.0, -1.0, 3.0];
    let v = [1.0f32, 2.0, -4.0, 8.0];
    let cu = [0i32, 2];
    let mut out = [f32::NAN; 4];
    kernscope::varlen_attention(
        &mut TensorMut::f32(&mut out, &[2, 1, 2]).unwrap(),
        &Tensor::f32(&q, &[2, 1, 2]).unwrap(),
        &Tensor::f32(&k, &[2, 1, 2]).unwrap(),
        &Tensor::f32(&v, &[2, 1, 2]).unwrap(),
        &Tensor::i32(&cu, &[2]).unwrap(),
        &Tensor::i32(&cu, &[2]).unwrap(),
        0.5,
        true,
    )
    .unwrap();
    assert!(close(out[0] as f64, 1.0, 1e-6) && close(out[1] as f64, 2.0, 1e-6), "{:?}", out);
    let s0 = 0.5 * (0.5 * 2.0 - 1.0 * 1.0);
    let s1 = 0.5 * (0.5 * -1.0 - 1.0 * 3.0);
    let (e0, e1) = (f64::exp(s0), f64::exp(s1));
    let p0 = e0 / (e0 + e1);
    assert!(close(out[2] as f64, p0 * 1.0 + (1.0 - p0) * -4.0, 1e-5), "{:?}", out);
    assert!(close(out[3] as f64, p0 * 2.0 + (1.0 - p0) * 8.0, 1e-5), "{:?}", out);
    let before = out;
    let e = kernscope::varlen_attention(
        &mut TensorMut::f32(&mut out, &[2, 1, 2]).unwrap(),
        &Tensor::f32(&q, &[2, 1, 2]).unwrap(),
        &Tensor::f32(&k, &[2, 1, 2]).unwrap(),
        &Tensor::f32(&v, &[2, 1, 2]).unwrap(),
        &Tensor::i32(&[0, 3], &[2]).unwrap(),
        &Tensor::i32(&cu, &[2]).unwrap(),
        0.5,
        true,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("cu_seqlens_q"), "{}", e);
    assert_eq!(out, before);
}

// ---- the quant_matmul fusions ----------------------------------------------------------------

/// Q8_0 rows built here: per 32-element block an f16 scale d (exact: 1/16, 2/16, 3/16) then 32
/// int8 codes q; element = d * q. Returns (packed [n, k / 32 * 34], FP64 values [n, k]).
fn q8_0_rows(n: usize, k: usize) -> (Vec<u8>, Vec<f64>) {
    let (mut packed, mut values) = (Vec::new(), vec![0.0f64; n * k]);
    for r in 0..n {
        for b in 0..k / 32 {
            let d = 0.0625f32 * (1 + (r + b) % 3) as f32;
            packed.extend_from_slice(&f32_to_f16_bits(d).to_le_bytes());
            for j in 0..32 {
                let q = ((r * 7 + b * 13 + j * 5) % 41) as i32 - 20;
                packed.push(q as i8 as u8);
                values[r * k + b * 32 + j] = d as f64 * q as f64;
            }
        }
    }
    (packed, values)
}

/// FP64 h @ w^T with an allowance for the FP32 computation of h (rel * |h| per element) and
/// the FP32 sum in any order.
fn matmul_ref(h: &[f64], w: &[f64], m: usize, n: usize, k: usize, rel: f64) -> Vec<(f64, f64)> {
    let u = 2f64.powi(-24);
    let mut out = Vec::new();
    for i in 0..m {
        for j in 0..n {
            let (mut acc, mut abs) = (0.0, 0.0);
            for c in 0..k {
                acc += h[i * k + c] * w[j * k + c];
                abs += (h[i * k + c] * w[j * k + c]).abs();
            }
            out.push((acc, 1e-6 + 1e-6 * acc.abs() + (rel + 8.0 * (k as f64).sqrt() * u) * abs));
        }
    }
    out
}

#[test]
fn fused_add_rms_norm_quant_matmul_matches_fp64() {
    let (m, n, k) = (2usize, 3usize, 64usize);
    let (packed, wv) = q8_0_rows(n, k);
    let x: Vec<f32> = (0..m * k).map(|i| X[i % 10] * (1.0 + i as f32 / 64.0)).collect();
    let res: Vec<f32> = (0..m * k).map(|i| X[(i * 3 + 1) % 10] * 0.5).collect();
    let nw: Vec<f32> = (0..k).map(|i| W[i % 5] + 0.125).collect();
    let eps = 1e-5;
    let rel = (8.0 * (k as f64).sqrt() + 16.0) * 2f64.powi(-24);
    let norm = |s: &[f64]| -> Vec<f64> {
        let mut h = Vec::new();
        for row in s.chunks(k) {
            let scale = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / k as f64 + eps).sqrt();
            h.extend(row.iter().zip(&nw).map(|(v, g)| v * scale * *g as f64));
        }
        h
    };
    let w = Tensor::u8(&packed, &[n as i64, (k / 32 * 34) as i64]).unwrap();

    // with x: residual_out = x + residual; out = quant_matmul(rms_norm(x + residual))
    let mut out = [f32::NAN; 6];
    let mut res_out = vec![f32::NAN; m * k];
    cpu()
        .fused_add_rms_norm_quant_matmul(
            &mut TensorMut::f32(&mut out, &[2, 3]).unwrap(),
            Some(&mut TensorMut::f32(&mut res_out, &[2, 64]).unwrap()),
            Some(&Tensor::f32(&x, &[2, 64]).unwrap()),
            &Tensor::f32(&res, &[2, 64]).unwrap(),
            &Tensor::f32(&nw, &[64]).unwrap(),
            eps,
            &w,
            QType::Q8_0,
        )
        .unwrap();
    let s: Vec<f64> = x.iter().zip(&res).map(|(a, b)| *a as f64 + *b as f64).collect();
    for (g, want) in res_out.iter().zip(&s) {
        assert_eq!(*g, *want as f32, "residual_out");
    }
    for (g, (want, tol)) in out.iter().zip(matmul_ref(&norm(&s), &wv, m, n, k, rel)) {
        assert!((*g as f64 - want).abs() <= tol, "out {} vs {}", g, want);
    }

    // x = None: out = quant_matmul(rms_norm(residual))
    let mut out0 = [f32::NAN; 6];
    kernscope::fused_add_rms_norm_quant_matmul(
        &mut TensorMut::f32(&mut out0, &[2, 3]).unwrap(),
        None,
        None,
        &Tensor::f32(&res, &[2, 64]).unwrap(),
        &Tensor::f32(&nw, &[64]).unwrap(),
        eps,
        &w,
        QType::Q8_0,
    )
    .unwrap();
    let r64: Vec<f64> = res.iter().map(|v| *v as f64).collect();
    for (g, (want, tol)) in out0.iter().zip(matmul_ref(&norm(&r64), &wv, m, n, k, rel)) {
        assert!((*g as f64 - want).abs() <= tol, "out (no x) {} vs {}", g, want);
    }
}

#[test]
fn fused_add_rms_norm_quant_matmul_residual_out_without_x_is_rejected() {
    let (packed, _) = q8_0_rows(3, 64);
    let res = vec![0.5f32; 128];
    let nw = vec![1.0f32; 64];
    let mut out = [7.0f32; 6];
    let mut res_out = vec![7.0f32; 128];
    let e = cpu()
        .fused_add_rms_norm_quant_matmul(
            &mut TensorMut::f32(&mut out, &[2, 3]).unwrap(),
            Some(&mut TensorMut::f32(&mut res_out, &[2, 64]).unwrap()),
            None,
            &Tensor::f32(&res, &[2, 64]).unwrap(),
            &Tensor::f32(&nw, &[64]).unwrap(),
            1e-6,
            &Tensor::u8(&packed, &[3, 68]).unwrap(),
            QType::Q8_0,
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("fused_add_rms_norm_quant_matmul") && e.message().contains("residual_out"), "{}", e);
    assert!(out.iter().chain(&res_out).all(|&v| v == 7.0));
}

#[test]
fn silu_and_mul_quant_matmul_matches_fp64_and_rejects_odd_gate_up() {
    let (m, n, k) = (2usize, 3usize, 64usize);
    let (packed, wv) = q8_0_rows(n, k);
    let w = Tensor::u8(&packed, &[3, 68]).unwrap();
    let gu: Vec<f32> = (0..m * 2 * k).map(|i| X[(i * 7) % 10] * 0.75 + (i % 3) as f32 * 0.25).collect();
    let mut h = Vec::new();
    for r in 0..m {
        for c in 0..k {
            let (g, u) = (gu[r * 2 * k + c] as f64, gu[r * 2 * k + k + c] as f64);
            h.push(g / (1.0 + (-g).exp()) * u);
        }
    }
    let mut out = [f32::NAN; 6];
    cpu()
        .silu_and_mul_quant_matmul(
            &mut TensorMut::f32(&mut out, &[2, 3]).unwrap(),
            &Tensor::f32(&gu, &[2, 128]).unwrap(),
            &w,
            QType::Q8_0,
        )
        .unwrap();
    for (g, (want, tol)) in out.iter().zip(matmul_ref(&h, &wv, m, n, k, 16.0 * 2f64.powi(-24))) {
        assert!((*g as f64 - want).abs() <= tol, "out {} vs {}", g, want);
    }

    let before = out;
    let e = kernscope::silu_and_mul_quant_matmul(
        &mut TensorMut::f32(&mut out, &[2, 3]).unwrap(),
        &Tensor::f32(&gu[..254], &[2, 127]).unwrap(),
        &w,
        QType::Q8_0,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("silu_and_mul_quant_matmul") && e.message().contains("gate_up"), "{}", e);
    assert_eq!(out, before);
}

// ---- quant_matmul_a8 -----------------------------------------------------------------------------

/// x quantized per block of 32 as docs/contracts.md#quant_matmul_a8 writes it, each step
/// one f32 rounding: (d per block (NaN for a block with a NaN or inf, 0 when d < FLT_MIN), the
/// codes q).
fn a8_quantize(x: &[f32]) -> (Vec<f32>, Vec<f64>) {
    let (mut d, mut q) = (Vec::new(), Vec::new());
    for blk in x.chunks(32) {
        let bad = blk.iter().any(|v| !v.is_finite());
        let amax = blk.iter().filter(|v| v.is_finite()).fold(0.0f32, |a, v| a.max(v.abs()));
        let dd = amax / 127.0f32;
        if bad || !(dd >= f32::MIN_POSITIVE) {
            d.push(if bad { f32::NAN } else { 0.0 });
            q.extend(std::iter::repeat(0.0).take(32));
            continue;
        }
        let inv = 127.0f32 / amax;
        d.push(dd);
        for v in blk {
            let t = *v * inv;
            let f = t.floor();
            let r = if t - f < 0.5 {
                f
            } else if t - f > 0.5 || f % 2.0 != 0.0 {
                f + 1.0
            } else {
                f
            }; // rint: ties to even
            q.push(r.max(-127.0).min(127.0) as f64);
        }
    }
    (d, q)
}

#[test]
fn quant_matmul_a8_matches_the_contract_and_rejects_f16() {
    let (m, n, k) = (3usize, 3usize, 64usize);
    let (packed, wv) = q8_0_rows(n, k);
    let w = Tensor::u8(&packed, &[n as i64, (k / 32 * 34) as i64]).unwrap();
    let mut x: Vec<f32> = (0..m * k).map(|i| X[(i * 3) % 10] * (1.0 + (i % 7) as f32 * 0.375)).collect();
    // row 0, block 0 at d = 1: ties (0.5, 1.5, 2.5, -2.5) go to even codes (0, 2, 2, -2)
    x[..5].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -2.5]);
    x[2 * k + 40] = f32::NAN; // row 2: a NaN in block 1 makes every output of the row NaN
    let (d, q) = a8_quantize(&x);
    let u = 2f64.powi(-24);
    let mut out = [f32::NAN; 9];
    cpu()
        .quant_matmul_a8(
            &mut TensorMut::f32(&mut out, &[3, 3]).unwrap(),
            &Tensor::f32(&x, &[3, 64]).unwrap(),
            &w,
            QType::Q8_0,
        )
        .unwrap();
    let mut exact = [f32::NAN; 9];
    kernscope::quant_matmul(
        &mut TensorMut::f32(&mut exact, &[3, 3]).unwrap(),
        &Tensor::f32(&x, &[3, 64]).unwrap(),
        &w,
        QType::Q8_0,
    )
    .unwrap();
    for i in 0..m {
        for j in 0..n {
            let g = out[i * n + j] as f64;
            if i == 2 {
                assert!(g.is_nan(), "row 2 (NaN in x): out[2][{}] = {}", j, g);
                continue;
            }
            let (mut acc, mut abs, mut half_step) = (0.0f64, 0.0f64, 0.0f64);
            for c in 0..k {
                let xh = d[(i * k + c) / 32] as f64 * q[i * k + c];
                acc += wv[j * k + c] * xh;
                abs += (wv[j * k + c] * xh).abs();
                half_step += wv[j * k + c].abs() * d[(i * k + c) / 32] as f64 / 2.0;
            }
            let tol = 1e-6 + 1e-6 * acc.abs() + (k / 32 + 10) as f64 * u * abs;
            assert!((g - acc).abs() <= tol, "out[{}][{}] = {}, want {}", i, j, g, acc);
            // quant_matmul of the unquantized x: at most half a code step per element away
            let e = exact[i * n + j] as f64;
            assert!((g - e).abs() <= half_step * 1.0001 + 1e-5 * (1.0 + e.abs()), "vs quant_matmul: {} vs {}", g, e);
        }
    }

    // a dense weight format: rejected, naming the op and qtype; nothing written
    let dense = vec![0u8; n * k * 2];
    let before = out;
    let e = kernscope::quant_matmul_a8(
        &mut TensorMut::f32(&mut out, &[3, 3]).unwrap(),
        &Tensor::f32(&x, &[3, 64]).unwrap(),
        &Tensor::u8(&dense, &[n as i64, (k * 2) as i64]).unwrap(),
        QType::F16,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("quant_matmul_a8") && e.message().contains("qtype"), "{}", e);
    assert!(out.iter().zip(&before).all(|(a, b)| a.to_bits() == b.to_bits()));
}

// ---- rotary_embedding_kv_append ----------------------------------------------------------------

/// q [3, 2, 8], k and v [3, 1, 8], caches [2 blocks, 2 slots, 1, 8] (filled, so untouched rows
/// are compared too).
fn rope_kv_inputs() -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let q: Vec<f32> = (0..48).map(|i| X[i % 10] * (1.0 + i as f32 / 16.0)).collect();
    let k: Vec<f32> = (0..24).map(|i| X[(i * 3 + 1) % 10] - 0.25 * i as f32).collect();
    let v: Vec<f32> = (0..24).map(|i| W[i % 5] * i as f32).collect();
    let kc: Vec<f32> = (0..32).map(|i| -(i as f32)).collect();
    let vc: Vec<f32> = (0..32).map(|i| 100.0 + i as f32).collect();
    (q, k, v, kc, vc)
}

#[test]
fn rotary_embedding_kv_append_equals_rotary_then_append() {
    let pos = [0i32, 5, 100];
    let slots = [2i64, -1, 0]; // slot -1 skipped
    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for neox in [true, false] {
        let (mut q, mut k, v, mut kc, mut vc) = rope_kv_inputs();
        let (mut q2, mut k2, mut kc2, mut vc2) = (q.clone(), k.clone(), kc.clone(), vc.clone());
        cpu()
            .rotary_embedding_kv_append(
                &mut TensorMut::f32(&mut q, &[3, 2, 8]).unwrap(),
                &mut TensorMut::f32(&mut k, &[3, 1, 8]).unwrap(),
                &Tensor::f32(&v, &[3, 1, 8]).unwrap(),
                &Tensor::i32(&pos, &[3]).unwrap(),
                4, // rotary_dim < head_dim: features 4..8 pass through
                10000.0,
                neox,
                &mut TensorMut::f32(&mut kc, &[2, 2, 1, 8]).unwrap(),
                &mut TensorMut::f32(&mut vc, &[2, 2, 1, 8]).unwrap(),
                &Tensor::i64(&slots, &[3]).unwrap(),
            )
            .unwrap();
        kernscope::rotary_embedding(
            &mut TensorMut::f32(&mut q2, &[3, 2, 8]).unwrap(),
            Some(&mut TensorMut::f32(&mut k2, &[3, 1, 8]).unwrap()),
            &Tensor::i32(&pos, &[3]).unwrap(),
            4,
            10000.0,
            neox,
        )
        .unwrap();
        kernscope::kv_cache_append(
            &mut TensorMut::f32(&mut kc2, &[2, 2, 1, 8]).unwrap(),
            &mut TensorMut::f32(&mut vc2, &[2, 2, 1, 8]).unwrap(),
            &Tensor::f32(&k2, &[3, 1, 8]).unwrap(),
            &Tensor::f32(&v, &[3, 1, 8]).unwrap(),
            &Tensor::i64(&slots, &[3]).unwrap(),
        )
        .unwrap();
        assert_eq!(bits(&q), bits(&q2), "q (neox {})", neox);
        assert_eq!(bits(&k), bits(&k2), "k (neox {})", neox);
        assert_eq!(bits(&kc), bits(&kc2), "k_cache (neox {})", neox);
        assert_eq!(bits(&vc), bits(&vc2), "v_cache (neox {})", neox);
        // the call did something: token 1 (position 5) rotated, slot 2 holds token 0's rotated k
        assert_ne!(bits(&q[16..20]), bits(&rope_kv_inputs().0[16..20]));
        assert_eq!(bits(&kc[16..24]), bits(&k[0..8]));
        assert_eq!(bits(&vc[0..8]), bits(&v[16..24]));
    }
}

#[test]
fn rotary_embedding_kv_append_odd_rotary_dim_is_rejected() {
    let (mut q, mut k, v, mut kc, mut vc) = rope_kv_inputs();
    let before = (q.clone(), k.clone(), kc.clone(), vc.clone());
    let e = kernscope::rotary_embedding_kv_append(
        &mut TensorMut::f32(&mut q, &[3, 2, 8]).unwrap(),
        &mut TensorMut::f32(&mut k, &[3, 1, 8]).unwrap(),
        &Tensor::f32(&v, &[3, 1, 8]).unwrap(),
        &Tensor::i64(&[0, 1, 2], &[3]).unwrap(),
        3,
        10000.0,
        true,
        &mut TensorMut::f32(&mut kc, &[2, 2, 1, 8]).unwrap(),
        &mut TensorMut::f32(&mut vc, &[2, 2, 1, 8]).unwrap(),
        &Tensor::i32(&[0, 1, 3], &[3]).unwrap(),
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("rotary_embedding_kv_append") && e.message().contains("rotary_dim"), "{}", e);
    assert_eq!((q, k, kc, vc), before);
}

// ---- fused_add_rms_norm_quant_matmul_rope_kv_append --------------------------------------------

/// One token: H = 2, KVH = 1, D = 8 (out [1, 32] = q | k | v), K = 64 (Q8_0 weight [32, 68]),
/// caches [2 blocks, 2 slots, 1, 8] (filled, so untouched rows are compared too).
/// (weight, x, residual, norm_weight, k_cache, v_cache)
type NormRopeInputs = (Vec<u8>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn norm_rope_inputs() -> NormRopeInputs {
    let (packed, _) = q8_0_rows(32, 64);
    let x: Vec<f32> = (0..64).map(|i| X[i % 10] * (1.0 + i as f32 / 64.0)).collect();
    let res: Vec<f32> = (0..64).map(|i| X[(i * 3 + 1) % 10] * 0.5).collect();
    let nw: Vec<f32> = (0..64).map(|i| W[i % 5] + 0.125).collect();
    let kc: Vec<f32> = (0..32).map(|i| -(i as f32)).collect();
    let vc: Vec<f32> = (0..32).map(|i| 100.0 + i as f32).collect();
    (packed, x, res, nw, kc, vc)
}

#[test]
fn fused_add_rms_norm_quant_matmul_rope_kv_append_equals_the_two_calls() {
    let (h, kvh, d) = (2usize, 1usize, 8usize);
    let pos = [5i32];
    let slots = [3i64]; // block 1, offset 1
    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let (packed, x, res, nw, kc0, vc0) = norm_rope_inputs();
    let w = Tensor::u8(&packed, &[32, 68]).unwrap();
    for with_x in [true, false] {
        for neox in [true, false] {
            let (mut out, mut res_out, mut kc, mut vc) =
                (vec![f32::NAN; 32], vec![f32::NAN; 64], kc0.clone(), vc0.clone());
            let (mut out2, mut res_out2, mut kc2, mut vc2) = (out.clone(), res_out.clone(), kc0.clone(), vc0.clone());
            let xt = Tensor::f32(&x, &[1, 64]).unwrap();
            let mut ro = TensorMut::f32(&mut res_out, &[1, 64]).unwrap();
            cpu()
                .fused_add_rms_norm_quant_matmul_rope_kv_append(
                    &mut TensorMut::f32(&mut out, &[1, 32]).unwrap(),
                    if with_x { Some(&mut ro) } else { None },
                    if with_x { Some(&xt) } else { None },
                    &Tensor::f32(&res, &[1, 64]).unwrap(),
                    &Tensor::f32(&nw, &[64]).unwrap(),
                    1e-5,
                    &w,
                    QType::Q8_0,
                    h as i64,
                    kvh as i64,
                    &Tensor::i32(&pos, &[1]).unwrap(),
                    4, // rotary_dim < head_dim: features 4..8 pass through
                    10000.0,
                    neox,
                    &mut TensorMut::f32(&mut kc, &[2, 2, 1, 8]).unwrap(),
                    &mut TensorMut::f32(&mut vc, &[2, 2, 1, 8]).unwrap(),
                    &Tensor::i64(&slots, &[1]).unwrap(),
                )
                .unwrap();

            // the two calls: the norm + matmul into out2, then RoPE + append on its column slices
            let mut ro2 = TensorMut::f32(&mut res_out2, &[1, 64]).unwrap();
            kernscope::fused_add_rms_norm_quant_matmul(
                &mut TensorMut::f32(&mut out2, &[1, 32]).unwrap(),
                if with_x { Some(&mut ro2) } else { None },
                if with_x { Some(&xt) } else { None },
                &Tensor::f32(&res, &[1, 64]).unwrap(),
                &Tensor::f32(&nw, &[64]).unwrap(),
                1e-5,
                &w,
                QType::Q8_0,
            )
            .unwrap();
            let plain = out2.clone();
            let (q2, rest) = out2.split_at_mut(h * d);
            let (k2, v2) = rest.split_at_mut(kvh * d);
            kernscope::rotary_embedding_kv_append(
                &mut TensorMut::f32(q2, &[1, 2, 8]).unwrap(),
                &mut TensorMut::f32(k2, &[1, 1, 8]).unwrap(),
                &Tensor::f32(v2, &[1, 1, 8]).unwrap(),
                &Tensor::i32(&pos, &[1]).unwrap(),
                4,
                10000.0,
                neox,
                &mut TensorMut::f32(&mut kc2, &[2, 2, 1, 8]).unwrap(),
                &mut TensorMut::f32(&mut vc2, &[2, 2, 1, 8]).unwrap(),
                &Tensor::i64(&slots, &[1]).unwrap(),
            )
            .unwrap();
            let what = format!("(x {}, neox {})", with_x, neox);
            assert_eq!(bits(&out), bits(&out2), "out {}", what);
            assert_eq!(bits(&res_out), bits(&res_out2), "residual_out {}", what);
            assert_eq!(bits(&kc), bits(&kc2), "k_cache {}", what);
            assert_eq!(bits(&vc), bits(&vc2), "v_cache {}", what);
            // the call did something: q rotated, slot 3 holds the rotated k and v, the rest kept
            assert_ne!(bits(&out[0..4]), bits(&plain[0..4]), "q not rotated {}", what);
            assert_eq!(bits(&kc[24..32]), bits(&out[16..24]), "k_cache slot 3 {}", what);
            assert_eq!(bits(&vc[24..32]), bits(&out[24..32]), "v_cache slot 3 {}", what);
            assert_eq!(bits(&kc[0..24]), bits(&kc0[0..24]), "k_cache other slots {}", what);
            assert_eq!(res_out.iter().all(|v| v.is_nan()), !with_x, "residual_out written {}", what);
        }
    }
}

#[test]
fn fused_add_rms_norm_quant_matmul_rope_kv_append_zero_heads_is_rejected() {
    let (packed, x, res, nw, mut kc, mut vc) = norm_rope_inputs();
    let (mut out, mut res_out) = (vec![7.0f32; 32], vec![7.0f32; 64]);
    let before = (kc.clone(), vc.clone());
    let e = kernscope::fused_add_rms_norm_quant_matmul_rope_kv_append(
        &mut TensorMut::f32(&mut out, &[1, 32]).unwrap(),
        Some(&mut TensorMut::f32(&mut res_out, &[1, 64]).unwrap()),
        Some(&Tensor::f32(&x, &[1, 64]).unwrap()),
        &Tensor::f32(&res, &[1, 64]).unwrap(),
        &Tensor::f32(&nw, &[64]).unwrap(),
        1e-5,
        &Tensor::u8(&packed, &[32, 68]).unwrap(),
        QType::Q8_0,
        0, // num_heads
        1,
        &Tensor::i64(&[5], &[1]).unwrap(),
        8,
        10000.0,
        false,
        &mut TensorMut::f32(&mut kc, &[2, 2, 1, 8]).unwrap(),
        &mut TensorMut::f32(&mut vc, &[2, 2, 1, 8]).unwrap(),
        &Tensor::i32(&[3], &[1]).unwrap(),
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(
        e.message().contains("fused_add_rms_norm_quant_matmul_rope_kv_append") && e.message().contains("num_heads"),
        "{}",
        e
    );
    assert!(out.iter().chain(&res_out).all(|&v| v == 7.0));
    assert_eq!((kc, vc), before);
}

// ---- rotary_embedding_kv_append_paged_attention ------------------------------------------------

/// `n` pseudo-random values in [-2, 2) from a fixed seed (a 64-bit LCG's top bits).
fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// q [3, 6, 8], k and v [3, 2, 8] (GQA: 6 query heads, 2 kv heads), caches [6 blocks, 2 slots,
/// 2, 8], random (so untouched cache rows are compared too). (q, k, v, k_cache, v_cache)
type RopeAttnInputs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn rope_attn_inputs(seed: u64) -> RopeAttnInputs {
    (
        random_f32(3 * 6 * 8, seed),
        random_f32(3 * 2 * 8, seed + 1),
        random_f32(3 * 2 * 8, seed + 2),
        random_f32(6 * 2 * 2 * 8, seed + 3),
        random_f32(6 * 2 * 2 * 8, seed + 4),
    )
}

#[test]
fn rotary_embedding_kv_append_paged_attention_equals_the_two_calls() {
    let (t, h, kvh, d, rd, theta, scale) = (3i64, 6i64, 2i64, 8i64, 4i64, 10000.0, 0.35);
    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    // (what, positions, slot_mapping, block_tables, seq_ids, context_lens)
    let decode =
        ("decode, seq_ids None", vec![2i64, 0, 3], vec![0i32, 2, 5], vec![4i32, 0, 1, 5, 3, 2], None, vec![3i32, 1, 4]);
    // tokens 0 and 1 of sequence 1 (token 1 reads the slot token 0 appends), token 2 of sequence 0
    let chunk = (
        "prefill chunk, seq_ids given",
        vec![1i64, 2, 0],
        vec![11i32, 2, 6],
        vec![3i32, 2, 5, 1],
        Some(vec![1i32, 1, 0]),
        vec![2i32, 3, 1],
    );
    for (ci, (what, pos, slots, bt, seq, ctx)) in [decode, chunk].into_iter().enumerate() {
        let bt_rows = bt.len() as i64 / 2;
        for neox in [true, false] {
            let what = format!("({}, neox {})", what, neox);
            let inputs = rope_attn_inputs(10 + ci as u64 * 5);
            let (mut q, mut k, v, mut kc, mut vc) = inputs.clone();
            let (mut q2, mut k2, _, mut kc2, mut vc2) = inputs.clone();
            let (mut out, mut out2) = (vec![f32::NAN; (t * h * d) as usize], vec![f32::NAN; (t * h * d) as usize]);
            let seq_t = seq.as_ref().map(|s| Tensor::i32(s, &[t]).unwrap());
            cpu()
                .rotary_embedding_kv_append_paged_attention(
                    &mut TensorMut::f32(&mut out, &[t, h, d]).unwrap(),
                    &mut TensorMut::f32(&mut q, &[t, h, d]).unwrap(),
                    &mut TensorMut::f32(&mut k, &[t, kvh, d]).unwrap(),
                    &Tensor::f32(&v, &[t, kvh, d]).unwrap(),
                    &Tensor::i64(&pos, &[t]).unwrap(),
                    rd, // rotary_dim < head_dim: features 4..8 pass through
                    theta,
                    neox,
                    &mut TensorMut::f32(&mut kc, &[6, 2, kvh, d]).unwrap(),
                    &mut TensorMut::f32(&mut vc, &[6, 2, kvh, d]).unwrap(),
                    &Tensor::i32(&slots, &[t]).unwrap(),
                    &Tensor::i32(&bt, &[bt_rows, 2]).unwrap(),
                    seq_t.as_ref(),
                    &Tensor::i32(&ctx, &[t]).unwrap(),
                    scale,
                )
                .unwrap();

            // the two calls on copies of the inputs
            cpu()
                .rotary_embedding_kv_append(
                    &mut TensorMut::f32(&mut q2, &[t, h, d]).unwrap(),
                    &mut TensorMut::f32(&mut k2, &[t, kvh, d]).unwrap(),
                    &Tensor::f32(&v, &[t, kvh, d]).unwrap(),
                    &Tensor::i64(&pos, &[t]).unwrap(),
                    rd,
                    theta,
                    neox,
                    &mut TensorMut::f32(&mut kc2, &[6, 2, kvh, d]).unwrap(),
                    &mut TensorMut::f32(&mut vc2, &[6, 2, kvh, d]).unwrap(),
                    &Tensor::i32(&slots, &[t]).unwrap(),
                )
                .unwrap();
            cpu()
                .paged_attention(
                    &mut TensorMut::f32(&mut out2, &[t, h, d]).unwrap(),
                    &Tensor::f32(&q2, &[t, h, d]).unwrap(),
                    &Tensor::f32(&kc2, &[6, 2, kvh, d]).unwrap(),
                    &Tensor::f32(&vc2, &[6, 2, kvh, d]).unwrap(),
                    &Tensor::i32(&bt, &[bt_rows, 2]).unwrap(),
                    seq_t.as_ref(),
                    &Tensor::i32(&ctx, &[t]).unwrap(),
                    scale,
                )
                .unwrap();
            assert_eq!(bits(&out), bits(&out2), "out {}", what);
            assert_eq!(bits(&q), bits(&q2), "q {}", what);
            assert_eq!(bits(&k), bits(&k2), "k {}", what);
            assert_eq!(bits(&kc), bits(&kc2), "k_cache {}", what);
            assert_eq!(bits(&vc), bits(&vc2), "v_cache {}", what);
            // the call did something: every out value written, q rotated (features past rotary_dim
            // kept), the slots hold the rotated k and v, the other cache rows untouched
            assert!(out.iter().all(|o| !o.is_nan()), "out not written {}", what);
            assert_ne!(bits(&q[0..4]), bits(&inputs.0[0..4]), "q of token 0 not rotated {}", what);
            assert_eq!(bits(&q[4..8]), bits(&inputs.0[4..8]), "q past rotary_dim {}", what);
            let row = (kvh * d) as usize;
            for slot in 0..12usize {
                let r = slot * row..(slot + 1) * row;
                match slots.iter().position(|&s| s as usize == slot) {
                    Some(ti) => {
                        assert_eq!(
                            bits(&kc[r.clone()]),
                            bits(&k[ti * row..(ti + 1) * row]),
                            "k_cache[{}] {}",
                            slot,
                            what
                        );
                        assert_eq!(bits(&vc[r]), bits(&v[ti * row..(ti + 1) * row]), "v_cache[{}] {}", slot, what);
                    }
                    None => assert_eq!(bits(&kc[r.clone()]), bits(&inputs.3[r]), "k_cache[{}] kept {}", slot, what),
                }
            }
        }
    }
}

#[test]
fn rotary_embedding_kv_append_paged_attention_bad_context_len_is_rejected() {
    let (t, h, kvh, d) = (3i64, 6i64, 2i64, 8i64);
    let (mut q, mut k, v, mut kc, mut vc) = rope_attn_inputs(20);
    let mut out = vec![7.0f32; (t * h * d) as usize];
    let before = (q.clone(), k.clone(), kc.clone(), vc.clone());
    let e = kernscope::rotary_embedding_kv_append_paged_attention(
        &mut TensorMut::f32(&mut out, &[t, h, d]).unwrap(),
        &mut TensorMut::f32(&mut q, &[t, h, d]).unwrap(),
        &mut TensorMut::f32(&mut k, &[t, kvh, d]).unwrap(),
        &Tensor::f32(&v, &[t, kvh, d]).unwrap(),
        &Tensor::i32(&[2, 0, 3], &[t]).unwrap(),
        4,
        10000.0,
        true,
        &mut TensorMut::f32(&mut kc, &[6, 2, kvh, d]).unwrap(),
        &mut TensorMut::f32(&mut vc, &[6, 2, kvh, d]).unwrap(),
        &Tensor::i64(&[0, 2, 5], &[t]).unwrap(),
        &Tensor::i32(&[4, 0, 1, 5, 3, 2], &[3, 2]).unwrap(),
        None,
        &Tensor::i32(&[3, 5, 4], &[t]).unwrap(), // 5 > max_blocks_per_seq * block_size = 4
        0.35,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(
        e.message().contains("rotary_embedding_kv_append_paged_attention")
            && e.message().contains("context_lens[1] = 5"),
        "{}",
        e
    );
    assert!(out.iter().all(|&o| o == 7.0));
    assert_eq!((q, k, kc, vc), before);
}

// ---- paged_attention_after_append ----------------------------------------------------------------

#[test]
fn paged_attention_after_append_same_bits_as_paged_attention() {
    let (t, h, kvh, d, scale) = (3i64, 6i64, 2i64, 8i64, 0.35);
    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let (q, _, _, kc, vc) = rope_attn_inputs(30);
    let (bt, ctx) = ([4i32, 0, 1, 5, 3, 2], [3i32, 1, 4]);
    for seq in [None, Some([2i32, 0, 1])] {
        let seq_t = seq.as_ref().map(|s| Tensor::i32(s, &[t]).unwrap());
        let mut want = vec![f32::NAN; (t * h * d) as usize];
        cpu()
            .paged_attention(
                &mut TensorMut::f32(&mut want, &[t, h, d]).unwrap(),
                &Tensor::f32(&q, &[t, h, d]).unwrap(),
                &Tensor::f32(&kc, &[6, 2, kvh, d]).unwrap(),
                &Tensor::f32(&vc, &[6, 2, kvh, d]).unwrap(),
                &Tensor::i32(&bt, &[3, 2]).unwrap(),
                seq_t.as_ref(),
                &Tensor::i32(&ctx, &[t]).unwrap(),
                scale,
            )
            .unwrap();
        assert!(want.iter().all(|o| !o.is_nan()));
        for fresh_keys in [0i64, 1] {
            let mut out = vec![f32::NAN; (t * h * d) as usize];
            cpu()
                .paged_attention_after_append(
                    &mut TensorMut::f32(&mut out, &[t, h, d]).unwrap(),
                    &Tensor::f32(&q, &[t, h, d]).unwrap(),
                    &Tensor::f32(&kc, &[6, 2, kvh, d]).unwrap(),
                    &Tensor::f32(&vc, &[6, 2, kvh, d]).unwrap(),
                    &Tensor::i32(&bt, &[3, 2]).unwrap(),
                    seq_t.as_ref(),
                    &Tensor::i32(&ctx, &[t]).unwrap(),
                    scale,
                    fresh_keys,
                )
                .unwrap();
            assert_eq!(bits(&out), bits(&want), "fresh_keys {}, seq_ids {:?}", fresh_keys, seq);
        }
    }
}

#[test]
fn paged_attention_after_append_negative_fresh_keys_is_rejected() {
    let (t, h, kvh, d) = (3i64, 6i64, 2i64, 8i64);
    let (q, _, _, kc, vc) = rope_attn_inputs(31);
    let mut out = vec![7.0f32; (t * h * d) as usize];
    let e = kernscope::paged_attention_after_append(
        &mut TensorMut::f32(&mut out, &[t, h, d]).unwrap(),
        &Tensor::f32(&q, &[t, h, d]).unwrap(),
        &Tensor::f32(&kc, &[6, 2, kvh, d]).unwrap(),
        &Tensor::f32(&vc, &[6, 2, kvh, d]).unwrap(),
        &Tensor::i32(&[4, 0, 1, 5, 3, 2], &[3, 2]).unwrap(),
        None,
        &Tensor::i32(&[3, 1, 4], &[t]).unwrap(),
        0.35,
        -1,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("paged_attention_after_append") && e.message().contains("fresh_keys"), "{}", e);
    assert!(out.iter().all(|&o| o == 7.0));
}
