//! The record of a run: when each worker started and ended each piece of work, for timeline
//! pictures and for tests that check orders (never durations).

use std::time::{Duration, Instant};

use crate::vocab::Action;

/// What a [`Span`] of a worker's time was spent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// A forward action.
    Forward,
    /// The recomputation that opens a checkpointed micro-batch's backward action.
    Recompute,
    /// A backward action (after any recomputation).
    Backward,
    /// The loss function, run on the last stage right after its forward.
    Loss,
    /// The deferred weight gradients of a stage ([`Layer::flush_grads`](crate::Layer::flush_grads)),
    /// right after its last backward action of a run (the span's action).
    WeightGrad,
}

/// One piece of a worker's time: `kind` work for `action`, from `start` to `end` after the
/// record's origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The schedule action it belongs to.
    pub action: Action,
    /// What it did.
    pub kind: SpanKind,
    /// When it started, after [`Record::origin`].
    pub start: Duration,
    /// When it ended, after [`Record::origin`].
    pub end: Duration,
}

/// Spans per worker, in the order each worker ran them, over one or more runs (a GPipe
/// `forward` and its `backward` land in one record until it is taken).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    origin: Instant,
    workers: Vec<Vec<Span>>,
}

impl Record {
    pub(crate) fn new(origin: Instant, workers: usize) -> Self {
        Record {
            origin,
            workers: vec![Vec::new(); workers],
        }
    }

    pub(crate) fn extend(&mut self, worker_spans: Vec<Vec<Span>>) {
        if self.workers.len() < worker_spans.len() {
            self.workers.resize(worker_spans.len(), Vec::new());
        }
        for (mine, spans) in self.workers.iter_mut().zip(worker_spans) {
            mine.extend(spans);
        }
    }

    /// The instant spans are measured from.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Each worker's spans, in the order it ran them.
    pub fn workers(&self) -> &[Vec<Span>] {
        &self.workers
    }

    /// The actions each worker started, in order: one entry per action, however many spans
    /// it has (a checkpointed backward has a recompute and a backward span; the last
    /// stage's forward in a step, a forward and a loss span). A span is recorded whether its
    /// work succeeded or failed.
    pub fn actions(&self) -> Vec<Vec<Action>> {
        self.workers
            .iter()
            .map(|spans| {
                let mut actions: Vec<Action> = spans.iter().map(|s| s.action).collect();
                actions.dedup();
                actions
            })
            .collect()
    }

    /// The time from the earliest start to the latest end.
    pub fn makespan(&self) -> Duration {
        let spans = || self.workers.iter().flatten();
        match (spans().map(|s| s.start).min(), spans().map(|s| s.end).max()) {
            (Some(first), Some(last)) => last.saturating_sub(first),
            _ => Duration::ZERO,
        }
    }
}
