//! The pending point-to-point operations of one process (the TCP backend's tag
//! matching tables), and how they fail when a peer or a group goes.

use super::queue::{Frame, Queue};
use crate::{Buffer, Completer, DType, Error};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// A receive waiting for its message.
pub(super) struct PendingRecv {
    pub(super) buf: Buffer,
    pub(super) done: Completer<Buffer>,
    pub(super) queue: Queue,
    pub(super) deadline: Instant,
    /// Group ranks: this one and the peer.
    pub(super) me: usize,
    pub(super) peer: usize,
}

pub(super) struct PendingSend {
    pub(super) group: u64,
    /// The destination's world rank.
    pub(super) dst: usize,
    pub(super) tag: u64,
    /// The buffer, once its sender thread has written it.
    pub(super) buf: Option<Buffer>,
    pub(super) acked: bool,
    pub(super) done: Completer<Buffer>,
    pub(super) queue: Queue,
    pub(super) deadline: Instant,
    pub(super) me: usize,
    pub(super) peer: usize,
    pub(super) shape: (DType, usize),
}

/// (group, source world rank, tag).
pub(super) type Key = (u64, usize, u64);

/// The pending point-to-point operations of one process.
#[derive(Default)]
pub(crate) struct Tables {
    pub(super) recvs: HashMap<Key, VecDeque<PendingRecv>>,
    pub(super) unexpected: HashMap<Key, VecDeque<Frame>>,
    pub(super) sends: HashMap<u64, PendingSend>,
    pub(super) next_id: u64,
}

pub(super) type Failed = Vec<(Queue, Completer<Buffer>, Error)>;

impl Tables {
    /// World rank `r` is gone: the receives from it and the sends to it fail.
    pub fn fail_peer(&mut self, r: usize, why: &str) -> Failed {
        let lost = |peer: usize| Error::PeerLost {
            rank: peer,
            why: why.to_string(),
        };
        let mut failed = Vec::new();
        for (_, q) in self.recvs.iter_mut().filter(|(k, _)| k.1 == r) {
            failed.extend(q.drain(..).map(|p| (p.queue, p.done, lost(p.peer))));
        }
        self.recvs.retain(|_, q| !q.is_empty());
        // A send the peer acked has been delivered: it completes when the sender thread
        // hands its buffer back (the ack can overtake that), however the peer left.
        let ids: Vec<u64> = self
            .sends
            .iter()
            .filter(|(_, s)| s.dst == r && !s.acked)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if let Some(s) = self.sends.remove(&id) {
                failed.push((s.queue, s.done, lost(s.peer)));
            }
        }
        failed
    }

    /// Everything of `group` (`None`: of every group) fails with `e`.
    pub(super) fn fail_group(&mut self, group: Option<u64>, e: &Error) -> Failed {
        let mine = |g: u64| group.is_none_or(|x| x == g);
        let mut failed = Vec::new();
        for (_, q) in self.recvs.iter_mut().filter(|(k, _)| mine(k.0)) {
            failed.extend(q.drain(..).map(|p| (p.queue, p.done, e.clone())));
        }
        self.recvs.retain(|_, q| !q.is_empty());
        self.unexpected.retain(|k, _| !mine(k.0));
        let ids: Vec<u64> = self
            .sends
            .iter()
            .filter(|(_, s)| mine(s.group))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if let Some(s) = self.sends.remove(&id) {
                failed.push((s.queue, s.done, e.clone()));
            }
        }
        failed
    }
}
