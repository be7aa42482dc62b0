//! The state the ranks of one thread group share: a generation barrier that knows who
//! is missing, the failure that poisons the group, each rank's posted buffers, and the
//! exit count that keeps every posted buffer alive until no peer can touch it.
//!
//! # The buffer-lifetime protocol
//!
//! A collective is `meet` (post this rank's buffer addresses; wait for every rank), then
//! work on the peers' buffers, then `leave`. Once `meet` has released a generation, every
//! rank is *inside* the operation and may read or write every posted buffer. `leave`
//! returns only when every rank of that generation has left, **whatever has failed in the
//! meantime**: a failure recorded by another rank, a dropped group or a panic does not cut
//! it short (unlike `arrive`), because a rank that returned early would hand its buffer
//! back, to be freed, while a peer still reduces into it. Ranks inside an operation do
//! bounded work (no waits), so they leave promptly; if `leave` itself passes the timeout,
//! it reports that the buffers must be leaked, and the caller forgets them instead of
//! freeing them.
//!
//! Under `cfg(loom)` the clock is gone: spins are bounded by a count and waits have no
//! deadline, so the loom models (tests/loom.rs) explore the protocol's interleavings.

use super::mailbox::Mailbox;
use crate::sync::{Arc, AtomicBool, AtomicU64, Condvar, Mutex, MutexGuard, Ordering};
use crate::{Buffer, DType, Error, ReduceOp, Result};
use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

#[cfg(not(loom))]
use crate::group::deadline_after;

/// Which collective a rank posted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp),
    /// An `f32` all-reduce rounded to a 16-bit wire format.
    AllReduceWire(ReduceOp, DType),
    Coalesced(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
    Barrier,
    /// A collective whose arguments this rank rejected (the message says why): it takes
    /// its place in the rendezvous only so that its peers fail too, never runs.
    Rejected(String),
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
#[cfg(not(loom))]
const SPIN: Duration = Duration::from_micros(50);
/// Under loom: how many times a rank looks before sleeping.
#[cfg(loom)]
const SPIN_LOOKS: usize = 2;

/// A buffer address posted for peers, as an integer so the table is `Send`.
pub(crate) type Addr = usize;

struct State {
    generation: u64,
    arrived: Vec<bool>,
    count: usize,
    failure: Option<Error>,
    posted: Vec<(Option<Desc>, Vec<Addr>)>,
    /// The generation whose exits are being counted, and who has left it.
    exit_generation: u64,
    left: Vec<bool>,
    exits: usize,
    /// The failure recorded when the last rank left `exit_generation`, if any: a failure
    /// from inside the operation (a later one, such as a rank dropping its group after
    /// finishing, does not concern it).
    exit_failure: Option<Error>,
}

/// A subgroup: its members (as ranks of the parent) and its shared state.
pub(crate) type Subgroup = (Vec<usize>, Arc<World>);

/// Every rank's posted addresses, once all have met: the caller is now inside the
/// operation and must call [`World::leave`] with `generation`, whatever happens next.
pub(crate) struct Entered {
    pub generation: u64,
    pub addrs: Vec<Vec<Addr>>,
    /// A mismatch between what the ranks posted (already recorded as the group's failure):
    /// the caller touches no peer buffer and leaves.
    pub mismatch: Option<Error>,
}

/// Why `leave` failed: peers may still touch this rank's buffers, so they must be leaked.
#[derive(Debug)]
pub(crate) struct MustLeak(pub Error);

/// The shared state of one group (the world, or a subgroup).
pub(crate) struct World {
    pub size: usize,
    pub timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
    /// The generation, mirrored for lock-free spinning.
    released: AtomicU64,
    /// The last generation every rank has left, mirrored for lock-free spinning.
    all_left: AtomicU64,
    /// Whether a failure is recorded, mirrored for lock-free spinning.
    poisoned: AtomicBool,
    /// Subgroups by the index of the `new_group` call that made them.
    pub subgroups: Mutex<HashMap<usize, Subgroup>>,
    /// The point-to-point operations' mailbox, failed with the group.
    pub mailbox: Mailbox,
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
                exit_generation: 0,
                left: vec![false; size],
                exits: 0,
                exit_failure: None,
            }),
            changed: Condvar::new(),
            released: AtomicU64::new(0),
            all_left: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            subgroups: Mutex::new(HashMap::new()),
            mailbox: Mailbox::new(size, timeout),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a lock poisoned by a
        // panicking rank is still valid (and the panic itself poisons the group).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Poisons the group: every waiting and later operation fails with `e` (the first
    /// failure wins). Ranks inside an operation still finish it and leave (see the
    /// module docs).
    pub fn fail(&self, e: Error) {
        let mut st = self.lock();
        Self::record(&mut st, e.clone());
        self.poisoned.store(true, Ordering::Release);
        self.changed.notify_all();
        drop(st);
        // A rank that panicked or left fails the point-to-point operations waiting for
        // it (other failures concern the collectives alone).
        if let Error::PeerLost { rank, .. } = &e {
            self.mailbox.depart(*rank, e.clone());
        }
    }

    fn record(st: &mut State, e: Error) {
        if st.failure.is_none() {
            st.failure = Some(e);
        }
    }

    /// Watches `done` without the lock for a moment (yielding the core to peers), since
    /// they usually arrive within microseconds and a condition-variable wake-up costs
    /// tens of microseconds.
    fn spin(&self, done: impl Fn() -> bool) {
        #[cfg(not(loom))]
        {
            let until = std::time::Instant::now() + SPIN;
            while !done() && !self.poisoned.load(Ordering::Acquire) {
                if std::time::Instant::now() >= until {
                    break;
                }
                std::thread::yield_now();
            }
        }
        #[cfg(loom)]
        for _ in 0..SPIN_LOOKS {
            if done() || self.poisoned.load(Ordering::Acquire) {
                break;
            }
            loom::thread::yield_now();
        }
    }

    /// Sleeps on the condition variable until notified or `deadline` (a timeout too long
    /// for the clock saturates a century away: `group::deadline_after`); returns the guard
    /// and whether the deadline has passed. Loom has no clock: there it waits until
    /// notified.
    fn sleep<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        #[cfg(not(loom))] deadline: std::time::Instant,
    ) -> (MutexGuard<'a, State>, bool) {
        #[cfg(not(loom))]
        {
            let now = std::time::Instant::now();
            if now >= deadline {
                return (st, true);
            }
            let st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            (st, false)
        }
        #[cfg(loom)]
        (
            self.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
            false,
        )
    }

    /// Waits until every rank has called `arrive` for this generation, or a failure.
    fn arrive<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        rank: usize,
        desc: &Desc,
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
        drop(st);
        self.spin(|| self.released.load(Ordering::Acquire) != generation);
        let mut st = self.lock();
        #[cfg(not(loom))]
        let deadline = deadline_after(self.timeout);
        loop {
            // The generation is checked first: once released, every rank is inside the
            // operation, even if a failure was recorded just after.
            if st.generation != generation {
                return Ok(st);
            }
            if let Some(e) = &st.failure {
                return Err(e.clone());
            }
            let (guard, expired) = self.sleep(
                st,
                #[cfg(not(loom))]
                deadline,
            );
            st = guard;
            if expired && st.generation == generation {
                let missing = (0..self.size).filter(|&r| !st.arrived[r]).collect();
                let e = Error::Timeout {
                    what: format!("{desc} (waiting for every rank to start it)"),
                    after: self.timeout,
                    missing,
                };
                Self::record(&mut st, e.clone());
                self.poisoned.store(true, Ordering::Release);
                self.changed.notify_all();
                return Err(e);
            }
        }
    }

    /// Posts this rank's collective and buffer addresses and waits for every rank. On
    /// success every rank is inside the operation (every posted buffer may be touched by
    /// any rank) and must [`World::leave`]; an error means no rank got this rank's
    /// addresses. A mismatch between the ranks' collectives is recorded as the group's
    /// failure and returned in [`Entered::mismatch`].
    pub fn meet(&self, rank: usize, desc: &Desc, addrs: Vec<Addr>) -> Result<Entered> {
        let mut st = self.lock();
        st.posted[rank] = (Some(desc.clone()), addrs);
        let mut st = self.arrive(st, rank, desc)?;
        let generation = st.generation;
        let mut mismatch = None;
        let rejected = |d: &Option<Desc>| match d {
            Some(Desc {
                kind: Kind::Rejected(why),
                ..
            }) => Some(why.clone()),
            _ => None,
        };
        let rejecting: Vec<(usize, String)> = st
            .posted
            .iter()
            .enumerate()
            .filter_map(|(peer, (d, _))| rejected(d).map(|why| (peer, why)))
            .collect();
        if rejecting.len() == self.size {
            // Every rank rejected its arguments: each reports its own error, and the
            // group, which nobody used, stays usable.
            let why = rejected(&st.posted[rank].0).unwrap_or_default();
            return Ok(Entered {
                generation,
                addrs: st.posted.iter().map(|(_, a)| a.clone()).collect(),
                mismatch: Some(Error::InvalidArgument(why)),
            });
        }
        if let Some((peer, why)) = rejecting.first() {
            mismatch = Some(match rejected(&st.posted[rank].0) {
                Some(mine) => Error::InvalidArgument(mine),
                None => Error::Mismatch(format!(
                    "rank {rank} called {desc}, but rank {peer} rejected its arguments: {why}"
                )),
            });
        }
        for (peer, (d, _)) in st.posted.iter().enumerate() {
            if mismatch.is_some() {
                break;
            }
            if d.as_ref() != Some(desc) {
                let theirs = d.as_ref().map_or("nothing".to_string(), |d| d.to_string());
                mismatch = Some(Error::Mismatch(format!(
                    "rank {rank} called {desc}, but rank {peer} called {theirs}"
                )));
                break;
            }
        }
        let addrs = st.posted.iter().map(|(_, a)| a.clone()).collect();
        if let Some(e) = &mismatch {
            Self::record(&mut st, e.clone());
            self.poisoned.store(true, Ordering::Release);
            self.changed.notify_all();
        }
        Ok(Entered {
            generation,
            addrs,
            mismatch,
        })
    }

    /// Leaves the operation of `generation` and waits until every rank has left it: only
    /// then may this rank's buffers be freed or reused. A recorded failure does not end
    /// the wait (peers inside the operation are still running); only the timeout does,
    /// and then the buffers must be leaked ([`MustLeak`]) and the group is poisoned.
    ///
    /// Returns the failure recorded before the last rank left, if any: the operation's
    /// result is then incomplete on every rank.
    pub fn leave(
        &self,
        rank: usize,
        generation: u64,
        desc: &Desc,
    ) -> Result<Option<Error>, MustLeak> {
        let mut st = self.lock();
        if st.exit_generation != generation {
            st.exit_generation = generation;
            st.exits = 0;
            st.left.iter_mut().for_each(|l| *l = false);
        }
        st.left[rank] = true;
        st.exits += 1;
        if st.exits == self.size {
            st.exit_failure = st.failure.clone();
            self.all_left.store(generation, Ordering::Release);
            self.changed.notify_all();
            return Ok(st.exit_failure.clone());
        }
        drop(st);
        self.spin(|| self.all_left.load(Ordering::Acquire) == generation);
        let mut st = self.lock();
        #[cfg(not(loom))]
        let deadline = deadline_after(self.timeout);
        loop {
            // Nobody can start counting a later generation before every rank has left
            // this one, so `exit_generation != generation` cannot happen here; it is
            // checked anyway, as "everyone has left".
            if st.exit_generation != generation || st.exits == self.size {
                return Ok(st.exit_failure.clone());
            }
            let (guard, expired) = self.sleep(
                st,
                #[cfg(not(loom))]
                deadline,
            );
            st = guard;
            if expired && st.exit_generation == generation && st.exits < self.size {
                let missing = (0..self.size).filter(|&r| !st.left[r]).collect();
                let e = Error::Timeout {
                    what: format!(
                        "{desc} (waiting for every rank to finish it; this rank's buffers \
                         are leaked, since a peer may still access them)"
                    ),
                    after: self.timeout,
                    missing,
                };
                Self::record(&mut st, e.clone());
                self.poisoned.store(true, Ordering::Release);
                self.changed.notify_all();
                return Err(MustLeak(e));
            }
        }
    }
}

/// The part of `0..len` that rank `rank` of `size` handles.
pub(crate) fn share(len: usize, size: usize, rank: usize) -> std::ops::Range<usize> {
    (len * rank / size)..(len * (rank + 1) / size)
}

/// The address of a buffer's first byte, posted for peers.
pub(crate) fn addr_of(b: &mut Buffer) -> Addr {
    b.as_bytes_mut().as_mut_ptr() as Addr
}

/// Loom models of the rendezvous (`cargo xtask loom`): every interleaving of two ranks
/// meeting, touching each other's buffer and leaving, with a failure recorded at any
/// point by a third thread (a rank dropping its group). Loom reports a data race if a
/// rank could free its buffer while the peer still writes into it.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell;

    fn desc() -> Desc {
        Desc {
            kind: Kind::AllReduce(ReduceOp::Sum),
            parts: vec![(DType::F32, 1)],
        }
    }

    /// One rank: meet; if inside, write into the peer's buffer; leave; then "free" its
    /// own buffer (a write that must happen after the peer's last access).
    fn rank(world: &World, me: usize, bufs: &[Arc<UnsafeCell<u32>>; 2]) {
        let d = desc();
        if let Ok(entered) = world.meet(me, &d, vec![0]) {
            if entered.mismatch.is_none() {
                bufs[1 - me].with_mut(|p| {
                    // SAFETY: loom checks this access against the owner's free below.
                    unsafe { *p += 1 }
                });
            }
            if world.leave(me, entered.generation, &d).is_err() {
                return; // leaked: never freed
            }
        }
        bufs[me].with_mut(|p| {
            // SAFETY: the "free": loom reports a race if the peer may still write.
            unsafe { *p = u32::MAX }
        });
    }

    #[test]
    fn no_buffer_is_freed_while_a_peer_uses_it() {
        loom::model(|| {
            let world = World::new(2, Duration::from_secs(1));
            let bufs = [Arc::new(UnsafeCell::new(0)), Arc::new(UnsafeCell::new(0))];
            let peer = {
                let (world, bufs) = (world.clone(), bufs.clone());
                loom::thread::spawn(move || rank(&world, 1, &bufs))
            };
            let failer = {
                let world = world.clone();
                loom::thread::spawn(move || {
                    world.fail(Error::PeerLost {
                        rank: 2,
                        why: "dropped its group".into(),
                    })
                })
            };
            rank(&world, 0, &bufs);
            peer.join().unwrap();
            failer.join().unwrap();
        });
    }

    /// Two operations back to back: the second cannot overwrite the posted table (or be
    /// counted as the first's exits) while a slow rank is still in the first.
    #[test]
    fn back_to_back_operations_stay_apart() {
        loom::model(|| {
            let world = World::new(2, Duration::from_secs(1));
            let bufs = [Arc::new(UnsafeCell::new(0)), Arc::new(UnsafeCell::new(0))];
            let peer = {
                let (world, bufs) = (world.clone(), bufs.clone());
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        let d = desc();
                        let e = world.meet(1, &d, vec![1]).unwrap();
                        assert_eq!(e.addrs, vec![vec![0], vec![1]]);
                        bufs[0].with_mut(|p| {
                            // SAFETY: checked by loom against rank 0's own write below.
                            unsafe { *p += 1 }
                        });
                        world.leave(1, e.generation, &d).unwrap();
                    }
                })
            };
            for _ in 0..2 {
                let d = desc();
                let e = world.meet(0, &d, vec![0]).unwrap();
                assert_eq!(e.addrs, vec![vec![0], vec![1]]);
                world.leave(0, e.generation, &d).unwrap();
                bufs[0].with_mut(|p| {
                    // SAFETY: after leave: the peer's write must be ordered before this.
                    unsafe { *p += 10 }
                });
            }
            peer.join().unwrap();
        });
    }
}
