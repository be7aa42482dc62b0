//! The state every thread of one process's TCP mesh shares: frames received and not yet
//! taken, which peers are gone, the point-to-point tables, and the links to the peers.
//!
//! Reader threads (one per peer socket) [`deliver`](Shared::deliver) frames here; a
//! group's progress thread [`take`](Shared::take_coll)s its collectives' frames, waiting
//! on one condition variable with a deadline. A peer whose socket ends is
//! [marked gone](Shared::mark_dead): every wait for it fails with its reason, at once.

use super::frame::{FrameKind, Header};
pub(crate) use super::queue::{finish, Frame, Outgoing, Queue, Task};
use super::tables::Tables;
use crate::{Buffer, Error, Result};
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The connection to one peer.
pub(crate) struct Link {
    pub write: Mutex<TcpStream>,
    /// A handle of the same socket, to shut it down while a write holds `write`.
    pub raw: TcpStream,
    pub out: Mutex<Option<Sender<Outgoing>>>,
}

/// Why a wait for a frame ended without one.
#[derive(Debug)]
pub(crate) enum WaitErr {
    /// The peer (a world rank) is gone: why.
    Lost(usize, String),
    Timeout,
    /// This group was dropped.
    Closed,
}

/// (group, source world rank, sequence number, phase).
type CollKey = (u64, usize, u64, u8);

pub(crate) struct State {
    coll: HashMap<CollKey, VecDeque<Frame>>,
    /// Per group, the lowest sequence number still to come: older frames are dropped.
    floor: HashMap<u64, u64>,
    /// Per world rank, why it is gone.
    pub dead: Vec<Option<String>>,
    pub closed: bool,
    pub p2p: Tables,
}

/// The mesh's shared state (see the module docs).
pub(crate) struct Shared {
    /// This process's world rank.
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    state: Mutex<State>,
    /// Frames arrived, a peer went, a group closed.
    arrived: Condvar,
    /// Wakes the point-to-point watchdog.
    pub(super) watch: Condvar,
    /// Per world rank (`None` for this one).
    pub links: Vec<Option<Link>>,
    /// Large payloads of finished collectives, kept for the next frames to be read into
    /// (fresh pages cost a fault each and the kernel's zeroing).
    pool: Mutex<Vec<Buffer>>,
}

/// Payloads at least this large are pooled.
const POOL_MIN_BYTES: usize = 64 * 1024;
/// At most this many payloads are pooled,
const POOL_MAX: usize = 16;
/// holding at most this many bytes together.
const POOL_MAX_BYTES: usize = 512 << 20;

/// The elements `b` has room for.
fn capacity(b: &Buffer) -> usize {
    match b {
        Buffer::F32(v) => v.capacity(),
        Buffer::F16(v) => v.capacity(),
        Buffer::BF16(v) => v.capacity(),
        Buffer::F64(v) => v.capacity(),
        Buffer::U8(v) => v.capacity(),
    }
}

/// Sets `b`'s length to `len`, within its capacity (new elements are zeros).
fn set_len(b: &mut Buffer, len: usize) {
    match b {
        Buffer::F32(v) => v.resize(len, 0.0),
        Buffer::F16(v) => v.resize(len, half::f16::ZERO),
        Buffer::BF16(v) => v.resize(len, half::bf16::ZERO),
        Buffer::F64(v) => v.resize(len, 0.0),
        Buffer::U8(v) => v.resize(len, 0),
    }
}

impl Shared {
    pub fn new(rank: usize, size: usize, timeout: Duration, links: Vec<Option<Link>>) -> Shared {
        Shared {
            rank,
            size,
            timeout,
            state: Mutex::new(State {
                coll: HashMap::new(),
                floor: HashMap::new(),
                dead: vec![None; size],
                closed: false,
                p2p: Tables::default(),
            }),
            arrived: Condvar::new(),
            watch: Condvar::new(),
            links,
            pool: Mutex::new(Vec::new()),
        }
    }

    /// A buffer of `count` elements of `dtype` to read a frame's payload into: a pooled
    /// one when there is one large enough, else a fresh one ([`Error::Alloc`] if it
    /// cannot be had).
    pub fn payload(&self, dtype: crate::DType, count: usize) -> Result<Buffer> {
        if count.saturating_mul(dtype.size()) >= POOL_MIN_BYTES {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let fit = pool
                .iter()
                .enumerate()
                .filter(|(_, b)| b.dtype() == dtype && capacity(b) >= count)
                .min_by_key(|(_, b)| capacity(b))
                .map(|(i, _)| i);
            if let Some(i) = fit {
                let mut b = pool.swap_remove(i);
                drop(pool);
                set_len(&mut b, count);
                return Ok(b);
            }
        }
        Buffer::try_zeros(dtype, count)
    }

    /// Keeps a payload that is no longer needed for [`payload`](Self::payload).
    pub fn recycle(&self, b: Buffer) {
        if b.len() * b.dtype().size() >= POOL_MIN_BYTES {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let held: usize = pool.iter().map(|p| capacity(p) * p.dtype().size()).sum();
            if pool.len() < POOL_MAX && held + capacity(&b) * b.dtype().size() <= POOL_MAX_BYTES {
                pool.push(b);
            }
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn wait_watch<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        for_at_most: Duration,
    ) -> MutexGuard<'a, State> {
        self.watch
            .wait_timeout(st, for_at_most)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    /// A frame from world rank `src`, from its reader thread (or from this rank itself).
    pub fn deliver(&self, src: usize, frame: Frame) {
        match frame.header.kind {
            FrameKind::Coll => {
                let h = frame.header;
                let mut st = self.lock();
                if !st.closed && h.key >= st.floor.get(&h.group).copied().unwrap_or(0) {
                    st.coll
                        .entry((h.group, src, h.key, h.phase))
                        .or_default()
                        .push_back(frame);
                    self.arrived.notify_all();
                }
            }
            FrameKind::P2pData => self.p2p_data(src, frame),
            FrameKind::P2pAck => self.p2p_ack(src, &frame.header),
        }
    }

    /// Waits until `deadline` for the next frame of collective `seq` (phase `phase`) of
    /// `group` from world rank `src`.
    pub fn take_coll(
        &self,
        (group, src, seq, phase): CollKey,
        deadline: Instant,
        closed: &AtomicBool,
    ) -> std::result::Result<Frame, WaitErr> {
        let key = (group, src, seq, phase);
        let mut st = self.lock();
        loop {
            if let Some(q) = st.coll.get_mut(&key) {
                if let Some(f) = q.pop_front() {
                    if q.is_empty() {
                        st.coll.remove(&key);
                    }
                    return Ok(f);
                }
            }
            if let Some(why) = &st.dead[src] {
                return Err(WaitErr::Lost(src, why.clone()));
            }
            if closed.load(Ordering::Acquire) || st.closed {
                return Err(WaitErr::Closed);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitErr::Timeout);
            }
            st = self
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Whether a frame of `key` is waiting.
    pub fn has_coll(&self, key: CollKey) -> bool {
        self.lock().coll.get(&key).is_some_and(|q| !q.is_empty())
    }

    /// Collective `seq` of `group` is over on this rank: its late frames are dropped.
    pub fn finish_coll(&self, group: u64, seq: u64) {
        let mut st = self.lock();
        // Never lowered: collectives finish in order, but a floor must not move back.
        let floor = st.floor.entry(group).or_insert(0);
        *floor = (*floor).max(seq + 1);
        st.coll.retain(|&(g, _, s, _), _| g != group || s > seq);
    }

    /// Wakes the waits of every group (one of them closed).
    pub fn wake(&self) {
        let _st = self.lock();
        self.arrived.notify_all();
    }

    /// Whether world rank `r` is gone, and why.
    pub fn gone(&self, r: usize) -> Option<String> {
        self.lock().dead.get(r).cloned().flatten()
    }

    /// World rank `r` is gone (its socket ended or broke: `why`): every wait for it fails
    /// from now on, and so do the point-to-point operations pending with it.
    pub fn mark_dead(&self, r: usize, why: String) {
        let mut st = self.lock();
        if st.dead[r].is_some() {
            return;
        }
        if !st.closed {
            tracing::debug!(rank = self.rank, peer = r, %why, "TCP group peer lost");
        }
        st.dead[r] = Some(why.clone());
        self.arrived.notify_all();
        let failed = st.p2p.fail_peer(r, &why);
        drop(st);
        if let Some(link) = &self.links[r] {
            let _ = link.raw.shutdown(Shutdown::Both);
        }
        for (queue, done, e) in failed {
            finish(&queue, done, Err(e));
        }
    }

    /// Writes one frame to world rank `dst` (not this rank); a failure marks it gone.
    pub fn write_frame(&self, dst: usize, header: &Header, payload: &[u8]) -> Result<()> {
        let lost = |why: String| Error::PeerLost { rank: dst, why };
        let Some(link) = &self.links[dst] else {
            return Err(Error::Internal(format!("no link to rank {dst}")));
        };
        if let Some(why) = self.gone(dst) {
            return Err(lost(why));
        }
        let mut s = link.write.lock().unwrap_or_else(|p| p.into_inner());
        // Checked again under the lock: a writer that failed before us shut the socket.
        if let Some(why) = self.gone(dst) {
            return Err(lost(why));
        }
        let head = header.encode();
        let written = if payload.len() <= 64 * 1024 {
            // One write: a small frame goes out as one segment.
            let mut b = Vec::with_capacity(head.len() + payload.len());
            b.extend_from_slice(&head);
            b.extend_from_slice(payload);
            s.write_all(&b)
        } else {
            s.write_all(&head).and_then(|()| s.write_all(payload))
        };
        if written.is_err() {
            // Part of the frame may be out: shut the socket before another writer can
            // append a frame to the half-written one (the peer would read the two as one).
            let _ = link.raw.shutdown(Shutdown::Both);
        }
        drop(s);
        written.map_err(|e| {
            let why = format!("writing to it failed: {e}");
            self.mark_dead(dst, why.clone());
            lost(why)
        })
    }

    /// Hands `out` to world rank `dst`'s sender thread (or delivers it here, for this
    /// rank). `false` when the peer is gone.
    pub fn post_out(&self, dst: usize, out: Outgoing) -> bool {
        if dst == self.rank {
            match out {
                Outgoing::Data { header, buf } => {
                    let id = header.desc;
                    // The send keeps its buffer: the receive gets a copy.
                    let copy = buf.clone();
                    self.deliver(
                        dst,
                        Frame {
                            header,
                            payload: copy,
                        },
                    );
                    self.returned(id, buf);
                }
                Outgoing::Ack(h) => self.p2p_ack(dst, &h),
            }
            return true;
        }
        let Some(link) = &self.links[dst] else {
            return false;
        };
        let out_tx = link.out.lock().unwrap_or_else(|p| p.into_inner());
        match out_tx.as_ref() {
            Some(tx) => tx.send(out).is_ok(),
            None => false,
        }
    }

    /// Starts stopping: marks the mesh closed and ends every sender queue (the sender
    /// threads write what is queued, then end). Then [`shut_writes`](Self::shut_writes).
    pub fn close(&self) {
        {
            let mut st = self.lock();
            st.closed = true;
            st.coll.clear();
            self.arrived.notify_all();
            self.watch.notify_all();
        }
        for link in self.links.iter().flatten() {
            drop(link.out.lock().unwrap_or_else(|p| p.into_inner()).take());
        }
    }

    /// Shuts the write side of every socket, after what was written (a FIN, which the
    /// peers' readers see as this rank leaving). The reader threads drain the sockets
    /// until the peers close theirs, so that no unread data turns the close into a reset
    /// that could cut off data still in flight to a peer.
    pub fn shut_writes(&self) {
        for link in self.links.iter().flatten() {
            let _ = link.raw.shutdown(Shutdown::Write);
        }
    }
}
