//! Point-to-point operations: what [`ProcessGroup::send`](crate::ProcessGroup::send),
//! [`recv`](crate::ProcessGroup::recv) and
//! [`batch_isend_irecv`](crate::ProcessGroup::batch_isend_irecv) take, and the checks
//! every backend makes of their arguments.
//!
//! Semantics, on every backend of this crate (as c10d's, with its failure modes made
//! errors):
//!
//! - Messages from one rank to another with the same tag arrive in the order they were
//!   posted (MPI's non-overtaking rule); different tags and different peers are
//!   independent.
//! - A send completes once the matching receive has taken its data (the buffer comes
//!   back unchanged); a receive completes with its buffer holding the data.
//! - A receive whose buffer differs from the matching send's in type or length fails on
//!   both ranks with [`Error::Mismatch`]: never a truncated or
//!   padded buffer.
//! - A peer or tag out of range is [`Error::InvalidArgument`]
//!   on the calling rank alone.
//! - Every pending operation is bounded by the group's timeout, and fails with
//!   [`Error::PeerLost`] when the peer panics or drops its group (only the operations
//!   that wait for that peer: point-to-point traffic between other ranks goes on).
//!
//! What each backend adds: the thread backend hands buffers over in a mailbox keyed by
//! (source, destination, tag) and sends never block; MPI sends a header before each
//! message and the receiver answers with a verdict, so a mismatch fails both sides;
//! NCCL has no tags (they are checked, and messages match in posting order per peer),
//! sees a length or type mismatch only in its debug mode, and runs one operation at a
//! time, so two ranks that exchange both ways post the pair in one
//! [`batch_isend_irecv`](crate::ProcessGroup::batch_isend_irecv), as with torch's NCCL
//! backend (the portable way on every backend).

use crate::{Error, Result};

/// The largest tag a point-to-point operation takes: 32767, the smallest upper bound MPI
/// guarantees (`MPI_TAG_UB`), so that a program runs unchanged on every backend. The
/// collectives composed of point-to-point messages (the default `gather`, `scatter` and
/// `all_to_all`) send theirs with this tag: user messages take `0..MAX_TAG`, or they may
/// mix with those of a collective running at the same time between the same ranks.
pub const MAX_TAG: u32 = 32767;

/// One operation of a [`batch_isend_irecv`](crate::ProcessGroup::batch_isend_irecv), as
/// torch's `P2POp`: a send of `buf` to `peer`, or a receive into `buf` from `peer`.
/// `B` is [`Buffer`](crate::Buffer), or with the `cuda` feature a `DeviceBuffer`.
#[derive(Debug, Clone, PartialEq)]
pub enum P2pOp<B = crate::Buffer> {
    /// Send `buf` to rank `peer` with `tag`.
    Send {
        /// The data.
        buf: B,
        /// The destination rank.
        peer: usize,
        /// The tag, at most [`MAX_TAG`].
        tag: u32,
    },
    /// Receive into `buf` from rank `peer`, the message sent with `tag`.
    Recv {
        /// Where the data goes: its type and length must match the send's.
        buf: B,
        /// The source rank.
        peer: usize,
        /// The tag, at most [`MAX_TAG`].
        tag: u32,
    },
}

impl<B> P2pOp<B> {
    /// A send of `buf` to `peer`.
    pub fn send(buf: B, peer: usize, tag: u32) -> Self {
        P2pOp::Send { buf, peer, tag }
    }

    /// A receive into `buf` from `peer`.
    pub fn recv(buf: B, peer: usize, tag: u32) -> Self {
        P2pOp::Recv { buf, peer, tag }
    }

    /// The peer rank.
    pub fn peer(&self) -> usize {
        match self {
            P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
        }
    }

    /// The tag.
    pub fn tag(&self) -> u32 {
        match self {
            P2pOp::Send { tag, .. } | P2pOp::Recv { tag, .. } => *tag,
        }
    }

    /// Whether this is a send.
    pub fn is_send(&self) -> bool {
        matches!(self, P2pOp::Send { .. })
    }
}

/// Checks a point-to-point operation's peer and tag for a group of `size` ranks:
/// `InvalidArgument` naming `what` when either is out of range.
pub(crate) fn check_peer(what: &str, peer: usize, tag: u32, size: usize) -> Result<()> {
    if peer >= size {
        return Err(Error::InvalidArgument(format!(
            "{what}: peer {peer} is not a rank of a group of {size}"
        )));
    }
    if tag > MAX_TAG {
        return Err(Error::InvalidArgument(format!(
            "{what}: tag {tag} is above the largest tag, {MAX_TAG}"
        )));
    }
    Ok(())
}

/// The error of a receive whose buffer (`theirs` for the sender's, `mine` for the
/// receiver's, as type and length) does not match the send it met.
pub(crate) fn mismatch(
    src: usize,
    dst: usize,
    tag: u32,
    sent: (crate::DType, usize),
    posted: (crate::DType, usize),
) -> Error {
    Error::Mismatch(format!(
        "rank {src} sent {:?} x {} to rank {dst} (tag {tag}), which posted a receive of {:?} x {}",
        sent.0, sent.1, posted.0, posted.1
    ))
}
