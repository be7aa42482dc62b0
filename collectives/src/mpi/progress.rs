//! The progress thread: the one thread of the process that calls MPI.
//!
//! It initialises MPI, owns every communicator, starts each operation as a non-blocking
//! MPI collective in the order it was issued, tests the requests in flight until they
//! complete or their deadline passes, completes the work handles (so continuations run
//! here), and finalises MPI when the last group handle is gone.
//!
//! Each communicator has a twin (`ctrl`, a duplicate) that carries only descriptors:
//! the debug mode's check before an operation and the agreement before a `new_group`.
//! An operation with a check is started on the main communicator only once its check has
//! passed and every earlier operation of that communicator has been started, so both
//! communicators see their collectives in the same order on every rank, as MPI requires.
//!
//! An operation may run in stages ([`staged`](super::job::staged)): each stage starts its requests once every
//! request of the stage before has completed, after local work on the buffers (the
//! deterministic all-reduce reduces its chunk between an all-to-all and an all-gather).
//! While such an operation has stages left to start, it *holds* its communicator: no
//! later operation starts there until its last stage has, so every rank issues the
//! stages and the operations around them in one order, whichever completes first
//! locally.

use super::debug::{self, WORDS};
use super::job::{Action, Job, Joined, Op, Running};
use super::pt2pt::{Links, P2p};
use super::raw::{self, Request};
use super::shared::{guarded, CommId, Graveyard, WORLD};
use crate::{Error, Result};
use mpi::environment::Universe;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::Threading;
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often abandoned operations are tested for completion.
const GRAVEYARD_POLL: Duration = Duration::from_millis(10);

/// The handle side of the progress thread, shared by every group of the process.
pub(super) struct Runtime {
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    /// This process's rank in `MPI_COMM_WORLD`.
    pub rank: usize,
    /// The number of processes.
    pub size: usize,
    /// How long dropping the last handle waits for the progress thread to finish.
    join_timeout: Duration,
}

impl Runtime {
    /// Starts the progress thread, which initialises MPI; waits for that up to `timeout`.
    pub(super) fn start(timeout: Duration) -> Result<Runtime> {
        let (jobs, rx) = mpsc::channel();
        let (ready_tx, ready) = mpsc::sync_channel(1);
        let worker = std::thread::Builder::new()
            .name("collectives-mpi".into())
            .spawn(move || progress_thread(rx, ready_tx))
            .map_err(|e| Error::io("starting the MPI progress thread", e))?;
        match ready.recv_timeout(timeout) {
            Ok(Ok((rank, size))) => Ok(Runtime {
                jobs: Some(jobs),
                worker: Some(worker),
                rank,
                size,
                join_timeout: timeout,
            }),
            Ok(Err(e)) => {
                // The thread has nothing left to do; it ends at once.
                let _ = worker.join();
                Err(e)
            }
            // The thread is stuck in MPI_Init; it is left behind.
            Err(_) => Err(Error::Timeout {
                what: "MPI initialisation".into(),
                after: timeout,
                missing: Vec::new(),
            }),
        }
    }

    /// Hands a job to the progress thread; if it has stopped, the job's work fails.
    pub(super) fn submit(&self, job: Job) {
        let unsent = match &self.jobs {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        let gone = || Error::Gone {
            what: "the MPI progress thread has stopped".into(),
        };
        match unsent {
            Some(Job::Op(op)) => op.action.fail(gone()),
            Some(Job::P2p(job)) => job.fail(gone()),
            _ => {}
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Closing the channel lets the progress thread finish what was issued (each
        // operation within its timeout), then finalise MPI and end.
        drop(self.jobs.take());
        let Some(worker) = self.worker.take() else {
            return;
        };
        if worker.thread().id() == std::thread::current().id() {
            // Dropped by a continuation on the progress thread itself: it ends on its own.
            return;
        }
        let deadline = crate::group::deadline_after(self.join_timeout);
        while !worker.is_finished() {
            if Instant::now() >= deadline {
                tracing::warn!(
                    "the MPI progress thread did not finish within {:?}; leaving it behind",
                    self.join_timeout
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = worker.join();
    }
}

fn progress_thread(rx: Receiver<Job>, ready: mpsc::SyncSender<Result<(usize, usize)>>) {
    // Only this thread calls MPI, so `Serialized` (or `Funneled`: this thread is the one
    // that initialises MPI, hence its main thread) is all that is needed.
    let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Serialized) else {
        let _ = ready.send(Err(Error::Unsupported(
            "MPI is already initialised in this process: MPI can be initialised once per \
             process, so create one MpiGroup (MpiGroup::init) and keep it, or its subgroups, \
             for the whole run"
                .into(),
        )));
        return;
    };
    if threading < Threading::Funneled {
        let _ = ready.send(Err(Error::Unsupported(format!(
            "this MPI library provides only {threading:?} thread support; the MPI backend \
             needs Funneled or better"
        ))));
        return;
    }
    let world = universe.world();
    if let Err(e) = raw::errors_return(&world) {
        let _ = ready.send(Err(e));
        return;
    }
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let mut engine = Engine::new(world);
    if ready.send(Ok((rank, size))).is_err() {
        // `start` gave up waiting; nobody will ever send a job.
        engine.shutdown(universe);
        return;
    }
    engine.run(&rx);
    engine.shutdown(universe);
}

/// A communicator and the operations not yet started on it.
struct Comm {
    main: SimpleCommunicator,
    ctrl: SimpleCommunicator,
    /// The point-to-point duplicates.
    links: Links,
    rank: usize,
    /// Why the communicator can no longer be used, after an operation was abandoned.
    broken: Option<Error>,
    /// Operations not yet started on `main`, in issue order.
    queue: VecDeque<Waiting>,
    /// Checked operations so far (the number in the debug mode's messages).
    seq: u64,
    /// The handle is gone: free the communicator once the queue is empty.
    freed: bool,
    /// A started operation has stages left to start: nothing else starts here until it
    /// has started its last (see the module docs).
    held: bool,
}

impl Comm {
    fn new(main: SimpleCommunicator) -> Comm {
        let ctrl = main.duplicate();
        let links = Links::of(&main);
        Comm {
            links,
            rank: main.rank() as usize,
            main,
            ctrl,
            broken: None,
            queue: VecDeque::new(),
            seq: 0,
            freed: false,
            held: false,
        }
    }

    /// Marks the communicator unusable and fails its waiting operations.
    fn break_with(&mut self, why: &Error, graveyard: &mut Graveyard) {
        let broken = Error::Unusable {
            cause: Box::new(why.clone()),
        };
        for w in self.queue.drain(..) {
            if let Some(check) = w.check {
                graveyard.bury(vec![check.request], Box::new(check.bufs), w.op.timeout);
            }
            w.op.action.fail(broken.clone());
        }
        self.broken.get_or_insert(broken);
    }
}

/// An operation waiting to start, perhaps with its descriptor check in flight.
struct Waiting {
    op: Op,
    deadline: Instant,
    check: Option<Check>,
}

/// A descriptor exchange in flight: this rank's descriptor and room for every rank's.
struct Check {
    request: Request,
    bufs: (Vec<u64>, Vec<u64>),
}

struct Engine {
    comms: HashMap<CommId, Comm>,
    next_id: CommId,
    running: Vec<(Running, Instant, CommId, Duration)>,
    /// Point-to-point operations: outside the communicators' queues of collectives.
    p2p: P2p,
    graveyard: Graveyard,
}

impl Engine {
    fn new(world: SimpleCommunicator) -> Engine {
        let mut comms = HashMap::new();
        comms.insert(WORLD, Comm::new(world));
        Engine {
            comms,
            next_id: WORLD + 1,
            running: Vec::new(),
            p2p: P2p::default(),
            graveyard: Graveyard::default(),
        }
    }

    fn idle(&self) -> bool {
        self.running.is_empty()
            && self.comms.values().all(|c| c.queue.is_empty())
            && self.p2p.idle()
    }

    /// Whether data is moving: a collective in flight or queued, a send, or a receive
    /// whose message has begun (their fragments move only while they are tested, so the
    /// engine tests eagerly). Otherwise only receives wait for a peer's message to come
    /// at all.
    fn data_moving(&self) -> bool {
        !self.running.is_empty()
            || self.comms.values().any(|c| !c.queue.is_empty())
            || self.p2p.data_in_flight()
    }

    /// Runs jobs until the channel is closed and everything issued has finished.
    fn run(&mut self, rx: &Receiver<Job>) {
        let mut open = true;
        let mut backoff = Backoff::default();
        while open || !self.idle() {
            let mut progressed = false;
            if open && self.idle() {
                // Nothing to test: sleep until a job comes (waking now and then while
                // abandoned operations may still complete).
                let job = if self.graveyard.graves.is_empty() {
                    rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
                } else {
                    rx.recv_timeout(GRAVEYARD_POLL)
                };
                match job {
                    Ok(job) => {
                        self.accept(job);
                        progressed = true;
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => open = false,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(job) => {
                        self.accept(job);
                        progressed = true;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            progressed |= self.poll();
            if !self.graveyard.graves.is_empty()
                && self.graveyard.last_poll.elapsed() >= GRAVEYARD_POLL
            {
                self.graveyard.poll();
            }
            backoff.pause(progressed, self.data_moving());
        }
    }

    fn accept(&mut self, job: Job) {
        match job {
            Job::P2p(job) => self.p2p.accept(job),
            Job::Free(id) => {
                if let Some(comm) = self.comms.get_mut(&id) {
                    comm.freed = true;
                }
                self.collect_freed();
            }
            Job::Op(op) => {
                let Some(comm) = self.comms.get_mut(&op.comm) else {
                    op.action.fail(Error::Internal(format!(
                        "unknown MPI communicator {}",
                        op.comm
                    )));
                    return;
                };
                if let Some(e) = &comm.broken {
                    op.action.fail(e.clone());
                    return;
                }
                let deadline = crate::group::deadline_after(op.timeout);
                let check = if op.check {
                    comm.seq += 1;
                    let mine = op.desc.encode(comm.seq).to_vec();
                    let all = vec![0u64; WORDS * comm.main.size() as usize];
                    let mut bufs = (mine, all);
                    // SAFETY: the two vectors move into the `Check` with the request (their
                    // heap storage stays put) and are kept until it completes, or buried.
                    match unsafe { raw::iallgather(&comm.ctrl, &bufs.0, &mut bufs.1) } {
                        Ok(request) => Some(Check { request, bufs }),
                        Err(e) => {
                            comm.break_with(&e, &mut self.graveyard);
                            op.action.fail(e);
                            return;
                        }
                    }
                } else {
                    None
                };
                comm.queue.push_back(Waiting {
                    op,
                    deadline,
                    check,
                });
            }
        }
    }

    /// Starts what can start, tests what runs; whether anything happened.
    fn poll(&mut self) -> bool {
        let mut progressed = false;
        let comms = &self.comms;
        progressed |= self
            .p2p
            .poll(|id| comms.get(&id).map(|c| &c.links), &mut self.graveyard);
        if self.comms.values().any(|c| !c.queue.is_empty()) {
            let ids: Vec<CommId> = self.comms.keys().copied().collect();
            for id in ids {
                progressed |= self.advance(id);
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() {
            let (run, deadline, id, _) = &mut self.running[i];
            let (id, deadline) = (*id, *deadline);
            let mut error = run.error.take();
            run.requests.retain_mut(|r| match r.test() {
                Ok(done) => !done,
                Err(e) => {
                    error.get_or_insert(e);
                    false
                }
            });
            run.error = error;
            let stage_next =
                run.requests.is_empty() && run.error.is_none() && !run.steps.is_empty();
            if stage_next && now < deadline {
                // The next stage, on this rank's own time: its local work is done when it
                // returns, and its requests are tested from the next round on. (Past the
                // deadline, it times out below instead of starting.)
                let step = run.steps.pop_front();
                let started = match (step, self.comms.get(&id)) {
                    (Some(step), Some(c)) => catch_unwind(AssertUnwindSafe(|| {
                        step(&c.main, &mut *run.bufs, &mut run.requests)
                    }))
                    .unwrap_or_else(|_| {
                        Err(Error::Panicked {
                            what: format!("a stage of {}", run.what),
                            message: None,
                        })
                    }),
                    _ => Err(Error::Internal(format!(
                        "a stage of {} lost its communicator",
                        run.what
                    ))),
                };
                if let Err(e) = started {
                    // This rank will not start the stages its peers start next.
                    run.steps.clear();
                    if let Some(c) = self.comms.get_mut(&id) {
                        c.break_with(&e, &mut self.graveyard);
                    }
                    run.error = Some(e);
                }
                if run.steps.is_empty() {
                    // Its last stage has started: later operations may start after it.
                    if let Some(c) = self.comms.get_mut(&id) {
                        c.held = false;
                    }
                }
                progressed = true;
            } else if run.requests.is_empty() && !stage_next {
                let (run, ..) = self.running.swap_remove(i);
                if let Some(c) = self.comms.get_mut(&id) {
                    if !run.steps.is_empty() {
                        // Failed between stages: the peers go on to stages this rank
                        // skips.
                        let e = run.error.clone().unwrap_or_else(|| {
                            Error::Internal("stages left after the last".into())
                        });
                        c.held = false;
                        c.break_with(&e, &mut self.graveyard);
                    }
                }
                let result = match run.error {
                    Some(e) => Err(e),
                    None => Ok(run.bufs),
                };
                guarded(&run.what, || (run.finish)(result));
                progressed = true;
            } else if now >= deadline {
                let (run, _, comm, timeout) = self.running.swap_remove(i);
                let e = Error::Timeout {
                    what: run.what.clone(),
                    after: timeout,
                    missing: Vec::new(),
                };
                if let Some(c) = self.comms.get_mut(&comm) {
                    if !run.steps.is_empty() {
                        c.held = false;
                    }
                    c.break_with(&e, &mut self.graveyard);
                }
                self.graveyard.bury(run.requests, run.bufs, timeout);
                guarded(&run.what, || (run.finish)(Err(e)));
                progressed = true;
            } else {
                i += 1;
            }
        }
        self.collect_freed();
        progressed
    }

    /// Starts the operations at the front of a communicator's queue that may start.
    fn advance(&mut self, id: CommId) -> bool {
        let mut progressed = false;
        loop {
            let Some(comm) = self.comms.get_mut(&id) else {
                return progressed;
            };
            if comm.held {
                return progressed;
            }
            let Some(front) = comm.queue.front_mut() else {
                return progressed;
            };
            if let Some(check) = &mut front.check {
                match check.request.test() {
                    Ok(true) => {}
                    Ok(false) if Instant::now() < front.deadline => return progressed,
                    Ok(false) => {
                        let e = Error::Timeout {
                            what: format!("MPI {} (descriptor check)", front.op.desc),
                            after: front.op.timeout,
                            missing: Vec::new(),
                        };
                        if let Some(w) = comm.queue.pop_front() {
                            if let Some(check) = w.check {
                                let bufs = Box::new(check.bufs);
                                self.graveyard.bury(vec![check.request], bufs, w.op.timeout);
                            }
                            w.op.action.fail(e.clone());
                        }
                        comm.break_with(&e, &mut self.graveyard);
                        return true;
                    }
                    Err(e) => {
                        comm.break_with(&e, &mut self.graveyard);
                        return true;
                    }
                }
            }
            progressed = true;
            let Some(w) = comm.queue.pop_front() else {
                return progressed;
            };
            if let Some(check) = &w.check {
                if let Err(e) = debug::compare(&check.bufs.1) {
                    // Every rank sees the same descriptors, so every rank skips this one.
                    w.op.action.fail(e);
                    continue;
                }
            }
            let what = format!("MPI {}", w.op.desc);
            match w.op.action {
                Action::Collective(start) => {
                    let started = guarded(&what, || start(Ok(&comm.main)));
                    if let Some(Some(mut run)) = started {
                        run.what = what;
                        // Its later stages start before anything issued after it.
                        comm.held = !run.steps.is_empty();
                        self.running.push((run, w.deadline, id, w.op.timeout));
                    }
                }
                Action::Split { ranks, done } => {
                    let joined = self.split(id, &ranks);
                    done.complete(joined);
                }
            }
        }
    }

    /// `MPI_Comm_split` of communicator `id` for `ranks` (every rank has agreed to it).
    fn split(&mut self, id: CommId, ranks: &[usize]) -> Result<Option<Joined>> {
        let parent = self
            .comms
            .get(&id)
            .ok_or_else(|| Error::Internal(format!("unknown MPI communicator {id}")))?;
        let index = ranks.iter().position(|&r| r == parent.rank);
        let color = match index {
            Some(_) => Color::with_value(0),
            None => Color::undefined(),
        };
        let key = raw::count(index.unwrap_or(0))?;
        match (index, parent.main.split_by_color_with_key(color, key)) {
            (Some(rank), Some(main)) => {
                raw::errors_return(&main)?;
                let size = main.size() as usize;
                let comm = self.next_id;
                self.next_id += 1;
                self.comms.insert(comm, Comm::new(main));
                Ok(Some(Joined { comm, rank, size }))
            }
            (None, None) => Ok(None),
            _ => Err(Error::Internal(
                "MPI_Comm_split disagreed with the list of ranks".into(),
            )),
        }
    }

    /// Frees the communicators whose handles are gone and whose queues are empty
    /// (operations still running on them complete normally: MPI defers the free).
    fn collect_freed(&mut self) {
        // A held communicator has an operation with stages left to start on it; one with
        // point-to-point operations in flight or waiting still needs its links.
        let p2p = &self.p2p;
        self.comms.retain(|&id, c| {
            let unused = c.freed && c.queue.is_empty() && !c.held;
            !unused || p2p.uses(id)
        });
    }

    /// Frees the communicators and finalises MPI, unless abandoned operations are still
    /// pending: finalising would wait for peers that may never come, so then MPI is left
    /// as it is (and `mpirun` reports a process that exited without finalising).
    fn shutdown(mut self, universe: Universe) {
        self.comms.clear();
        loop {
            self.graveyard.poll();
            let now = Instant::now();
            if self.graveyard.graves.iter().all(|g| now >= g.deadline) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.graveyard.graves.is_empty() {
            drop(universe);
        } else {
            tracing::warn!(
                "{} abandoned MPI operation(s) never completed; not finalising MPI",
                self.graveyard.graves.len()
            );
            // MPI may still write into these buffers.
            for g in self.graveyard.graves {
                std::mem::forget(g.bufs);
            }
            std::mem::forget(universe);
        }
    }
}

/// Waiting between tests of requests in flight: MPI progresses only inside MPI calls
/// (each test moves a large collective on by about one fragment), so while a collective
/// is pending, test eagerly, yielding the core, for up to two seconds without a
/// completion, then sleep longer the longer nothing happens, up to a millisecond. (A
/// one-millisecond spin made a 16 MiB all-reduce take 400 ms: one fragment per sleep.)
///
/// When only receives wait for a message to begin (a pipeline's stage waiting for its
/// next activation, for milliseconds of its peer's compute), spinning for two seconds
/// would take a core from the computation it waits for (two MPI ranks' stages on two
/// cores ran 0.74x as fast as on thread ranks): the engine spins only briefly after each
/// completion, then sleeps in steps that grow to [`Backoff::P2P_MAX_SLEEP`], which bounds
/// how late a message's start is seen.
#[derive(Default)]
struct Backoff {
    idle_since: Option<Instant>,
}

impl Backoff {
    const SPIN: Duration = Duration::from_secs(2);
    const MAX_SLEEP: Duration = Duration::from_millis(1);
    /// How long waiting receives are tested eagerly after a completion.
    const P2P_SPIN: Duration = Duration::from_micros(200);
    /// The longest sleep between tests while only receives wait for a message to begin.
    const P2P_MAX_SLEEP: Duration = Duration::from_micros(100);

    fn pause(&mut self, progressed: bool, moving: bool) {
        if progressed {
            self.idle_since = None;
            return;
        }
        let idle = self.idle_since.get_or_insert_with(Instant::now).elapsed();
        let (spin, max_sleep) = if moving {
            (Self::SPIN, Self::MAX_SLEEP)
        } else {
            (Self::P2P_SPIN, Self::P2P_MAX_SLEEP)
        };
        if idle < spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep((idle / 32).clamp(Duration::from_micros(10), max_sleep));
        }
    }
}
