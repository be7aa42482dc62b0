//! The thread backend's point-to-point operations: one mailbox per group, keyed by
//! (source, destination, tag), where a send or a receive waits until its match is
//! posted.
//!
//! Buffers are moved into the mailbox, not lent: the operation posted second takes its
//! match out under the lock and copies the data with no lock held, then completes both
//! works. Nothing is shared by address, so no rank can free a buffer another still
//! reads, whatever fails and whenever. Continuations chained to a work completed by the
//! peer's thread run on the owning rank's progress thread (`Completer::complete_from_afar`),
//! as the trait promises.
//!
//! Bounded waits: a watchdog thread per mailbox (started with its first waiting
//! operation, gone with the group) fails every operation still unmatched at its deadline
//! with [`Error::Timeout`]. Failure spreads: [`Mailbox::depart`] (called when a rank
//! panics or drops its group) fails every operation that waits for that rank with
//! [`Error::PeerLost`]. Only the ranks a message concerns are affected: a collective
//! that fails the group (a mismatch, a timeout) leaves point-to-point traffic between
//! the ranks still there alone.

use crate::p2p::mismatch;
use crate::sync::{Arc, Condvar, Mutex, MutexGuard};
use crate::{Buffer, Completer, Error};
use std::collections::{HashMap, VecDeque};
#[cfg(not(loom))]
use std::time::{Duration, Instant};

/// The job queue of a rank's progress thread, where continuations of its works run.
pub(crate) type Queue = std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>;

/// A posted send or receive.
struct Posted {
    /// The rank that posted it (whose queue runs its continuations).
    owner: usize,
    buf: Buffer,
    done: Completer<Buffer>,
    #[cfg(not(loom))]
    deadline: Instant,
}

/// (source, destination, tag).
type Key = (usize, usize, u32);

/// Unmatched operations of one key: at most one of the two is non-empty.
#[derive(Default)]
struct Queues {
    sends: VecDeque<Posted>,
    recvs: VecDeque<Posted>,
}

struct State {
    pending: HashMap<Key, Queues>,
    /// Per rank, why it left the group (dropped it or panicked), once it has.
    gone: Vec<Option<Error>>,
    /// The group is gone: the watchdog ends.
    closed: bool,
    watchdog: bool,
}

struct Inner {
    state: Mutex<State>,
    /// Wakes the watchdog: a new deadline, a failure, the end.
    changed: Condvar,
    /// Per rank, its progress thread's queue, once it has joined.
    queues: Mutex<Vec<Option<Queue>>>,
    #[cfg(not(loom))]
    timeout: Duration,
}

impl Inner {
    /// Completes `done`, owned by rank `owner`, from whichever thread is here: a
    /// continuation chained to it goes to the owner's progress thread.
    fn finish(&self, owner: usize, done: Completer<Buffer>, result: crate::Result<Buffer>) {
        let queue = self
            .queues
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(owner)
            .cloned()
            .flatten();
        done.complete_from_afar(result, |job| match queue {
            // A queue whose thread is gone drops the job: the works chained from it fail.
            Some(q) => drop(q.send(job)),
            None => job(),
        });
    }
}

/// The mailbox of one group (see the module docs). Dropping it (with the group's shared
/// state) ends its watchdog.
pub(crate) struct Mailbox {
    inner: Arc<Inner>,
}

/// Which side an operation is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Send,
    Recv,
}

impl Mailbox {
    pub fn new(
        size: usize,
        #[cfg_attr(loom, allow(unused_variables))] timeout: std::time::Duration,
    ) -> Self {
        Mailbox {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    pending: HashMap::new(),
                    gone: (0..size).map(|_| None).collect(),
                    closed: false,
                    watchdog: false,
                }),
                changed: Condvar::new(),
                queues: Mutex::new((0..size).map(|_| None).collect()),
                #[cfg(not(loom))]
                timeout,
            }),
        }
    }

    /// Registers `rank`'s progress-thread queue.
    pub fn register(&self, rank: usize, queue: Queue) {
        let mut queues = self.inner.queues.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = queues.get_mut(rank) {
            *slot = Some(queue);
        }
    }

    /// Unregisters `rank`'s queue (its group is being dropped): the progress thread ends
    /// once no sender of its queue is left, and the mailbox must not keep one.
    pub fn unregister(&self, rank: usize) {
        let mut queues = self.inner.queues.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = queues.get_mut(rank) {
            *slot = None;
        }
    }

    /// Posts `rank`'s send of `buf` to `peer` (`Side::Send`) or receive into `buf` from
    /// `peer` (`Side::Recv`) with `tag`; `done` completes when it is matched, fails, or
    /// times out. The arguments are checked by the caller.
    pub fn post(
        &self,
        side: Side,
        rank: usize,
        peer: usize,
        tag: u32,
        buf: Buffer,
        done: Completer<Buffer>,
    ) {
        let key = match side {
            Side::Send => (rank, peer, tag),
            Side::Recv => (peer, rank, tag),
        };
        let posted = Posted {
            owner: rank,
            buf,
            done,
            #[cfg(not(loom))]
            deadline: crate::group::deadline_after(self.inner.timeout),
        };
        let mut st = self.lock();
        if let Some(e) = st.gone.get(rank).cloned().flatten() {
            // This rank has left (its progress thread panicked): it posts no more.
            drop(st);
            self.complete(posted, e);
            return;
        }
        let queues = st.pending.entry(key).or_default();
        let theirs = match side {
            Side::Send => &mut queues.recvs,
            Side::Recv => &mut queues.sends,
        };
        if let Some(other) = theirs.pop_front() {
            if queues.sends.is_empty() && queues.recvs.is_empty() {
                st.pending.remove(&key);
            }
            drop(st);
            let (send, recv) = match side {
                Side::Send => (posted, other),
                Side::Recv => (other, posted),
            };
            self.hand_over(key, send, recv);
            return;
        }
        if let Some(e) = st.gone.get(peer).cloned().flatten() {
            // Nothing the peer posted before it left matches, and it posts no more.
            if st
                .pending
                .get(&key)
                .is_some_and(|q| q.sends.is_empty() && q.recvs.is_empty())
            {
                st.pending.remove(&key);
            }
            drop(st);
            self.complete(posted, e);
            return;
        }
        let queues = st.pending.entry(key).or_default();
        match side {
            Side::Send => queues.sends.push_back(posted),
            Side::Recv => queues.recvs.push_back(posted),
        }
        self.watch(st);
    }

    /// Copies a matched send's data into its receive's buffer, or fails both on a
    /// mismatch of type or length; completes both.
    fn hand_over(&self, (src, dst, tag): Key, send: Posted, mut recv: Posted) {
        let sent = (send.buf.dtype(), send.buf.len());
        let posted = (recv.buf.dtype(), recv.buf.len());
        if sent != posted {
            let e = mismatch(src, dst, tag, sent, posted);
            self.complete(send, e.clone());
            self.complete(recv, e);
            return;
        }
        recv.buf.as_bytes_mut().copy_from_slice(send.buf.as_bytes());
        self.inner.finish(recv.owner, recv.done, Ok(recv.buf));
        self.inner.finish(send.owner, send.done, Ok(send.buf));
    }

    /// Fails `p` with `e` (its buffer is dropped).
    fn complete(&self, p: Posted, e: Error) {
        self.inner.finish(p.owner, p.done, Err(e));
    }

    /// Rank `rank` has left the group (`e` says how: it dropped the group or panicked).
    /// Every pending operation waiting for it fails with `e`, and so does every later one
    /// that nothing it sent before leaving matches; its own pending receives fail too (no
    /// one waits for them). The messages it sent before leaving are still delivered.
    pub fn depart(&self, rank: usize, e: Error) {
        let mut st = self.lock();
        match st.gone.get_mut(rank) {
            Some(slot @ None) => *slot = Some(e.clone()),
            _ => return,
        }
        let mut failed = Vec::new();
        for (&(src, dst, _), q) in st.pending.iter_mut() {
            // Receives from it, and its own receives; sends to it.
            if src == rank || dst == rank {
                failed.extend(q.recvs.drain(..));
            }
            if dst == rank {
                failed.extend(q.sends.drain(..));
            }
        }
        st.pending
            .retain(|_, q| !(q.sends.is_empty() && q.recvs.is_empty()));
        self.inner.changed.notify_all();
        drop(st);
        for p in failed {
            self.complete(p, e.clone());
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After posting an operation that waits: makes sure the watchdog runs and sees its
    /// deadline.
    fn watch(&self, mut st: MutexGuard<'_, State>) {
        #[cfg(not(loom))]
        if !st.watchdog {
            let inner = self.inner.clone();
            let spawned = std::thread::Builder::new()
                .name("collectives-p2p-watchdog".into())
                .spawn(move || watchdog(&inner));
            st.watchdog = spawned.is_ok();
            if let Err(e) = spawned {
                // Without a watchdog nothing would bound the waits: the pending
                // operations fail instead (a later one tries to start it again).
                let e = Error::io("starting the point-to-point watchdog", e);
                let pending: Vec<Posted> = st
                    .pending
                    .drain()
                    .flat_map(|(_, q)| q.sends.into_iter().chain(q.recvs))
                    .collect();
                drop(st);
                for p in pending {
                    self.complete(p, e.clone());
                }
                return;
            }
        }
        #[cfg(loom)]
        let _ = &mut st.watchdog;
        self.inner.changed.notify_all();
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        let mut st = self.lock();
        st.closed = true;
        self.inner.changed.notify_all();
    }
}

/// Fails the operations whose deadline has passed, sleeping until the next one, until
/// the mailbox is dropped.
#[cfg(not(loom))]
fn watchdog(inner: &Inner) {
    let mut st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if st.closed {
            return;
        }
        let now = Instant::now();
        let mut expired = Vec::new();
        let mut next: Option<Instant> = None;
        for (&key, q) in st.pending.iter_mut() {
            for list in [&mut q.sends, &mut q.recvs] {
                while list.front().is_some_and(|p| p.deadline <= now) {
                    if let Some(p) = list.pop_front() {
                        expired.push((key, p));
                    }
                }
                if let Some(p) = list.front() {
                    next = Some(next.map_or(p.deadline, |n| n.min(p.deadline)));
                }
            }
        }
        st.pending
            .retain(|_, q| !(q.sends.is_empty() && q.recvs.is_empty()));
        if !expired.is_empty() {
            drop(st);
            for ((src, dst, tag), p) in expired {
                let (side, peer) = if p.owner == src {
                    ("send to", dst)
                } else {
                    ("receive from", src)
                };
                let e = Error::Timeout {
                    what: format!(
                        "rank {}'s {side} rank {peer} (tag {tag}), never matched",
                        p.owner
                    ),
                    after: inner.timeout,
                    missing: vec![peer],
                };
                inner.finish(p.owner, p.done, Err(e));
            }
            st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
            continue;
        }
        st = match next {
            Some(at) => {
                inner
                    .changed
                    .wait_timeout(st, at.saturating_duration_since(now))
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
            None => inner.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
        };
    }
}

/// Loom models of the hand-off (`cargo xtask loom`): a send and a receive posted from two
/// threads in any order, with the sender leaving the group at any point from a third.
/// Each work completes exactly once (a lost completer would hang `wait`), a matched
/// receive holds the sent data, and the receive fails only when nothing was sent before
/// the sender left.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use crate::Work;

    #[test]
    fn a_message_is_handed_over_once_or_both_sides_fail() {
        loom::model(|| {
            let mailbox = Arc::new(Mailbox::new(2, std::time::Duration::from_secs(1)));
            let sender = {
                let mailbox = mailbox.clone();
                loom::thread::spawn(move || {
                    let (work, done) = Work::pending();
                    mailbox.post(Side::Send, 0, 1, 7, Buffer::F32(vec![1.0, 2.0]), done);
                    work.wait()
                })
            };
            let failer = {
                let mailbox = mailbox.clone();
                loom::thread::spawn(move || {
                    mailbox.depart(
                        0,
                        Error::PeerLost {
                            rank: 0,
                            why: "dropped its group".into(),
                        },
                    )
                })
            };
            let (work, done) = Work::pending();
            mailbox.post(Side::Recv, 1, 0, 7, Buffer::F32(vec![0.0; 2]), done);
            let received = work.wait();
            let sent = sender.join().unwrap();
            failer.join().unwrap();
            // The send is posted before its rank leaves (program order on one thread
            // is not assumed here: the departure runs on a third thread), so every
            // outcome is: both matched, or the send failed by the departure and then
            // the receive found nothing.
            match (&sent, &received) {
                (Ok(s), Ok(r)) => {
                    assert_eq!(s, &Buffer::F32(vec![1.0, 2.0]));
                    assert_eq!(r, &Buffer::F32(vec![1.0, 2.0]));
                }
                (_, Err(Error::PeerLost { rank: 0, .. })) => {}
                _ => panic!("the two sides disagree: {sent:?} / {received:?}"),
            }
        });
    }

    #[test]
    fn messages_with_one_tag_arrive_in_order() {
        loom::model(|| {
            let mailbox = Arc::new(Mailbox::new(2, std::time::Duration::from_secs(1)));
            let sender = {
                let mailbox = mailbox.clone();
                loom::thread::spawn(move || {
                    let works: Vec<_> = (0..2)
                        .map(|v| {
                            let (work, done) = Work::pending();
                            mailbox.post(Side::Send, 0, 1, 0, Buffer::F64(vec![v as f64]), done);
                            work
                        })
                        .collect();
                    works.into_iter().map(|w| w.wait().unwrap()).count()
                })
            };
            let got: Vec<Buffer> = (0..2)
                .map(|_| {
                    let (work, done) = Work::pending();
                    mailbox.post(Side::Recv, 1, 0, 0, Buffer::F64(vec![-1.0]), done);
                    work
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|w| w.wait().unwrap())
                .collect();
            assert_eq!(sender.join().unwrap(), 2);
            assert_eq!(got, vec![Buffer::F64(vec![0.0]), Buffer::F64(vec![1.0])]);
        });
    }
}
