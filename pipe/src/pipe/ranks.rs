//! [`Pipe`]'s runs when its stages are on ranks
//! ([`PipeBuilder::on_ranks`](crate::PipeBuilder::on_ranks)): each rank runs its own
//! stages, the rank of stage 0 announces every run (its kind, step number, mode and
//! micro-batch sizes) and the others check it, so a rank that calls another method or is
//! at another step fails at once, on every rank, instead of hanging.

use super::{check_schedule, complete, complete_losses, Pending, Pipe, StepOutput};
use crate::error::Error;
use crate::frame::{Control, Frame, RunKind};
use crate::microbatch::{Batch, MicroBatch};
use crate::ranks::Ranks;
use crate::schedule::Schedule;
use crate::tensor::Tensor;
use crate::vocab::{Device, Pass};

/// The micro-batches of the given sizes, in order.
fn plan_of(sizes: &[usize]) -> Vec<MicroBatch> {
    let mut offset = 0;
    sizes
        .iter()
        .enumerate()
        .map(|(index, &len)| {
            let mb = MicroBatch { index, offset, len };
            offset += len;
            mb
        })
        .collect()
}

impl<T: Tensor> Pipe<T> {
    /// Agrees on a run with every other rank: the rank of stage 0 (which passes `plan`)
    /// announces it, the others receive and check it. Returns the run's micro-batches.
    fn start_run(
        &self,
        ranks: &Ranks<T>,
        kind: RunKind,
        plan: Option<Vec<MicroBatch>>,
    ) -> Result<Vec<MicroBatch>, Error> {
        let first = ranks.stage_rank[0];
        if ranks.rank() == first {
            let plan =
                plan.ok_or_else(|| Error::Placement("stage 0 runs here without a plan".into()))?;
            let start = Control::Start {
                kind,
                step: self.step,
                train: self.train,
                sizes: plan.iter().map(|mb| mb.len).collect(),
            };
            for peer in ranks.peers() {
                ranks.send_control(peer, &start)?;
            }
            return Ok(plan);
        }
        let mine = (kind, self.step, self.train);
        match ranks.recv_control(first, self.timeout)? {
            Control::Start {
                kind,
                step,
                train,
                sizes,
            } => {
                if (kind, step, train) != mine {
                    return Err(Error::RankMismatch {
                        rank: ranks.rank(),
                        other: first,
                        why: format!(
                            "{:?} at step {} (training: {}) here, {kind:?} at step {step} \
                             (training: {train}) on the rank of stage 0",
                            mine.0, mine.1, mine.2
                        ),
                    });
                }
                let theirs = plan_of(&sizes);
                match plan {
                    Some(plan) if plan != theirs => Err(Error::RankMismatch {
                        rank: ranks.rank(),
                        other: first,
                        why: format!(
                            "micro-batches {:?} here, {sizes:?} on the rank of stage 0",
                            plan.iter().map(|mb| mb.len).collect::<Vec<_>>()
                        ),
                    }),
                    _ if theirs.is_empty() => Err(Error::Frame("a run of no micro-batches".into())),
                    _ => Ok(theirs),
                }
            }
            Control::Abort {
                rank,
                site,
                message,
            } => Err(Error::Remote {
                rank,
                site,
                message,
            }),
            other => Err(Error::Frame(format!(
                "rank {first} sent {other:?} where a run's start was due"
            ))),
        }
    }

    /// Ends a run that failed (`error`) before its workers started: tells every peer
    /// (unless the failure is theirs), ends this rank's part, and drains each peer's
    /// frames of the run, so the next run starts clean. Returns `error`.
    fn fail_run(&self, ranks: &Ranks<T>, error: Error) -> Error {
        if !matches!(error, Error::Remote { .. }) {
            ranks.abort_peers(&error);
        }
        for peer in ranks.peers() {
            let _ = ranks.send_control(peer, &Control::Done);
        }
        for peer in ranks.peers() {
            // Frames of the run up to the peer's `Done` (a peer that failed first sent its
            // abort before it).
            loop {
                match ranks.recv(peer, self.timeout, &|_| Ok(Device::Cpu)) {
                    Ok(Frame::Control(Control::Done)) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        }
        let _ = ranks.transport.flush(self.timeout);
        error
    }

    /// Runs `f`, the part of a run before its start on this rank; a failure is sent to
    /// the peers and the run ended cleanly ([`fail_run`](Self::fail_run)).
    fn before_start<R>(
        &self,
        ranks: &Ranks<T>,
        f: impl FnOnce(&Self) -> Result<R, Error>,
    ) -> Result<R, Error> {
        f(self).map_err(|e| self.fail_run(ranks, e))
    }

    pub(super) fn forward_on_ranks(
        &mut self,
        ranks: &Ranks<T>,
        input: Batch<T>,
    ) -> Result<Batch<T>, Error> {
        self.discard_pending();
        let n = self.balance.len();
        let (first, last) = (ranks.is_local(0), ranks.is_local(n - 1));
        let prepared = self.before_start(ranks, |pipe| {
            pipe.check_poison()?;
            if !first {
                return Ok(None);
            }
            let (plan, parts) = input.scatter(pipe.chunks)?;
            Ok(Some((plan, pipe.on_device(parts, 0)?)))
        })?;
        let (plan, inputs) = match prepared {
            Some((plan, inputs)) => (Some(plan), inputs),
            None => (None, Vec::new()),
        };
        let plan = self
            .start_run(ranks, RunKind::Forward, plan)
            .map_err(|e| self.fail_run(ranks, e))?;
        let schedule = Schedule::gpipe_forward(plan.len(), n)?;
        let outcome = self.run(&schedule, &plan, inputs, Vec::new(), None, None)?;
        let output = if last {
            Batch::gather(complete(outcome.outputs, n - 1, Pass::Forward)?)?
        } else {
            Batch::new(Vec::new())
        };
        if self.train {
            let batch_len = plan.iter().map(|mb| mb.len).sum();
            self.pending = Some(Pending {
                plan,
                kept: outcome.kept,
                trackers: outcome.trackers,
                batch_len,
            });
        }
        Ok(output)
    }

    pub(super) fn backward_on_ranks(
        &mut self,
        ranks: &Ranks<T>,
        grad_output: Batch<T>,
    ) -> Result<Batch<T>, Error> {
        let n = self.balance.len();
        let (first, last) = (ranks.is_local(0), ranks.is_local(n - 1));
        let pending = self.pending.take();
        let prepared = self.before_start(ranks, |pipe| {
            pipe.check_poison()?;
            let pending = pending.ok_or(Error::NoPendingForward)?;
            let grads = if last {
                let got = grad_output.batch_len()?;
                if got != pending.batch_len {
                    return Err(Error::GradientLength {
                        expected: pending.batch_len,
                        got,
                    });
                }
                pipe.on_device(grad_output.split_as(&pending.plan)?, n - 1)?
            } else {
                Vec::new()
            };
            Ok((pending, grads))
        });
        let (pending, grads) = match prepared {
            Ok(p) => p,
            Err(e) => {
                // The run failed on every rank: its forward's state is gone too.
                self.step += 1;
                return Err(e);
            }
        };
        let Pending {
            plan,
            kept,
            trackers,
            ..
        } = pending;
        let plan = self
            .start_run(ranks, RunKind::Backward, Some(plan))
            .map_err(|e| self.fail_run(ranks, e))?;
        let schedule = Schedule::gpipe_backward(plan.len(), n)?;
        let outcome = self.run(
            &schedule,
            &plan,
            Vec::new(),
            grads,
            Some((kept, trackers)),
            None,
        )?;
        self.step += 1;
        if first {
            Batch::gather_gradients(complete(outcome.input_grads, 0, Pass::Backward)?)
        } else {
            Ok(Batch::new(Vec::new()))
        }
    }

    pub(super) fn step_on_ranks<L, F>(
        &mut self,
        ranks: &Ranks<T>,
        schedule: Option<&Schedule>,
        input: Batch<T>,
        loss: F,
    ) -> Result<StepOutput<T, L>, Error>
    where
        L: Send,
        F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), Error> + Send,
    {
        self.discard_pending();
        let n = self.balance.len();
        let (first, last) = (ranks.is_local(0), ranks.is_local(n - 1));
        let prepared = self.before_start(ranks, |pipe| {
            pipe.check_poison()?;
            if !pipe.train {
                return Err(Error::NotTraining);
            }
            if !first {
                return Ok(None);
            }
            let plan = pipe.micro_batches(input.batch_len()?)?;
            let parts = input.split_as(&plan)?;
            Ok(Some((plan, pipe.on_device(parts, 0)?)))
        })?;
        let (plan, inputs) = match prepared {
            Some((plan, inputs)) => (Some(plan), inputs),
            None => (None, Vec::new()),
        };
        let plan = self
            .start_run(ranks, RunKind::Step, plan)
            .map_err(|e| self.fail_run(ranks, e))?;
        let m = plan.len();
        let generated;
        let schedule = match schedule {
            Some(s) => s,
            None => {
                generated = self.schedule.generate(m, n)?;
                &generated
            }
        };
        if let Err(e) = check_schedule(schedule, n, m) {
            return Err(self.fail_run(ranks, e));
        }
        if let Some(e) = split_worker(ranks, schedule) {
            return Err(self.fail_run(ranks, e));
        }
        let (outcome, losses) = self.run_with_loss(schedule, &plan, inputs, loss)?;
        self.step += 1;
        let output = if last {
            Batch::gather(complete(outcome.outputs, n - 1, Pass::Forward)?)?
        } else {
            Batch::new(Vec::new())
        };
        let input_grad = if first {
            Batch::gather_gradients(complete(outcome.input_grads, 0, Pass::Backward)?)?
        } else {
            Batch::new(Vec::new())
        };
        let losses = if last {
            complete_losses(losses, n)?
        } else {
            Vec::new()
        };
        Ok(StepOutput {
            output,
            input_grad,
            losses,
        })
    }
}

/// A worker of `schedule` whose stages are on different ranks: it cannot run.
fn split_worker<T>(ranks: &Ranks<T>, schedule: &Schedule) -> Option<Error> {
    let n = ranks.stage_rank.len();
    for a in 0..n {
        for b in a + 1..n {
            if schedule.worker_of(a) == schedule.worker_of(b)
                && ranks.stage_rank[a] != ranks.stage_rank[b]
            {
                return Some(Error::Placement(format!(
                    "stages {a} and {b} share a worker of the schedule but run on ranks {} and {}",
                    ranks.stage_rank[a], ranks.stage_rank[b]
                )));
            }
        }
    }
    None
}
