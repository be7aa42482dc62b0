//! Shapes of a batch of matrices and their thin factors, validated once.

use crate::{Error, Result, MAX_RANK};
use std::fmt;

/// The shape of a batched low-rank product: `batch` matrices `M` of `n x m` (row-major,
/// one after the other) and thin factors of rank `r`.
///
/// Factors are stored **column-major**: `P` (`n x r`) is `r` contiguous columns of `n`
/// elements, `Q` (`m x r`) is `r` contiguous columns of `m`, one factor after the other
/// for each matrix of the batch. Columns are what Gram-Schmidt normalises and what the
/// product `Mᵀ P` accumulates, so this layout makes both unit-stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
///
/// The fields are private: a `Dims` exists only through [`Dims::new`], so every value has
/// `r` in `1..=MAX_RANK` and buffer lengths that fit in `usize`, which the kernels'
/// `unsafe` code relies on.
pub struct Dims {
    batch: usize,
    n: usize,
    m: usize,
    r: usize,
}

impl Dims {
    /// Validates a shape: `r` must be in `1..=MAX_RANK` and every buffer length must fit
    /// in `usize`. Zero `batch`, `n` or `m` is allowed (the operations then do nothing).
    pub fn new(batch: usize, n: usize, m: usize, r: usize) -> Result<Self> {
        if r == 0 || r > MAX_RANK {
            return Err(Error::InvalidRank(r));
        }
        let d = Dims { batch, n, m, r };
        let fits = n
            .checked_mul(m)
            .and_then(|x| x.checked_mul(batch))
            .and_then(|_| n.max(m).checked_mul(r))
            .and_then(|x| x.checked_mul(batch))
            .and_then(|x| x.checked_mul(8));
        match fits {
            Some(_) => Ok(d),
            None => Err(Error::Overflow(d.to_string())),
        }
    }

    /// Number of matrices.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Rows of each matrix `M`.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Columns of each matrix `M`.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Rank of the factors.
    pub fn r(&self) -> usize {
        self.r
    }

    /// Elements of one matrix `M`.
    pub fn matrix_len(&self) -> usize {
        self.n * self.m
    }

    /// Elements of all matrices.
    pub fn m_len(&self) -> usize {
        self.batch * self.n * self.m
    }

    /// Elements of all `P` factors (`batch x n x r`).
    pub fn p_len(&self) -> usize {
        self.batch * self.n * self.r
    }

    /// Elements of all `Q` factors (`batch x m x r`).
    pub fn q_len(&self) -> usize {
        self.batch * self.m * self.r
    }

    /// Errors unless `actual == expected`.
    pub(crate) fn expect(&self, name: &'static str, actual: usize, expected: usize) -> Result<()> {
        if actual == expected {
            Ok(())
        } else {
            Err(Error::BufferSize {
                name,
                expected,
                actual,
                dims: self.to_string(),
            })
        }
    }
}

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "batch {} of {} x {} matrices at rank {}",
            self.batch, self.n, self.m, self.r
        )
    }
}

/// Errors unless two element-wise operands have the same length.
pub(crate) fn same_len(a: &'static str, len_a: usize, b: &'static str, len_b: usize) -> Result<()> {
    if len_a == len_b {
        Ok(())
    } else {
        Err(Error::LengthMismatch { a, len_a, b, len_b })
    }
}

/// A flag buffer ([`Backend::flag_nonfinite`](crate::Backend::flag_nonfinite)) holds
/// exactly one element.
pub(crate) fn check_flag(len: usize) -> Result<()> {
    if len == 1 {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            a: "flag",
            len_a: len,
            b: "one element",
            len_b: 1,
        })
    }
}

/// Validates an orthogonalisation epsilon.
pub(crate) fn check_epsilon(eps: f32) -> Result<()> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidEpsilon(eps))
    }
}

/// Gram-Schmidt's zero-column threshold: a column whose residual after both passes of
/// projection is at most this fraction of its original norm is set to zero.
///
/// A column that depends exactly on the earlier ones keeps only the rounding of the
/// projections outside their span after the second pass, a few `ε_f32` of its norm; a
/// genuine direction of a full-rank input of condition number `κ` keeps about `1 / κ`.
/// `8 · ε` (about `9.5e-7`) separates the two up to `κ` of about `10^5`, whatever `n`.
pub(crate) fn zero_column_tolerance(_n: usize) -> f32 {
    8.0 * f32::EPSILON
}

/// `range` resolved against a buffer of `len` elements, or [`Error::OutOfBounds`]: the
/// rule every backend's `view` and `view_mut` follow.
pub(crate) fn resolve(
    range: impl std::ops::RangeBounds<usize>,
    len: usize,
) -> Result<std::ops::Range<usize>> {
    use std::ops::Bound;
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::OutOfBounds { start, end, len });
    }
    Ok(start..end)
}
