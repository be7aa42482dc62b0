//! Fallible allocation of the CPU backend's buffers: a size that no allocation can hold,
//! or one the allocator refuses, is [`Error::Alloc`], never a panic ("capacity
//! overflow") or an abort (`handle_alloc_error`).

use crate::{Element, Error, Result};
use std::alloc::Layout;

/// The error for a buffer of `len` elements of `T`.
fn refused<T>(len: usize) -> Error {
    Error::Alloc {
        elements: len,
        element_bytes: size_of::<T>(),
    }
}

/// A vector of `len` zeros (`T::default()` for every [`Element`]).
///
/// Allocated as `vec![T::default(); len]` is, through the allocator's zeroed allocation
/// (`alloc_zeroed`, `calloc`): a large buffer's pages come fresh from the OS, mapped
/// lazily on first touch, and are not written here. `Layout::array` refuses more than
/// `isize::MAX` bytes, so the size is checked before anything is asked of the allocator.
pub(super) fn zeroed<T: Element>(len: usize) -> Result<Vec<T>> {
    let layout = Layout::array::<T>(len).map_err(|_| refused::<T>(len))?;
    if layout.size() == 0 {
        // No allocation: `len` is 0 (every `Element` has a size).
        return Ok(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size (checked above), as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(refused::<T>(len));
    }
    // SAFETY: `ptr` is non-null and was allocated by the global allocator (the one `Vec`
    // uses) with `Layout::array::<T>(len)`: `T`'s alignment and `len * size_of::<T>()`
    // bytes (at most `isize::MAX`), exactly the layout of a `Vec<T>` of capacity `len`.
    // All `len` elements are initialised: the memory is zeroed, and all-zero bytes are a
    // valid `T` because `Element` requires `bytemuck::Pod` (for the sealed `f32`, `f16`
    // and `bf16` they are also `T::default()`, 0.0). The vector owns the allocation from
    // here; nothing else holds `ptr`.
    Ok(unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, len) })
}

/// A vector holding a copy of `host` (one `memcpy`, as `to_vec`), with its allocation
/// failure an error.
pub(super) fn copied<T: Element>(host: &[T]) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(host.len())
        .map_err(|_| refused::<T>(host.len()))?;
    v.extend_from_slice(host);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn zeros_are_default<T: Element>() {
        for len in [0, 1, 7, 1 << 16] {
            let v = zeroed::<T>(len).unwrap();
            assert_eq!((v.len(), v.capacity()), (len, len));
            assert!(v.iter().all(|x| *x == T::default()));
        }
        let host: Vec<T> = (0..100).map(|i| T::from_f32(i as f32)).collect();
        assert_eq!(copied(&host).unwrap(), host);
        assert_eq!(copied::<T>(&[]).unwrap(), Vec::<T>::new());
    }

    #[test]
    fn zeroed_buffers_hold_defaults_and_copies_are_equal() {
        zeros_are_default::<f32>();
        zeros_are_default::<f16>();
        zeros_are_default::<bf16>();
    }

    #[test]
    fn sizes_beyond_isize_max_are_refused_before_allocating() {
        for len in [usize::MAX, usize::MAX / 2, (isize::MAX as usize) / 4 + 1] {
            assert!(matches!(
                zeroed::<f32>(len),
                Err(Error::Alloc { elements, element_bytes: 4 }) if elements == len
            ));
        }
        assert!(matches!(
            zeroed::<f16>(usize::MAX / 2),
            Err(Error::Alloc {
                element_bytes: 2,
                ..
            })
        ));
    }
}
