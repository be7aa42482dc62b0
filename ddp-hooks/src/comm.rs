//! The bridge between `lowrank` buffers and `collectives` process groups.

use collectives::{Buffer, ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};
use lowrank::{Backend, CpuBackend, Element};

/// An element type that travels through a process group.
pub trait CommElement: Element {
    /// Wraps a host vector for a collective.
    fn wrap(v: Vec<Self>) -> Buffer;
    /// Unwraps a collective's result.
    fn unwrap(b: Buffer) -> collectives::Result<Vec<Self>>;
}

macro_rules! comm_element {
    ($($t:ty),*) => {$(
        impl CommElement for $t {
            fn wrap(v: Vec<Self>) -> Buffer {
                Buffer::from(v)
            }
            fn unwrap(b: Buffer) -> collectives::Result<Vec<Self>> {
                Vec::<$t>::try_from(b)
            }
        }
    )*};
}
comm_element!(f32, f16, bf16);

/// A backend whose buffers can be reduced through a [`ProcessGroup`]. The CPU backend
/// moves its vectors in and out without copying.
pub trait CommBackend: Backend + 'static {
    /// All-reduces `buf` over `pg`; the work gives the buffer back.
    fn all_reduce<T: CommElement>(
        &self,
        pg: &dyn ProcessGroup,
        buf: Self::Buffer<T>,
        op: ReduceOp,
    ) -> Work<Self::Buffer<T>>;
}

impl CommBackend for CpuBackend {
    fn all_reduce<T: CommElement>(
        &self,
        pg: &dyn ProcessGroup,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        pg.all_reduce(T::wrap(buf), op).then(|r| T::unwrap(r?))
    }
}
