//! The gradients' way in and out of the reducer: the state a pipe's gradients-final
//! callbacks share with the caller's thread ([`Shared`]), a partition's gradients handed
//! over to their buckets ([`Shared::hand_over`]), and the reduced gradients written back
//! into the layers ([`write_back`]).

use super::{Fault, GradTensor, PipelineError, Problem, Result};
use crate::{CommHook, Reducer};
use lowrank::CpuBackend;
use pipe::{Layer, Pipe};
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The state the partitions' callbacks share with the caller's thread.
pub(super) struct Shared<H> {
    pub(super) reducer: Mutex<Reducer<CpuBackend, H>>,
    /// Global index of each partition's first parameter, then the parameter count.
    pub(super) bounds: Vec<usize>,
    /// Global index of each partition's first layer.
    pub(super) first_layer: Vec<usize>,
    /// Parameter shapes, forward order.
    pub(super) shapes: Vec<Vec<usize>>,
    /// Whether the callbacks hand gradients over (a synchronised step with
    /// [`Launch::PerPartition`] is running).
    pub(super) armed: AtomicBool,
    /// Problems the callbacks met in the step in progress.
    pub(super) faults: Mutex<Vec<Fault>>,
}

impl<H: CommHook<CpuBackend>> Shared<H> {
    pub(super) fn reducer(&self) -> MutexGuard<'_, Reducer<CpuBackend, H>> {
        self.reducer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn faults(&self) -> MutexGuard<'_, Vec<Fault>> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn params(&self, partition: usize) -> Range<usize> {
        self.bounds[partition]..self.bounds[partition + 1]
    }

    /// Copies partition `j`'s gradients into their slots and marks them ready, last
    /// parameter first (so the partition's first bucket launches while the others are
    /// still being copied). A gradient that cannot be copied is marked unused (a zero on
    /// this rank), so its bucket still launches; the problems are returned.
    pub(super) fn hand_over<T: GradTensor>(
        &self,
        reducer: &mut Reducer<CpuBackend, H>,
        j: usize,
        layers: &[Box<dyn Layer<T>>],
    ) -> Vec<Fault> {
        let range = self.params(j);
        let params: Vec<(usize, pipe::Param<'_, T>)> = layers
            .iter()
            .enumerate()
            .flat_map(|(l, layer)| {
                let global = self.first_layer[j] + l;
                layer.parameters().into_iter().map(move |p| (global, p))
            })
            .collect();
        let mut faults = Vec::new();
        let mut fault = |param, problem| {
            faults.push(Fault {
                partition: j,
                param,
                problem,
            })
        };
        if params.len() != range.len() {
            fault(
                None,
                Problem::Params {
                    expected: range.len(),
                    got: params.len(),
                },
            );
            for p in range.rev() {
                if let Err(e) = reducer.mark_unused(p) {
                    fault(None, Problem::Reducer(e));
                }
            }
            return faults;
        }
        for (p, (layer, param)) in range.zip(&params).rev() {
            let at = Some((*layer, param.name));
            let got = param.grad.dims();
            let copied = if got != self.shapes[p] {
                Err(Problem::Shape {
                    expected: self.shapes[p].clone(),
                    got,
                })
            } else {
                match reducer.grad_mut(p) {
                    Ok(slot) => param.grad.copy_to(slot).map_err(Problem::Tensor),
                    Err(e) => Err(Problem::Reducer(e)),
                }
            };
            let marked = match copied {
                Ok(()) => reducer.mark_ready(p),
                Err(problem) => {
                    fault(at, problem);
                    // The copy may have written part of the slot: zeroed as unused.
                    reducer.discard(p)
                }
            };
            if let Err(e) = marked {
                fault(at, Problem::Reducer(e));
            }
        }
        faults
    }
}

/// Overwrites every layer's gradients with the reduced ones.
pub(super) fn write_back<T: GradTensor, H: CommHook<CpuBackend>>(
    shared: &Shared<H>,
    reducer: &Reducer<CpuBackend, H>,
    pipe: &mut Pipe<T>,
) -> Result<()> {
    let mut faults = Vec::new();
    for (j, layers) in pipe.partitions_mut().iter_mut().enumerate() {
        let range = shared.params(j);
        let mut p = range.start;
        let first_layer = shared.first_layer[j];
        for (l, layer) in layers.iter_mut().enumerate() {
            for param in layer.parameters_mut() {
                if p < range.end {
                    let reduced = reducer.grad(p)?;
                    if let Err(e) = param.grad.copy_from(reduced) {
                        faults.push(Fault {
                            partition: j,
                            param: Some((first_layer + l, param.name)),
                            problem: Problem::Tensor(e),
                        });
                    }
                }
                p += 1;
            }
        }
        if p != range.end {
            faults.push(Fault {
                partition: j,
                param: None,
                problem: Problem::Params {
                    expected: range.len(),
                    got: p - range.start,
                },
            });
        }
    }
    if faults.is_empty() {
        Ok(())
    } else {
        Err(PipelineError::Gradients(faults))
    }
}
