//! What the TCP backend's modules pass between them: a progress thread's tasks and
//! queue, a received frame, a sender thread's work, and the completion of a work on its
//! group's queue. A leaf: it uses no other module of the backend but `frame`.

use super::frame::Header;
use crate::{Buffer, Completer, Result};
use std::sync::mpsc::Sender;

/// A job for a group's progress thread.
pub(crate) enum Task {
    /// Run this (an operation, or a continuation of a point-to-point work).
    Run(Box<dyn FnOnce() + Send>),
    /// The group is dropped: stop.
    Stop,
}

/// A group's progress-thread queue, where continuations of its works run.
pub(crate) type Queue = Sender<Task>;

/// A received frame: its header and its payload, read straight into a typed buffer.
#[derive(Debug)]
pub(crate) struct Frame {
    pub header: Header,
    pub payload: Buffer,
}

/// What a peer's sender thread writes: point-to-point messages and acks, so that no
/// caller and no reader thread blocks on a socket.
pub(crate) enum Outgoing {
    /// A message (returned to its send, by id, once written).
    Data { header: Header, buf: Buffer },
    /// An ack.
    Ack(Header),
}

/// Completes `done` from a thread that is not its group's: a continuation chained to it
/// runs on the group's progress thread.
pub(crate) fn finish(queue: &Queue, done: Completer<Buffer>, result: Result<Buffer>) {
    done.complete_from_afar(result, |job| drop(queue.send(Task::Run(job))));
}
