//! DLPack export (the Python boundary's only unsafe code): GPU memory handed to Python
//! frameworks as a `dltensor` capsule, the protocol `torch.from_dlpack`, CuPy and JAX take.
//!
//! One capsule describes one 1-D `uint8` tensor over a whole arena; the Python layer makes each
//! model tensor a typed view of a slice of it, so every tensor shares the arena and the arena
//! lives until the last of them is freed. The capsule owns a `DLManagedTensor` whose
//! `manager_ctx` holds an `Arc` of whatever keeps the memory alive. Ownership follows the
//! DLPack rules: a consumer renames the capsule `used_dltensor` and calls the tensor's deleter
//! when done; a capsule nobody consumed calls it from its destructor.

use std::any::Any;
use std::ffi::{CStr, c_void};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

/// `DLDeviceType::kDLCUDA`.
const KDL_CUDA: i32 = 2;
/// `DLDataTypeCode::kDLUInt`.
const KDL_UINT: u8 = 1;
/// The capsule's name before a consumer takes it.
const DLTENSOR: &CStr = c"dltensor";

/// `DLDevice` (dlpack.h).
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType` (dlpack.h).
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` (dlpack.h).
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (dlpack.h; the unversioned form every consumer accepts).
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What the tensor's pointers point into, and what keeps its memory alive.
struct Holder {
    shape: [i64; 1],
    strides: [i64; 1],
    _keep: Arc<dyn Any + Send + Sync>,
}

/// The tensor's deleter: frees what [`gpu_bytes`] allocated, once.
unsafe extern "C" fn deleter(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its `manager_ctx` come from Box::into_raw in `gpu_bytes`, and DLPack
    // calls the deleter exactly once (the consumer, or the capsule's destructor when nobody
    // consumed it, never both: consuming renames the capsule).
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx.cast::<Holder>()));
    }
}

/// The capsule's destructor: frees the tensor unless a consumer took it.
unsafe extern "C" fn capsule_destructor(cap: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed (holding the GIL); a capsule
    // still named "dltensor" was never consumed, so its pointer is our DLManagedTensor and
    // nobody else will call its deleter.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, DLTENSOR.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, DLTENSOR.as_ptr()).cast::<DLManagedTensor>();
            if !m.is_null()
                && let Some(d) = (*m).deleter
            {
                d(m);
            }
        }
    }
}

/// A `dltensor` capsule for `len` bytes of GPU memory at `ptr` on CUDA device `device_id`, a
/// 1-D uint8 tensor; `keep` stays alive until the consumer frees the tensor.
pub fn gpu_bytes<'py>(
    py: Python<'py>,
    ptr: u64,
    len: u64,
    device_id: i32,
    keep: Arc<dyn Any + Send + Sync>,
) -> PyResult<Bound<'py, PyAny>> {
    let len = i64::try_from(len)
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("tensor too large for DLPack"))?;
    let holder = Box::into_raw(Box::new(Holder {
        shape: [len],
        strides: [1],
        _keep: keep,
    }));
    // SAFETY: `holder` was just allocated and stays allocated until the deleter frees it, so
    // the shape and strides pointers stay valid as long as the tensor.
    let (shape, strides) =
        unsafe { ((*holder).shape.as_mut_ptr(), (*holder).strides.as_mut_ptr()) };
    let m = Box::into_raw(Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: ptr as *mut c_void,
            device: DLDevice {
                device_type: KDL_CUDA,
                device_id,
            },
            ndim: 1,
            dtype: DLDataType {
                code: KDL_UINT,
                bits: 8,
                lanes: 1,
            },
            shape,
            strides,
            byte_offset: 0,
        },
        manager_ctx: holder.cast::<c_void>(),
        deleter: Some(deleter),
    }));
    // SAFETY: `m` is a valid DLManagedTensor that the capsule owns from here on (its destructor
    // frees it unless a consumer takes it); the name is a static C string.
    let cap = unsafe {
        ffi::PyCapsule_New(
            m.cast::<c_void>(),
            DLTENSOR.as_ptr(),
            Some(capsule_destructor),
        )
    };
    if cap.is_null() {
        // SAFETY: no capsule owns `m`: free it here, once.
        unsafe { deleter(m) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new reference, which the Bound takes over.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) })
}
