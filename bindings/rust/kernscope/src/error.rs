use std::ffi::CStr;
use std::fmt;

use kernscope_sys as sys;

/// A failing `ks_status_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Bad shape, stride, eps, overlap, id out of range, ...
    InvalidArgument,
    /// A dtype the op does not handle, or mismatched dtypes.
    UnsupportedDtype,
    /// A tensor on a device the op/backend cannot use, or mixed devices.
    UnsupportedDevice,
    /// Backend not compiled in, no device present, or a pinned variant that cannot run.
    BackendUnavailable,
    /// A CUDA runtime call or launch failed.
    Cuda,
    OutOfMemory,
    Internal,
    /// A code this crate does not know (a newer library).
    Unknown(i32),
}

impl Status {
    /// `None` for `KS_SUCCESS`.
    pub fn from_raw(code: sys::ks_status_t) -> Option<Status> {
        Some(match code {
            sys::KS_SUCCESS => return None,
            sys::KS_ERROR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::KS_ERROR_UNSUPPORTED_DTYPE => Status::UnsupportedDtype,
            sys::KS_ERROR_UNSUPPORTED_DEVICE => Status::UnsupportedDevice,
            sys::KS_ERROR_BACKEND_UNAVAILABLE => Status::BackendUnavailable,
            sys::KS_ERROR_CUDA => Status::Cuda,
            sys::KS_ERROR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::KS_ERROR_INTERNAL => Status::Internal,
            other => Status::Unknown(other),
        })
    }

    /// The C enum value.
    pub fn code(self) -> sys::ks_status_t {
        match self {
            Status::InvalidArgument => sys::KS_ERROR_INVALID_ARGUMENT,
            Status::UnsupportedDtype => sys::KS_ERROR_UNSUPPORTED_DTYPE,
            Status::UnsupportedDevice => sys::KS_ERROR_UNSUPPORTED_DEVICE,
            Status::BackendUnavailable => sys::KS_ERROR_BACKEND_UNAVAILABLE,
            Status::Cuda => sys::KS_ERROR_CUDA,
            Status::OutOfMemory => sys::KS_ERROR_OUT_OF_MEMORY,
            Status::Internal => sys::KS_ERROR_INTERNAL,
            Status::Unknown(c) => c,
        }
    }

    /// The library's stable name, e.g. `"KS_ERROR_INVALID_ARGUMENT"` (`ks_status_name`).
    pub fn name(self) -> &'static str {
        // ks_status_name returns static storage.
        let p = unsafe { sys::ks_status_name(self.code()) };
        if p.is_null() {
            return "KS_ERROR_UNKNOWN";
        }
        unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("KS_ERROR_UNKNOWN")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed kernscope call: the status and the message of `ks_last_error()`, which names the
/// op and the argument (e.g. `"rms_norm: eps must be finite and > 0, got 0"`). Errors found by
/// this crate before calling the library (a shape that does not fit the slice, a NUL byte in
/// a name) use the same form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }

    pub fn status(&self) -> Status {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The error of a call that just returned `code` on this thread.
    pub(crate) fn last(status: Status) -> Error {
        let p = unsafe { sys::ks_last_error() };
        let message =
            if p.is_null() { String::new() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
        Error { status, message }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Turns a status code returned by the library on this thread into a `Result`.
pub(crate) fn check(code: sys::ks_status_t) -> Result<()> {
    match Status::from_raw(code) {
        None => Ok(()),
        Some(s) => Err(Error::last(s)),
    }
}
