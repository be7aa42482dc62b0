//! [`Mesh`]: `stages × replicas` ranks, pipeline parallel along one axis and data parallel
//! along the other, laid out as Megatron-LM lays them out by default.
//!
//! World rank `r` is stage `r / replicas` of replica `r % replicas`:
//! `r = stage * replicas + replica`. The ranks of one stage are consecutive, so a stage's
//! data-parallel group (the heavy gradient traffic) stays within a node when a node holds
//! a multiple of `replicas` ranks. Two stages × two replicas:
//!
//! | world rank | stage | replica | pipeline group (replica's) | data-parallel group (stage's) |
//! |-----------:|------:|--------:|----------------------------|-------------------------------|
//! | 0          | 0     | 0       | {0, 2}, as rank 0          | {0, 1}, as rank 0             |
//! | 1          | 0     | 1       | {1, 3}, as rank 0          | {0, 1}, as rank 1             |
//! | 2          | 1     | 0       | {0, 2}, as rank 1          | {2, 3}, as rank 0             |
//! | 3          | 1     | 1       | {1, 3}, as rank 1          | {2, 3}, as rank 1             |
//!
//! [`Mesh::groups`] creates both kinds of group with [`ProcessGroup::new_group`], on every
//! rank in the same order: the pipeline groups of replicas `0..replicas`, then the
//! data-parallel groups of stages `0..stages`.

use super::{PipelineError, Result};
use collectives::{Buffer, ProcessGroup, ReduceOp};
use std::sync::Arc;

/// The shape of a pipeline × data-parallel job: `stages` pipeline stages (one partition
/// each), every stage held by `replicas` data-parallel replicas, on `stages * replicas`
/// ranks. See the [module docs](self) for the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    /// Pipeline stages: the partitions of the model (its balance's length).
    pub stages: usize,
    /// Data-parallel replicas of each stage.
    pub replicas: usize,
}

/// Why a [`Mesh`] does not fit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MeshError {
    /// No stages or no replicas.
    #[error("a mesh of {stages} stages × {replicas} replicas: both must be at least 1")]
    Empty {
        /// The stages asked for.
        stages: usize,
        /// The replicas asked for.
        replicas: usize,
    },
    /// The world group has another number of ranks than the mesh.
    #[error("a mesh of {stages} stages × {replicas} replicas needs {} ranks, the world group has {world}", stages * replicas)]
    Size {
        /// The stages.
        stages: usize,
        /// The replicas.
        replicas: usize,
        /// The world group's size.
        world: usize,
    },
    /// A group that [`ProcessGroup::new_group`] should have given this rank is missing.
    #[error("world rank {rank} got no {kind} group from `new_group`")]
    Missing {
        /// This world rank.
        rank: usize,
        /// `"pipeline"` or `"data-parallel"`.
        kind: &'static str,
    },
}

impl Mesh {
    /// `stages × replicas`.
    pub fn new(stages: usize, replicas: usize) -> Self {
        Mesh { stages, replicas }
    }

    /// The number of ranks, `stages * replicas` (saturating).
    pub fn size(&self) -> usize {
        self.stages.saturating_mul(self.replicas)
    }

    /// The world rank of `stage` of `replica`: `stage * replicas + replica`; `None` out
    /// of range.
    pub fn rank(&self, stage: usize, replica: usize) -> Option<usize> {
        (stage < self.stages && replica < self.replicas).then(|| stage * self.replicas + replica)
    }

    /// The stage and replica of world rank `rank`; `None` out of range.
    pub fn coords(&self, rank: usize) -> Option<(usize, usize)> {
        (self.replicas > 0 && rank < self.size())
            .then(|| (rank / self.replicas, rank % self.replicas))
    }

    /// The world ranks of `replica`'s pipeline, stage 0 first.
    pub fn pipeline_ranks(&self, replica: usize) -> Vec<usize> {
        (0..self.stages)
            .filter_map(|s| self.rank(s, replica))
            .collect()
    }

    /// The world ranks of `stage`'s replicas, replica 0 first.
    pub fn data_parallel_ranks(&self, stage: usize) -> Vec<usize> {
        (0..self.replicas)
            .filter_map(|d| self.rank(stage, d))
            .collect()
    }

    /// Checks the mesh against `world` (both sizes positive, `stages * replicas` ranks):
    /// this rank's stage and replica.
    pub fn check(&self, world: &dyn ProcessGroup) -> Result<(usize, usize)> {
        if self.stages == 0 || self.replicas == 0 {
            return Err(MeshError::Empty {
                stages: self.stages,
                replicas: self.replicas,
            }
            .into());
        }
        let size = world.size();
        match self.coords(world.rank()) {
            Some(coords) if size == self.size() => Ok(coords),
            _ => Err(MeshError::Size {
                stages: self.stages,
                replicas: self.replicas,
                world: size,
            }
            .into()),
        }
    }

    /// Creates the mesh's groups over `world` and returns this rank's. Every rank of
    /// `world` must call it (with the same mesh), in the same order relative to its other
    /// [`new_group`](ProcessGroup::new_group) calls.
    pub fn groups(&self, world: &dyn ProcessGroup) -> Result<MeshGroups> {
        let (stage, replica) = self.check(world)?;
        let rank = world.rank();
        let mut pipeline = None;
        for d in 0..self.replicas {
            let group = world
                .new_group(&self.pipeline_ranks(d))
                .map_err(crate::Error::from)?;
            if d == replica {
                pipeline = group;
            }
        }
        let mut data = None;
        for s in 0..self.stages {
            let group = world
                .new_group(&self.data_parallel_ranks(s))
                .map_err(crate::Error::from)?;
            if s == stage {
                data = group;
            }
        }
        let missing = |kind| PipelineError::Mesh(MeshError::Missing { rank, kind });
        Ok(MeshGroups {
            stage,
            replica,
            pipeline: Arc::from(pipeline.ok_or_else(|| missing("pipeline"))?),
            data: Arc::from(data.ok_or_else(|| missing("data-parallel"))?),
        })
    }
}

/// One rank's place in a [`Mesh`] and its two groups ([`Mesh::groups`]).
#[derive(Clone)]
pub struct MeshGroups {
    /// This rank's stage: its rank in `pipeline`.
    pub stage: usize,
    /// This rank's replica: its rank in `data`.
    pub replica: usize,
    /// The ranks of this replica's pipeline, stage `s` as rank `s`.
    pub pipeline: Arc<dyn ProcessGroup>,
    /// The replicas of this rank's stage, replica `d` as rank `d`.
    pub data: Arc<dyn ProcessGroup>,
}

impl std::fmt::Debug for MeshGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshGroups")
            .field("stage", &self.stage)
            .field("replica", &self.replica)
            .field("pipeline_size", &self.pipeline.size())
            .field("data_size", &self.data.size())
            .finish()
    }
}

/// The ranks of a mesh agree on a synchronised step's outcome: one world all-reduce of a
/// flag per rank (1 where the step failed). This rank's own error comes first; a step
/// that went through here but failed elsewhere is [`PipelineError::PeersFailed`].
pub(super) fn agree<R>(
    world: &dyn ProcessGroup,
    outcome: Result<R>,
    timeout: std::time::Duration,
) -> Result<R> {
    let mut flags = vec![0.0f32; world.size()];
    if outcome.is_err() {
        if let Some(flag) = flags.get_mut(world.rank()) {
            *flag = 1.0;
        }
    }
    let agreed = world
        .all_reduce(Buffer::F32(flags), ReduceOp::Sum)
        .wait_timeout(timeout);
    let value = outcome?;
    match agreed.map_err(crate::Error::from)? {
        Buffer::F32(flags) => {
            let ranks: Vec<usize> = flags
                .iter()
                .enumerate()
                .filter(|(_, &f)| f != 0.0)
                .map(|(r, _)| r)
                .collect();
            if ranks.is_empty() {
                Ok(value)
            } else {
                Err(PipelineError::PeersFailed { ranks })
            }
        }
        other => Err(crate::Error::Comm(collectives::Error::Mismatch(format!(
            "the step's agreement came back as {:?}, not f32",
            other.dtype()
        )))
        .into()),
    }
}
