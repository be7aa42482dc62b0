//! A [`DistributedPipe`]'s steps (the pipe's run with the gradients reduced around it),
//! its settings and what it reports.

use super::handover::write_back;
use super::{
    mesh, DistributedPipe, GradTensor, Launch, Mesh, MeshGroups, PipelineError, Result, StepTimes,
};
use crate::{CommHook, Reducer};
use lowrank::CpuBackend;
use pipe::{Batch, MicroBatch, Pipe, Schedule, StepOutput};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

impl<T: GradTensor, H: CommHook<CpuBackend> + 'static> DistributedPipe<T, H> {
    /// The same, launching at another point (see [`Launch`]).
    pub fn with_launch(mut self, launch: Launch) -> Self {
        self.launch = launch;
        self
    }

    /// Sets when synchronised steps hand gradients over, from the next step on.
    pub fn set_launch(&mut self, launch: Launch) {
        self.launch = launch;
    }

    /// When synchronised steps hand gradients over.
    pub fn launch(&self) -> Launch {
        self.launch
    }

    /// Runs a training step of the pipe ([`Pipe::step`]) and, if synchronisation is on,
    /// reduces the gradients over the ranks as partitions finish, then writes the
    /// averaged gradients into the layers. With it off, gradients only accumulate in the
    /// layers. See the module docs for errors.
    pub fn step<L, F>(&mut self, input: Batch<T>, loss: F) -> Result<StepOutput<T, L>>
    where
        L: Send,
        F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), pipe::Error> + Send,
    {
        self.reduce_around(|pipe| pipe.step(input, loss))
    }

    /// [`step`](Self::step) with a schedule of your own ([`Pipe::step_with`]).
    pub fn step_with<L, F>(
        &mut self,
        schedule: &Schedule,
        input: Batch<T>,
        loss: F,
    ) -> Result<StepOutput<T, L>>
    where
        L: Send,
        F: FnMut(MicroBatch, &Batch<T>) -> Result<(L, Batch<T>), pipe::Error> + Send,
    {
        self.reduce_around(|pipe| pipe.step_with(schedule, input, loss))
    }

    /// The pipe's forward pass ([`Pipe::forward`]); nothing is reduced.
    pub fn forward(&mut self, input: Batch<T>) -> Result<Batch<T>> {
        Ok(self.pipe.forward(input)?)
    }

    /// The pending forward's backward pass ([`Pipe::backward`]), reduced as
    /// [`step`](Self::step) is; returns the input gradient.
    pub fn backward(&mut self, grad_output: Batch<T>) -> Result<Batch<T>> {
        self.reduce_around(|pipe| pipe.backward(grad_output))
    }

    fn reduce_around<R>(
        &mut self,
        run: impl FnOnce(&mut Pipe<T>) -> Result<R, pipe::Error>,
    ) -> Result<R> {
        let started = Instant::now();
        self.times = None;
        if !self.sync {
            let value = run(&mut self.pipe)?;
            self.times = Some(StepTimes {
                pipe: started.elapsed(),
                tail: Duration::ZERO,
            });
            return Ok(value);
        }
        self.shared.faults().clear();
        let early = self.launch == Launch::PerPartition;
        self.shared.armed.store(early, Ordering::Release);
        let ran = run(&mut self.pipe);
        self.shared.armed.store(false, Ordering::Release);
        let ended = Instant::now();
        let shared = &*self.shared;
        let mut reducer = shared.reducer();
        if !early && ran.is_ok() {
            for (j, layers) in self.pipe.partitions().iter().enumerate().rev() {
                let faults = shared.hand_over(&mut reducer, j, layers);
                shared.faults().extend(faults);
            }
        }
        // Whatever happened, every bucket launches and is waited for: no peer waits.
        let finished = reducer.finish();
        let faults = std::mem::take(&mut *shared.faults());
        let outcome = match ran {
            Ok(_) if !faults.is_empty() => {
                if let Err(also) = finished {
                    tracing::warn!("the step whose gradients could not be handed over also failed to reduce: {also}");
                }
                Err(PipelineError::Gradients(faults))
            }
            Ok(value) => finished.map(|()| value).map_err(PipelineError::from),
            Err(e) => {
                match finished {
                    // The partitions the failure stopped were reduced as zeros: expected.
                    Err(crate::Error::UnmarkedParameters { .. }) | Ok(()) => {}
                    Err(also) => tracing::warn!(
                        "the pipe step that failed with `{e}` also failed to reduce: {also}"
                    ),
                }
                Err(PipelineError::Pipe(e))
            }
        };
        let value = match &self.mesh {
            Some(mesh) => mesh::agree(&*mesh.world, outcome, self.pipe.timeout())?,
            None => outcome?,
        };
        write_back(shared, &reducer, &mut self.pipe)?;
        self.times = Some(StepTimes {
            pipe: ended - started,
            tail: ended.elapsed(),
        });
        Ok(value)
    }

    /// Where the time of the last step ([`step`](Self::step), [`step_with`](Self::step_with)
    /// or [`backward`](Self::backward)) went; `None` before the first and after a failed
    /// one.
    pub fn last_step_times(&self) -> Option<StepTimes> {
        self.times
    }

    /// Hook calls so far (one per bucket per synchronised step).
    pub fn hook_calls(&self) -> u64 {
        self.shared.reducer().hook_calls()
    }

    /// Parameter indices (forward order) of each bucket, in launch order.
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.shared.reducer().bucket_params()
    }

    /// The partition each bucket belongs to, in launch order (never increasing).
    pub fn bucket_partitions(&self) -> Vec<usize> {
        let bounds = &self.shared.bounds;
        self.bucket_params()
            .iter()
            .map(|b| bounds.partition_point(|&start| start <= b[0]) - 1)
            .collect()
    }

    /// The reducer (its hook and buckets), locked. Between steps no callback holds it.
    pub fn reducer(&self) -> MutexGuard<'_, Reducer<CpuBackend, H>> {
        self.shared.reducer()
    }
}

impl<T: GradTensor, H> DistributedPipe<T, H> {
    /// The mesh, where this rank is part of one ([`on_mesh`](DistributedPipe::on_mesh)).
    pub fn mesh(&self) -> Option<Mesh> {
        self.mesh.as_ref().map(|m| m.mesh)
    }

    /// This rank's stage, replica and groups on its mesh (`None` off a mesh).
    pub fn mesh_groups(&self) -> Option<&MeshGroups> {
        self.mesh.as_ref().map(|m| &m.groups)
    }

    /// The pipe (layers, parameters and their gradients).
    pub fn pipe(&self) -> &Pipe<T> {
        &self.pipe
    }

    /// The pipe, mutably (an optimizer step through [`Pipe::partitions_mut`], `eval`).
    /// Runs started on it directly are not reduced.
    pub fn pipe_mut(&mut self) -> &mut Pipe<T> {
        &mut self.pipe
    }

    /// The pipe, without its gradients-final callback.
    pub fn into_pipe(mut self) -> Pipe<T> {
        self.pipe.on_gradients_final(|_, _| {});
        self.pipe
    }

    /// Sets every layer's gradients to zero ([`Pipe::zero_grad`]).
    pub fn zero_grad(&mut self) {
        self.pipe.zero_grad();
    }

    /// Parameters in all (forward order: partition by partition, layer by layer).
    pub fn param_count(&self) -> usize {
        self.shared.shapes.len()
    }

    /// The global indices of partition `j`'s parameters (empty past the last partition).
    pub fn partition_params(&self, j: usize) -> Range<usize> {
        let b = &self.shared.bounds;
        match (b.get(j), b.get(j + 1)) {
            (Some(&start), Some(&end)) => start..end,
            _ => b[b.len() - 1]..b[b.len() - 1],
        }
    }
}

impl<T: GradTensor, H> accum::GradSync for DistributedPipe<T, H> {
    /// Sets the setting of the next step (a step takes `&mut self`, so none is in
    /// progress).
    fn set_sync(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.sync, on)
    }

    fn sync_enabled(&self) -> bool {
        self.sync
    }
}
