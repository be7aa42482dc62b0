//! A replay of a [`Schedule`] with real durations: per-stage costs of each pass and of each
//! message between workers, an event-driven run of the workers' lists, and what comes of
//! it (per-action start and end, makespan, busy time, bubble, peak activation memory).
//!
//! PyTorch's `_simulate_comms_compute` steps the ranks in unit timesteps; this one uses the
//! durations of [`Costs`], which [`Costs::from_record`] measures from a recorded step, so a
//! slow stage or a costly message shows up where it does in a run.
//!
//! The model: a worker runs its list strictly in order, starting its next action when it
//! is free and every input of the action has arrived. An input made on another worker
//! arrives the producer's end plus the message cost; on the same worker, at the producer's
//! end. What an action waits for (the crate's dataflow rules):
//!
//! - `F(s, m)` waits for `F(s − 1, m)` (for `s > 0`);
//! - `B(s, m)` and `I(s, m)` wait for `F(s, m)` (if the schedule has forwards) and, for
//!   `s < n − 1`, for the `B` or `I` of `(s + 1, m)`;
//! - `W(s, m)` waits for `I(s, m)`.
//!
//! Messages do not contend for links: each takes its cost whatever else is in flight.
//!
//! Costs are in seconds (any unit works if used throughout; the trace export,
//! [`chrome_trace_of`](crate::trace::chrome_trace_of), reads them as seconds).

use std::collections::HashMap;
use std::fmt;

use crate::error::Error;
use crate::record::{Record, SpanKind};
use crate::schedule::Schedule;
use crate::vocab::{Action, Pass};

/// What is wrong with [`Costs`] for a schedule or a record; carried as
/// [`Error::Custom`] (downcast the source to read it).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum CostsError {
    /// The costs cover another number of stages than the schedule has.
    StageCount {
        /// Stages in the schedule.
        schedule: usize,
        /// Stages the costs cover.
        costs: usize,
    },
    /// The schedule has an action whose pass has no cost on its stage.
    MissingCost {
        /// The stage.
        stage: usize,
        /// The pass without a cost.
        pass: Pass,
    },
    /// A cost that is negative or not finite.
    InvalidCost {
        /// The stage.
        stage: usize,
        /// Which cost (`"forward"`, `"send_activation"`, ...).
        what: &'static str,
        /// The value given.
        value: f64,
    },
    /// The record has no span for a (stage, pass) the schedule has.
    NoSpans {
        /// The stage.
        stage: usize,
        /// The pass.
        pass: Pass,
    },
    /// The record has a span of an action outside the schedule's stages and micro-batches.
    NotInSchedule {
        /// The action.
        action: Action,
    },
    /// Per-stage activation bytes for another number of stages than the costs cover.
    BytesCount {
        /// Stages the costs cover.
        stages: usize,
        /// Entries given.
        bytes: usize,
    },
    /// A simulation that does not belong to the schedule it was given with.
    SimulationMismatch,
}

impl fmt::Display for CostsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CostsError::StageCount { schedule, costs } => write!(
                f,
                "the schedule has {schedule} stages, the costs cover {costs}{}",
                if costs < schedule {
                    format!(" (no costs for stage {costs} on)")
                } else {
                    String::new()
                }
            ),
            CostsError::MissingCost { stage, pass } => write!(
                f,
                "stage {stage} has no cost for its {} ({}) actions",
                pass_name(*pass),
                pass.letter()
            ),
            CostsError::InvalidCost { stage, what, value } => write!(
                f,
                "stage {stage}: cost {what} must be finite and non-negative (got {value})"
            ),
            CostsError::NoSpans { stage, pass } => write!(
                f,
                "the record has no span of stage {stage}'s {} ({}) actions, which the schedule has",
                pass_name(*pass),
                pass.letter()
            ),
            CostsError::NotInSchedule { action } => {
                write!(f, "the record has {action}, which the schedule does not")
            }
            CostsError::BytesCount { stages, bytes } => write!(
                f,
                "activation bytes for {bytes} stages, the costs cover {stages}"
            ),
            CostsError::SimulationMismatch => {
                f.write_str("the simulation is not of the schedule given with it")
            }
        }
    }
}

impl std::error::Error for CostsError {}

impl From<CostsError> for Error {
    fn from(e: CostsError) -> Self {
        Error::custom(e)
    }
}

fn pass_name(pass: Pass) -> &'static str {
    match pass {
        Pass::Forward => "forward",
        Pass::Backward => "backward",
        Pass::InputGrad => "input-gradient",
        Pass::WeightGrad => "weight-gradient",
    }
}

const PASSES: [Pass; 4] = [
    Pass::Forward,
    Pass::Backward,
    Pass::InputGrad,
    Pass::WeightGrad,
];

fn pass_index(pass: Pass) -> usize {
    match pass {
        Pass::Forward => 0,
        Pass::Backward => 1,
        Pass::InputGrad => 2,
        Pass::WeightGrad => 3,
    }
}

/// One stage's costs: the duration of each pass (`None`: unknown, an error if the schedule
/// runs it), the cost of each message it sends to another worker, and optionally the bytes
/// one micro-batch's activations take while held.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StageCosts {
    /// Duration of a forward action (`F`), including the loss on the last stage.
    pub forward: Option<f64>,
    /// Duration of a backward action (`B`), including any recomputation.
    pub backward: Option<f64>,
    /// Duration of an input-gradient action (`I`).
    pub input_grad: Option<f64>,
    /// Duration of a weight-gradient action (`W`).
    pub weight_grad: Option<f64>,
    /// Cost of sending one micro-batch's output to the next stage, when that stage is on
    /// another worker.
    pub send_activation: f64,
    /// Cost of sending one micro-batch's input gradient to the previous stage, when that
    /// stage is on another worker.
    pub send_gradient: f64,
    /// Bytes one micro-batch's activations take on this stage between its forward and
    /// the backward (or weight-gradient) action that frees them.
    pub activation_bytes: Option<u64>,
    /// The deferred weight gradients of a stage without `W` actions
    /// ([`PipeBuilder::defer_weight_grads`](crate::PipeBuilder::defer_weight_grads)): one
    /// flush right after its last backward action, on its worker, after the gradient that
    /// action sends has left. Zero when nothing is deferred.
    pub flush: f64,
}

impl StageCosts {
    /// The duration of `pass`, if known.
    pub fn of(&self, pass: Pass) -> Option<f64> {
        match pass {
            Pass::Forward => self.forward,
            Pass::Backward => self.backward,
            Pass::InputGrad => self.input_grad,
            Pass::WeightGrad => self.weight_grad,
        }
    }

    fn set(&mut self, pass: Pass, value: f64) {
        let slot = match pass {
            Pass::Forward => &mut self.forward,
            Pass::Backward => &mut self.backward,
            Pass::InputGrad => &mut self.input_grad,
            Pass::WeightGrad => &mut self.weight_grad,
        };
        *slot = Some(value);
    }

    fn check(&self, stage: usize) -> Result<(), CostsError> {
        let all = [
            ("forward", self.forward),
            ("backward", self.backward),
            ("input_grad", self.input_grad),
            ("weight_grad", self.weight_grad),
            ("send_activation", Some(self.send_activation)),
            ("send_gradient", Some(self.send_gradient)),
            ("flush", Some(self.flush)),
        ];
        for (what, value) in all {
            if let Some(value) = value {
                if !value.is_finite() || value < 0.0 {
                    return Err(CostsError::InvalidCost { stage, what, value });
                }
            }
        }
        Ok(())
    }
}

/// Per-stage costs for [`simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Costs {
    stages: Vec<StageCosts>,
}

impl Costs {
    /// Costs from one entry per stage. Errors on a negative or non-finite cost.
    pub fn new(stages: Vec<StageCosts>) -> Result<Self, Error> {
        for (s, c) in stages.iter().enumerate() {
            c.check(s)?;
        }
        Ok(Costs { stages })
    }

    /// The same costs on every one of `stages` stages: `forward` for `F`, `backward` for
    /// `B`, half of `backward` each for `I` and `W`, and `transfer` for every message
    /// between workers (both directions). Errors on a negative or non-finite cost.
    pub fn uniform(
        stages: usize,
        forward: f64,
        backward: f64,
        transfer: f64,
    ) -> Result<Self, Error> {
        let one = StageCosts {
            forward: Some(forward),
            backward: Some(backward),
            input_grad: Some(backward / 2.0),
            weight_grad: Some(backward / 2.0),
            send_activation: transfer,
            send_gradient: transfer,
            activation_bytes: None,
            flush: 0.0,
        };
        Costs::new(vec![one; stages])
    }

    /// The same costs with `bytes[s]` bytes per held micro-batch on stage `s`, so that
    /// [`simulate`] reports peak memory in bytes too.
    pub fn with_activation_bytes(mut self, bytes: &[u64]) -> Result<Self, Error> {
        if bytes.len() != self.stages.len() {
            return Err(CostsError::BytesCount {
                stages: self.stages.len(),
                bytes: bytes.len(),
            }
            .into());
        }
        for (c, &b) in self.stages.iter_mut().zip(bytes) {
            c.activation_bytes = Some(b);
        }
        Ok(self)
    }

    /// Measured costs: for each (stage, pass), the mean duration of its actions in a
    /// recorded run of `schedule` (one or more runs; a stage's consecutive spans of one
    /// action are one action).
    ///
    /// A checkpointed backward's recompute span counts toward its action, and the last
    /// stage's loss span toward its forward. A deferred weight-gradient flush
    /// ([`SpanKind::WeightGrad`]) counts as `W` if the schedule has `W` actions on that
    /// stage (spread over them when the record has no `W` action of its own), else toward
    /// the backward action it follows. Message costs are estimated from the record: for
    /// each direction of each stage, the least gap between a producer's end and the start
    /// of its consumer on another worker that was waiting for it (zero if none was seen).
    ///
    /// Errors if the record has an action outside the schedule, or no span of a
    /// (stage, pass) the schedule has.
    pub fn from_record(record: &Record, schedule: &Schedule) -> Result<Self, Error> {
        let (n, m) = (schedule.stages(), schedule.micro_batches());
        let mut in_schedule = vec![[0usize; 4]; n];
        for a in schedule.workers().iter().flatten() {
            if a.stage < n {
                in_schedule[a.stage][pass_index(a.pass)] += 1;
            }
        }
        let mut total = vec![[0f64; 4]; n];
        let mut flushes = vec![0f64; n];
        let mut instances = vec![[0usize; 4]; n];
        // Per action occurrence: (worker, first start, producing end, previous span's end).
        let mut occurrences: HashMap<Action, Vec<Occurrence>> = HashMap::new();
        for (w, spans) in record.workers().iter().enumerate() {
            let mut previous_end: Option<f64> = None;
            let mut k = 0;
            while k < spans.len() {
                let action = spans[k].action;
                if action.stage >= n || action.micro_batch >= m {
                    return Err(CostsError::NotInSchedule { action }.into());
                }
                let s = action.stage;
                let mut j = k;
                let mut produced = None;
                while j < spans.len() && spans[j].action == action {
                    let span = &spans[j];
                    let d = span.end.saturating_sub(span.start).as_secs_f64();
                    let pass = match span.kind {
                        SpanKind::WeightGrad if in_schedule[s][3] > 0 => Pass::WeightGrad,
                        SpanKind::WeightGrad => {
                            // The flush after the stage's last backward: its own cost.
                            flushes[s] += d;
                            j += 1;
                            continue;
                        }
                        _ => action.pass,
                    };
                    total[s][pass_index(pass)] += d;
                    if matches!(span.kind, SpanKind::Forward | SpanKind::Backward) {
                        produced = Some(span.end.as_secs_f64());
                    }
                    j += 1;
                }
                instances[s][pass_index(action.pass)] += 1;
                let start = spans[k].start.as_secs_f64();
                occurrences.entry(action).or_default().push(Occurrence {
                    worker: w,
                    start,
                    produced: produced.unwrap_or_else(|| spans[j - 1].end.as_secs_f64()),
                    previous_end,
                });
                previous_end = Some(spans[j - 1].end.as_secs_f64());
                k = j;
            }
        }
        let mut stages = vec![StageCosts::default(); n];
        for s in 0..n {
            for pass in PASSES {
                let p = pass_index(pass);
                if in_schedule[s][p] == 0 {
                    continue;
                }
                let count = if instances[s][p] > 0 {
                    instances[s][p]
                } else if total[s][p] > 0.0 {
                    in_schedule[s][p]
                } else {
                    return Err(CostsError::NoSpans { stage: s, pass }.into());
                };
                stages[s].set(pass, total[s][p] / count as f64);
            }
        }
        // Message costs: the least observed wait of a consumer on another worker.
        let mut least = vec![[None::<f64>; 2]; n];
        let grad_pass = |s: usize, mb: usize| {
            [Pass::Backward, Pass::InputGrad]
                .into_iter()
                .map(move |p| Action {
                    stage: s,
                    micro_batch: mb,
                    pass: p,
                })
                .find(|a| occurrences.contains_key(a))
        };
        for (&consumer, list) in &occurrences {
            let (s, mb) = (consumer.stage, consumer.micro_batch);
            let (producer, direction) = match consumer.pass {
                Pass::Forward if s > 0 => (Some(Action::forward(s - 1, mb)), 0),
                Pass::Backward | Pass::InputGrad if s + 1 < n => (grad_pass(s + 1, mb), 1),
                _ => (None, 0),
            };
            let Some(producer) = producer else { continue };
            let Some(made) = occurrences.get(&producer) else {
                continue;
            };
            for (c, p) in list.iter().zip(made) {
                let waited = c.previous_end.is_none_or(|e| e <= p.produced);
                if c.worker != p.worker && waited {
                    let gap = (c.start - p.produced).max(0.0);
                    let slot = &mut least[producer.stage][direction];
                    *slot = Some(slot.map_or(gap, |g: f64| g.min(gap)));
                }
            }
        }
        for (c, [activation, gradient]) in stages.iter_mut().zip(least) {
            c.send_activation = activation.unwrap_or(0.0);
            c.send_gradient = gradient.unwrap_or(0.0);
        }
        for (c, f) in stages.iter_mut().zip(flushes) {
            c.flush = f;
        }
        Costs::new(stages)
    }

    /// The per-stage costs.
    pub fn stages(&self) -> &[StageCosts] {
        &self.stages
    }

    /// One stage's costs.
    pub fn stage(&self, stage: usize) -> Option<&StageCosts> {
        self.stages.get(stage)
    }
}

struct Occurrence {
    worker: usize,
    start: f64,
    produced: f64,
    previous_end: Option<f64>,
}

/// One action of a simulated run: where and when it ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    /// The action.
    pub action: Action,
    /// The worker that ran it.
    pub worker: usize,
    /// When it started.
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// What [`simulate`] found: the timeline and its measures.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Per worker, its actions in the order it ran them, with their times.
    pub workers: Vec<Vec<Timed>>,
    /// The latest end (the run starts at 0).
    pub makespan: f64,
    /// Per worker, the sum of its actions' durations.
    pub busy: Vec<f64>,
    /// Per worker, the most micro-batches its stages hold at once (summed over its
    /// stages): a forward holds one, a backward or weight-gradient action frees it, an
    /// input-gradient action keeps it for its `W`.
    pub peak_micro_batches: Vec<usize>,
    /// Per stage, the most micro-batches it holds at once.
    pub stage_peak_micro_batches: Vec<usize>,
    /// Per worker, the peak in bytes, when the costs carry every stage's activation bytes.
    pub peak_bytes: Option<Vec<u64>>,
}

impl Simulation {
    /// The idle share of the workers' time: `1 − Σ busy / (workers × makespan)` (0 for an
    /// empty run).
    pub fn bubble(&self) -> f64 {
        let capacity = self.workers.len() as f64 * self.makespan;
        if capacity <= 0.0 {
            return 0.0;
        }
        1.0 - self.busy.iter().sum::<f64>() / capacity
    }

    /// When `action` ran, if the schedule has it.
    pub fn timing(&self, action: Action) -> Option<&Timed> {
        self.workers.iter().flatten().find(|t| t.action == action)
    }
}

/// Replays `schedule` with `costs`: each worker takes its next action when it is free and
/// that action's inputs have arrived (see the [module docs](self)).
///
/// Errors if the costs do not cover the schedule's stages or lack the cost of a pass the
/// schedule runs ([`CostsError`], as [`Error::Custom`]), and with [`Error::Deadlock`] if
/// the lists wait on each other (which [`Schedule::new`] already rejects).
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Simulation, Error> {
    let (n, m) = (schedule.stages(), schedule.micro_batches());
    if costs.stages.len() != n {
        return Err(CostsError::StageCount {
            schedule: n,
            costs: costs.stages.len(),
        }
        .into());
    }
    let lists = schedule.workers();
    let index = |a: &Action| pass_index(a.pass) * n * m + a.stage * m + a.micro_batch;
    let mut listed = vec![false; 4 * n * m];
    let mut has_forward = false;
    for a in lists.iter().flatten() {
        if a.stage >= n || a.micro_batch >= m {
            return Err(Error::ActionOutOfRange {
                action: *a,
                stages: n,
                micro_batches: m,
            });
        }
        if costs.stages[a.stage].of(a.pass).is_none() {
            return Err(CostsError::MissingCost {
                stage: a.stage,
                pass: a.pass,
            }
            .into());
        }
        listed[index(a)] = true;
        has_forward |= a.pass == Pass::Forward;
    }
    let worker_of = |stage: usize| schedule.worker_of(stage);
    // The inputs of `a`: each the producing action and its message cost if it crosses.
    let inputs = |a: &Action, w: usize| -> Vec<(Action, f64)> {
        let crossing = |producer: usize, cost: f64| {
            if worker_of(producer) == Some(w) {
                0.0
            } else {
                cost
            }
        };
        let (s, mb) = (a.stage, a.micro_batch);
        let mut needs = Vec::new();
        match a.pass {
            Pass::Forward => {
                if s > 0 {
                    let cost = crossing(s - 1, costs.stages[s - 1].send_activation);
                    needs.push((Action::forward(s - 1, mb), cost));
                }
            }
            Pass::Backward | Pass::InputGrad => {
                if has_forward {
                    needs.push((Action::forward(s, mb), 0.0));
                }
                if s + 1 < n {
                    let b = Action::backward(s + 1, mb);
                    let i = Action::input_grad(s + 1, mb);
                    // Neither listed: wait on B forever (a deadlock, reported below).
                    let producer = if listed[index(&i)] && !listed[index(&b)] {
                        i
                    } else {
                        b
                    };
                    let cost = crossing(s + 1, costs.stages[s + 1].send_gradient);
                    needs.push((producer, cost));
                }
            }
            Pass::WeightGrad => needs.push((Action::input_grad(s, mb), 0.0)),
        }
        needs
    };

    // Per worker and position: whether the action there is its stage's last backward one
    // (the stage's deferred flush follows it).
    let last_backward: Vec<Vec<bool>> = lists
        .iter()
        .map(|list| {
            let mut last = vec![false; list.len()];
            for s in 0..n {
                if let Some(k) = list
                    .iter()
                    .rposition(|a| a.stage == s && a.pass != Pass::Forward)
                {
                    last[k] = true;
                }
            }
            last
        })
        .collect();
    let mut end: Vec<Option<f64>> = vec![None; 4 * n * m];
    let mut heads = vec![0usize; lists.len()];
    let mut free = vec![0f64; lists.len()];
    let mut flushed = vec![0f64; lists.len()];
    let mut timed: Vec<Vec<Timed>> = lists.iter().map(|l| Vec::with_capacity(l.len())).collect();
    loop {
        let mut moved = false;
        for (w, list) in lists.iter().enumerate() {
            while let Some(a) = list.get(heads[w]) {
                let mut ready = free[w];
                let mut all = true;
                for (producer, cost) in inputs(a, w) {
                    match end[index(&producer)] {
                        Some(e) => ready = ready.max(e + cost),
                        None => {
                            all = false;
                            break;
                        }
                    }
                }
                if !all {
                    break;
                }
                let duration = costs.stages[a.stage].of(a.pass).unwrap_or(0.0);
                let finish = ready + duration;
                end[index(a)] = Some(finish);
                let flush = if last_backward[w][heads[w]] {
                    costs.stages[a.stage].flush
                } else {
                    0.0
                };
                free[w] = finish + flush;
                flushed[w] += flush;
                timed[w].push(Timed {
                    action: *a,
                    worker: w,
                    start: ready,
                    end: finish,
                });
                heads[w] += 1;
                moved = true;
            }
        }
        let waiting: Vec<(usize, Action)> = lists
            .iter()
            .enumerate()
            .filter_map(|(w, l)| l.get(heads[w]).map(|&a| (w, a)))
            .collect();
        if waiting.is_empty() {
            break;
        }
        if !moved {
            return Err(Error::Deadlock {
                waiting,
                grid: crate::schedule::grid_around(schedule.workers(), &heads),
            });
        }
    }

    let makespan = free.iter().copied().fold(0.0, f64::max);
    let busy = timed
        .iter()
        .zip(&flushed)
        .map(|(l, f)| l.iter().map(|t| t.end - t.start).sum::<f64>() + f)
        .collect();

    // Memory follows each worker's list: it does not depend on the timing.
    let start_held = if has_forward { 0 } else { m };
    let mut stage_held = vec![start_held; n];
    let mut stage_peak = vec![start_held; n];
    let bytes: Option<Vec<u64>> = costs.stages.iter().map(|c| c.activation_bytes).collect();
    let mut peak_micro_batches = Vec::with_capacity(lists.len());
    let mut peak_bytes = Vec::with_capacity(lists.len());
    for (w, list) in lists.iter().enumerate() {
        let mine: Vec<usize> = (0..n).filter(|&s| worker_of(s) == Some(w)).collect();
        let held_bytes = |held: &[usize]| -> u64 {
            bytes.as_ref().map_or(0, |b| {
                mine.iter()
                    .map(|&s| b[s].saturating_mul(held[s] as u64))
                    .fold(0u64, u64::saturating_add)
            })
        };
        let mut units: usize = mine.iter().map(|&s| stage_held[s]).sum();
        let (mut peak, mut peak_b) = (units, held_bytes(&stage_held));
        for a in list {
            let s = a.stage;
            match a.pass {
                Pass::Forward => {
                    stage_held[s] += 1;
                    units += 1;
                }
                Pass::Backward | Pass::WeightGrad => {
                    if stage_held[s] > 0 {
                        stage_held[s] -= 1;
                        units -= 1;
                    }
                }
                Pass::InputGrad => {}
            }
            stage_peak[s] = stage_peak[s].max(stage_held[s]);
            peak = peak.max(units);
            peak_b = peak_b.max(held_bytes(&stage_held));
        }
        peak_micro_batches.push(peak);
        peak_bytes.push(peak_b);
    }

    Ok(Simulation {
        workers: timed,
        makespan,
        busy,
        peak_micro_batches,
        stage_peak_micro_batches: stage_peak,
        peak_bytes: bytes.map(|_| peak_bytes),
    })
}
