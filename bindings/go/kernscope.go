// Package kernscope is the Go binding of kernscope: LLM inference operators behind a C ABI
// over DLPack tensors (libkernscope.so, include/kernscope/kernscope.h).
//
// Tensors are views (*Tensor) over Go slices, or over device pointers for CUDA, carrying
// dtype, shape, strides and device. Every op returns an error: a *Error holding the Status
// and the library's message, which names the op and the argument. Each status has a sentinel
// for errors.Is (ErrInvalidArgument, ErrUnsupportedDtype, ...). Validation runs before any
// write: after an error every output is unchanged.
//
// Building: cgo needs the headers and the library, e.g.
//
//	CGO_CFLAGS="-I$REPO/include -I/usr/include" \
//	CGO_LDFLAGS="-L$BUILD -Wl,-rpath,$BUILD" go test ./...
//
// The library's last error and ForceVariant pins are per OS thread. Ops read the error on
// the thread that failed (they lock the goroutine to its thread for the call); pins only
// apply to a goroutine that has called runtime.LockOSThread.
package kernscope

/*
#cgo LDFLAGS: -lkernscope
#include <stdlib.h>
#include "ksgo.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Status is a failing ks_status_t. It implements error; the ErrXxx sentinels are Status
// values, and *Error unwraps to its Status, so errors.Is(err, ErrInvalidArgument) works.
type Status int

const (
	StatusInvalidArgument    Status = C.KS_ERROR_INVALID_ARGUMENT
	StatusUnsupportedDtype   Status = C.KS_ERROR_UNSUPPORTED_DTYPE
	StatusUnsupportedDevice  Status = C.KS_ERROR_UNSUPPORTED_DEVICE
	StatusBackendUnavailable Status = C.KS_ERROR_BACKEND_UNAVAILABLE
	StatusCUDA               Status = C.KS_ERROR_CUDA
	StatusOutOfMemory        Status = C.KS_ERROR_OUT_OF_MEMORY
	StatusInternal           Status = C.KS_ERROR_INTERNAL
)

// Sentinels for errors.Is.
var (
	ErrInvalidArgument    error = StatusInvalidArgument
	ErrUnsupportedDtype   error = StatusUnsupportedDtype
	ErrUnsupportedDevice  error = StatusUnsupportedDevice
	ErrBackendUnavailable error = StatusBackendUnavailable
	ErrCUDA               error = StatusCUDA
	ErrOutOfMemory        error = StatusOutOfMemory
	ErrInternal           error = StatusInternal
)

// String is the library's stable name, e.g. "KS_ERROR_INVALID_ARGUMENT".
func (s Status) String() string {
	p := C.ks_status_name(C.ks_status_t(s))
	if p == nil {
		return fmt.Sprintf("KS_STATUS_%d", int(s))
	}
	return C.GoString(p)
}

func (s Status) Error() string { return "kernscope: " + s.String() }

// Error is a failed call: the status and the message of ks_last_error(), e.g.
// "rms_norm: eps must be ...". Checks made by this package before calling the library (a
// shape that does not fit its slice, too many dimensions) produce the same form.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return "kernscope: " + e.Status.String() + ": " + e.Message }

// Unwrap returns the Status, so errors.Is matches the ErrXxx sentinels.
func (e *Error) Unwrap() error { return e.Status }

func newError(s Status, format string, args ...any) error {
	return &Error{Status: s, Message: fmt.Sprintf(format, args...)}
}

// call runs f on a locked OS thread and, on failure, reads ks_last_error() there.
func call(f func() C.ks_status_t) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := f()
	if st == C.KS_SUCCESS {
		return nil
	}
	return &Error{Status: Status(st), Message: C.GoString(C.ks_last_error())}
}

// Backend picks where a call runs.
type Backend int

const (
	BackendAuto Backend = C.KS_BACKEND_AUTO // by the tensors' device, then the registry
	BackendCPU  Backend = C.KS_BACKEND_CPU
	BackendCUDA Backend = C.KS_BACKEND_CUDA
)

// QType is the storage format of packed weight rows (GGUF block formats).
type QType int

const (
	QTypeNone QType = C.KS_QTYPE_NONE // dense float tensor
	QTypeF32  QType = C.KS_QTYPE_F32
	QTypeF16  QType = C.KS_QTYPE_F16
	QTypeBF16 QType = C.KS_QTYPE_BF16
	QTypeQ4_0 QType = C.KS_QTYPE_Q4_0
	QTypeQ4_1 QType = C.KS_QTYPE_Q4_1
	QTypeQ8_0 QType = C.KS_QTYPE_Q8_0
)

// Version is "MAJOR.MINOR.PATCH" of the loaded library.
func Version() string { return C.GoString(C.ks_version()) }

// BackendAvailable reports whether the backend is compiled in and usable (CUDA: a device exists).
func BackendAvailable(b Backend) bool { return C.ks_backend_available(C.ks_backend_t(b)) != 0 }

// SetDeterministic turns deterministic (batch-invariant) mode on or off, process-wide: a
// row's result never depends on the call's row count or the row's place.
func SetDeterministic(on bool) error {
	v := C.int(0)
	if on {
		v = 1
	}
	return call(func() C.ks_status_t { return C.ks_set_deterministic(v) })
}

// Deterministic reports whether deterministic mode is on (KS_DETERMINISTIC=1 at start).
func Deterministic() bool { return C.ks_deterministic() != 0 }

// LastError is ks_last_error() of the calling OS thread ("" after a success). Errors returned
// by this package already carry their message; this is meaningful only on a goroutine that
// holds runtime.LockOSThread.
func LastError() string { return C.GoString(C.ks_last_error()) }

// QTypeInfo returns the elements and bytes per block of a packed format.
func QTypeInfo(q QType) (blockSize, blockBytes int64, err error) {
	var bs, bb C.int64_t
	err = call(func() C.ks_status_t { return C.ks_qtype_info(C.ks_qtype_t(q), &bs, &bb) })
	return int64(bs), int64(bb), err
}

// VariantInfo describes one registered variant.
type VariantInfo struct {
	Op, Backend, Name string
	DTypes            string // comma list: "fp16,bf16,fp32"
	Summary           string
}

// Variants lists every registered variant (every op, every backend).
func Variants() ([]VariantInfo, error) {
	n := int(C.ks_variant_count())
	out := make([]VariantInfo, 0, n)
	for i := 0; i < n; i++ {
		var info C.ks_variant_info_t
		if err := call(func() C.ks_status_t { return C.ks_variant_info(C.size_t(i), &info) }); err != nil {
			return out, err
		}
		out = append(out, VariantInfo{C.GoString(info.op), C.GoString(info.backend), C.GoString(info.name),
			C.GoString(info.dtypes), C.GoString(info.summary)})
	}
	return out, nil
}

// Which returns the variant the registry picks for (op, dtype, backend) and why.
// dtype: "fp16" | "bf16" | "fp32" (for packed-weight ops: the activation dtype).
func Which(op, dtype string, b Backend) (variant, reason string, err error) {
	return which(op, dtype, func(cop, cdt *C.char, v, r **C.char) C.ks_status_t {
		return C.ks_which(cop, cdt, C.ks_backend_t(b), v, r)
	})
}

// WhichShape is Which for a call of shape (rows, cols) as the routing table keys it
// (ks_which_shape; docs/routing.md#shape-keys). Errors: an unknown op, dtype or backend, or a
// negative rows or cols (StatusInvalidArgument); a backend that is not available.
func WhichShape(op, dtype string, b Backend, rows, cols int64) (variant, reason string, err error) {
	return which(op, dtype, func(cop, cdt *C.char, v, r **C.char) C.ks_status_t {
		return C.ks_which_shape(cop, cdt, C.ks_backend_t(b), C.int64_t(rows), C.int64_t(cols), v, r)
	})
}

func which(op, dtype string, call func(cop, cdt *C.char, v, r **C.char) C.ks_status_t) (string, string, error) {
	cop, cdt := C.CString(op), C.CString(dtype)
	defer C.free(unsafe.Pointer(cop))
	defer C.free(unsafe.Pointer(cdt))
	runtime.LockOSThread() // the returned strings are thread-local
	defer runtime.UnlockOSThread()
	var v, r *C.char
	if st := call(cop, cdt, &v, &r); st != C.KS_SUCCESS {
		return "", "", &Error{Status: Status(st), Message: C.GoString(C.ks_last_error())}
	}
	return C.GoString(v), C.GoString(r), nil
}

// RoutingTable returns the active routing table as JSON (first matching cell wins).
func RoutingTable() (string, error) {
	var j *C.char
	if st := C.ks_routing_table(&j); st != C.KS_SUCCESS {
		return "", &Error{Status: Status(st), Message: C.GoString(C.ks_last_error())}
	}
	return C.GoString(j), nil
}

// ForceVariant pins op to variant for calls on the calling OS thread (hold
// runtime.LockOSThread for it to mean anything). variant "" returns op to automatic selection;
// op "" clears every pin.
func ForceVariant(op, variant string) error {
	var cop, cvar *C.char
	if op != "" {
		cop = C.CString(op)
		defer C.free(unsafe.Pointer(cop))
	}
	if variant != "" {
		cvar = C.CString(variant)
		defer C.free(unsafe.Pointer(cvar))
	}
	return call(func() C.ks_status_t { return C.ks_force_variant(cop, cvar) })
}

// ForcedVariant is the variant pinned for op on the calling OS thread by ForceVariant, or ""
// when none.
func ForcedVariant(op string) (string, error) {
	cop := C.CString(op)
	defer C.free(unsafe.Pointer(cop))
	var v *C.char
	if err := call(func() C.ks_status_t { return C.ks_forced_variant(cop, &v) }); err != nil {
		return "", err
	}
	if v == nil {
		return "", nil
	}
	return C.GoString(v), nil
}

// OpRunsVariantsOf is the op whose variants the entry point op runs, for entry points without
// variants of their own ("paged_attention" for "paged_attention_after_append"); "" for any other.
func OpRunsVariantsOf(op string) string {
	cop := C.CString(op)
	defer C.free(unsafe.Pointer(cop))
	return goStringOrEmpty(C.ks_op_runs_variants_of(cop))
}

// OpColsFactors names the factors where op's routing key cols (WhichShape) is a product
// ("N x K (...)" for quant_matmul, "max_blocks_per_seq x block_size (...)" for
// paged_attention); "" where cols is one number.
func OpColsFactors(op string) string {
	cop := C.CString(op)
	defer C.free(unsafe.Pointer(cop))
	return goStringOrEmpty(C.ks_op_cols_factors(cop))
}

func goStringOrEmpty(v *C.char) string {
	if v == nil {
		return ""
	}
	return C.GoString(v)
}

// LastLaunchConfig is the launch configuration of the calling OS thread's last CUDA launch of
// op, as text; "" if none.
func LastLaunchConfig(op string) string {
	cop := C.CString(op)
	defer C.free(unsafe.Pointer(cop))
	return C.GoString(C.ks_last_launch_config(cop))
}
