//! Checked sizes and fallible allocation for tensors and layer buffers: a shape whose
//! element count overflows is [`Error::ShapeOverflow`], a buffer too large for any
//! allocation or refused by the allocator [`Error::Alloc`]; never a panic ("capacity
//! overflow", an arithmetic overflow) or an abort (`handle_alloc_error`).

use std::alloc::Layout;

use crate::error::Error;

/// The element count of `shape` (the product of its dimensions, 1 for `[]`), if its
/// `f32`s fit in one allocation. As ndarray requires of any array, the product of the
/// non-zero dimensions must not exceed `isize::MAX` (even when a zero makes the count 0).
pub(crate) fn element_count(op: &'static str, shape: &[usize]) -> Result<usize, Error> {
    let nonzero = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d.max(1)))
        .filter(|&n| n <= isize::MAX as usize);
    if nonzero.is_none() {
        return Err(Error::ShapeOverflow {
            op,
            shape: shape.to_vec(),
        });
    }
    // At most the non-zero product: it fits.
    let len = shape.iter().product();
    Layout::array::<f32>(len).map_err(|_| refused::<f32>(op, len))?;
    Ok(len)
}

/// The error for a buffer of `len` elements of `T`.
fn refused<T>(op: &'static str, len: usize) -> Error {
    Error::Alloc {
        op,
        elements: len,
        element_bytes: size_of::<T>(),
    }
}

/// An empty vector with room for exactly `len` elements.
pub(crate) fn with_capacity<T>(op: &'static str, len: usize) -> Result<Vec<T>, Error> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| refused::<T>(op, len))?;
    Ok(v)
}

/// `len` copies of `value`.
pub(crate) fn filled(op: &'static str, len: usize, value: f32) -> Result<Vec<f32>, Error> {
    let mut v = with_capacity(op, len)?;
    v.resize(len, value);
    Ok(v)
}

/// `len` zeros from the allocator's zeroed allocation (`alloc_zeroed`, `calloc`, as
/// `vec![0.0; len]` and ndarray's `zeros`): a large buffer's pages are mapped lazily by
/// the OS, not written here. `Layout::array` refuses more than `isize::MAX` bytes before
/// the allocator is asked.
pub(crate) fn zeros(op: &'static str, len: usize) -> Result<Vec<f32>, Error> {
    let layout = Layout::array::<f32>(len).map_err(|_| refused::<f32>(op, len))?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size (checked above), as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(refused::<f32>(op, len));
    }
    // SAFETY: `ptr` is non-null and was allocated by the global allocator (the one `Vec`
    // uses) with `Layout::array::<f32>(len)`: `f32`'s alignment and `4 * len` bytes (at
    // most `isize::MAX`), exactly the layout of a `Vec<f32>` of capacity `len`. All `len`
    // elements are initialised: the memory is zeroed, and all-zero bytes are the `f32`
    // 0.0. The vector owns the allocation from here; nothing else holds `ptr`.
    Ok(unsafe { Vec::from_raw_parts(ptr.cast::<f32>(), len, len) })
}

/// The elements of `iter` (exactly `len` of them, as an array's iterator gives), in a
/// vector allocated fallibly.
pub(crate) fn collect(
    op: &'static str,
    len: usize,
    iter: impl Iterator<Item = f32>,
) -> Result<Vec<f32>, Error> {
    let mut v = with_capacity(op, len)?;
    v.extend(iter);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_allocations_are_checked() {
        assert_eq!(element_count("t", &[]).unwrap(), 1);
        assert_eq!(element_count("t", &[3, 0, 1 << 40]).unwrap(), 0);
        assert!(matches!(
            element_count("t", &[0, 1 << 40, 1 << 40]),
            Err(Error::ShapeOverflow { .. })
        ));
        assert_eq!(element_count("t", &[2, 3]).unwrap(), 6);
        assert!(matches!(
            element_count("t", &[1 << 32, 1 << 32]),
            Err(Error::ShapeOverflow { op: "t", .. })
        ));
        assert!(matches!(
            element_count("t", &[1 << 62]),
            Err(Error::Alloc { elements, element_bytes: 4, .. }) if elements == 1 << 62
        ));
        let z = zeros("t", 1 << 16).unwrap();
        assert!(z.len() == 1 << 16 && z.capacity() == 1 << 16 && z.iter().all(|&v| v == 0.0));
        assert!(zeros("t", 0).unwrap().is_empty());
        assert_eq!(filled("t", 3, 1.5).unwrap(), vec![1.5; 3]);
        for len in [usize::MAX / 2, usize::MAX] {
            assert!(matches!(zeros("t", len), Err(Error::Alloc { .. })));
            assert!(matches!(filled("t", len, 1.0), Err(Error::Alloc { .. })));
            assert!(matches!(
                with_capacity::<u64>("t", len),
                Err(Error::Alloc { .. })
            ));
        }
    }
}
