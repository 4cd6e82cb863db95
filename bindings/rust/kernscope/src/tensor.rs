use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;
use std::os::raw::c_void;
use std::ptr;

use kernscope_sys as sys;

use crate::error::{Error, Result, Status};

/// A DLPack dtype (`code`, `bits`, `lanes`). The library takes fp16, bf16 and fp32 floats,
/// int32/int64 ids and uint8 packed blocks; any other value can be expressed (the library
/// then answers `Status::UnsupportedDtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

impl DType {
    pub const F16: DType = DType { code: sys::kDLFloat, bits: 16, lanes: 1 };
    pub const BF16: DType = DType { code: sys::kDLBfloat, bits: 16, lanes: 1 };
    pub const F32: DType = DType { code: sys::kDLFloat, bits: 32, lanes: 1 };
    pub const F64: DType = DType { code: sys::kDLFloat, bits: 64, lanes: 1 };
    pub const I32: DType = DType { code: sys::kDLInt, bits: 32, lanes: 1 };
    pub const I64: DType = DType { code: sys::kDLInt, bits: 64, lanes: 1 };
    pub const U8: DType = DType { code: sys::kDLUInt, bits: 8, lanes: 1 };

    /// Bytes of one element (`bits * lanes / 8`, rounded up).
    pub fn size_bytes(self) -> usize {
        (self.bits as usize * self.lanes as usize + 7) / 8
    }

    /// The library's name for the float dtypes ("fp16", "bf16", "fp32"), as `which` takes.
    pub fn name(self) -> Option<&'static str> {
        match self {
            DType::F16 => Some("fp16"),
            DType::BF16 => Some("bf16"),
            DType::F32 => Some("fp32"),
            _ => None,
        }
    }

    fn raw(self) -> sys::DLDataType {
        sys::DLDataType { code: self.code, bits: self.bits, lanes: self.lanes }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.name(), *self) {
            (Some(n), _) => f.write_str(n),
            (None, DType::F64) => f.write_str("fp64"),
            (None, DType::I32) => f.write_str("int32"),
            (None, DType::I64) => f.write_str("int64"),
            (None, DType::U8) => f.write_str("uint8"),
            (None, d) => write!(f, "dlpack(code={}, bits={}, lanes={})", d.code, d.bits, d.lanes),
        }
    }
}

/// Where a tensor's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(i32),
    /// Any other DLPack device: (`DLDeviceType`, device id).
    Other(i32, i32),
}

impl Device {
    fn raw(self) -> sys::DLDevice {
        let (device_type, device_id) = match self {
            Device::Cpu => (sys::kDLCPU, 0),
            Device::Cuda(id) => (sys::kDLCUDA, id),
            Device::Other(t, id) => (t, id),
        };
        sys::DLDevice { device_type, device_id }
    }
}

/// Element types a host slice can hold. Sealed: `f32`, `f64`, `u16` (fp16 / bf16 bits), `i32`,
/// `i64` (ids), `u8` (packed blocks).
pub trait Element: sealed::Sealed + Copy {}
impl Element for f32 {}
impl Element for f64 {}
impl Element for u16 {}
impl Element for i32 {}
impl Element for i64 {}
impl Element for u8 {}
mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for u16 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for u8 {}
}

/// Shape, strides, dtype, device and data pointer shared by the two view types.
#[derive(Clone)]
struct Desc {
    data: *mut c_void,
    dtype: DType,
    device: Device,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    byte_offset: u64,
    /// Bytes available from `data` (host slices); `None` for raw pointers.
    capacity: Option<usize>,
}

impl Desc {
    fn host<T: Element>(data: *mut c_void, len: usize, dtype: DType, shape: &[i64]) -> Result<Desc> {
        if dtype.size_bytes() != size_of::<T>() {
            return Err(Error::new(
                Status::UnsupportedDtype,
                format!(
                    "tensor: dtype {} is {} bytes per element, the slice holds {}-byte elements",
                    dtype,
                    dtype.size_bytes(),
                    size_of::<T>()
                ),
            ));
        }
        let d = Desc {
            data,
            dtype,
            device: Device::Cpu,
            shape: shape.to_vec(),
            strides: None,
            byte_offset: 0,
            capacity: Some(len * size_of::<T>()),
        };
        d.check_extent()?;
        Ok(d)
    }

    /// Elements reachable through shape and strides must lie inside the borrowed slice.
    fn check_extent(&self) -> Result<()> {
        let cap = match self.capacity {
            Some(c) => c,
            None => return Ok(()),
        };
        let bad = |what: String| Err(Error::new(Status::InvalidArgument, format!("tensor: {}", what)));
        if self.shape.iter().any(|&s| s < 0) {
            return bad(format!("negative dimension in shape {:?}", self.shape));
        }
        if let Some(st) = &self.strides {
            if st.len() != self.shape.len() {
                return bad(format!("strides {:?} do not match shape {:?}", st, self.shape));
            }
            if st.iter().any(|&s| s < 0) {
                return bad(format!("negative stride in {:?}", st));
            }
        }
        // Number of elements spanned (the last reachable index + 1), with overflow checks.
        let mut span: u128 = 1;
        if self.shape.contains(&0) {
            span = 0;
        } else {
            match &self.strides {
                None => {
                    for &s in &self.shape {
                        span *= s as u128;
                    }
                }
                Some(st) => {
                    for (&s, &t) in self.shape.iter().zip(st) {
                        span += (s as u128 - 1) * t as u128;
                    }
                }
            }
        }
        let need = span * self.dtype.size_bytes() as u128 + self.byte_offset as u128;
        if need > cap as u128 {
            return bad(format!(
                "shape {:?} of {} needs {} bytes, the slice holds {}",
                self.shape, self.dtype, need, cap
            ));
        }
        Ok(())
    }

    fn raw(&self) -> sys::DLTensor {
        sys::DLTensor {
            data: self.data,
            device: self.device.raw(),
            ndim: self.shape.len() as i32,
            dtype: self.dtype.raw(),
            // The library never writes through shape or strides.
            shape: self.shape.as_ptr() as *mut i64,
            strides: self.strides.as_ref().map_or(ptr::null_mut(), |s| s.as_ptr() as *mut i64),
            byte_offset: self.byte_offset,
        }
    }
}

impl fmt::Debug for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &format_args!("{}", self.dtype))
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("device", &self.device)
            .field("byte_offset", &self.byte_offset)
            .finish()
    }
}

macro_rules! view_common {
    ($ty:ident) => {
        impl<'a> $ty<'a> {
            pub fn dtype(&self) -> DType {
                self.desc.dtype
            }
            pub fn shape(&self) -> &[i64] {
                &self.desc.shape
            }
            pub fn strides(&self) -> Option<&[i64]> {
                self.desc.strides.as_deref()
            }
            pub fn device(&self) -> Device {
                self.desc.device
            }
            /// Explicit strides in elements (the library takes compact row-major strides;
            /// others are rejected with `Status::InvalidArgument`). Checked against the slice.
            pub fn with_strides(mut self, strides: &[i64]) -> Result<Self> {
                self.desc.strides = Some(strides.to_vec());
                self.desc.check_extent()?;
                Ok(self)
            }
            /// The same memory under another shape (checked against the slice).
            pub fn reshape(mut self, shape: &[i64]) -> Result<Self> {
                self.desc.shape = shape.to_vec();
                self.desc.strides = None;
                self.desc.check_extent()?;
                Ok(self)
            }
            /// The same memory under another dtype of the same element size (e.g. `u16` storage
            /// as bf16 instead of fp16).
            pub fn with_dtype(mut self, dtype: DType) -> Result<Self> {
                if dtype.size_bytes() != self.desc.dtype.size_bytes() {
                    return Err(Error::new(
                        Status::UnsupportedDtype,
                        format!("tensor: cannot view {} as {}", self.desc.dtype, dtype),
                    ));
                }
                self.desc.dtype = dtype;
                Ok(self)
            }
            /// Labels the memory as living on `device`.
            ///
            /// # Safety
            /// The memory must be usable there (e.g. CUDA managed or host-registered memory); the
            /// library may hand the pointer to device code.
            pub unsafe fn on_device(mut self, device: Device) -> Self {
                self.desc.device = device;
                self
            }
            pub(crate) fn raw(&self) -> sys::DLTensor {
                self.desc.raw()
            }
        }

        impl fmt::Debug for $ty<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.desc.fmt(f)
            }
        }
    };
}

/// A read-only tensor view: a borrowed slice (or a raw/device pointer) plus dtype, shape,
/// strides and device.
#[derive(Clone)]
pub struct Tensor<'a> {
    desc: Desc,
    _borrow: PhantomData<&'a [u8]>,
}

/// A writable tensor view over a mutably borrowed slice (or a raw/device pointer).
pub struct TensorMut<'a> {
    desc: Desc,
    _borrow: PhantomData<&'a mut [u8]>,
}

view_common!(Tensor);
view_common!(TensorMut);

impl<'a> Tensor<'a> {
    /// A view of `data` as `dtype` with `shape` (row-major). The slice's element size must equal
    /// the dtype's and the shape must fit in the slice.
    pub fn new<T: Element>(data: &'a [T], dtype: DType, shape: &[i64]) -> Result<Self> {
        let desc = Desc::host::<T>(data.as_ptr() as *mut c_void, data.len(), dtype, shape)?;
        Ok(Tensor { desc, _borrow: PhantomData })
    }
    pub fn f32(data: &'a [f32], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::F32, shape)
    }
    /// IEEE binary16 values given as their bits.
    pub fn f16_bits(data: &'a [u16], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::F16, shape)
    }
    /// bfloat16 values given as their bits.
    pub fn bf16_bits(data: &'a [u16], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::BF16, shape)
    }
    pub fn i32(data: &'a [i32], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::I32, shape)
    }
    pub fn i64(data: &'a [i64], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::I64, shape)
    }
    /// Packed GGUF blocks (`[rows, row_bytes]`).
    pub fn u8(data: &'a [u8], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::U8, shape)
    }

    /// A view of memory this crate cannot check, e.g. a CUDA device pointer.
    ///
    /// # Safety
    /// `data + byte_offset` must hold the tensor described, on `device`, and stay valid and
    /// unwritten by others for `'a`.
    pub unsafe fn from_raw(
        data: *const c_void,
        dtype: DType,
        shape: &[i64],
        device: Device,
        byte_offset: u64,
    ) -> Tensor<'a> {
        let desc = Desc {
            data: data as *mut c_void,
            dtype,
            device,
            shape: shape.to_vec(),
            strides: None,
            byte_offset,
            capacity: None,
        };
        Tensor { desc, _borrow: PhantomData }
    }
}

impl<'a> TensorMut<'a> {
    pub fn new<T: Element>(data: &'a mut [T], dtype: DType, shape: &[i64]) -> Result<Self> {
        let desc = Desc::host::<T>(data.as_mut_ptr() as *mut c_void, data.len(), dtype, shape)?;
        Ok(TensorMut { desc, _borrow: PhantomData })
    }
    pub fn f32(data: &'a mut [f32], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::F32, shape)
    }
    pub fn f16_bits(data: &'a mut [u16], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::F16, shape)
    }
    pub fn bf16_bits(data: &'a mut [u16], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::BF16, shape)
    }
    pub fn i32(data: &'a mut [i32], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::I32, shape)
    }
    pub fn i64(data: &'a mut [i64], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::I64, shape)
    }
    pub fn u8(data: &'a mut [u8], shape: &[i64]) -> Result<Self> {
        Self::new(data, DType::U8, shape)
    }

    /// # Safety
    /// As [`Tensor::from_raw`], and nothing else may read or write the memory during `'a`.
    pub unsafe fn from_raw(
        data: *mut c_void,
        dtype: DType,
        shape: &[i64],
        device: Device,
        byte_offset: u64,
    ) -> TensorMut<'a> {
        let desc = Desc { data, dtype, device, shape: shape.to_vec(), strides: None, byte_offset, capacity: None };
        TensorMut { desc, _borrow: PhantomData }
    }

    /// A read-only view of the same memory, for as long as this one is borrowed.
    pub fn as_tensor(&self) -> Tensor<'_> {
        Tensor { desc: self.desc.clone(), _borrow: PhantomData }
    }
}

// Views behave like `&[T]` / `&mut [T]` (raw views are `unsafe` to build).
unsafe impl Send for Tensor<'_> {}
unsafe impl Sync for Tensor<'_> {}
unsafe impl Send for TensorMut<'_> {}
