package kernscope_test

// The cases of tests/c/test_c_api.c through the Go binding, against double-precision
// references computed here: values, one error per validation class (message naming the op and
// the argument, outputs unchanged), the registry.

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"runtime"
	"strings"
	"testing"

	ks "github.com/kernscope/kernscope/bindings/go"
)

var (
	xs = []float32{0.5, -1.25, 2.0, 3.5, -0.75, 1.0, 2.0, -3.0, 4.0, 0.125}
	ws = []float32{1.0, 0.5, -2.0, 1.5, 0.25}
)

func close(got, want, tol float64) bool { return math.Abs(got-want) <= tol+tol*math.Abs(want) }

func rmsNormRef(x, w []float32, eps float64) []float64 {
	h := len(w)
	var out []float64
	for r := 0; r < len(x)/h; r++ {
		ss := 0.0
		for i := 0; i < h; i++ {
			v := float64(x[r*h+i])
			ss += v * v
		}
		scale := 1 / math.Sqrt(ss/float64(h)+eps)
		for i := 0; i < h; i++ {
			out = append(out, float64(x[r*h+i])*scale*float64(w[i]))
		}
	}
	return out
}

func filled(n int, v float32) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = v
	}
	return s
}

func untouched(t *testing.T, s []float32, v float32) {
	t.Helper()
	for i, g := range s {
		if g != v {
			t.Fatalf("output[%d] = %v was written after an error", i, g)
		}
	}
}

func TestVersionStatusBackend(t *testing.T) {
	if ks.Version() != "0.1.0" {
		t.Fatalf("version %q", ks.Version())
	}
	if ks.StatusInvalidArgument.String() != "KS_ERROR_INVALID_ARGUMENT" {
		t.Fatal(ks.StatusInvalidArgument.String())
	}
	if !ks.BackendAvailable(ks.BackendCPU) {
		t.Fatal("CPU backend unavailable")
	}
}

func TestRMSNormMatchesFP64(t *testing.T) {
	out := filled(10, float32(math.NaN()))
	if err := ks.RMSNorm(ks.F32(out, 2, 5), ks.F32(xs, 2, 5), ks.F32(ws, 5), 1e-6); err != nil {
		t.Fatal(err)
	}
	for i, r := range rmsNormRef(xs, ws, 1e-6) {
		if !close(float64(out[i]), r, 1e-6) {
			t.Errorf("out[%d] = %v, want %v", i, out[i], r)
		}
	}
	// In place, and bf16 bits (the inputs are exact in bf16).
	x := append([]float32(nil), xs...)
	xt := ks.F32(x, 2, 5)
	if err := ks.RMSNorm(xt, xt, ks.F32(ws, 5), 1e-6); err != nil {
		t.Fatal(err)
	}
	for i, r := range rmsNormRef(xs, ws, 1e-6) {
		if !close(float64(x[i]), r, 1e-6) {
			t.Errorf("in place x[%d] = %v, want %v", i, x[i], r)
		}
	}
	bf := func(v []float32) []uint16 {
		b := make([]uint16, len(v))
		for i, f := range v {
			b[i] = uint16(math.Float32bits(f) >> 16)
		}
		return b
	}
	ob := make([]uint16, 10)
	if err := ks.RMSNorm(ks.BF16Bits(ob, 2, 5), ks.BF16Bits(bf(xs), 2, 5), ks.BF16Bits(bf(ws), 5), 1e-6); err != nil {
		t.Fatal(err)
	}
	for i, r := range rmsNormRef(xs, ws, 1e-6) {
		if g := math.Float32frombits(uint32(ob[i]) << 16); !close(float64(g), r, 1e-2) {
			t.Errorf("bf16 out[%d] = %v, want %v", i, g, r)
		}
	}
}

func TestSoftmaxSiluGemvMatchFP64(t *testing.T) {
	out := filled(10, float32(math.NaN()))
	if err := ks.Softmax(ks.F32(out, 2, 5), ks.F32(xs, 2, 5), ks.WithBackend(ks.BackendCPU)); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < 2; r++ {
		m, sum := math.Inf(-1), 0.0
		for i := 0; i < 5; i++ {
			m = math.Max(m, float64(xs[r*5+i]))
		}
		for i := 0; i < 5; i++ {
			sum += math.Exp(float64(xs[r*5+i]) - m)
		}
		for i := 0; i < 5; i++ {
			if want := math.Exp(float64(xs[r*5+i])-m) / sum; !close(float64(out[r*5+i]), want, 1e-6) {
				t.Errorf("softmax[%d][%d] = %v, want %v", r, i, out[r*5+i], want)
			}
		}
	}

	x2 := make([]float32, 20) // [2, 2*5]: gate then up
	for i := range x2 {
		x2[i] = xs[i%10] * 0.75
	}
	s := make([]float32, 10)
	if err := ks.SiluAndMul(ks.F32(s, 2, 5), ks.F32(x2, 2, 10)); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < 2; r++ {
		for i := 0; i < 5; i++ {
			g, u := float64(x2[r*10+i]), float64(x2[r*10+5+i])
			if want := g / (1 + math.Exp(-g)) * u; !close(float64(s[r*5+i]), want, 1e-6) {
				t.Errorf("silu_and_mul[%d][%d] = %v, want %v", r, i, s[r*5+i], want)
			}
		}
	}

	g := make([]float32, 2)
	if err := ks.Gemv(ks.F32(g, 2), ks.F32(ws, 5), ks.F32(xs, 2, 5)); err != nil {
		t.Fatal(err)
	}
	for n := 0; n < 2; n++ {
		acc, abs := 0.0, 0.0
		for h := 0; h < 5; h++ {
			p := float64(xs[n*5+h]) * float64(ws[h])
			acc, abs = acc+p, abs+math.Abs(p)
		}
		tol := 1e-6 + 1e-6*math.Abs(acc) + 8*math.Sqrt(5)*math.Pow(2, -24)*abs
		if math.Abs(float64(g[n])-acc) > tol {
			t.Errorf("gemv[%d] = %v, want %v", n, g[n], acc)
		}
	}
}

func TestFusedAddRMSNormInPlace(t *testing.T) {
	x := append([]float32(nil), xs...)
	res := make([]float32, 10)
	for i := range res {
		res[i] = xs[9-i] * 0.5
	}
	res0 := append([]float32(nil), res...)
	if err := ks.FusedAddRMSNorm(ks.F32(x, 2, 5), ks.F32(res, 2, 5), ks.F32(ws, 5), 1e-5); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < 2; r++ {
		s := make([]float64, 5)
		ss := 0.0
		for i := range s {
			s[i] = float64(xs[r*5+i]) + float64(res0[r*5+i])
			ss += s[i] * s[i]
		}
		scale := 1 / math.Sqrt(ss/5+1e-5)
		for i := range s {
			if !close(float64(res[r*5+i]), s[i], 1e-6) || !close(float64(x[r*5+i]), s[i]*scale*float64(ws[i]), 1e-6) {
				t.Errorf("row %d col %d: residual %v x %v", r, i, res[r*5+i], x[r*5+i])
			}
		}
	}
}

// checkErr asserts the status (errors.Is and errors.As) and that the message names every word.
func checkErr(t *testing.T, err error, sentinel error, status ks.Status, words ...string) {
	t.Helper()
	if !errors.Is(err, sentinel) {
		t.Fatalf("error %v is not %v", err, sentinel)
	}
	var ke *ks.Error
	if !errors.As(err, &ke) || ke.Status != status {
		t.Fatalf("error %v: not a *ks.Error with status %v", err, status)
	}
	for _, w := range words {
		if !strings.Contains(ke.Message, w) {
			t.Errorf("message %q does not name %q", ke.Message, w)
		}
	}
}

func TestInvalidArgumentEpsZero(t *testing.T) {
	out := filled(10, 7)
	err := ks.RMSNorm(ks.F32(out, 2, 5), ks.F32(xs, 2, 5), ks.F32(ws, 5), 0, ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "rms_norm", "eps")
	if errors.Is(err, ks.ErrUnsupportedDtype) {
		t.Error("invalid argument matched ErrUnsupportedDtype")
	}
	if !strings.HasPrefix(err.Error(), "kernscope: KS_ERROR_INVALID_ARGUMENT: rms_norm") {
		t.Errorf("Error() = %q", err.Error())
	}
	untouched(t, out, 7)
}

func TestUnsupportedDtypeFP64(t *testing.T) {
	x64 := make([]float64, 10)
	for i, v := range xs {
		x64[i] = float64(v)
	}
	out := filled(10, 7)
	err := ks.RMSNorm(ks.F32(out, 2, 5), ks.F64(x64, 2, 5), ks.F32(ws, 5), 1e-6, ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrUnsupportedDtype, ks.StatusUnsupportedDtype, "rms_norm", "x")
	untouched(t, out, 7)
}

func TestUnsupportedDeviceWeightOnCUDA(t *testing.T) {
	runtime.LockOSThread() // LastError below reads this thread's state
	defer runtime.UnlockOSThread()
	out := filled(10, 7)
	err := ks.RMSNorm(ks.F32(out, 2, 5), ks.F32(xs, 2, 5), ks.F32(ws, 5).OnDevice(ks.CUDA(0)), 1e-6,
		ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrUnsupportedDevice, ks.StatusUnsupportedDevice, "rms_norm", "weight")
	untouched(t, out, 7)
	// A success clears the previous error.
	if err := ks.Softmax(ks.F32(out, 2, 5), ks.F32(xs, 2, 5), ks.WithBackend(ks.BackendCPU)); err != nil {
		t.Fatal(err)
	}
	if ks.LastError() != "" {
		t.Errorf("last error after a success: %q", ks.LastError())
	}
}

func TestUnknownVariantAndRegistry(t *testing.T) {
	runtime.LockOSThread() // pins are per OS thread
	defer runtime.UnlockOSThread()
	if v, err := ks.Variants(); err != nil || len(v) == 0 {
		t.Fatalf("variants: %v %v", v, err)
	}
	variant, reason, err := ks.Which("rms_norm", "bf16", ks.BackendCPU)
	if err != nil || variant != "cpu_reference" || reason == "" {
		t.Fatalf("which: %q %q %v", variant, reason, err)
	}
	if j, err := ks.RoutingTable(); err != nil || !strings.Contains(j, `"kernscope-routing-active/1"`) ||
		!strings.Contains(j, `"generic.json"`) {
		t.Fatalf("routing table: %.200q %v", j, err)
	}
	sv, sr, err := ks.WhichShape("quant_matmul", "fp32", ks.BackendCPU, 1, 576)
	if err != nil || (sv != "cpu_avx512" && sv != "cpu_reference") || sr == "" {
		t.Fatalf("WhichShape: %q %q %v", sv, sr, err)
	}
	if _, _, err = ks.WhichShape("quant_matmul", "fp32", ks.BackendCPU, -1, 576); err == nil {
		t.Fatal("WhichShape accepted rows = -1")
	}
	_, _, err = ks.Which("no_such_op", "fp32", ks.BackendCPU)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "no_such_op")

	err = ks.ForceVariant("rms_norm", "no_such_variant")
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "rms_norm", "no_such_variant")
	out := filled(10, 7)
	if err := ks.RMSNorm(ks.F32(out, 2, 5), ks.F32(xs, 2, 5), ks.F32(ws, 5), 1e-6, ks.WithBackend(ks.BackendCPU)); err != nil {
		t.Fatalf("after a failed pin: %v", err)
	}
	if v, err := ks.ForcedVariant("rms_norm"); err != nil || v != "" {
		t.Fatalf("forced variant before a pin: %q %v", v, err)
	}
	if err := ks.ForceVariant("rms_norm", "cpu_reference"); err != nil {
		t.Fatal(err)
	}
	if v, err := ks.ForcedVariant("rms_norm"); err != nil || v != "cpu_reference" {
		t.Fatalf("forced variant after the pin: %q %v", v, err)
	}
	_, err = ks.ForcedVariant("no_such_op")
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "no_such_op")
	if err := ks.RMSNorm(ks.F32(out, 2, 5), ks.F32(xs, 2, 5), ks.F32(ws, 5), 1e-6, ks.WithBackend(ks.BackendCPU)); err != nil {
		t.Fatal(err)
	}
	if err := ks.ForceVariant("", ""); err != nil {
		t.Fatal(err)
	}
	if bs, bb, err := ks.QTypeInfo(ks.QTypeQ4_1); err != nil || bs != 32 || bb != 20 {
		t.Fatalf("qtype_info: %d %d %v", bs, bb, err)
	}
	if a, b := ks.OpRunsVariantsOf("paged_attention_after_append"), ks.OpRunsVariantsOf("rms_norm"); a != "paged_attention" || b != "" {
		t.Errorf("op_runs_variants_of: %q %q", a, b)
	}
	if a, b := ks.OpColsFactors("quant_matmul"), ks.OpColsFactors("softmax"); !strings.HasPrefix(a, "N x K") || b != "" {
		t.Errorf("op_cols_factors: %q %q", a, b)
	}
	if c := ks.LastLaunchConfig("rms_norm"); c != "" {
		t.Errorf("launch config without a CUDA launch: %q", c)
	}
}

func TestArgmaxAndEmbedding(t *testing.T) {
	idx := []int64{-1, -1}
	if err := ks.Argmax(ks.I64(idx), ks.F32(xs, 2, 5)); err != nil {
		t.Fatal(err)
	}
	if idx[0] != 3 || idx[1] != 3 {
		t.Fatalf("argmax %v", idx)
	}
	table := []float32{1, 2, 3, 4, 5, 6}
	out := make([]float32, 4)
	if err := ks.Embedding(ks.F32(out, 2, 2), ks.I32([]int32{2, 0}), ks.F32(table, 3, 2), ks.QTypeNone); err != nil {
		t.Fatal(err)
	}
	want := []float32{5, 6, 1, 2}
	for i := range want {
		if out[i] != want[i] {
			t.Fatalf("embedding %v", out)
		}
	}
	err := ks.Embedding(ks.F32(out, 2, 2), ks.I64([]int64{1, 3}), ks.F32(table, 3, 2), ks.QTypeNone)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "embedding")
	for i := range want {
		if out[i] != want[i] {
			t.Fatalf("embedding wrote after an error: %v", out)
		}
	}
}

func TestViewsAreCheckedAgainstTheirSlices(t *testing.T) {
	out := filled(15, 7)
	err := ks.Softmax(ks.F32(out, 3, 5), ks.F32(xs, 3, 5))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "softmax", "x")
	err = ks.Softmax(ks.F32(out, 2, 5), ks.F32(xs, 2, 5).WithStrides(5, 2))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "softmax", "x")
	// Non-compact strides inside the slice reach the library, which rejects them.
	err = ks.Softmax(ks.F32(out[:4], 2, 2), ks.F32(xs, 2, 2).WithStrides(5, 1))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "softmax")
	untouched(t, out, 7)
}

func TestDevicePointersReachTheLibrary(t *testing.T) {
	// Bogus addresses: every call here is rejected before any memory is touched.
	p := ks.FromPointer(0x10000, ks.DTypeF32, ks.CUDA(0), 2, 5)
	w := ks.FromPointer(0x20000, ks.DTypeF32, ks.CUDA(0), 5)
	err := ks.RMSNorm(p, p, w, 1e-6, ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrUnsupportedDevice, ks.StatusUnsupportedDevice, "rms_norm")
	if !ks.BackendAvailable(ks.BackendCUDA) {
		err = ks.RMSNorm(p, p, w, 1e-6, ks.WithBackend(ks.BackendCUDA), ks.WithStream(0))
		checkErr(t, err, ks.ErrBackendUnavailable, ks.StatusBackendUnavailable, "rms_norm")
	}
}

func TestSampleTopKOneIsArgmaxAndFlagsInvalidRows(t *testing.T) {
	idx := []int64{-1, -1}
	valid := []uint8{9, 9}
	if err := ks.Sample(ks.I64(idx), ks.U8(valid), ks.F32(xs, 2, 5), ks.I64([]int64{7, 1}), 1.0, 1, 1.0); err != nil {
		t.Fatal(err)
	}
	if idx[0] != 3 || idx[1] != 3 || valid[0] != 1 || valid[1] != 1 {
		t.Fatalf("sample %v %v", idx, valid)
	}
	nan := append([]float32{}, xs...)
	nan[6] = float32(math.NaN())
	if err := ks.Sample(ks.I64(idx), ks.U8(valid), ks.F32(nan, 2, 5), ks.I64([]int64{7, 1}), 0.8, 0, 0.9); err != nil {
		t.Fatal(err)
	}
	if idx[1] != 0 || valid[1] != 0 || valid[0] != 1 {
		t.Fatalf("sample with a NaN row %v %v", idx, valid)
	}
	if err := ks.Sample(ks.I64(idx), nil, ks.F32(xs, 2, 5), ks.I64([]int64{7, 1}), 0, 0, 1); err == nil {
		t.Fatal("temperature 0 must be rejected")
	}
}

// ---- the quant_matmul fusions ---------------------------------------------------------------

// q8_0Rows builds Q8_0 rows here: per 32-element block an f16 scale d (1/16, 2/16 or 3/16, exact
// in f16) then 32 int8 codes q; element = d * q. Returns packed [n, k/32*34] and FP64 values [n, k].
func q8_0Rows(n, k int) ([]uint8, []float64) {
	scales := []struct {
		bits uint16
		v    float64
	}{{0x2C00, 0.0625}, {0x3000, 0.125}, {0x3200, 0.1875}}
	var packed []uint8
	values := make([]float64, n*k)
	for r := 0; r < n; r++ {
		for b := 0; b < k/32; b++ {
			sc := scales[(r+b)%3]
			packed = append(packed, uint8(sc.bits), uint8(sc.bits>>8))
			for j := 0; j < 32; j++ {
				q := (r*7+b*13+j*5)%41 - 20
				packed = append(packed, uint8(int8(q)))
				values[r*k+b*32+j] = sc.v * float64(q)
			}
		}
	}
	return packed, values
}

// checkMatmul compares out [m, n] with FP64 h @ w^T, allowing rel*|h| per element of h (its FP32
// computation) and the FP32 sum in any order.
func checkMatmul(t *testing.T, what string, out []float32, h, w []float64, m, n, k int, rel float64) {
	t.Helper()
	u := math.Pow(2, -24)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			acc, abs := 0.0, 0.0
			for c := 0; c < k; c++ {
				p := h[i*k+c] * w[j*k+c]
				acc, abs = acc+p, abs+math.Abs(p)
			}
			tol := 1e-6 + 1e-6*math.Abs(acc) + (rel+8*math.Sqrt(float64(k))*u)*abs
			if g := float64(out[i*n+j]); math.Abs(g-acc) > tol {
				t.Errorf("%s[%d][%d] = %v, want %v", what, i, j, g, acc)
			}
		}
	}
}

func TestFusedAddRMSNormQuantMatmul(t *testing.T) {
	const m, n, k, eps = 2, 3, 64, 1e-5
	packed, wv := q8_0Rows(n, k)
	x, res, nw := make([]float32, m*k), make([]float32, m*k), make([]float32, k)
	for i := range x {
		x[i] = xs[i%10] * (1 + float32(i)/64)
		res[i] = xs[(i*3+1)%10] * 0.5
	}
	for i := range nw {
		nw[i] = ws[i%5] + 0.125
	}
	norm := func(s []float64) []float64 {
		h := make([]float64, len(s))
		for r := 0; r < m; r++ {
			ss := 0.0
			for c := 0; c < k; c++ {
				ss += s[r*k+c] * s[r*k+c]
			}
			scale := 1 / math.Sqrt(ss/k+eps)
			for c := 0; c < k; c++ {
				h[r*k+c] = s[r*k+c] * scale * float64(nw[c])
			}
		}
		return h
	}
	rel := (8*math.Sqrt(k) + 16) * math.Pow(2, -24)
	w := ks.U8(packed, n, k/32*34)

	// with x: residualOut = x + residual; out = quant_matmul(rms_norm(x + residual))
	out, resOut := filled(m*n, float32(math.NaN())), filled(m*k, float32(math.NaN()))
	if err := ks.FusedAddRMSNormQuantMatmul(ks.F32(out, m, n), ks.F32(resOut, m, k), ks.F32(x, m, k), ks.F32(res, m, k),
		ks.F32(nw, k), eps, w, ks.QTypeQ8_0, ks.WithBackend(ks.BackendCPU)); err != nil {
		t.Fatal(err)
	}
	s := make([]float64, m*k)
	for i := range s {
		s[i] = float64(x[i]) + float64(res[i])
		if resOut[i] != float32(s[i]) {
			t.Errorf("residual_out[%d] = %v, want %v", i, resOut[i], float32(s[i]))
		}
	}
	checkMatmul(t, "out", out, norm(s), wv, m, n, k, rel)

	// x nil: out = quant_matmul(rms_norm(residual))
	out0 := filled(m*n, float32(math.NaN()))
	if err := ks.FusedAddRMSNormQuantMatmul(ks.F32(out0, m, n), nil, nil, ks.F32(res, m, k), ks.F32(nw, k), eps, w,
		ks.QTypeQ8_0); err != nil {
		t.Fatal(err)
	}
	r64 := make([]float64, m*k)
	for i, v := range res {
		r64[i] = float64(v)
	}
	checkMatmul(t, "out (no x)", out0, norm(r64), wv, m, n, k, rel)

	// residual_out without x: rejected, naming the op and residual_out; nothing written
	out7, res7 := filled(m*n, 7), filled(m*k, 7)
	err := ks.FusedAddRMSNormQuantMatmul(ks.F32(out7, m, n), ks.F32(res7, m, k), nil, ks.F32(res, m, k), ks.F32(nw, k),
		eps, w, ks.QTypeQ8_0, ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "fused_add_rms_norm_quant_matmul", "residual_out")
	untouched(t, out7, 7)
	untouched(t, res7, 7)
}

func TestSiluAndMulQuantMatmul(t *testing.T) {
	const m, n, k = 2, 3, 64
	packed, wv := q8_0Rows(n, k)
	w := ks.U8(packed, n, k/32*34)
	gu := make([]float32, m*2*k)
	for i := range gu {
		gu[i] = xs[(i*7)%10]*0.75 + float32(i%3)*0.25
	}
	h := make([]float64, m*k)
	for r := 0; r < m; r++ {
		for c := 0; c < k; c++ {
			g, u := float64(gu[r*2*k+c]), float64(gu[r*2*k+k+c])
			h[r*k+c] = g / (1 + math.Exp(-g)) * u
		}
	}
	out := filled(m*n, float32(math.NaN()))
	if err := ks.SiluAndMulQuantMatmul(ks.F32(out, m, n), ks.F32(gu, m, 2*k), w, ks.QTypeQ8_0,
		ks.WithBackend(ks.BackendCPU)); err != nil {
		t.Fatal(err)
	}
	checkMatmul(t, "out", out, h, wv, m, n, k, 16*math.Pow(2, -24))

	// an odd gate_up width: rejected, naming the op and gate_up; nothing written
	out7 := filled(m*n, 7)
	err := ks.SiluAndMulQuantMatmul(ks.F32(out7, m, n), ks.F32(gu[:m*127], m, 127), w, ks.QTypeQ8_0)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "silu_and_mul_quant_matmul", "gate_up")
	untouched(t, out7, 7)
}

// ---- quant_matmul_a8 -----------------------------------------------------------------------------

// a8Quantize quantizes x per block of 32 as docs/contracts.md#quant_matmul_a8 writes it, each step
// one float32 rounding: d per block (NaN for a block holding a NaN or an Inf, 0 when d < FLT_MIN)
// and the codes q.
func a8Quantize(x []float32) ([]float32, []float64) {
	var d []float32
	var q []float64
	for b := 0; b < len(x); b += 32 {
		blk := x[b : b+32]
		bad, amax := false, float32(0)
		for _, v := range blk {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				bad = true
			} else if a := float32(math.Abs(float64(v))); a > amax {
				amax = a
			}
		}
		dd := float32(amax / 127)
		if bad || !(dd >= math.SmallestNonzeroFloat32*(1<<23)) { // FLT_MIN = 2^-126
			if bad {
				dd = float32(math.NaN())
			} else {
				dd = 0
			}
			d = append(d, dd)
			q = append(q, make([]float64, 32)...)
			continue
		}
		inv := float32(127 / amax)
		d = append(d, dd)
		for _, v := range blk {
			c := math.RoundToEven(float64(float32(v * inv)))
			q = append(q, math.Max(-127, math.Min(127, c)))
		}
	}
	return d, q
}

func TestQuantMatmulA8(t *testing.T) {
	const m, n, k = 3, 3, 64
	packed, wv := q8_0Rows(n, k)
	w := ks.U8(packed, n, k/32*34)
	x := make([]float32, m*k)
	for i := range x {
		x[i] = xs[(i*3)%10] * (1 + float32(i%7)*0.375)
	}
	// row 0, block 0 at d = 1: ties go to even codes (0.5, 1.5, 2.5, -2.5 -> 0, 2, 2, -2)
	copy(x, []float32{127, 0.5, 1.5, 2.5, -2.5})
	// row 2: a NaN in block 1 makes every output of the row NaN
	x[2*k+40] = float32(math.NaN())
	d, q := a8Quantize(x)
	out, exact := filled(m*n, float32(math.NaN())), filled(m*n, float32(math.NaN()))
	if err := ks.QuantMatmulA8(ks.F32(out, m, n), ks.F32(x, m, k), w, ks.QTypeQ8_0,
		ks.WithBackend(ks.BackendCPU)); err != nil {
		t.Fatal(err)
	}
	if err := ks.QuantMatmul(ks.F32(exact, m, n), ks.F32(x, m, k), w, ks.QTypeQ8_0); err != nil {
		t.Fatal(err)
	}
	u := math.Pow(2, -24)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			g := float64(out[i*n+j])
			if i == 2 {
				if !math.IsNaN(g) {
					t.Errorf("row 2 (NaN in x): out[2][%d] = %v, want NaN", j, g)
				}
				continue
			}
			acc, abs, halfStep := 0.0, 0.0, 0.0
			for c := 0; c < k; c++ {
				db := float64(d[(i*k+c)/32])
				p := wv[j*k+c] * db * q[i*k+c]
				acc, abs = acc+p, abs+math.Abs(p)
				halfStep += math.Abs(wv[j*k+c]) * db / 2
			}
			tol := 1e-6 + 1e-6*math.Abs(acc) + float64(k/32+10)*u*abs
			if math.Abs(g-acc) > tol {
				t.Errorf("out[%d][%d] = %v, want %v", i, j, g, acc)
			}
			// QuantMatmul of the unquantized x: at most half a code step per element away
			if e := float64(exact[i*n+j]); math.Abs(g-e) > halfStep*1.0001+1e-5*(1+math.Abs(e)) {
				t.Errorf("out[%d][%d] = %v, QuantMatmul %v", i, j, g, e)
			}
		}
	}

	// a dense weight format: rejected, naming the op and qtype; nothing written
	out7 := filled(m*n, 7)
	err := ks.QuantMatmulA8(ks.F32(out7, m, n), ks.F32(x, m, k), ks.U8(make([]uint8, n*k*2), n, k*2), ks.QTypeF16)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "quant_matmul_a8", "qtype")
	untouched(t, out7, 7)
}

// ---- rotary_embedding_kv_append ----------------------------------------------------------------

// ropeKVInputs: q [3, 2, 8], k and v [3, 1, 8], caches [2 blocks, 2 slots, 1, 8] (filled, so
// untouched rows are compared too).
func ropeKVInputs() (q, k, v, kc, vc []float32) {
	q, k, v, kc, vc = make([]float32, 48), make([]float32, 24), make([]float32, 24), make([]float32, 32),
		make([]float32, 32)
	for i := range q {
		q[i] = xs[i%10] * (1 + float32(i)/16)
	}
	for i := range k {
		k[i] = xs[(i*3+1)%10] - 0.25*float32(i)
		v[i] = ws[i%5] * float32(i)
	}
	for i := range kc {
		kc[i], vc[i] = -float32(i), 100+float32(i)
	}
	return
}

func sameBits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s[%d] = %v, want %v (bit for bit)", what, i, got[i], want[i])
		}
	}
}

func TestRotaryEmbeddingKVAppendEqualsRotaryThenAppend(t *testing.T) {
	pos := []int32{0, 5, 100}
	slots := []int64{2, -1, 0} // slot -1 skipped
	for _, neox := range []bool{true, false} {
		q, k, v, kc, vc := ropeKVInputs()
		q2, k2 := append([]float32(nil), q...), append([]float32(nil), k...)
		kc2, vc2 := append([]float32(nil), kc...), append([]float32(nil), vc...)
		// rotary_dim 4 < head_dim 8: features 4..8 pass through
		if err := ks.RotaryEmbeddingKVAppend(ks.F32(q, 3, 2, 8), ks.F32(k, 3, 1, 8), ks.F32(v, 3, 1, 8), ks.I32(pos, 3), 4,
			10000, neox, ks.F32(kc, 2, 2, 1, 8), ks.F32(vc, 2, 2, 1, 8), ks.I64(slots, 3),
			ks.WithBackend(ks.BackendCPU)); err != nil {
			t.Fatal(err)
		}
		if err := ks.RotaryEmbedding(ks.F32(q2, 3, 2, 8), ks.F32(k2, 3, 1, 8), ks.I32(pos, 3), 4, 10000, neox); err != nil {
			t.Fatal(err)
		}
		if err := ks.KVCacheAppend(ks.F32(kc2, 2, 2, 1, 8), ks.F32(vc2, 2, 2, 1, 8), ks.F32(k2, 3, 1, 8), ks.F32(v, 3, 1, 8),
			ks.I64(slots, 3)); err != nil {
			t.Fatal(err)
		}
		sameBits(t, "q", q, q2)
		sameBits(t, "k", k, k2)
		sameBits(t, "k_cache", kc, kc2)
		sameBits(t, "v_cache", vc, vc2)
		// the call did something: slot 2 holds token 0's rotated k, slot 0 token 2's v
		sameBits(t, "k_cache slot 2", kc[16:24], k[0:8])
		sameBits(t, "v_cache slot 0", vc[0:8], v[16:24])
		if q0, _, _, _, _ := ropeKVInputs(); q[16] == q0[16] && q[17] == q0[17] {
			t.Error("q of token 1 (position 5) was not rotated")
		}
	}
}

func TestRotaryEmbeddingKVAppendRejectsVOverlappingKAndNilK(t *testing.T) {
	q, k, v, kc, vc := ropeKVInputs()
	q0, k0, kc0, vc0 := append([]float32(nil), q...), append([]float32(nil), k...), append([]float32(nil), kc...),
		append([]float32(nil), vc...)
	pos, slots := ks.I64([]int64{0, 1, 2}, 3), ks.I32([]int32{0, 1, 3}, 3)
	err := ks.RotaryEmbeddingKVAppend(ks.F32(q, 3, 2, 8), ks.F32(k, 3, 1, 8), ks.F32(k, 3, 1, 8), pos, 8, 10000, true,
		ks.F32(kc, 2, 2, 1, 8), ks.F32(vc, 2, 2, 1, 8), slots, ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "rotary_embedding_kv_append", "v and k overlap")
	err = ks.RotaryEmbeddingKVAppend(ks.F32(q, 3, 2, 8), nil, ks.F32(v, 3, 1, 8), pos, 8, 10000, true,
		ks.F32(kc, 2, 2, 1, 8), ks.F32(vc, 2, 2, 1, 8), slots)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "rotary_embedding_kv_append", "k")
	sameBits(t, "q", q, q0)
	sameBits(t, "k", k, k0)
	sameBits(t, "k_cache", kc, kc0)
	sameBits(t, "v_cache", vc, vc0)
}

// ---- fused_add_rms_norm_quant_matmul_rope_kv_append --------------------------------------------

// normRopeInputs: one token, H = 2, KVH = 1, D = 8 (out [1, 32] = q | k | v), K = 64 (Q8_0 weight
// [32, 68]), caches [2 blocks, 2 slots, 1, 8] (filled, so untouched rows are compared too).
func normRopeInputs() (packed []uint8, x, res, nw, kc, vc []float32) {
	packed, _ = q8_0Rows(32, 64)
	x, res, nw = make([]float32, 64), make([]float32, 64), make([]float32, 64)
	for i := range x {
		x[i] = xs[i%10] * (1 + float32(i)/64)
		res[i] = xs[(i*3+1)%10] * 0.5
		nw[i] = ws[i%5] + 0.125
	}
	kc, vc = make([]float32, 32), make([]float32, 32)
	for i := range kc {
		kc[i], vc[i] = -float32(i), 100+float32(i)
	}
	return
}

func TestFusedAddRMSNormQuantMatmulRopeKVAppendEqualsTheTwoCalls(t *testing.T) {
	const h, kvh, d = 2, 1, 8
	pos := []int32{5}
	slots := []int64{3} // block 1, offset 1
	packed, x, res, nw, kc0, vc0 := normRopeInputs()
	w := ks.U8(packed, 32, 68)
	for _, withX := range []bool{true, false} {
		for _, neox := range []bool{true, false} {
			out, resOut := filled(32, float32(math.NaN())), filled(64, float32(math.NaN()))
			kc, vc := append([]float32(nil), kc0...), append([]float32(nil), vc0...)
			out2, resOut2 := filled(32, float32(math.NaN())), filled(64, float32(math.NaN()))
			kc2, vc2 := append([]float32(nil), kc0...), append([]float32(nil), vc0...)
			var xt, ro, ro2 *ks.Tensor
			if withX {
				xt, ro, ro2 = ks.F32(x, 1, 64), ks.F32(resOut, 1, 64), ks.F32(resOut2, 1, 64)
			}
			// rotary_dim 4 < head_dim 8: features 4..8 pass through
			if err := ks.FusedAddRMSNormQuantMatmulRopeKVAppend(ks.F32(out, 1, 32), ro, xt, ks.F32(res, 1, 64),
				ks.F32(nw, 64), 1e-5, w, ks.QTypeQ8_0, h, kvh, ks.I32(pos, 1), 4, 10000, neox, ks.F32(kc, 2, 2, 1, 8),
				ks.F32(vc, 2, 2, 1, 8), ks.I64(slots, 1), ks.WithBackend(ks.BackendCPU)); err != nil {
				t.Fatal(err)
			}
			// the two calls: the norm + matmul into out2, then RoPE + append on its column slices
			if err := ks.FusedAddRMSNormQuantMatmul(ks.F32(out2, 1, 32), ro2, xt, ks.F32(res, 1, 64), ks.F32(nw, 64),
				1e-5, w, ks.QTypeQ8_0); err != nil {
				t.Fatal(err)
			}
			plain := append([]float32(nil), out2...)
			if err := ks.RotaryEmbeddingKVAppend(ks.F32(out2[:h*d], 1, h, d), ks.F32(out2[h*d:(h+kvh)*d], 1, kvh, d),
				ks.F32(out2[(h+kvh)*d:], 1, kvh, d), ks.I32(pos, 1), 4, 10000, neox, ks.F32(kc2, 2, 2, 1, 8),
				ks.F32(vc2, 2, 2, 1, 8), ks.I64(slots, 1)); err != nil {
				t.Fatal(err)
			}
			sameBits(t, "out", out, out2)
			sameBits(t, "residual_out", resOut, resOut2)
			sameBits(t, "k_cache", kc, kc2)
			sameBits(t, "v_cache", vc, vc2)
			// the call did something: q rotated, slot 3 holds the rotated k and v, the rest kept
			if math.Float32bits(out[0]) == math.Float32bits(plain[0]) &&
				math.Float32bits(out[2]) == math.Float32bits(plain[2]) {
				t.Errorf("q was not rotated (x %v, neox %v)", withX, neox)
			}
			sameBits(t, "k_cache slot 3", kc[24:32], out[16:24])
			sameBits(t, "v_cache slot 3", vc[24:32], out[24:32])
			sameBits(t, "k_cache other slots", kc[:24], kc0[:24])
			if !withX && !math.IsNaN(float64(resOut[0])) {
				t.Error("residual_out written without x")
			}
		}
	}
}

func TestFusedAddRMSNormQuantMatmulRopeKVAppendRejectsZeroHeads(t *testing.T) {
	packed, x, res, nw, kc, vc := normRopeInputs()
	kc0, vc0 := append([]float32(nil), kc...), append([]float32(nil), vc...)
	out, resOut := filled(32, 7), filled(64, 7)
	err := ks.FusedAddRMSNormQuantMatmulRopeKVAppend(ks.F32(out, 1, 32), ks.F32(resOut, 1, 64), ks.F32(x, 1, 64),
		ks.F32(res, 1, 64), ks.F32(nw, 64), 1e-5, ks.U8(packed, 32, 68), ks.QTypeQ8_0, 0, 1,
		ks.I64([]int64{5}, 1), 8, 10000, false, ks.F32(kc, 2, 2, 1, 8), ks.F32(vc, 2, 2, 1, 8),
		ks.I32([]int32{3}, 1), ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "fused_add_rms_norm_quant_matmul_rope_kv_append",
		"num_heads")
	untouched(t, out, 7)
	untouched(t, resOut, 7)
	sameBits(t, "k_cache", kc, kc0)
	sameBits(t, "v_cache", vc, vc0)
}

// ---- rotary_embedding_kv_append_paged_attention ------------------------------------------------

// ropeAttnCase: q [3, 6, 8], k and v [3, 2, 8] (GQA: 6 query heads, 2 kv heads), caches
// [6 blocks, 2 slots, 2, 8], random (so untouched cache rows are compared too).
type ropeAttnCase struct {
	q, k, v, kc, vc []float32
}

func ropeAttnInputs(seed int64) ropeAttnCase {
	r := rand.New(rand.NewSource(seed))
	fill := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = float32(r.NormFloat64())
		}
		return s
	}
	return ropeAttnCase{fill(3 * 6 * 8), fill(3 * 2 * 8), fill(3 * 2 * 8), fill(6 * 2 * 2 * 8), fill(6 * 2 * 2 * 8)}
}

func (c ropeAttnCase) clone() ropeAttnCase {
	cp := func(s []float32) []float32 { return append([]float32(nil), s...) }
	return ropeAttnCase{cp(c.q), cp(c.k), cp(c.v), cp(c.kc), cp(c.vc)}
}

func TestRotaryEmbeddingKVAppendPagedAttentionEqualsTheTwoCalls(t *testing.T) {
	const tok, h, kvh, d, rd, theta, scale = 3, 6, 2, 8, 4, 10000.0, 0.35
	cases := []struct {
		name                string
		positions, slots    *ks.Tensor
		blockTables, seqIDs *ks.Tensor
		contextLens         *ks.Tensor
		appended            []int // the slots written
	}{
		// a decode step: token t is the newest position (context_lens[t] - 1) of sequence t
		{"decode, seq_ids nil", ks.I32([]int32{2, 0, 3}, 3), ks.I64([]int64{0, 2, 5}, 3),
			ks.I32([]int32{4, 0, 1, 5, 3, 2}, 3, 2), nil, ks.I32([]int32{3, 1, 4}, 3), []int{0, 2, 5}},
		// tokens 0 and 1 of sequence 1 (token 1 reads the slot token 0 appends), token 2 of sequence 0
		{"prefill chunk, seq_ids given", ks.I64([]int64{1, 2, 0}, 3), ks.I32([]int32{11, 2, 6}, 3),
			ks.I32([]int32{3, 2, 5, 1}, 2, 2), ks.I32([]int32{1, 1, 0}, 3), ks.I32([]int32{2, 3, 1}, 3),
			[]int{11, 2, 6}},
	}
	for ci, c := range cases {
		for _, neox := range []bool{true, false} {
			in := ropeAttnInputs(int64(10 + ci))
			a, b := in.clone(), in.clone()
			out, out2 := filled(tok*h*d, float32(math.NaN())), filled(tok*h*d, float32(math.NaN()))
			if err := ks.RotaryEmbeddingKVAppendPagedAttention(ks.F32(out, tok, h, d), ks.F32(a.q, tok, h, d),
				ks.F32(a.k, tok, kvh, d), ks.F32(a.v, tok, kvh, d), c.positions, rd, theta, neox,
				ks.F32(a.kc, 6, 2, kvh, d), ks.F32(a.vc, 6, 2, kvh, d), c.slots, c.blockTables, c.seqIDs,
				c.contextLens, scale, ks.WithBackend(ks.BackendCPU)); err != nil {
				t.Fatal(err)
			}
			// the two calls on copies of the inputs
			if err := ks.RotaryEmbeddingKVAppend(ks.F32(b.q, tok, h, d), ks.F32(b.k, tok, kvh, d),
				ks.F32(b.v, tok, kvh, d), c.positions, rd, theta, neox, ks.F32(b.kc, 6, 2, kvh, d),
				ks.F32(b.vc, 6, 2, kvh, d), c.slots, ks.WithBackend(ks.BackendCPU)); err != nil {
				t.Fatal(err)
			}
			if err := ks.PagedAttention(ks.F32(out2, tok, h, d), ks.F32(b.q, tok, h, d), ks.F32(b.kc, 6, 2, kvh, d),
				ks.F32(b.vc, 6, 2, kvh, d), c.blockTables, c.seqIDs, c.contextLens, scale,
				ks.WithBackend(ks.BackendCPU)); err != nil {
				t.Fatal(err)
			}
			what := func(s string) string { return s + " (" + c.name + map[bool]string{true: ", neox)", false: ")"}[neox] }
			sameBits(t, what("out"), out, out2)
			sameBits(t, what("q"), a.q, b.q)
			sameBits(t, what("k"), a.k, b.k)
			sameBits(t, what("k_cache"), a.kc, b.kc)
			sameBits(t, what("v_cache"), a.vc, b.vc)
			// the call did something: every out value written, q rotated, features past rotary_dim kept,
			// the slots hold the rotated k and v, the other cache rows untouched
			for i, o := range out {
				if math.IsNaN(float64(o)) {
					t.Fatalf("%s[%d] not written", what("out"), i)
				}
			}
			if a.q[0] == in.q[0] && a.q[1] == in.q[1] && a.q[2] == in.q[2] && a.q[3] == in.q[3] {
				t.Errorf("%s: q of token 0 (position 2 or 1) was not rotated", what(""))
			}
			sameBits(t, what("q past rotary_dim"), a.q[rd:d], in.q[rd:d])
			row := kvh * d
			written := map[int]bool{}
			for ti, slot := range c.appended {
				written[slot] = true
				sameBits(t, what("k_cache slot"), a.kc[slot*row:(slot+1)*row], a.k[ti*row:(ti+1)*row])
				sameBits(t, what("v_cache slot"), a.vc[slot*row:(slot+1)*row], in.v[ti*row:(ti+1)*row])
			}
			for slot := 0; slot < 12; slot++ {
				if !written[slot] {
					sameBits(t, what("k_cache other slots"), a.kc[slot*row:(slot+1)*row], in.kc[slot*row:(slot+1)*row])
				}
			}
		}
	}
}

func TestRotaryEmbeddingKVAppendPagedAttentionRejectsBadContextAndOutOverK(t *testing.T) {
	const tok, h, kvh, d = 3, 6, 2, 8
	in := ropeAttnInputs(20)
	a := in.clone()
	buf := filled(tok*h*d, 7) // out; its first tok*kvh*d values are also k in the second call
	pos, slots := ks.I32([]int32{2, 0, 3}, 3), ks.I64([]int64{0, 2, 5}, 3)
	bt := ks.I32([]int32{4, 0, 1, 5, 3, 2}, 3, 2)
	// context_lens[1] = 5 > max_blocks_per_seq * block_size = 4
	err := ks.RotaryEmbeddingKVAppendPagedAttention(ks.F32(buf, tok, h, d), ks.F32(a.q, tok, h, d),
		ks.F32(a.k, tok, kvh, d), ks.F32(a.v, tok, kvh, d), pos, 4, 10000, true, ks.F32(a.kc, 6, 2, kvh, d),
		ks.F32(a.vc, 6, 2, kvh, d), slots, bt, nil, ks.I32([]int32{3, 5, 4}, 3), 0.35, ks.WithBackend(ks.BackendCPU))
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "rotary_embedding_kv_append_paged_attention",
		"context_lens[1] = 5")
	untouched(t, buf, 7)
	// out overlapping k (the fused op's own rule)
	kIn := append([]float32(nil), buf[:tok*kvh*d]...)
	err = ks.RotaryEmbeddingKVAppendPagedAttention(ks.F32(buf, tok, h, d), ks.F32(a.q, tok, h, d),
		ks.F32(buf[:tok*kvh*d], tok, kvh, d), ks.F32(a.v, tok, kvh, d), pos, 4, 10000, true,
		ks.F32(a.kc, 6, 2, kvh, d), ks.F32(a.vc, 6, 2, kvh, d), slots, bt, nil, ks.I32([]int32{3, 1, 4}, 3), 0.35)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "rotary_embedding_kv_append_paged_attention",
		"out and k overlap")
	sameBits(t, "out / k", buf[:tok*kvh*d], kIn)
	untouched(t, buf, 7)
	// a nil k is named before the library is called
	err = ks.RotaryEmbeddingKVAppendPagedAttention(ks.F32(buf, tok, h, d), ks.F32(a.q, tok, h, d), nil,
		ks.F32(a.v, tok, kvh, d), pos, 4, 10000, true, ks.F32(a.kc, 6, 2, kvh, d), ks.F32(a.vc, 6, 2, kvh, d), slots,
		bt, nil, ks.I32([]int32{3, 1, 4}, 3), 0.35)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "rotary_embedding_kv_append_paged_attention", "k")
	sameBits(t, "q", a.q, in.q)
	sameBits(t, "k", a.k, in.k)
	sameBits(t, "k_cache", a.kc, in.kc)
	sameBits(t, "v_cache", a.vc, in.vc)
}

// ---- paged_attention_after_append ----------------------------------------------------------------

func TestPagedAttentionAfterAppendSameBitsAsPagedAttention(t *testing.T) {
	const tok, h, kvh, d, scale = 3, 6, 2, 8, 0.35
	in := ropeAttnInputs(30)
	bt, ctx := ks.I32([]int32{4, 0, 1, 5, 3, 2}, 3, 2), ks.I32([]int32{3, 1, 4}, 3)
	for _, seqIDs := range []*ks.Tensor{nil, ks.I32([]int32{2, 0, 1}, 3)} {
		want := filled(tok*h*d, float32(math.NaN()))
		if err := ks.PagedAttention(ks.F32(want, tok, h, d), ks.F32(in.q, tok, h, d), ks.F32(in.kc, 6, 2, kvh, d),
			ks.F32(in.vc, 6, 2, kvh, d), bt, seqIDs, ctx, scale, ks.WithBackend(ks.BackendCPU)); err != nil {
			t.Fatal(err)
		}
		for i, o := range want {
			if math.IsNaN(float64(o)) {
				t.Fatalf("paged_attention out[%d] not written", i)
			}
		}
		for _, fresh := range []int64{0, 1} {
			out := filled(tok*h*d, float32(math.NaN()))
			if err := ks.PagedAttentionAfterAppend(ks.F32(out, tok, h, d), ks.F32(in.q, tok, h, d),
				ks.F32(in.kc, 6, 2, kvh, d), ks.F32(in.vc, 6, 2, kvh, d), bt, seqIDs, ctx, scale, fresh,
				ks.WithBackend(ks.BackendCPU)); err != nil {
				t.Fatal(err)
			}
			sameBits(t, fmt.Sprintf("out (fresh_keys %d, seq_ids given %v)", fresh, seqIDs != nil), out, want)
		}
	}
}

func TestPagedAttentionAfterAppendRejectsNegativeFreshKeys(t *testing.T) {
	const tok, h, kvh, d = 3, 6, 2, 8
	in := ropeAttnInputs(31)
	out := filled(tok*h*d, 7)
	err := ks.PagedAttentionAfterAppend(ks.F32(out, tok, h, d), ks.F32(in.q, tok, h, d), ks.F32(in.kc, 6, 2, kvh, d),
		ks.F32(in.vc, 6, 2, kvh, d), ks.I32([]int32{4, 0, 1, 5, 3, 2}, 3, 2), nil, ks.I32([]int32{3, 1, 4}, 3), 0.35,
		-1)
	checkErr(t, err, ks.ErrInvalidArgument, ks.StatusInvalidArgument, "paged_attention_after_append", "fresh_keys")
	untouched(t, out, 7)
}
