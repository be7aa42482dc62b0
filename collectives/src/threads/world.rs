//! The state the ranks of one thread group share: a generation barrier that knows who
//! is missing, the failure that poisons the group, and each rank's posted buffers.

use crate::{Buffer, DType, Error, ReduceOp, Result};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Which collective a rank posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp),
    Coalesced(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
    Barrier,
}

/// What a rank posted: the collective and the type and length of each buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub kind: Kind,
    pub parts: Vec<(DType, usize)>,
}

impl fmt::Display for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} on [", self.kind)?;
        for (i, (d, n)) in self.parts.iter().enumerate() {
            write!(f, "{}{d:?} x {n}", if i > 0 { ", " } else { "" })?;
        }
        write!(f, "]")
    }
}

/// How long a rank watches for its peers before sleeping (see `World::arrive`).
const SPIN: Duration = Duration::from_micros(50);

/// A buffer address posted for peers, as an integer so the table is `Send`.
pub(crate) type Addr = usize;

struct State {
    generation: u64,
    arrived: Vec<bool>,
    count: usize,
    failure: Option<Error>,
    posted: Vec<(Option<Desc>, Vec<Addr>)>,
}

/// A subgroup: its members (as ranks of the parent) and its shared state.
pub(crate) type Subgroup = (Vec<usize>, Arc<World>);

/// The shared state of one group (the world, or a subgroup).
pub(crate) struct World {
    pub size: usize,
    pub timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
    /// The generation, mirrored for lock-free spinning.
    released: AtomicU64,
    /// Whether a failure is recorded, mirrored for lock-free spinning.
    poisoned: AtomicBool,
    /// Subgroups by the index of the `new_group` call that made them.
    pub subgroups: Mutex<HashMap<usize, Subgroup>>,
}

impl World {
    pub fn new(size: usize, timeout: Duration) -> Arc<World> {
        Arc::new(World {
            size,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                arrived: vec![false; size],
                count: 0,
                failure: None,
                posted: vec![(None, Vec::new()); size],
            }),
            changed: Condvar::new(),
            released: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            subgroups: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a lock poisoned by a
        // panicking rank is still valid (and the panic itself poisons the group).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Poisons the group: every waiting and later operation fails with `e` (the first
    /// failure wins).
    pub fn fail(&self, e: Error) {
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some(e);
        }
        self.poisoned.store(true, Ordering::Release);
        self.changed.notify_all();
    }

    /// Waits until every rank has called `arrive` for this generation.
    fn arrive<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        rank: usize,
        what: &str,
    ) -> Result<MutexGuard<'a, State>> {
        if let Some(e) = &st.failure {
            return Err(e.clone());
        }
        let generation = st.generation;
        st.arrived[rank] = true;
        st.count += 1;
        if st.count == self.size {
            st.count = 0;
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            self.released.store(st.generation, Ordering::Release);
            self.changed.notify_all();
            return Ok(st);
        }
        // Peers usually arrive within microseconds: watch the generation without the lock
        // for a moment (yielding the core to them) before sleeping on the condition
        // variable, which costs a wake-up of tens of microseconds.
        drop(st);
        let spin_until = Instant::now() + SPIN;
        while self.released.load(Ordering::Acquire) == generation
            && !self.poisoned.load(Ordering::Acquire)
            && Instant::now() < spin_until
        {
            std::thread::yield_now();
        }
        let mut st = self.lock();
        let deadline = Instant::now() + self.timeout;
        loop {
            let now = Instant::now();
            if st.generation != generation {
                return Ok(st);
            }
            if let Some(e) = &st.failure {
                return Err(e.clone());
            }
            if now >= deadline {
                let missing = (0..self.size).filter(|&r| !st.arrived[r]).collect();
                let e = Error::Timeout {
                    what: what.to_string(),
                    after: self.timeout,
                    missing,
                };
                st.failure = Some(e.clone());
                self.poisoned.store(true, Ordering::Release);
                self.changed.notify_all();
                return Err(e);
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Posts this rank's collective and buffer addresses, waits for every rank, checks
    /// that all posted the same collective on matching buffers, and returns every rank's
    /// addresses. Peers' addresses stay valid until every rank has passed
    /// [`World::done`] for this operation.
    pub fn meet(&self, rank: usize, desc: &Desc, addrs: Vec<Addr>) -> Result<Vec<Vec<Addr>>> {
        let mut st = self.lock();
        st.posted[rank] = (Some(desc.clone()), addrs);
        let st = self.arrive(
            st,
            rank,
            &format!("{desc} (waiting for every rank to start it)"),
        )?;
        for (peer, (d, _)) in st.posted.iter().enumerate() {
            if d.as_ref() != Some(desc) {
                let theirs = d.as_ref().map_or("nothing".to_string(), |d| d.to_string());
                let e = Error::Mismatch(format!(
                    "rank {rank} called {desc}, but rank {peer} called {theirs}"
                ));
                drop(st);
                self.fail(e.clone());
                return Err(e);
            }
        }
        Ok(st.posted.iter().map(|(_, a)| a.clone()).collect())
    }

    /// Waits until every rank has finished reading and writing the posted buffers.
    pub fn done(&self, rank: usize, desc: &Desc) -> Result<()> {
        let st = self.lock();
        self.arrive(
            st,
            rank,
            &format!("{desc} (waiting for every rank to finish it)"),
        )
        .map(drop)
    }
}

/// The part of `0..len` that rank `rank` of `size` handles.
pub(crate) fn share(len: usize, size: usize, rank: usize) -> std::ops::Range<usize> {
    (len * rank / size)..(len * (rank + 1) / size)
}

/// A placeholder used before a buffer exists for an address.
pub(crate) fn addr_of(b: &mut Buffer) -> Addr {
    b.as_bytes_mut().as_mut_ptr() as Addr
}
