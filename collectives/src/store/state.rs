//! The server's shared state: the keys and their values under the byte meter, the waits
//! on them, the job's failure once one is known, and the answer to each request.

use std::collections::{HashMap, HashSet};
use std::net::TcpStream;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::codec::{Failure, Request, Response, SET_IF_ABSENT};
use super::limits::{Charge, Meter, OverQuota, StoreLimits, StoreStats, Stored};
use super::token::StoreToken;
use super::MAX_WORLD_SIZE;

/// How often a parked wait checks that its client is still connected.
const LEAVE_POLL: Duration = Duration::from_millis(200);

/// The key under which a join registers `rank`.
pub(super) fn join_key(rank: usize) -> String {
    format!("collectives/join/rank/{rank}")
}

/// What the accept thread, the connection threads and the owner share.
pub(super) struct Shared {
    state: Mutex<State>,
    /// Notified whenever a key is set, the job fails or the server stops.
    pub(super) changed: Condvar,
    /// Notified whenever a connection closes or a rank is first heard from.
    pub(super) closed: Condvar,
    pub(super) world_size: usize,
    pub(super) token: Option<StoreToken>,
    pub(super) limits: StoreLimits,
    pub(super) meter: Arc<Meter>,
}

/// A clone of a connection's stream, and whether a request of it is being handled.
pub(super) struct Connection {
    pub(super) stream: TcpStream,
    pub(super) busy: bool,
}

pub(super) struct State {
    data: HashMap<String, Arc<Stored>>,
    /// Set once: every later request is answered with it.
    failed: Option<Failure>,
    pub(super) stopping: bool,
    /// The open connections, so that stopping can shut them down.
    pub(super) conns: HashMap<u64, Connection>,
    pub(super) next_conn: u64,
    /// The connections' threads, joined when the server stops.
    pub(super) workers: Vec<JoinHandle<()>>,
    waiting: usize,
    /// The ranks (below the world size) that have asked to join, whatever the answer:
    /// after a failure, a stopping server waits a grace period for the others, so that
    /// a rank that starts late is told why the job failed rather than finding no server.
    heard: HashSet<usize>,
}

/// How a wait ended.
enum WaitEnd<'a> {
    /// Every key is there; the lock is still held.
    Ready(MutexGuard<'a, State>),
    /// The timeout passed with these keys missing.
    TimedOut(Vec<String>),
    /// The job failed.
    Failed(Failure),
    /// The server stops, or the client has left: there is no one to answer.
    Abandoned,
}

impl Shared {
    pub(super) fn new(world_size: usize, token: Option<StoreToken>, limits: StoreLimits) -> Shared {
        Shared {
            state: Mutex::new(State {
                data: HashMap::new(),
                failed: None,
                stopping: false,
                conns: HashMap::new(),
                next_conn: 0,
                workers: Vec::new(),
                waiting: 0,
                heard: HashSet::new(),
            }),
            changed: Condvar::new(),
            closed: Condvar::new(),
            world_size,
            token,
            meter: Meter::new(limits.max_bytes),
            limits,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state if that ever changes.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn stats(&self) -> StoreStats {
        let state = self.lock();
        StoreStats {
            connections: state.conns.len(),
            waiting: state.waiting,
            keys: state.data.len(),
            bytes_held: self.meter.held(),
        }
    }

    /// Whether the job has failed.
    pub(super) fn has_failed(&self) -> bool {
        self.lock().failed.is_some()
    }

    /// Whether every rank of the world has asked to join.
    pub(super) fn all_heard(&self, state: &State) -> bool {
        state.heard.len() >= self.world_size
    }

    /// Records that `rank` asked to join.
    fn heard(&self, rank: usize) {
        if rank >= self.world_size {
            return;
        }
        if self.lock().heard.insert(rank) {
            self.closed.notify_all();
        }
    }

    /// The reply to a hello offering `token`, and whether the connection may go on.
    pub(super) fn hello(&self, token: Option<&[u8]>) -> (Response, bool) {
        if let Some(ours) = &self.token {
            let why = match token {
                None => "this store requires a token and the hello carried none",
                Some(offered) if !ours.matches(offered) => "the hello's token is wrong",
                Some(_) => "",
            };
            if !why.is_empty() {
                return (Response::Refused(why.into()), false);
            }
        }
        let hello = Response::Hello {
            world_size: self.world_size as u64,
            token_checked: self.token.is_some(),
            idle_timeout: self.limits.idle_timeout,
        };
        (hello, true)
    }

    /// The reply to the request in `frame` (after the hello), or `None` when there is no
    /// one to answer: the server stops, or the client left during a wait. `alive` tells
    /// whether the client is still connected. A value set keeps the frame it came in
    /// (no copy) with its `charge`; otherwise the charge is handed back, to be held
    /// until the reply is out.
    pub(super) fn handle(
        &self,
        frame: Vec<u8>,
        charge: Charge,
        alive: &dyn Fn() -> bool,
    ) -> (Option<Response>, Option<Charge>) {
        let request = match Request::decode(&frame) {
            Ok(request) => request,
            Err(message) => return (Some(Response::Protocol(message)), Some(charge)),
        };
        if let Some(failure) = &self.lock().failed {
            if !matches!(request, Request::Fail(_)) {
                return (Some(Response::Failed(failure.clone())), Some(charge));
            }
        }
        let reply = match request {
            Request::Hello { .. } => Response::Protocol("a second hello on one connection".into()),
            Request::Set { key, value } | Request::SetIfAbsent { key, value } => {
                let only_if_absent = frame.first() == Some(&SET_IF_ABSENT);
                let key = key.to_owned();
                let start = value.as_ptr().addr() - frame.as_ptr().addr();
                let range = start..start + value.len();
                let reply = self.store_frame(key, frame, range, charge, only_if_absent);
                return (Some(reply), None);
            }
            Request::Get { key, timeout } => match self.wait_for(&[key], timeout, alive) {
                WaitEnd::Ready(state) => match state.data.get(key) {
                    Some(value) => Response::Value(Arc::clone(value) as _),
                    None => Response::TimedOut(vec![key.to_owned()]),
                },
                WaitEnd::TimedOut(missing) => Response::TimedOut(missing),
                WaitEnd::Failed(failure) => Response::Failed(failure),
                WaitEnd::Abandoned => return (None, Some(charge)),
            },
            Request::Add { key, delta } => {
                let mut state = self.lock();
                self.add(&mut state, key, delta)
            }
            Request::Check { keys } => {
                let state = self.lock();
                Response::Bool(keys.iter().all(|key| state.data.contains_key(*key)))
            }
            Request::Wait {
                arrive,
                keys,
                timeout,
            } => {
                let arrived = arrive.map_or(Ok(()), |key| {
                    let mut state = self.lock();
                    self.insert(&mut state, key, b"1".to_vec())
                });
                match arrived.map(|()| self.wait_for(&keys, timeout, alive)) {
                    Err(refused) => quota(refused),
                    Ok(WaitEnd::Ready(_)) => Response::Unit,
                    Ok(WaitEnd::TimedOut(missing)) => Response::TimedOut(missing),
                    Ok(WaitEnd::Failed(failure)) => Response::Failed(failure),
                    Ok(WaitEnd::Abandoned) => return (None, Some(charge)),
                }
            }
            Request::Delete { key } => {
                let removed = self.lock().data.remove(key);
                Response::Bool(removed.is_some())
            }
            Request::Join {
                rank,
                world_size,
                id,
            } => self.join(rank, world_size, id),
            Request::Fail(failure) => {
                // A client's text, shown in every rank's error and in the log.
                self.fail(failure.sanitized());
                Response::Unit
            }
        };
        (Some(reply), Some(charge))
    }

    /// Stores `frame[range]` under `key`, keeping the frame and its charge; with
    /// `only_if_absent`, an existing value is left and returned instead.
    fn store_frame(
        &self,
        key: String,
        frame: Vec<u8>,
        range: Range<usize>,
        charge: Charge,
        only_if_absent: bool,
    ) -> Response {
        let mut state = self.lock();
        if only_if_absent {
            if let Some(existing) = state.data.get(&key) {
                return Response::Value(Arc::clone(existing) as _);
            }
        }
        let stored = match Stored::in_frame(&self.meter, &key, frame, range, charge) {
            Ok(stored) => stored,
            Err(refused) => return quota(refused),
        };
        state.data.insert(key, Arc::new(stored));
        self.changed.notify_all();
        Response::Unit
    }

    /// Records the job's first failure and wakes every wait to answer with it.
    fn fail(&self, failure: Failure) {
        let mut state = self.lock();
        if state.failed.is_none() {
            tracing::debug!(?failure, "the store's job failed");
            state.failed = Some(failure);
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Registers `rank` with set-if-absent, after comparing world sizes; a mismatch or
    /// a rank claimed by another process fails the job for every rank. A malformed join
    /// ([`malformed_join`]) is answered `Invalid`, to its client alone, before it
    /// touches the rendezvous.
    fn join(&self, rank: u64, world_size: u64, id: &[u8]) -> Response {
        if let Some(why) = malformed_join(rank, world_size) {
            tracing::debug!(rank, world_size, "store refused a malformed join");
            return Response::Invalid(why);
        }
        // Below `world_size`, itself at most `MAX_WORLD_SIZE`: the cast is exact.
        let rank = rank as usize;
        self.heard(rank);
        let ours = self.world_size;
        if world_size != ours as u64 {
            let failure = Failure::Rendezvous {
                why: format!(
                    "the ranks disagree on the world size: rank {rank} has \
                     WORLD_SIZE={world_size}, rank 0 (which serves the store) has WORLD_SIZE={ours}"
                ),
                ranks: if rank == 0 { vec![0] } else { vec![0, rank] },
            };
            self.fail(failure.clone());
            return Response::Failed(failure);
        }
        let key = join_key(rank);
        let mut state = self.lock();
        match state.data.get(&key) {
            Some(existing) if (**existing).as_ref() == id => Response::Unit,
            Some(_) => {
                drop(state);
                let failure = Failure::Rendezvous {
                    why: format!(
                        "two processes joined as rank {rank} (is RANK={rank} set on both?)"
                    ),
                    ranks: vec![rank],
                };
                self.fail(failure.clone());
                Response::Failed(failure)
            }
            None => match self.insert(&mut state, &key, id.to_vec()) {
                Ok(()) => Response::Unit,
                Err(refused) => quota(refused),
            },
        }
    }

    /// Stores `value` under `key`, charged to the meter, and wakes the waits.
    fn insert(
        &self,
        state: &mut State,
        key: &str,
        value: Vec<u8>,
    ) -> std::result::Result<(), OverQuota> {
        let stored = Stored::new(&self.meter, key, value)?;
        state.data.insert(key.to_owned(), Arc::new(stored));
        self.changed.notify_all();
        Ok(())
    }

    fn add(&self, state: &mut State, key: &str, delta: i64) -> Response {
        let old = match state.data.get(key) {
            None => 0,
            Some(stored) => {
                let bytes = (**stored).as_ref();
                match std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                {
                    Some(old) => old,
                    None => {
                        return Response::Invalid(format!(
                            "add to key {key:?}: its {} bytes are not a decimal integer",
                            bytes.len()
                        ))
                    }
                }
            }
        };
        let Some(new) = old.checked_add(delta) else {
            return Response::Invalid(format!("add of {delta} to key {key:?} ({old}) overflows"));
        };
        match self.insert(state, key, new.to_string().into_bytes()) {
            Ok(()) => Response::Int(new),
            Err(refused) => quota(refused),
        }
    }

    /// Waits until all `keys` exist, the timeout passes, the job fails, the server
    /// stops or the client leaves (checked every [`LEAVE_POLL`] through `alive`).
    fn wait_for(&self, keys: &[&str], timeout: Duration, alive: &dyn Fn() -> bool) -> WaitEnd<'_> {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.lock();
        let mut parked = false;
        let mut last_check = Instant::now();
        let end = loop {
            if let Some(failure) = &state.failed {
                break Err(WaitEnd::Failed(failure.clone()));
            }
            let missing: Vec<String> = keys
                .iter()
                .filter(|key| !state.data.contains_key(**key))
                .map(|key| (*key).to_owned())
                .collect();
            // A wait already satisfied is answered even while the server stops.
            if missing.is_empty() {
                break Ok(());
            }
            if state.stopping {
                break Err(WaitEnd::Abandoned);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| d <= now) {
                break Err(WaitEnd::TimedOut(missing));
            }
            if now.duration_since(last_check) >= LEAVE_POLL {
                // The check is a system call or three: not under the lock.
                drop(state);
                let gone = !alive();
                state = self.lock();
                last_check = Instant::now();
                if gone {
                    break Err(WaitEnd::Abandoned);
                }
                continue;
            }
            if !parked {
                parked = true;
                state.waiting += 1;
            }
            // A timeout too large for an `Instant` is as good as none.
            let slice = deadline.map_or(LEAVE_POLL, |d| (d - now).min(LEAVE_POLL));
            state = self
                .changed
                .wait_timeout(state, slice)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        if parked {
            state.waiting -= 1;
        }
        match end {
            Ok(()) => WaitEnd::Ready(state),
            Err(end) => end,
        }
    }
}

/// Why a join of `rank` of `world_size` is malformed, whatever the store: its rank is
/// not below its own world size, or its world size is 0 or above [`MAX_WORLD_SIZE`]
/// (no client of this crate sends one). `None` for a well-formed join, which may still
/// disagree with the store's world size (a rendezvous mistake that fails every rank).
fn malformed_join(rank: u64, world_size: u64) -> Option<String> {
    if world_size == 0 {
        return Some(format!(
            "join as rank {rank} of a world of 0 ranks: a world has at least one rank"
        ));
    }
    if world_size > MAX_WORLD_SIZE as u64 {
        return Some(format!(
            "join as rank {rank} of a world of {world_size} ranks: more than the \
             {MAX_WORLD_SIZE} a store supports"
        ));
    }
    if rank >= world_size {
        return Some(format!(
            "join as rank {rank}: not below its world size {world_size}"
        ));
    }
    None
}

/// The reply to a request refused for the byte limit.
pub(super) fn quota(refused: OverQuota) -> Response {
    Response::Quota {
        needed: refused.needed as u64,
        held: refused.held as u64,
        limit: refused.limit as u64,
    }
}
