//! How the stages of a pipe on several ranks reach each other: a small trait of
//! ordered byte frames between ranks ([`Transport`]), an in-process implementation over
//! channels ([`LocalTransport`], for tests and for ranks that are threads of one process)
//! and, with the `collectives` feature, one over any `collectives::ProcessGroup`
//! ([`GroupTransport`](crate::group_transport::GroupTransport)).
//!
//! The pipe encodes what it sends (activations, gradients, skips, the run's start and
//! end, a failure) into frames itself (`frame.rs`), with a short shape header per tensor,
//! so a transport moves opaque bytes and nothing needs declaring up front.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::time::Duration;

/// Why a transport failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Nothing arrived (or a frame was not taken) within the time allowed.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        after: Duration,
    },
    /// The peer rank is gone: it failed, dropped its end, or its process died.
    #[error("rank {rank} is gone: {why}")]
    PeerLost {
        /// The rank.
        rank: usize,
        /// What happened.
        why: String,
    },
    /// A rank out of range, a frame too large for the transport.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Anything else the underlying transport reported.
    #[error("{0}")]
    Other(String),
}

/// Ordered byte frames between the ranks of a pipe.
///
/// Frames from one rank to another arrive in the order they were sent. `send` may be
/// called from several threads at once; each peer's frames are received by one thread
/// at a time. Every wait is bounded: `recv` by its timeout, `flush` by its.
pub trait Transport: Send + Sync {
    /// This rank, `0..ranks()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn ranks(&self) -> usize;
    /// Posts `frame` for rank `to`: returns once it is posted, not when it is received.
    fn send(&self, to: usize, frame: Vec<u8>) -> Result<(), TransportError>;
    /// The next frame from rank `from`, waiting at most `timeout`.
    fn recv(&self, from: usize, timeout: Duration) -> Result<Vec<u8>, TransportError>;
    /// Waits (at most `timeout`) until every frame this rank has sent has been taken by
    /// its receiver, or fails with the first send that failed. The in-process transport
    /// hands frames over at once; a network one waits for its sends here.
    fn flush(&self, timeout: Duration) -> Result<(), TransportError> {
        let _ = timeout;
        Ok(())
    }
    /// An empty buffer with room for `capacity` bytes, to build a frame in. A transport
    /// that keeps the buffers of finished frames hands one back here, so that a steady
    /// stream of frames maps no fresh memory (a fresh buffer of a large frame costs a
    /// page fault per 4 KiB when it is first written). The default allocates.
    fn buffer(&self, capacity: usize) -> Vec<u8> {
        Vec::with_capacity(capacity)
    }
    /// Gives back a received frame's buffer once it has been read, for
    /// [`buffer`](Transport::buffer) and the transport's own receives. The default drops
    /// it.
    fn recycle(&self, frame: Vec<u8>) {
        drop(frame);
    }
}

impl<X: Transport + ?Sized> Transport for std::sync::Arc<X> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn ranks(&self) -> usize {
        (**self).ranks()
    }
    fn send(&self, to: usize, frame: Vec<u8>) -> Result<(), TransportError> {
        (**self).send(to, frame)
    }
    fn recv(&self, from: usize, timeout: Duration) -> Result<Vec<u8>, TransportError> {
        (**self).recv(from, timeout)
    }
    fn flush(&self, timeout: Duration) -> Result<(), TransportError> {
        (**self).flush(timeout)
    }
    fn buffer(&self, capacity: usize) -> Vec<u8> {
        (**self).buffer(capacity)
    }
    fn recycle(&self, frame: Vec<u8>) {
        (**self).recycle(frame)
    }
}

/// One rank of an in-process transport: a channel per ordered pair of ranks. Make the
/// ranks with [`LocalTransport::create`] and hand one to each thread; dropping one makes
/// the others' receives from it fail with [`TransportError::PeerLost`] once its frames
/// are taken.
pub struct LocalTransport {
    rank: usize,
    /// `to[j]`: this rank's sender to rank `j`.
    to: Vec<Mutex<Sender<Vec<u8>>>>,
    /// `from[j]`: this rank's receiver of rank `j`'s frames.
    from: Vec<Mutex<Receiver<Vec<u8>>>>,
}

impl std::fmt::Debug for LocalTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LocalTransport {{ rank: {}, ranks: {} }}",
            self.rank,
            self.to.len()
        )
    }
}

impl LocalTransport {
    /// The `ranks` ends of a new in-process transport, in rank order.
    pub fn create(ranks: usize) -> Vec<LocalTransport> {
        // senders[i][j], receivers[j][i]: the channel from rank i to rank j.
        let mut senders: Vec<Vec<Option<Sender<Vec<u8>>>>> = (0..ranks)
            .map(|_| (0..ranks).map(|_| None).collect())
            .collect();
        let mut receivers: Vec<Vec<Option<Receiver<Vec<u8>>>>> = (0..ranks)
            .map(|_| (0..ranks).map(|_| None).collect())
            .collect();
        for (i, row) in senders.iter_mut().enumerate() {
            for (j, slot) in row.iter_mut().enumerate() {
                let (tx, rx) = channel();
                *slot = Some(tx);
                receivers[j][i] = Some(rx);
            }
        }
        senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(rank, (to, from))| LocalTransport {
                rank,
                to: to.into_iter().flatten().map(Mutex::new).collect(),
                from: from.into_iter().flatten().map(Mutex::new).collect(),
            })
            .collect()
    }

    fn check(&self, peer: usize) -> Result<(), TransportError> {
        if peer >= self.to.len() {
            return Err(TransportError::InvalidArgument(format!(
                "rank {peer} is not one of {} ranks",
                self.to.len()
            )));
        }
        Ok(())
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.to.len()
    }

    fn send(&self, to: usize, frame: Vec<u8>) -> Result<(), TransportError> {
        self.check(to)?;
        let tx = self.to[to].lock().unwrap_or_else(|p| p.into_inner());
        tx.send(frame).map_err(|_| TransportError::PeerLost {
            rank: to,
            why: "its end of the transport was dropped".into(),
        })
    }

    fn recv(&self, from: usize, timeout: Duration) -> Result<Vec<u8>, TransportError> {
        self.check(from)?;
        let rx = self.from[from].lock().unwrap_or_else(|p| p.into_inner());
        rx.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => TransportError::Timeout {
                what: format!("rank {}'s receive from rank {from}", self.rank),
                after: timeout,
            },
            RecvTimeoutError::Disconnected => TransportError::PeerLost {
                rank: from,
                why: "its end of the transport was dropped".into(),
            },
        })
    }
}
