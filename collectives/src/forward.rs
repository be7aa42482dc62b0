//! [`forward_group!`](crate::forward_group): one delegation macro for every
//! [`ProcessGroup`](crate::ProcessGroup) wrapper.

/// Implements [`ProcessGroup`](crate::ProcessGroup) for a wrapper: every method the
/// invocation does not write itself goes to the group the wrapper holds, so a wrapper
/// cannot forget one (a wrapper without `device_native` silently loses NCCL's device
/// path; without `all_reduce_device` it stages device buffers through the host).
///
/// The invocation names the wrapped group by a closure-like `inner: |s| expr;` (`s` is
/// `&self`; `expr` is a reference to anything that implements `ProcessGroup`), then
/// writes the methods it overrides, with their trait signatures:
///
/// ```
/// use collectives::{forward_group, run_local, Buffer, ProcessGroup, ReduceOp, Work};
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// /// Counts its all-reduces; everything else is the inner group's.
/// struct Counting<G> {
///     inner: G,
///     calls: AtomicUsize,
/// }
///
/// forward_group! {
///     impl[G: ProcessGroup] ProcessGroup for Counting<G> {
///         inner: |s| &s.inner;
///         fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
///             self.calls.fetch_add(1, Ordering::Relaxed);
///             self.inner.all_reduce(buf, op)
///         }
///     }
/// }
///
/// let out = run_local(2, |g| {
///     let g = Counting { inner: g, calls: AtomicUsize::new(0) };
///     let sum = g.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum).wait().unwrap();
///     g.barrier().wait().unwrap(); // forwarded
///     (sum, g.calls.load(Ordering::Relaxed), g.device_native())
/// })
/// .unwrap();
/// for r in out {
///     assert_eq!(r.unwrap(), (Buffer::F32(vec![2.0]), 1, false));
/// }
/// ```
///
/// The generic parameters go in brackets after `impl` (`impl[G: ProcessGroup]`; none:
/// `impl ProcessGroup for Wrapper`). Forwarded: `rank`, `size`, `backend`, `timeout`,
/// `all_reduce`, `all_reduce_wire`, `all_reduce_coalesced`, `broadcast`, `all_gather`,
/// `reduce_scatter`, `barrier`, `send`, `recv`, `batch_isend_irecv`, `reduce`, `gather`,
/// `scatter`, `all_to_all`, `all_to_all_split`, `new_group` (the inner group's subgroup,
/// unwrapped), `device_native`, `narrowed` and, when `collectives` is built with its
/// `cuda` feature, `all_reduce_device`, `broadcast_device`, `send_device`, `recv_device`
/// and `batch_isend_irecv_device`. The cuda-only methods follow the feature
/// of `collectives` itself, whatever the calling crate's features are; a wrapper that
/// overrides one writes it under a `cfg` that holds exactly when `collectives/cuda` is on.
#[macro_export]
macro_rules! forward_group {
    (
        impl $([$($gen:tt)*])? ProcessGroup for $ty:ty {
            inner: |$s:ident| $to:expr;
            $(
                $(#[$attr:meta])*
                fn $name:ident ( $($args:tt)* ) -> $ret:ty $body:block
            )*
        }
    ) => {
        impl $(<$($gen)*>)? $crate::ProcessGroup for $ty {
            $(
                $(#[$attr])*
                fn $name ( $($args)* ) -> $ret $body
            )*
            $crate::__forward_unless! { rank [$($name)*] {
                fn rank(&self) -> usize {
                    let $s = self;
                    $crate::ProcessGroup::rank($to)
                }
            } }
            $crate::__forward_unless! { size [$($name)*] {
                fn size(&self) -> usize {
                    let $s = self;
                    $crate::ProcessGroup::size($to)
                }
            } }
            $crate::__forward_unless! { backend [$($name)*] {
                fn backend(&self) -> &'static str {
                    let $s = self;
                    $crate::ProcessGroup::backend($to)
                }
            } }
            $crate::__forward_unless! { timeout [$($name)*] {
                fn timeout(&self) -> ::std::time::Duration {
                    let $s = self;
                    $crate::ProcessGroup::timeout($to)
                }
            } }
            $crate::__forward_unless! { all_reduce [$($name)*] {
                fn all_reduce(
                    &self,
                    buf: $crate::Buffer,
                    op: $crate::ReduceOp,
                ) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::all_reduce($to, buf, op)
                }
            } }
            $crate::__forward_unless! { all_reduce_wire [$($name)*] {
                fn all_reduce_wire(
                    &self,
                    buf: $crate::Buffer,
                    wire: $crate::DType,
                    op: $crate::ReduceOp,
                ) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::all_reduce_wire($to, buf, wire, op)
                }
            } }
            $crate::__forward_unless! { all_reduce_coalesced [$($name)*] {
                fn all_reduce_coalesced(
                    &self,
                    bufs: ::std::vec::Vec<$crate::Buffer>,
                    op: $crate::ReduceOp,
                ) -> $crate::Work<::std::vec::Vec<$crate::Buffer>> {
                    let $s = self;
                    $crate::ProcessGroup::all_reduce_coalesced($to, bufs, op)
                }
            } }
            $crate::__forward_unless! { broadcast [$($name)*] {
                fn broadcast(&self, buf: $crate::Buffer, root: usize) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::broadcast($to, buf, root)
                }
            } }
            $crate::__forward_unless! { all_gather [$($name)*] {
                fn all_gather(
                    &self,
                    buf: $crate::Buffer,
                ) -> $crate::Work<::std::vec::Vec<$crate::Buffer>> {
                    let $s = self;
                    $crate::ProcessGroup::all_gather($to, buf)
                }
            } }
            $crate::__forward_unless! { reduce_scatter [$($name)*] {
                fn reduce_scatter(
                    &self,
                    buf: $crate::Buffer,
                    op: $crate::ReduceOp,
                ) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::reduce_scatter($to, buf, op)
                }
            } }
            $crate::__forward_unless! { barrier [$($name)*] {
                fn barrier(&self) -> $crate::Work<()> {
                    let $s = self;
                    $crate::ProcessGroup::barrier($to)
                }
            } }
            $crate::__forward_unless! { new_group [$($name)*] {
                fn new_group(
                    &self,
                    ranks: &[usize],
                ) -> $crate::Result<
                    ::std::option::Option<::std::boxed::Box<dyn $crate::ProcessGroup>>,
                > {
                    let $s = self;
                    $crate::ProcessGroup::new_group($to, ranks)
                }
            } }
            $crate::__forward_unless! { send [$($name)*] {
                fn send(&self, buf: $crate::Buffer, dst: usize, tag: u32) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::send($to, buf, dst, tag)
                }
            } }
            $crate::__forward_unless! { recv [$($name)*] {
                fn recv(&self, buf: $crate::Buffer, src: usize, tag: u32) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::recv($to, buf, src, tag)
                }
            } }
            $crate::__forward_unless! { batch_isend_irecv [$($name)*] {
                fn batch_isend_irecv(
                    &self,
                    ops: ::std::vec::Vec<$crate::P2pOp>,
                ) -> ::std::vec::Vec<$crate::Work<$crate::Buffer>> {
                    let $s = self;
                    $crate::ProcessGroup::batch_isend_irecv($to, ops)
                }
            } }
            $crate::__forward_unless! { reduce [$($name)*] {
                fn reduce(
                    &self,
                    buf: $crate::Buffer,
                    root: usize,
                    op: $crate::ReduceOp,
                ) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::reduce($to, buf, root, op)
                }
            } }
            $crate::__forward_unless! { gather [$($name)*] {
                fn gather(
                    &self,
                    buf: $crate::Buffer,
                    root: usize,
                ) -> $crate::Work<::std::vec::Vec<$crate::Buffer>> {
                    let $s = self;
                    $crate::ProcessGroup::gather($to, buf, root)
                }
            } }
            $crate::__forward_unless! { scatter [$($name)*] {
                fn scatter(
                    &self,
                    chunks: ::std::vec::Vec<$crate::Buffer>,
                    out: $crate::Buffer,
                    root: usize,
                ) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::scatter($to, chunks, out, root)
                }
            } }
            $crate::__forward_unless! { all_to_all [$($name)*] {
                fn all_to_all(&self, buf: $crate::Buffer) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::all_to_all($to, buf)
                }
            } }
            $crate::__forward_unless! { all_to_all_split [$($name)*] {
                fn all_to_all_split(
                    &self,
                    buf: $crate::Buffer,
                    send_counts: ::std::vec::Vec<usize>,
                    recv_counts: ::std::vec::Vec<usize>,
                ) -> $crate::Work<$crate::Buffer> {
                    let $s = self;
                    $crate::ProcessGroup::all_to_all_split($to, buf, send_counts, recv_counts)
                }
            } }
            $crate::__forward_unless! { device_native [$($name)*] {
                fn device_native(&self) -> bool {
                    let $s = self;
                    $crate::ProcessGroup::device_native($to)
                }
            } }
            $crate::__forward_unless! { narrowed [$($name)*] {
                fn narrowed(&self) -> ::std::option::Option<$crate::Narrowed<'_>> {
                    let $s = self;
                    $crate::ProcessGroup::narrowed($to)
                }
            } }
            $crate::__forward_cuda! {
                $crate::__forward_unless! { all_reduce_device [$($name)*] {
                    fn all_reduce_device(
                        &self,
                        buf: $crate::DeviceBuffer,
                        op: $crate::ReduceOp,
                    ) -> $crate::Work<$crate::DeviceBuffer> {
                        let $s = self;
                        $crate::ProcessGroup::all_reduce_device($to, buf, op)
                    }
                } }
                $crate::__forward_unless! { send_device [$($name)*] {
                    fn send_device(
                        &self,
                        buf: $crate::DeviceBuffer,
                        dst: usize,
                        tag: u32,
                    ) -> $crate::Work<$crate::DeviceBuffer> {
                        let $s = self;
                        $crate::ProcessGroup::send_device($to, buf, dst, tag)
                    }
                } }
                $crate::__forward_unless! { recv_device [$($name)*] {
                    fn recv_device(
                        &self,
                        buf: $crate::DeviceBuffer,
                        src: usize,
                        tag: u32,
                    ) -> $crate::Work<$crate::DeviceBuffer> {
                        let $s = self;
                        $crate::ProcessGroup::recv_device($to, buf, src, tag)
                    }
                } }
                $crate::__forward_unless! { batch_isend_irecv_device [$($name)*] {
                    fn batch_isend_irecv_device(
                        &self,
                        ops: ::std::vec::Vec<$crate::P2pOp<$crate::DeviceBuffer>>,
                    ) -> ::std::vec::Vec<$crate::Work<$crate::DeviceBuffer>> {
                        let $s = self;
                        $crate::ProcessGroup::batch_isend_irecv_device($to, ops)
                    }
                } }
                $crate::__forward_unless! { broadcast_device [$($name)*] {
                    fn broadcast_device(
                        &self,
                        buf: $crate::DeviceBuffer,
                        root: usize,
                    ) -> $crate::Work<$crate::DeviceBuffer> {
                        let $s = self;
                        $crate::ProcessGroup::broadcast_device($to, buf, root)
                    }
                } }
            }
        }
    };
}

/// `forward_group!`'s helper: the method in braces, unless its name is in the list
/// (the wrapper wrote that method itself).
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_unless {
    (rank [rank $($rest:tt)*] $code:tt) => {};
    (size [size $($rest:tt)*] $code:tt) => {};
    (backend [backend $($rest:tt)*] $code:tt) => {};
    (timeout [timeout $($rest:tt)*] $code:tt) => {};
    (all_reduce [all_reduce $($rest:tt)*] $code:tt) => {};
    (all_reduce_wire [all_reduce_wire $($rest:tt)*] $code:tt) => {};
    (all_reduce_coalesced [all_reduce_coalesced $($rest:tt)*] $code:tt) => {};
    (broadcast [broadcast $($rest:tt)*] $code:tt) => {};
    (all_gather [all_gather $($rest:tt)*] $code:tt) => {};
    (reduce_scatter [reduce_scatter $($rest:tt)*] $code:tt) => {};
    (barrier [barrier $($rest:tt)*] $code:tt) => {};
    (new_group [new_group $($rest:tt)*] $code:tt) => {};
    (send [send $($rest:tt)*] $code:tt) => {};
    (recv [recv $($rest:tt)*] $code:tt) => {};
    (batch_isend_irecv [batch_isend_irecv $($rest:tt)*] $code:tt) => {};
    (reduce [reduce $($rest:tt)*] $code:tt) => {};
    (gather [gather $($rest:tt)*] $code:tt) => {};
    (scatter [scatter $($rest:tt)*] $code:tt) => {};
    (all_to_all [all_to_all $($rest:tt)*] $code:tt) => {};
    (all_to_all_split [all_to_all_split $($rest:tt)*] $code:tt) => {};
    (send_device [send_device $($rest:tt)*] $code:tt) => {};
    (recv_device [recv_device $($rest:tt)*] $code:tt) => {};
    (batch_isend_irecv_device [batch_isend_irecv_device $($rest:tt)*] $code:tt) => {};
    (device_native [device_native $($rest:tt)*] $code:tt) => {};
    (narrowed [narrowed $($rest:tt)*] $code:tt) => {};
    (all_reduce_device [all_reduce_device $($rest:tt)*] $code:tt) => {};
    (broadcast_device [broadcast_device $($rest:tt)*] $code:tt) => {};
    ($method:ident [$other:ident $($rest:tt)*] $code:tt) => {
        $crate::__forward_unless! { $method [$($rest)*] $code }
    };
    ($method:ident [] { $($code:tt)* }) => { $($code)* };
}

/// `forward_group!`'s helper: the items given, when `collectives` has its `cuda` feature.
#[cfg(feature = "cuda")]
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_cuda {
    ($($code:tt)*) => { $($code)* };
}

/// `forward_group!`'s helper: the items given, when `collectives` has its `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_cuda {
    ($($code:tt)*) => {};
}
