//! Point-to-point operations on the progress thread: `send` and `recv` as non-blocking
//! MPI messages, with a small protocol that makes a receive of the wrong type or length a
//! [`Error::Mismatch`] on both ranks.
//!
//! # The protocol
//! Every communicator has two duplicates for point-to-point traffic ([`Links`]): `data`
//! carries, from sender to receiver, a header (the buffer's type code and length, two
//! `u64`s) followed at once by the payload, both with the user's tag; `reply` carries,
//! from receiver to sender with the same tag, a verdict (`[ok, type, length]` of the
//! receive's buffer). A send posts its header, its payload and the receive of its verdict
//! together, and completes when all three have: with its buffer on `ok == 1`, else with
//! the mismatch (or the receiver's timeout) the verdict reports.
//!
//! A receive posts the receive of a header; when the header comes, it compares it with its
//! buffer, posts the payload's receive (into its buffer, or into a scratch buffer of the
//! sent shape that is dropped, on a mismatch), sends its verdict, and completes once the
//! payload has come. MPI matches messages from one rank with one tag on one communicator
//! in the order sent, and a sender posts a header and its payload back to back, so the
//! payload is the next `data` message after its header. To keep that pairing, at most one
//! receive per (communicator, source, tag) waits for its header at a time: the next one
//! posts its header receive only after the one before has posted its payload receive.
//! Receives of different tags or sources are independent, and sends never wait for
//! anything but MPI, so any number can be in flight in both directions.
//!
//! # Timeouts
//! Each operation is bounded by its group's timeout. A receive still waiting for its
//! header is cancelled (`MPI_Cancel`); if the header matched first, the receive discards
//! the payload and answers the sender with a "timed out" verdict, so the pairing of later
//! messages stays intact. Operations abandoned in other states are handed to the
//! graveyard with their buffers, as abandoned collectives are.

use super::debug::{dtype_code, dtype_of_code};
use super::raw::{self, Request};
use super::shared::{guarded, CommId, Graveyard};
use crate::p2p::mismatch;
use crate::{Buffer, Completer, DType, Error, Result};
use mpi::topology::SimpleCommunicator;
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// How long a cancelled header receive may take to complete before it is abandoned.
const CANCEL_GRACE: Duration = Duration::from_secs(10);

/// A header that no message wrote: what a cancelled header receive still holds.
const UNWRITTEN: u64 = u64::MAX;

/// Verdict codes.
const MATCHED: u64 = 1;
const MISMATCHED: u64 = 0;
const TIMED_OUT: u64 = 2;

/// The point-to-point duplicates of a communicator (see the module docs).
pub(super) struct Links {
    /// Headers and payloads, sender to receiver.
    pub(super) data: SimpleCommunicator,
    /// Verdicts, receiver to sender.
    pub(super) reply: SimpleCommunicator,
}

impl Links {
    /// Duplicates of `main` (collective over its ranks).
    pub(super) fn of(main: &SimpleCommunicator) -> Links {
        use mpi::topology::Communicator;
        Links {
            data: main.duplicate(),
            reply: main.duplicate(),
        }
    }
}

/// A `send` or `recv` as a group handle issues it.
pub(super) struct P2pJob {
    /// The communicator.
    pub(super) comm: CommId,
    /// This rank in it.
    pub(super) rank: usize,
    /// The other rank.
    pub(super) peer: usize,
    /// The user's tag (checked against `MAX_TAG`).
    pub(super) tag: u32,
    /// A send (else a receive).
    pub(super) send: bool,
    /// The data, or where it goes.
    pub(super) buf: Buffer,
    /// The bound on the operation, from the moment the progress thread takes it.
    pub(super) timeout: Duration,
    /// The work's completer.
    pub(super) done: Completer<Buffer>,
}

impl P2pJob {
    /// Fails the work without communicating.
    pub(super) fn fail(self, e: Error) {
        self.done.complete(Err(e));
    }
}

/// Receives that must not wait for their headers at the same time.
type Key = (CommId, usize, u32);

/// `$call` with `$v` bound to the buffer's elements in an MPI type (halves as `u16`).
macro_rules! on_elems {
    ($buf:expr, |$v:ident| $call:expr) => {
        match $buf {
            Buffer::F32($v) => $call,
            Buffer::F64($v) => $call,
            Buffer::U8($v) => $call,
            Buffer::F16(v) => {
                let $v: &mut [u16] = bytemuck::cast_slice_mut(v);
                $call
            }
            Buffer::BF16(v) => {
                let $v: &mut [u16] = bytemuck::cast_slice_mut(v);
                $call
            }
        }
    };
}

/// The buffers of a send, kept together so they can be buried together.
struct SendBufs {
    header: Vec<u64>,
    verdict: Vec<u64>,
    buf: Buffer,
}

struct SendRun {
    comm: CommId,
    rank: usize,
    peer: usize,
    tag: u32,
    deadline: Instant,
    timeout: Duration,
    done: Completer<Buffer>,
    bufs: SendBufs,
    requests: Vec<Request>,
    error: Option<Error>,
}

/// The buffers of a receive.
struct RecvBufs {
    header: Vec<u64>,
    verdict: Vec<u64>,
    buf: Buffer,
    /// Where a payload of the wrong shape goes, to be dropped.
    scratch: Option<Buffer>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// Not started: another receive of its key waits for its header.
    Waiting,
    /// Waiting for its header.
    Header,
    /// Timed out waiting for its header; the header receive is being cancelled.
    Cancelling { until: Instant },
    /// The payload's receive and the verdict's send are in flight.
    Body,
}

struct RecvRun {
    key: Key,
    rank: usize,
    deadline: Instant,
    timeout: Duration,
    /// `None` once the work has been completed (a timed-out receive finishing its part of
    /// the protocol).
    done: Option<Completer<Buffer>>,
    bufs: RecvBufs,
    phase: Phase,
    requests: Vec<Request>,
    /// The work's error, once known (a mismatch, or an MPI error).
    error: Option<Error>,
    /// The payload goes to scratch: MPI errors of its receive (a truncation) are expected.
    discarding: bool,
}

/// Every point-to-point operation of the process that has not completed.
#[derive(Default)]
pub(super) struct P2p {
    /// Taken from the channel, not yet looked at (in issue order).
    fresh: VecDeque<P2pJob>,
    sends: Vec<SendRun>,
    /// Receives started, in any phase but `Waiting`.
    recvs: Vec<RecvRun>,
    /// Receives not yet started, per key, in issue order.
    waiting: HashMap<Key, VecDeque<RecvRun>>,
    /// Keys with a receive waiting for its header (or cancelling it).
    busy: HashSet<Key>,
}

impl P2p {
    /// Takes a job from the channel; it starts at the next [`poll`](P2p::poll).
    pub(super) fn accept(&mut self, job: P2pJob) {
        self.fresh.push_back(job);
    }

    /// Whether nothing is in flight or waiting.
    pub(super) fn idle(&self) -> bool {
        self.fresh.is_empty()
            && self.sends.is_empty()
            && self.recvs.is_empty()
            && self.waiting.values().all(VecDeque::is_empty)
    }

    /// Whether data is moving: a send in flight, or a receive whose header has come (its
    /// payload's fragments move only while the engine tests them). Otherwise every
    /// operation waits for a peer's message to begin.
    pub(super) fn data_in_flight(&self) -> bool {
        !self.fresh.is_empty()
            || !self.sends.is_empty()
            || self.recvs.iter().any(|r| r.phase == Phase::Body)
    }

    /// Whether an operation on communicator `comm` is in flight or waiting (so its links
    /// must not be freed yet).
    pub(super) fn uses(&self, comm: CommId) -> bool {
        self.fresh.iter().any(|j| j.comm == comm)
            || self.sends.iter().any(|s| s.comm == comm)
            || self.recvs.iter().any(|r| r.key.0 == comm)
            || self
                .waiting
                .iter()
                .any(|(k, q)| k.0 == comm && !q.is_empty())
    }

    /// Starts what can start, tests what runs, completes what is done; whether anything
    /// happened.
    pub(super) fn poll<'a>(
        &mut self,
        links: impl Fn(CommId) -> Option<&'a Links>,
        graveyard: &mut Graveyard,
    ) -> bool {
        let mut progressed = false;
        while let Some(job) = self.fresh.pop_front() {
            progressed = true;
            let Some(l) = links(job.comm) else {
                let e = Error::Internal(format!("unknown MPI communicator {}", job.comm));
                guarded("an MPI point-to-point operation", || job.fail(e));
                continue;
            };
            if job.send {
                if let Some(s) = start_send(job, l, graveyard) {
                    self.sends.push(s);
                }
            } else {
                let key = (job.comm, job.peer, job.tag);
                self.waiting.entry(key).or_default().push_back(RecvRun {
                    key,
                    rank: job.rank,
                    deadline: crate::group::deadline_after(job.timeout),
                    timeout: job.timeout,
                    done: Some(job.done),
                    bufs: RecvBufs {
                        header: vec![UNWRITTEN; 2],
                        verdict: vec![0; 3],
                        buf: job.buf,
                        scratch: None,
                    },
                    phase: Phase::Waiting,
                    requests: Vec::new(),
                    error: None,
                    discarding: false,
                });
            }
        }
        progressed |= self.poll_sends(graveyard);
        progressed |= self.poll_recvs(&links, graveyard);
        progressed |= self.start_waiting(&links, graveyard);
        progressed
    }

    fn poll_sends(&mut self, graveyard: &mut Graveyard) -> bool {
        let mut progressed = false;
        let now = Instant::now();
        let mut i = 0;
        while i < self.sends.len() {
            let s = &mut self.sends[i];
            let mut error = s.error.take();
            s.requests.retain_mut(|r| match r.test() {
                Ok(done) => !done,
                Err(e) => {
                    error.get_or_insert(e);
                    false
                }
            });
            s.error = error;
            if s.requests.is_empty() {
                let (done, result) = self.sends.swap_remove(i).finish();
                guarded("an MPI send", || done.complete(result));
                progressed = true;
            } else if now >= s.deadline {
                let s = self.sends.swap_remove(i);
                let e = Error::Timeout {
                    what: format!("MPI send to rank {} (tag {})", s.peer, s.tag),
                    after: s.timeout,
                    missing: vec![s.peer],
                };
                graveyard.bury(s.requests, Box::new(s.bufs), s.timeout);
                guarded("an MPI send", || s.done.complete(Err(e)));
                progressed = true;
            } else {
                i += 1;
            }
        }
        progressed
    }

    fn poll_recvs<'a>(
        &mut self,
        links: &impl Fn(CommId) -> Option<&'a Links>,
        graveyard: &mut Graveyard,
    ) -> bool {
        let mut progressed = false;
        let now = Instant::now();
        let mut i = 0;
        while i < self.recvs.len() {
            let r = &mut self.recvs[i];
            let discarding = r.discarding && r.phase == Phase::Body;
            let mut error = None;
            r.requests.retain_mut(|q| match q.test() {
                Ok(done) => !done,
                // A truncated discard is a discard all the same.
                Err(_) if discarding => false,
                Err(e) => {
                    error.get_or_insert(e);
                    false
                }
            });
            if let Some(e) = error {
                // An MPI error: the receive ends here, whatever its phase.
                let r = self.recvs.swap_remove(i);
                if matches!(r.phase, Phase::Header | Phase::Cancelling { .. }) {
                    self.busy.remove(&r.key);
                }
                graveyard.bury(r.requests, Box::new(r.bufs), r.timeout);
                if let Some(done) = r.done {
                    guarded("an MPI receive", || done.complete(Err(e)));
                }
                progressed = true;
                continue;
            }
            let done_now = r.requests.is_empty();
            match r.phase {
                Phase::Header | Phase::Cancelling { .. } if done_now => {
                    progressed = true;
                    let late = matches!(r.phase, Phase::Cancelling { .. });
                    if late && r.bufs.header[0] == UNWRITTEN {
                        // Cancelled before any message matched it.
                        let r = self.recvs.swap_remove(i);
                        self.busy.remove(&r.key);
                        continue;
                    }
                    let key = r.key;
                    let started = links(key.0)
                        .ok_or_else(|| {
                            Error::Internal(format!("unknown MPI communicator {}", key.0))
                        })
                        .and_then(|l| r.body(l, late));
                    // Its payload's receive is posted (or never will be): the next
                    // receive of its key may post its header's.
                    self.busy.remove(&key);
                    if let Err(e) = started {
                        let r = self.recvs.swap_remove(i);
                        graveyard.bury(r.requests, Box::new(r.bufs), r.timeout);
                        if let Some(done) = r.done {
                            guarded("an MPI receive", || done.complete(Err(e)));
                        }
                        continue;
                    }
                    i += 1;
                }
                Phase::Body if done_now => {
                    progressed = true;
                    let r = self.recvs.swap_remove(i);
                    if let Some(done) = r.done {
                        let result = match r.error {
                            Some(e) => Err(e),
                            None => Ok(r.bufs.buf),
                        };
                        guarded("an MPI receive", || done.complete(result));
                    }
                }
                Phase::Header if now >= r.deadline => {
                    progressed = true;
                    let cancelled = r.requests.iter_mut().try_for_each(Request::cancel);
                    let e = r.timed_out();
                    if let Some(done) = r.done.take() {
                        guarded("an MPI receive", || done.complete(Err(e)));
                    }
                    match cancelled {
                        Ok(()) => {
                            r.phase = Phase::Cancelling {
                                until: now + CANCEL_GRACE,
                            };
                            i += 1;
                        }
                        Err(_) => {
                            let r = self.recvs.swap_remove(i);
                            self.busy.remove(&r.key);
                            graveyard.bury(r.requests, Box::new(r.bufs), r.timeout);
                        }
                    }
                }
                Phase::Cancelling { until } if now >= until => {
                    progressed = true;
                    let r = self.recvs.swap_remove(i);
                    self.busy.remove(&r.key);
                    graveyard.bury(r.requests, Box::new(r.bufs), r.timeout);
                }
                Phase::Body if now >= r.deadline => {
                    progressed = true;
                    let r = self.recvs.swap_remove(i);
                    let e = r.timed_out();
                    graveyard.bury(r.requests, Box::new(r.bufs), r.timeout);
                    if let Some(done) = r.done {
                        guarded("an MPI receive", || done.complete(Err(e)));
                    }
                }
                _ => i += 1,
            }
        }
        progressed
    }

    /// Starts the first waiting receive of every key that has none waiting for its
    /// header; fails waiting receives whose deadline has passed.
    fn start_waiting<'a>(
        &mut self,
        links: &impl Fn(CommId) -> Option<&'a Links>,
        graveyard: &mut Graveyard,
    ) -> bool {
        let mut progressed = false;
        let now = Instant::now();
        for (key, queue) in self.waiting.iter_mut() {
            let mut expired = Vec::new();
            queue.retain_mut(|r| {
                if now < r.deadline {
                    return true;
                }
                expired.push((r.done.take(), r.timed_out()));
                false
            });
            for (done, e) in expired {
                progressed = true;
                if let Some(done) = done {
                    guarded("an MPI receive", || done.complete(Err(e)));
                }
            }
            if self.busy.contains(key) {
                continue;
            }
            let Some(mut r) = queue.pop_front() else {
                continue;
            };
            progressed = true;
            let started = links(key.0)
                .ok_or_else(|| Error::Internal(format!("unknown MPI communicator {}", key.0)))
                .and_then(|l| {
                    // SAFETY: the header vector's heap storage stays put when the run
                    // moves, and the run (or the graveyard, with the buffers) keeps it
                    // until the request completes; nothing reads or writes it until then.
                    let q = unsafe { raw::irecv(&l.data, &mut r.bufs.header, key.1, key.2) }?;
                    r.requests.push(q);
                    Ok(())
                });
            match started {
                Ok(()) => {
                    r.phase = Phase::Header;
                    self.busy.insert(*key);
                    self.recvs.push(r);
                }
                Err(e) => {
                    graveyard.bury(r.requests, Box::new(r.bufs), r.timeout);
                    if let Some(done) = r.done {
                        guarded("an MPI receive", || done.complete(Err(e)));
                    }
                }
            }
        }
        self.waiting.retain(|_, q| !q.is_empty());
        progressed
    }
}

/// Posts a send's header, payload and verdict receive; `None` if it failed (its work is
/// then complete, and whatever started is buried with the buffers).
fn start_send(job: P2pJob, l: &Links, graveyard: &mut Graveyard) -> Option<SendRun> {
    let P2pJob {
        comm,
        rank,
        peer,
        tag,
        buf,
        timeout,
        done,
        ..
    } = job;
    let mut bufs = SendBufs {
        header: vec![dtype_code(Some(buf.dtype())), buf.len() as u64],
        verdict: vec![UNWRITTEN; 3],
        buf,
    };
    let mut requests = Vec::with_capacity(3);
    let started = (|| -> Result<()> {
        // SAFETY: MPI gets pointers into the vectors' heap storage, which stays put when
        // `bufs` moves into the run; the run keeps them until every request completes, or
        // the graveyard does (also on the error paths below: whatever started is buried
        // with them), and nothing touches them until then.
        unsafe {
            requests.push(raw::irecv(&l.reply, &mut bufs.verdict, peer, tag)?);
            requests.push(raw::isend(&l.data, &bufs.header, peer, tag)?);
            let payload = on_elems!(&mut bufs.buf, |v| raw::isend(&l.data, &*v, peer, tag));
            requests.push(payload?);
        }
        Ok(())
    })();
    if let Err(e) = started {
        graveyard.bury(requests, Box::new(bufs), timeout);
        guarded("an MPI send", || done.complete(Err(e)));
        return None;
    }
    Some(SendRun {
        comm,
        rank,
        peer,
        tag,
        deadline: crate::group::deadline_after(timeout),
        timeout,
        done,
        bufs,
        requests,
        error: None,
    })
}

impl SendRun {
    /// The work's completer and value, once every request has completed.
    fn finish(self) -> (Completer<Buffer>, Result<Buffer>) {
        let result = self.result();
        (self.done, result.map(|()| self.bufs.buf))
    }

    fn result(&self) -> Result<()> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let v = &self.bufs.verdict;
        let sent = (self.bufs.buf.dtype(), self.bufs.buf.len());
        match v[0] {
            MATCHED => Ok(()),
            MISMATCHED => {
                let posted = posted_shape(v[1], v[2]);
                Err(mismatch(self.rank, self.peer, self.tag, sent, posted))
            }
            TIMED_OUT => Err(Error::Timeout {
                what: format!(
                    "MPI send to rank {} (tag {}): the receive there",
                    self.peer, self.tag
                ),
                after: self.timeout,
                missing: vec![self.peer],
            }),
            other => Err(Error::Internal(format!(
                "an unreadable point-to-point verdict {other} from rank {}",
                self.peer
            ))),
        }
    }
}

/// A shape from the wire (a type code and a length), for error messages.
fn posted_shape(code: u64, len: u64) -> (DType, usize) {
    (
        dtype_of_code(code).unwrap_or(DType::U8),
        usize::try_from(len).unwrap_or(usize::MAX),
    )
}

impl RecvRun {
    fn timed_out(&self) -> Error {
        Error::Timeout {
            what: format!("MPI receive from rank {} (tag {})", self.key.1, self.key.2),
            after: self.timeout,
            missing: vec![self.key.1],
        }
    }

    /// The header has come: posts the payload's receive (into the buffer, or into
    /// scratch on a mismatch, or when `late`: the work has already timed out) and sends
    /// the verdict.
    fn body(&mut self, l: &Links, late: bool) -> Result<()> {
        let (src, tag) = (self.key.1, self.key.2);
        let header = [self.bufs.header[0], self.bufs.header[1]];
        let sent_dtype = dtype_of_code(header[0]);
        let sent_len = usize::try_from(header[1]).ok();
        let posted = (self.bufs.buf.dtype(), self.bufs.buf.len());
        let matched = !late && sent_dtype == Some(posted.0) && sent_len == Some(posted.1);
        let verdict = if late {
            TIMED_OUT
        } else if matched {
            MATCHED
        } else {
            self.error = Some(mismatch(
                src,
                self.rank,
                tag,
                posted_shape(header[0], header[1]),
                posted,
            ));
            MISMATCHED
        };
        self.bufs.verdict = vec![verdict, dtype_code(Some(posted.0)), posted.1 as u64];
        if !matched {
            self.discarding = true;
            // The sent shape, where it can be had; else an empty receive, which MPI
            // truncates (an error that `poll_recvs` expects while discarding).
            self.bufs.scratch = Some(
                match (sent_dtype, sent_len) {
                    (Some(d), Some(n)) => Buffer::try_zeros(d, n).ok(),
                    _ => None,
                }
                .unwrap_or(Buffer::U8(Vec::new())),
            );
        }
        self.phase = Phase::Body;
        let RecvBufs {
            verdict,
            buf,
            scratch,
            ..
        } = &mut self.bufs;
        let target = match scratch {
            Some(s) => s,
            None => buf,
        };
        // SAFETY: MPI gets pointers into the heap storage of the run's vectors, which
        // stays put when the run moves; the run keeps it until every request completes,
        // or the graveyard does (also when this fails: the caller buries the run's
        // requests with its buffers), and nothing touches it until then. The verdict
        // vector is not replaced again.
        unsafe {
            let payload = on_elems!(target, |v| raw::irecv(&l.data, v, src, tag));
            self.requests.push(payload?);
            self.requests.push(raw::isend(&l.reply, verdict, src, tag)?);
        }
        Ok(())
    }
}
