//! Point-to-point operations of the TCP backend: tag matching on the receiving side, in
//! the order posted, with an ack that completes the send.
//!
//! A send queues its message on the peer's sender thread (the caller never blocks) and
//! waits, in a table keyed by a message id, for the receiver's ack. The receiver's reader
//! thread matches each message against the receives posted for its (group, source, tag)
//! in order, or keeps it until one is posted. A match of the same type and length
//! completes the receive with the data and acks the send; any other fails the receive
//! and acks a mismatch, which fails the send: [`Error::Mismatch`] on both sides with one
//! message. A watchdog thread fails operations still pending at their deadline with
//! [`Error::Timeout`]; a lost peer fails those waiting for it with
//! [`Error::PeerLost`].

use super::frame::{dtype_code, dtype_from, FrameKind, Header};
use super::inbox::{finish, Frame, Outgoing, Queue, Shared};
use super::tables::{Failed, PendingRecv, PendingSend};
use crate::p2p::mismatch;
use crate::{Buffer, Completer, DType, Error};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Who posts an operation: its group, its rank there, and the queue its continuations
/// run on.
pub(crate) struct Poster<'a> {
    pub group: u64,
    pub me: usize,
    pub queue: &'a Queue,
}

fn timed_out(me: usize, side: &str, peer: usize, tag: u64, after: Duration) -> Error {
    Error::Timeout {
        what: format!("rank {me}'s {side} rank {peer} (tag {tag}) over TCP, never matched"),
        after,
        missing: vec![peer],
    }
}

impl Shared {
    /// Posts a send of `buf` to world rank `dst` (group rank `peer`) with `tag`.
    pub fn post_send(
        &self,
        who: Poster<'_>,
        buf: Buffer,
        (dst, peer): (usize, usize),
        tag: u32,
        done: Completer<Buffer>,
    ) {
        let mut st = self.lock();
        if let Some(why) = st.dead[dst].clone() {
            drop(st);
            return finish(who.queue, done, Err(Error::PeerLost { rank: peer, why }));
        }
        st.p2p.next_id += 1;
        let id = st.p2p.next_id;
        let mut header = Header::new(FrameKind::P2pData, who.group, u64::from(tag));
        header.desc = id;
        header.dtype = buf.dtype();
        header.count = buf.len() as u64;
        st.p2p.sends.insert(
            id,
            PendingSend {
                group: who.group,
                dst,
                tag: u64::from(tag),
                buf: None,
                acked: false,
                done,
                queue: who.queue.clone(),
                deadline: crate::group::deadline_after(self.timeout),
                me: who.me,
                peer,
                shape: (buf.dtype(), buf.len()),
            },
        );
        self.watch.notify_all();
        drop(st);
        if !self.post_out(dst, Outgoing::Data { header, buf }) {
            let why = self
                .gone(dst)
                .unwrap_or_else(|| "its connection is closed".into());
            self.mark_dead(dst, why);
        }
    }

    /// Posts a receive into `buf` from world rank `src` (group rank `peer`) with `tag`.
    pub fn post_recv(
        &self,
        who: Poster<'_>,
        buf: Buffer,
        (src, peer): (usize, usize),
        tag: u32,
        done: Completer<Buffer>,
    ) {
        let key = (who.group, src, u64::from(tag));
        let mut st = self.lock();
        let recv = PendingRecv {
            buf,
            done,
            queue: who.queue.clone(),
            deadline: crate::group::deadline_after(self.timeout),
            me: who.me,
            peer,
        };
        if let Some(q) = st.p2p.unexpected.get_mut(&key) {
            if let Some(frame) = q.pop_front() {
                if q.is_empty() {
                    st.p2p.unexpected.remove(&key);
                }
                drop(st);
                return self.hand_over(src, recv, frame);
            }
        }
        if let Some(why) = st.dead[src].clone() {
            drop(st);
            return finish(
                &recv.queue,
                recv.done,
                Err(Error::PeerLost { rank: peer, why }),
            );
        }
        st.p2p.recvs.entry(key).or_default().push_back(recv);
        self.watch.notify_all();
    }

    /// A message from world rank `src`: to the first receive posted for it, or kept.
    pub(super) fn p2p_data(&self, src: usize, frame: Frame) {
        let h = frame.header;
        let key = (h.group, src, h.key);
        let mut st = self.lock();
        let recv = st.p2p.recvs.get_mut(&key).and_then(VecDeque::pop_front);
        if st.p2p.recvs.get(&key).is_some_and(VecDeque::is_empty) {
            st.p2p.recvs.remove(&key);
        }
        match recv {
            Some(recv) => {
                drop(st);
                self.hand_over(src, recv, frame);
            }
            None => st.p2p.unexpected.entry(key).or_default().push_back(frame),
        }
    }

    /// Completes a matched receive (or fails it on a mismatch) and acks the sender.
    fn hand_over(&self, src: usize, recv: PendingRecv, frame: Frame) {
        let h = frame.header;
        let sent = (frame.payload.dtype(), frame.payload.len());
        let posted = (recv.buf.dtype(), recv.buf.len());
        let mut ack = Header::new(FrameKind::P2pAck, h.group, h.key);
        ack.desc = h.desc;
        ack.total = posted.1 as u64;
        ack.aux = u32::from(dtype_code(posted.0));
        let result = if sent == posted {
            Ok(frame.payload)
        } else {
            ack.coll = 1;
            Err(mismatch(recv.peer, recv.me, h.key as u32, sent, posted))
        };
        self.post_out(src, Outgoing::Ack(ack));
        finish(&recv.queue, recv.done, result);
    }

    /// An ack from world rank `src`.
    pub(super) fn p2p_ack(&self, src: usize, h: &Header) {
        let mut st = self.lock();
        let Some(s) = st.p2p.sends.get_mut(&h.desc) else {
            // Timed out already.
            return;
        };
        if s.dst != src || s.group != h.group || s.tag != h.key {
            return;
        }
        if h.coll == 0 {
            s.acked = true;
            if s.buf.is_none() {
                return;
            }
        }
        let Some(s) = st.p2p.sends.remove(&h.desc) else {
            return;
        };
        drop(st);
        let result = match (h.coll, s.buf) {
            (0, Some(buf)) => Ok(buf),
            _ => {
                let posted = (
                    dtype_from(h.aux as u8).unwrap_or(DType::U8),
                    h.total as usize,
                );
                Err(mismatch(s.me, s.peer, s.tag as u32, s.shape, posted))
            }
        };
        finish(&s.queue, s.done, result);
    }

    /// The sender thread has written message `id`: its buffer comes back.
    pub(super) fn returned(&self, id: u64, buf: Buffer) {
        let mut st = self.lock();
        let Some(s) = st.p2p.sends.get_mut(&id) else {
            return;
        };
        if !s.acked {
            s.buf = Some(buf);
            return;
        }
        let Some(s) = st.p2p.sends.remove(&id) else {
            return;
        };
        drop(st);
        finish(&s.queue, s.done, Ok(buf));
    }

    /// Fails every pending operation of `group` with `e` (the group is dropped).
    pub fn fail_group(&self, group: u64, e: &Error) {
        let failed = self.lock().p2p.fail_group(Some(group), e);
        for (q, done, e) in failed {
            finish(&q, done, Err(e));
        }
    }

    /// The watchdog: fails operations at their deadline, until the mesh closes (then
    /// everything still pending fails).
    pub fn watchdog(&self) {
        let mut st = self.lock();
        loop {
            if st.closed {
                let e = Error::Gone {
                    what: "the TCP group's connections are closed".into(),
                };
                let failed = st.p2p.fail_group(None, &e);
                drop(st);
                for (q, done, e) in failed {
                    finish(&q, done, Err(e));
                }
                return;
            }
            let now = Instant::now();
            let mut expired: Failed = Vec::new();
            let mut next: Option<Instant> = None;
            let t = self.timeout;
            for (&(_, _, tag), q) in st.p2p.recvs.iter_mut() {
                while q.front().is_some_and(|p| p.deadline <= now) {
                    if let Some(p) = q.pop_front() {
                        let e = timed_out(p.me, "receive from", p.peer, tag, t);
                        expired.push((p.queue, p.done, e));
                    }
                }
                if let Some(p) = q.front() {
                    next = Some(next.map_or(p.deadline, |n| n.min(p.deadline)));
                }
            }
            st.p2p.recvs.retain(|_, q| !q.is_empty());
            let late: Vec<u64> = st
                .p2p
                .sends
                .iter()
                .filter(|(_, s)| s.deadline <= now)
                .map(|(&id, _)| id)
                .collect();
            for id in late {
                if let Some(s) = st.p2p.sends.remove(&id) {
                    let e = timed_out(s.me, "send to", s.peer, s.tag, t);
                    expired.push((s.queue, s.done, e));
                }
            }
            for s in st.p2p.sends.values() {
                next = Some(next.map_or(s.deadline, |n| n.min(s.deadline)));
            }
            if !expired.is_empty() {
                drop(st);
                for (q, done, e) in expired {
                    finish(&q, done, Err(e));
                }
                st = self.lock();
                continue;
            }
            let wait = next.map_or(Duration::from_secs(3600), |n| n - now);
            st = self.wait_watch(st, wait);
        }
    }
}
