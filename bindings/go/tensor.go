package kernscope

/*
#include "ksgo.h"
*/
import "C"

import (
	"fmt"
	"math/bits"
	"unsafe"
)

// DType is a DLPack dtype. The library takes fp16, bf16 and fp32 floats, int32/int64 ids and
// uint8 packed blocks; other values are passed through (the library answers
// ErrUnsupportedDtype).
type DType struct {
	Code  uint8
	Bits  uint8
	Lanes uint16
}

var (
	DTypeF16  = DType{C.kDLFloat, 16, 1}
	DTypeBF16 = DType{C.kDLBfloat, 16, 1}
	DTypeF32  = DType{C.kDLFloat, 32, 1}
	DTypeF64  = DType{C.kDLFloat, 64, 1}
	DTypeI32  = DType{C.kDLInt, 32, 1}
	DTypeI64  = DType{C.kDLInt, 64, 1}
	DTypeU8   = DType{C.kDLUInt, 8, 1}
)

// Size is the bytes of one element.
func (d DType) Size() int { return (int(d.Bits)*int(d.Lanes) + 7) / 8 }

func (d DType) String() string {
	switch d {
	case DTypeF16:
		return "fp16"
	case DTypeBF16:
		return "bf16"
	case DTypeF32:
		return "fp32"
	case DTypeF64:
		return "fp64"
	case DTypeI32:
		return "int32"
	case DTypeI64:
		return "int64"
	case DTypeU8:
		return "uint8"
	}
	return fmt.Sprintf("dlpack(code=%d,bits=%d,lanes=%d)", d.Code, d.Bits, d.Lanes)
}

// Device is a DLPack device.
type Device struct {
	Type int32 // DLDeviceType: 1 CPU, 2 CUDA, ...
	ID   int32
}

var CPU = Device{C.kDLCPU, 0}

// CUDA is CUDA device id.
func CUDA(id int) Device { return Device{C.kDLCUDA, int32(id)} }

// Tensor is a view of a Go slice (or of device memory) with a dtype, shape, strides and
// device. It keeps the slice alive. The With/Reshape/On methods return new views.
type Tensor struct {
	data       unsafe.Pointer // Go memory, or nil for device/raw memory (ptr)
	ptr        uintptr
	nbytes     int // bytes reachable from data; -1 when unknown (raw)
	dtype      DType
	shape      []int64
	strides    []int64
	device     Device
	byteOffset uint64
}

func hostTensor(p unsafe.Pointer, n, elem int, dt DType, shape []int64) *Tensor {
	if len(shape) == 0 {
		shape = []int64{int64(n)}
	}
	if n == 0 {
		p = nil
	}
	return &Tensor{data: p, nbytes: n * elem, dtype: dt, shape: append([]int64(nil), shape...), device: CPU}
}

func ptrOf[T any](s []T) unsafe.Pointer {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Pointer(&s[0])
}

// F32 views data as fp32 with the given shape (default: [len(data)]).
func F32(data []float32, shape ...int64) *Tensor {
	return hostTensor(ptrOf(data), len(data), 4, DTypeF32, shape)
}

// F64 views data as fp64 (the ops reject it; kept for completeness and tests).
func F64(data []float64, shape ...int64) *Tensor {
	return hostTensor(ptrOf(data), len(data), 8, DTypeF64, shape)
}

// F16Bits views IEEE binary16 bit patterns.
func F16Bits(data []uint16, shape ...int64) *Tensor {
	return hostTensor(ptrOf(data), len(data), 2, DTypeF16, shape)
}

// BF16Bits views bfloat16 bit patterns.
func BF16Bits(data []uint16, shape ...int64) *Tensor {
	return hostTensor(ptrOf(data), len(data), 2, DTypeBF16, shape)
}

// I32 views int32 ids.
func I32(data []int32, shape ...int64) *Tensor {
	return hostTensor(ptrOf(data), len(data), 4, DTypeI32, shape)
}

// I64 views int64 ids (also argmax's output).
func I64(data []int64, shape ...int64) *Tensor {
	return hostTensor(ptrOf(data), len(data), 8, DTypeI64, shape)
}

// U8 views packed blocks ([rows, row_bytes]).
func U8(data []uint8, shape ...int64) *Tensor {
	return hostTensor(ptrOf(data), len(data), 1, DTypeU8, shape)
}

// FromPointer views memory this package cannot check, e.g. a CUDA device pointer (with
// dev = CUDA(0)). The caller keeps it valid and correctly sized for every call.
func FromPointer(ptr uintptr, dt DType, dev Device, shape ...int64) *Tensor {
	return &Tensor{ptr: ptr, nbytes: -1, dtype: dt, shape: append([]int64(nil), shape...), device: dev}
}

func (t *Tensor) DType() DType     { return t.dtype }
func (t *Tensor) Shape() []int64   { return append([]int64(nil), t.shape...) }
func (t *Tensor) Device() Device   { return t.device }
func (t *Tensor) Strides() []int64 { return append([]int64(nil), t.strides...) }

func (t *Tensor) clone() *Tensor {
	c := *t
	c.shape = append([]int64(nil), t.shape...)
	c.strides = append([]int64(nil), t.strides...)
	if t.strides == nil {
		c.strides = nil
	}
	return &c
}

// WithStrides sets strides in elements (the library takes compact row-major ones).
func (t *Tensor) WithStrides(strides ...int64) *Tensor {
	c := t.clone()
	c.strides = append([]int64{}, strides...)
	return c
}

// Reshape views the same memory with another shape (compact strides).
func (t *Tensor) Reshape(shape ...int64) *Tensor {
	c := t.clone()
	c.shape, c.strides = append([]int64(nil), shape...), nil
	return c
}

// WithDType views the memory as another dtype (e.g. uint16 storage as BF16).
func (t *Tensor) WithDType(dt DType) *Tensor {
	c := t.clone()
	c.dtype = dt
	return c
}

// WithByteOffset sets DLTensor.byte_offset (checked against the slice).
func (t *Tensor) WithByteOffset(off uint64) *Tensor {
	c := t.clone()
	c.byteOffset = off
	return c
}

// OnDevice labels the memory as living on dev; the caller asserts it is usable there.
func (t *Tensor) OnDevice(dev Device) *Tensor {
	c := t.clone()
	c.device = dev
	return c
}

// describe fills d and checks that the view fits its slice (host memory) so the library can
// never reach past it.
func (t *Tensor) describe(op, arg string, d *C.ksgo_desc) error {
	if t == nil {
		return newError(StatusInvalidArgument, "%s: %s is nil", op, arg)
	}
	if len(t.shape) > C.KSGO_MAX_DIMS {
		return newError(StatusInvalidArgument, "%s: %s has %d dimensions, the Go binding takes up to %d", op, arg,
			len(t.shape), C.KSGO_MAX_DIMS)
	}
	if t.strides != nil && len(t.strides) != len(t.shape) {
		return newError(StatusInvalidArgument, "%s: %s strides %v do not match shape %v", op, arg, t.strides, t.shape)
	}
	if t.nbytes >= 0 {
		need, ok := t.span()
		if !ok || need > uint64(t.nbytes) {
			return newError(StatusInvalidArgument, "%s: %s: shape %v strides %v of %v (byte offset %d) does not fit its %d-byte slice",
				op, arg, t.shape, t.strides, t.dtype, t.byteOffset, t.nbytes)
		}
	}
	d.ndim = C.int32_t(len(t.shape))
	d.code, d.bits, d.lanes = C.uint8_t(t.dtype.Code), C.uint8_t(t.dtype.Bits), C.uint16_t(t.dtype.Lanes)
	d.device_type, d.device_id = C.int32_t(t.device.Type), C.int32_t(t.device.ID)
	d.byte_offset = C.uint64_t(t.byteOffset)
	d.device_ptr = C.uint64_t(t.ptr)
	for i, s := range t.shape {
		d.shape[i] = C.int64_t(s)
	}
	d.has_strides = 0
	if t.strides != nil {
		d.has_strides = 1
		for i, s := range t.strides {
			d.strides[i] = C.int64_t(s)
		}
	}
	return nil
}

// span is the number of bytes from the base pointer to one past the last reachable element.
func (t *Tensor) span() (uint64, bool) {
	elems := uint64(1)
	for i, s := range t.shape {
		if s < 0 {
			return 0, false
		}
		if s == 0 {
			return t.byteOffset, true
		}
		if t.strides == nil {
			hi, lo := bits.Mul64(elems, uint64(s))
			if hi != 0 {
				return 0, false
			}
			elems = lo
		} else if t.strides[i] < 0 {
			return 0, false
		}
	}
	if t.strides != nil {
		elems = 1
		for i, s := range t.shape {
			hi, lo := bits.Mul64(uint64(s-1), uint64(t.strides[i]))
			if hi != 0 || lo > 1<<62 {
				return 0, false
			}
			elems += lo
			if elems > 1<<62 {
				return 0, false
			}
		}
	}
	hi, lo := bits.Mul64(elems, uint64(t.dtype.Size()))
	if hi != 0 || lo > 1<<62 || t.byteOffset > 1<<62 {
		return 0, false
	}
	return lo + t.byteOffset, true
}
