//! [`GroupTransport`]: a pipe's [`Transport`] over the point-to-point operations of a
//! `collectives` process group (feature `collectives`).
//!
//! Each frame travels as two messages from one rank to another, both with the
//! transport's tag ([`DEFAULT_TAG`] unless [`GroupTransport::with_tag`] says otherwise):
//! an 8-byte header, the frame's length as a little-endian `u64`, then the frame itself,
//! as [`Buffer::U8`]. The group keeps messages of one (source, destination, tag) in the
//! order they were posted, so frames arrive in order; a per-destination lock keeps the
//! header and body of concurrent senders' frames together.
//!
//! Waits: a group's send completes once its receiver has taken the data, so
//! [`flush`](Transport::flush) waits for every send posted so far. A receive or flush
//! that times out leaves the group's operation where it is: the next receive from that
//! rank takes up the header (or body) already posted, so a timeout never loses a frame
//! or the frame boundaries.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use collectives::{Buffer, ProcessGroup, Work, MAX_TAG};

use crate::transport::{Transport, TransportError};

/// The tag a [`GroupTransport`] sends its frames with unless told otherwise: 32700, near
/// the top of the tags every backend takes (`0..`[`MAX_TAG`]) and below [`MAX_TAG`] itself,
/// which the group's composed collectives use. Pick another with
/// [`GroupTransport::with_tag`] if the program's own point-to-point messages use it.
pub const DEFAULT_TAG: u32 = 32700;

/// The largest frame a [`GroupTransport`] receives: 1 TiB. A header announcing more is
/// [`TransportError::InvalidArgument`] (a corrupt or foreign message), not an allocation.
pub const MAX_FRAME: u64 = 1 << 40;

/// The length of a frame's header: a little-endian `u64`.
const HEADER: usize = 8;

/// The result of a group operation, as its continuation hands it over.
type Done = collectives::Result<Buffer>;

/// A receive from one rank that has been posted and not yet taken.
enum Pending {
    /// Nothing posted: the next receive posts a header.
    Idle,
    /// The header's receive.
    Header(Receiver<Done>),
    /// The body's receive, of this many bytes.
    Body(Receiver<Done>, usize),
}

/// Buffers of finished frames, kept for the next ones (see [`Transport::buffer`]).
#[derive(Default)]
struct Pool(Vec<Vec<u8>>);

impl Pool {
    /// How many buffers are kept at most.
    const KEEP: usize = 16;
    /// Buffers smaller than this are not worth keeping (malloc serves them from memory it
    /// already holds).
    const SMALLEST: usize = 16 << 10;

    fn put(&mut self, v: Vec<u8>) {
        if v.capacity() >= Self::SMALLEST && self.0.len() < Self::KEEP {
            self.0.push(v);
        }
    }

    /// The kept buffer with the least room of at least `capacity` bytes, emptied.
    fn take(&mut self, capacity: usize) -> Option<Vec<u8>> {
        let best = (0..self.0.len())
            .filter(|&i| self.0[i].capacity() >= capacity)
            .min_by_key(|&i| self.0[i].capacity())?;
        let mut v = self.0.swap_remove(best);
        v.clear();
        Some(v)
    }

    /// A buffer of exactly `len` bytes to receive into: a kept one (its old bytes are
    /// overwritten by the receive, which takes exactly `len`), or a fresh zeroed one.
    fn buffer_of(&mut self, len: usize) -> Vec<u8> {
        match self.take(len) {
            Some(mut v) => {
                v.resize(len, 0);
                v
            }
            None => vec![0; len],
        }
    }
}

/// The sends posted and not yet known to be complete.
struct Sends {
    /// Where each send's continuation reports its result.
    done_tx: Sender<Done>,
    done_rx: Receiver<Done>,
    /// How many results have not yet been taken from `done_rx`.
    outstanding: usize,
    /// The first send that failed and has not yet been reported by `flush`.
    failed: Option<TransportError>,
    /// Buffers of finished frames (sent, or received and read).
    pool: Pool,
}

impl Sends {
    /// Takes the results that have arrived (without waiting), keeping the first error.
    fn prune(&mut self) {
        while self.outstanding > 0 {
            match self.done_rx.try_recv() {
                Ok(r) => self.settle(r),
                Err(_) => break,
            }
        }
    }

    fn settle(&mut self, r: Done) {
        self.outstanding -= 1;
        match r {
            // A completed send's buffer comes back: kept for a later frame.
            Ok(Buffer::U8(v)) => self.pool.put(v),
            Ok(_) => {}
            Err(e) => {
                self.failed.get_or_insert_with(|| map_error(e));
            }
        }
    }
}

/// A [`Transport`] over a `collectives` process group: the pipe's ranks are the group's,
/// frames are the group's point-to-point messages (see the [module docs](self) for the
/// encoding). `G` is any [`ProcessGroup`], including `Box<dyn ProcessGroup>` and
/// `Arc<dyn ProcessGroup>`.
///
/// Two thread ranks of one process, exchanging a frame each way:
///
/// ```
/// use pipe::{GroupTransport, Transport};
/// use std::time::Duration;
///
/// let results = collectives::run_local(2, |group| {
///     let t = GroupTransport::new(group);
///     let peer = 1 - t.rank();
///     t.send(peer, format!("hello from {}", t.rank()).into_bytes())?;
///     let got = t.recv(peer, Duration::from_secs(10))?;
///     t.flush(Duration::from_secs(10))?;
///     Ok::<_, pipe::TransportError>(String::from_utf8(got).unwrap())
/// })
/// .unwrap();
/// assert_eq!(results[0].as_ref().unwrap().as_ref().unwrap(), "hello from 1");
/// assert_eq!(results[1].as_ref().unwrap().as_ref().unwrap(), "hello from 0");
/// ```
pub struct GroupTransport<G> {
    group: G,
    tag: u32,
    /// Per destination: held while a frame's header and body are posted.
    send_locks: Vec<Mutex<()>>,
    /// Per source: the receive posted and not yet taken.
    recvs: Vec<Mutex<Pending>>,
    sends: Mutex<Sends>,
}

impl<G> std::fmt::Debug for GroupTransport<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupTransport")
            .field("ranks", &self.send_locks.len())
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A `collectives` error as a transport error.
fn map_error(e: collectives::Error) -> TransportError {
    match e {
        collectives::Error::Timeout { what, after, .. } => TransportError::Timeout { what, after },
        collectives::Error::PeerLost { rank, why } => TransportError::PeerLost { rank, why },
        e @ (collectives::Error::InvalidArgument(_) | collectives::Error::Mismatch(_)) => {
            TransportError::InvalidArgument(e.to_string())
        }
        e => TransportError::Other(e.to_string()),
    }
}

/// `timeout` from now, or far enough away to mean none (`Duration::MAX`).
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Hands `work`'s result to a channel when it completes (on whichever thread completes
/// it), so that a wait for it can time out and be taken up again.
fn forward(work: Work<Buffer>, tx: Sender<Done>) {
    // The chained work only reports `Ok(())`; nothing waits for it.
    drop(work.then(move |r| {
        let _ = tx.send(r);
        Ok(())
    }));
}

/// A receive into `buf` from `from`, reporting to the returned channel.
fn post_recv<G: ProcessGroup>(group: &G, buf: Vec<u8>, from: usize, tag: u32) -> Receiver<Done> {
    let (tx, rx) = channel();
    forward(group.recv(Buffer::U8(buf), from, tag), tx);
    rx
}

impl<G: ProcessGroup> GroupTransport<G> {
    /// The transport over `group`'s ranks, sending on [`DEFAULT_TAG`].
    pub fn new(group: G) -> Self {
        let ranks = group.size();
        let (done_tx, done_rx) = channel();
        GroupTransport {
            group,
            tag: DEFAULT_TAG,
            send_locks: (0..ranks).map(|_| Mutex::new(())).collect(),
            recvs: (0..ranks).map(|_| Mutex::new(Pending::Idle)).collect(),
            sends: Mutex::new(Sends {
                done_tx,
                done_rx,
                outstanding: 0,
                failed: None,
                pool: Pool::default(),
            }),
        }
    }

    /// The same transport on `tag` instead (every rank must use the same one): any tag
    /// below [`MAX_TAG`], which the group's composed collectives use. Set it before the
    /// first frame.
    pub fn with_tag(mut self, tag: u32) -> Result<Self, TransportError> {
        if tag >= MAX_TAG {
            return Err(TransportError::InvalidArgument(format!(
                "tag {tag}: a transport's tag must be below {MAX_TAG}, the collectives' own"
            )));
        }
        self.tag = tag;
        Ok(self)
    }

    /// The tag frames travel with.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// The group underneath.
    pub fn group(&self) -> &G {
        &self.group
    }

    /// The group back (frames still in flight are the caller's to settle: call
    /// [`flush`](Transport::flush) first).
    pub fn into_group(self) -> G {
        self.group
    }

    fn check(&self, peer: usize) -> Result<(), TransportError> {
        if peer >= self.send_locks.len() {
            return Err(TransportError::InvalidArgument(format!(
                "rank {peer} is not one of {} ranks",
                self.send_locks.len()
            )));
        }
        Ok(())
    }

    /// Waits on `rx` until `deadline`; `None` on a timeout (the operation stays posted).
    fn wait(
        &self,
        rx: &Receiver<Done>,
        deadline: Instant,
        from: usize,
    ) -> Option<Result<Buffer, TransportError>> {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(r) => Some(r.map_err(map_error)),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Err(TransportError::PeerLost {
                rank: from,
                why: "the group dropped a pending receive".into(),
            })),
        }
    }
}

impl<G: ProcessGroup> Transport for GroupTransport<G> {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn ranks(&self) -> usize {
        self.group.size()
    }

    fn send(&self, to: usize, frame: Vec<u8>) -> Result<(), TransportError> {
        self.check(to)?;
        let header = (frame.len() as u64).to_le_bytes().to_vec();
        let works = {
            let _pair = lock(&self.send_locks[to]);
            let head = self.group.send(Buffer::U8(header), to, self.tag);
            let body = self.group.send(Buffer::U8(frame), to, self.tag);
            [head, body]
        };
        let mut sends = lock(&self.sends);
        sends.prune();
        for work in works {
            // A send the group refused at once (a bad argument) fails this call.
            if work.is_completed() {
                if let Err(e) = work.wait() {
                    return Err(map_error(e));
                }
                continue;
            }
            sends.outstanding += 1;
            forward(work, sends.done_tx.clone());
        }
        Ok(())
    }

    fn recv(&self, from: usize, timeout: Duration) -> Result<Vec<u8>, TransportError> {
        self.check(from)?;
        let deadline = deadline_after(timeout);
        let mut pending = lock(&self.recvs[from]);
        let timed_out = || TransportError::Timeout {
            what: format!("rank {}'s receive from rank {from}", self.group.rank()),
            after: timeout,
        };
        loop {
            match std::mem::replace(&mut *pending, Pending::Idle) {
                Pending::Idle => {
                    *pending =
                        Pending::Header(post_recv(&self.group, vec![0; HEADER], from, self.tag));
                }
                Pending::Header(rx) => match self.wait(&rx, deadline, from) {
                    None => {
                        *pending = Pending::Header(rx);
                        return Err(timed_out());
                    }
                    Some(r) => {
                        let head = match r? {
                            Buffer::U8(v) if v.len() == HEADER => v,
                            other => {
                                return Err(TransportError::Other(format!(
                                    "a frame header of {:?} x {}",
                                    other.dtype(),
                                    other.len()
                                )))
                            }
                        };
                        let len = u64::from_le_bytes(head.try_into().expect("8 bytes"));
                        if len > MAX_FRAME {
                            return Err(TransportError::InvalidArgument(format!(
                                "rank {from} announced a frame of {len} bytes, above the \
                                 largest a transport takes ({MAX_FRAME})"
                            )));
                        }
                        let len = usize::try_from(len).map_err(|_| {
                            TransportError::InvalidArgument(format!(
                                "a frame of {len} bytes does not fit this machine's memory"
                            ))
                        })?;
                        let buf = lock(&self.sends).pool.buffer_of(len);
                        *pending = Pending::Body(post_recv(&self.group, buf, from, self.tag), len);
                    }
                },
                Pending::Body(rx, len) => match self.wait(&rx, deadline, from) {
                    None => {
                        *pending = Pending::Body(rx, len);
                        return Err(timed_out());
                    }
                    Some(r) => {
                        return match r? {
                            Buffer::U8(v) if v.len() == len => Ok(v),
                            other => Err(TransportError::Other(format!(
                                "a frame body of {:?} x {}, for a header of {len} bytes",
                                other.dtype(),
                                other.len()
                            ))),
                        }
                    }
                },
            }
        }
    }

    fn buffer(&self, capacity: usize) -> Vec<u8> {
        let mut sends = lock(&self.sends);
        sends.prune();
        sends
            .pool
            .take(capacity)
            .unwrap_or_else(|| Vec::with_capacity(capacity))
    }

    fn recycle(&self, frame: Vec<u8>) {
        lock(&self.sends).pool.put(frame);
    }

    fn flush(&self, timeout: Duration) -> Result<(), TransportError> {
        let deadline = deadline_after(timeout);
        let mut sends = lock(&self.sends);
        sends.prune();
        while sends.outstanding > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match sends.done_rx.recv_timeout(left) {
                Ok(r) => sends.settle(r),
                Err(_) => {
                    if let Some(e) = sends.failed.take() {
                        return Err(e);
                    }
                    return Err(TransportError::Timeout {
                        what: format!(
                            "rank {}'s {} sends in flight",
                            self.group.rank(),
                            sends.outstanding
                        ),
                        after: timeout,
                    });
                }
            }
        }
        match sends.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
