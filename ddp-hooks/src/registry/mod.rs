//! Hooks by name, as PyTorch's `DDPCommHookType`: a spec string such as `allreduce`,
//! `fp16`, `bf16`, `noop`, `powersgd:rank=2,start_iter=10`, or PyTorch's own spellings
//! (`POWER_SGD_RANK2`, `powerSGD_hook:matrix_approximation_rank=2,start_powerSGD_iter=10`),
//! parsed into a [`HookSpec`] (whose docs list the names and options), which builds the
//! hook.

mod names;
mod options;
mod parse;
#[cfg(test)]
mod tests;

use crate::{
    AllReduce, BatchedPowerSgd, CommBackend, CommHook, Compress, Error, HalfWire, Noop, PowerSgd,
    PowerSgdConfig, QuantizePerChannel, QuantizePerTensor, Result,
};
use collectives::store::escape_for_log;
use collectives::ProcessGroup;
use half::{bf16, f16};
use parse::{parse_hook, parse_hook_with};
use std::str::FromStr;
use std::sync::Arc;

/// A hook type and its options, parsed from a spec string ([`FromStr`]).
///
/// # Names
///
/// Matched ignoring ASCII case. Each row is one hook; its names are ours (first, the one
/// [`CommHook::name`] gives), PyTorch's `DDPCommHookType` member, and PyTorch's hook
/// function:
///
/// | hook | ours | `DDPCommHookType` | function |
/// |---|---|---|---|
/// | [`AllReduce`] | `allreduce` | `ALLREDUCE` | `allreduce_hook` |
/// | [`Compress`] f16 | `fp16`, `fp16_compress` | `FP16_COMPRESS` | `fp16_compress_hook` |
/// | [`Compress`] bf16 | `bf16`, `bf16_compress` | `BF16_COMPRESS` | `bf16_compress_hook` |
/// | [`Noop`] | `noop` | `NOOP` | `noop_hook` |
/// | [`PowerSgd`] | `powersgd`, `power_sgd` | `POWER_SGD` (rank 1), `POWER_SGD_RANK2` | `powerSGD_hook` |
/// | [`BatchedPowerSgd`] | `batched_powersgd`, `batched_power_sgd` | `BATCHED_POWER_SGD` (rank 1), `BATCHED_POWER_SGD_RANK2` | `batched_powerSGD_hook` |
/// | [`QuantizePerTensor`] | `quantize_per_tensor` | `QUANTIZE_PER_TENSOR` | `quantization_pertensor_hook` |
/// | [`QuantizePerChannel`] | `quantize_per_channel` | `QUANTIZE_PER_CHANNEL` | `quantization_perchannel_hook` |
/// | [`PostLocalSgd`](crate::PostLocalSgd) | `post_local_sgd`, `post_localsgd` | (none) | `post_localSGD_hook` |
///
/// The PowerSGD members of `DDPCommHookType` are PyTorch's
/// `_powerSGD_comm_hook_wrapper(..., matrix_approximation_rank=k,
/// start_powerSGD_iter=1_000)` with every other `PowerSGDState` default: here the same
/// [`PowerSgdConfig`] as `powersgd:rank=k` (our defaults are PyTorch's). A `*_RANK2` name
/// fixes the rank (giving `rank` too is an error); every name takes the options of its
/// hook. The wrappers are `fp16+<hook>` / `bf16+<hook>`, or PyTorch's
/// `fp16_compress_wrapper+<hook>` / `bf16_compress_wrapper+<hook>`.
///
/// # Options
///
/// `name:key=value,...`, each option under our name or PyTorch's (keys ignore ASCII
/// case), at most once: one option under both names is an error naming both. Booleans
/// are `true`, `false`, `True`, `False`, `1` or `0`.
///
/// | PowerSGD: ours | PyTorch's `PowerSGDState` | takes | default |
/// |---|---|---|---|
/// | `rank` | `matrix_approximation_rank` | 1..=[`lowrank::MAX_RANK`] | 1 |
/// | `start_iter` | `start_powerSGD_iter` | integer (> 1 with error feedback or warm start) | 1000 |
/// | `min_compression_rate` | `min_compression_rate` | number > 0 | 2 |
/// | `error_feedback` | `use_error_feedback` | boolean | true |
/// | `warm_start` | `warm_start` | boolean | true |
/// | `epsilon` | `orthogonalization_epsilon` | number >= 0 | 0 |
/// | `seed` | `random_seed` | integer | 0 |
/// | `stats_every` | `compression_stats_logging_frequency` | integer >= 1 | 10000 |
/// | `batch_same_shape` | `batch_tensors_with_same_shape` | boolean or `auto` | false |
///
/// Every `PowerSGDState` option maps to our field; none is accepted and ignored. Two
/// mean what PyTorch's mean with other numbers: `random_seed` seeds this crate's
/// generator, so the random `Q` is reproducible across runs and backends here but is not
/// the `torch.randn` draw; `compression_stats_logging_frequency` spaces our `tracing`
/// log lines. `batch_tensors_with_same_shape` is PyTorch's `False` unless given:
/// `auto` asks for the backend's choice ([`PowerSgdConfig::batches_on`]: on for CUDA,
/// off on the CPU). As in PyTorch, the batched hook takes the same options and does not
/// use `min_compression_rate` and `batch_tensors_with_same_shape`.
///
/// Post-local SGD: `start_iter` (PyTorch's `start_localSGD_iter`, required),
/// `subgroup_size`, `allreduce` (`post_local_gradient_allreduce`). Quantisation:
/// `error_feedback` (beyond PyTorch), and per channel `bucket_size` (PyTorch's name, 512).
///
/// # Errors
///
/// [`Error::Spec`], whose `why` names the part at fault as typed: a bad value gives
/// the option, the value and what it takes (``powersgd option
/// `matrix_approximation_rank=zero`: expected an integer in 1..=64``); an unknown option
/// lists the hook's options, ours and PyTorch's, and the closest one; an unknown hook
/// name suggests the closest known one.
#[derive(Clone, Debug, PartialEq)]
pub enum HookSpec {
    /// The exact mean.
    AllReduce,
    /// Half-precision transfer.
    Fp16,
    /// bfloat16 transfer.
    Bf16,
    /// No communication.
    Noop,
    /// PowerSGD per layer.
    PowerSgd(PowerSgdConfig),
    /// PowerSGD on the whole bucket as one square matrix.
    BatchedPowerSgd(PowerSgdConfig),
    /// 8-bit quantisation with one scale per rank (`quantize_per_tensor`, PyTorch's
    /// `QUANTIZE_PER_TENSOR`; `quantize_per_tensor+ef` or
    /// `quantize_per_tensor:error_feedback=true` with error feedback): [`QuantizePerTensor`].
    QuantizePerTensor {
        /// Whether the quantisation error is carried to the next step (beyond PyTorch).
        error_feedback: bool,
    },
    /// 8-bit quantisation in rows of `bucket_size` elements, one scale each
    /// (`quantize_per_channel[:bucket_size=N]`, PyTorch's `QUANTIZE_PER_CHANNEL`; 512
    /// unless given; `quantize_per_channel+ef[:bucket_size=N]` or the option
    /// `error_feedback=true` with error feedback): [`QuantizePerChannel`].
    QuantizePerChannel {
        /// Elements per row (at least 1).
        bucket_size: usize,
        /// Whether the quantisation error is carried to the next step (beyond PyTorch).
        error_feedback: bool,
    },
    /// PyTorch's post-local SGD hook (`post_local_sgd:start_iter=N[,subgroup_size=K]
    /// [,allreduce=true|false]`): the exact mean until step `start_iter`, then the mean
    /// within consecutive blocks of `subgroup_size` ranks (default: the whole group), or
    /// nothing at all with `allreduce=false` (pure local SGD; pair it with a
    /// [`PeriodicModelAverager`](crate::averaging::PeriodicModelAverager) whose warm-up is
    /// `start_iter`). Building it creates the subgroups: every rank builds it at the same
    /// point.
    PostLocalSgd {
        /// PyTorch's `start_localSGD_iter`.
        start_iter: u64,
        /// Ranks per subgroup after the start (`None`: the whole group).
        subgroup_size: Option<usize>,
        /// PyTorch's `post_local_gradient_allreduce`.
        allreduce: bool,
    },
    /// Another hook whose transfers go as f16 (`fp16+powersgd:...`, PyTorch's
    /// `fp16_compress_wrapper`).
    Fp16Wrapped(Box<HookSpec>),
    /// Another hook whose transfers go as bf16 (`bf16+...`).
    Bf16Wrapped(Box<HookSpec>),
}

/// Characters of the spec an error quotes; the part at fault is quoted up to
/// [`QUOTE_PART`]. Errors stay small whatever the input.
const QUOTE_SPEC: usize = 100;
/// Characters of the part at fault (a name, an option) an error quotes.
const QUOTE_PART: usize = 32;

/// The first `max` characters of `s`, then `…` if there are more (cut on a char
/// boundary), with control characters and bidirectional overrides escaped
/// ([`escape_for_log`]): every part of a spec that an error quotes goes through here, so
/// that a spec cannot forge the line that reports it.
fn excerpt(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", escape_for_log(&s[..end])),
        None => escape_for_log(s).to_string(),
    }
}

impl FromStr for HookSpec {
    type Err = Error;

    /// Parses `name`, `name:key=value,key=value`, or `fp16+<spec>` / `bf16+<spec>`
    /// (PyTorch's `fp16_compress_wrapper+<spec>` / `bf16_compress_wrapper+<spec>`) for a
    /// hook whose transfers go in 16 bits (one wrapper: `fp16+fp16+powersgd` is an
    /// error). Names and options are ours or PyTorch's (see [`HookSpec`]);
    /// unset options keep PyTorch's defaults (as in `DDPCommHookType`, `start_iter`
    /// defaults to 1000, and `batch_same_shape` to false; `batch_same_shape=auto` leaves
    /// [`PowerSgdConfig::batch_tensors_with_same_shape`] unset, the backend's choice,
    /// resolved when the hook is built). Parsing takes time linear in the length of
    /// `spec`, and an error quotes at most its first 100 characters.
    ///
    /// The quantisation hooks take `error_feedback=true|false` (and `quantize_per_channel`
    /// `bucket_size=N`), or the suffix `+ef` on the name for `error_feedback=true`:
    /// `quantize_per_channel+ef:bucket_size=16` is
    /// `quantize_per_channel:bucket_size=16,error_feedback=true` (giving both is an
    /// error).
    fn from_str(spec: &str) -> Result<Self> {
        let err = |why: String| Error::Spec {
            spec: excerpt(spec, QUOTE_SPEC),
            why,
        };
        // A wrapper's `+` comes before the options: a `+` inside an option value
        // (`epsilon=1e+3`) is the value's.
        let spec_t = spec.trim();
        let name_end = spec_t.find(':').unwrap_or(spec_t.len());
        // The error-feedback suffix of a quantisation hook: `<name>+ef[:options]`.
        let head = spec_t[..name_end].trim_end();
        if let Some(cut) = head.len().checked_sub(3) {
            if head.is_char_boundary(cut)
                && head[cut..].eq_ignore_ascii_case("+ef")
                && !head[..cut].contains('+')
            {
                let opts = spec_t[name_end..].strip_prefix(':');
                return parse_hook_with(head[..cut].trim_end(), opts, true).map_err(err);
            }
        }
        let Some(plus) = spec_t[..name_end].find('+') else {
            return parse_hook(spec_t).map_err(err);
        };
        let (wrap, inner) = (&spec_t[..plus], &spec_t[plus + 1..]);
        let wrap = wrap.trim();
        let wrapped: fn(Box<HookSpec>) -> HookSpec = match names::wrapper(wrap) {
            Some(true) => HookSpec::Fp16Wrapped,
            Some(false) => HookSpec::Bf16Wrapped,
            None => {
                return Err(err(format!(
                    "unknown wrapper `{}`; known: fp16, bf16 (PyTorch's fp16_compress_wrapper, \
                     bf16_compress_wrapper)",
                    excerpt(wrap, QUOTE_PART)
                )))
            }
        };
        if inner[..inner.find(':').unwrap_or(inner.len())].contains('+') {
            return Err(err(
                "one wrapper at most: `fp16+<hook>` or `bf16+<hook>`, where <hook> has no `+`"
                    .into(),
            ));
        }
        let hook = parse_hook(inner.trim()).map_err(err)?;
        if matches!(
            hook,
            HookSpec::QuantizePerTensor { .. } | HookSpec::QuantizePerChannel { .. }
        ) {
            return Err(err(format!(
                "`{wrap}+` wraps a hook that computes in f32; `{}` already sends 8 bits \
                 (use it alone)",
                excerpt(inner.trim(), QUOTE_PART)
            )));
        }
        if matches!(hook, HookSpec::Fp16 | HookSpec::Bf16) {
            return Err(err(format!(
                "`{wrap}+` wraps a hook that computes in f32; `{}` already sends 16 bits \
                 (use it alone)",
                excerpt(inner.trim(), QUOTE_PART)
            )));
        }
        Ok(wrapped(Box::new(hook)))
    }
}

impl HookSpec {
    /// Builds the hook over `group`. The box is a whole hook: through [`CommHook`] alone
    /// it saves and loads its state ([`CommHook::save_state`], [`CommHook::load_state`];
    /// trivially for the stateless hooks), and reports its statistics and iteration
    /// (PowerSGD's; `None` for the others). A wrapped spec (`fp16+<hook>`) builds the
    /// inner hook over a [`HalfWire`] group, so these are the inner hook's own.
    pub fn build<B: CommBackend>(
        &self,
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<Box<dyn CommHook<B>>> {
        Ok(match self {
            HookSpec::AllReduce => Box::new(AllReduce::new(backend, group)),
            HookSpec::Fp16 => Box::new(Compress::<B, f16>::new(backend, group)),
            HookSpec::Bf16 => Box::new(Compress::<B, bf16>::new(backend, group)),
            HookSpec::Noop => Box::new(Noop::<B>::new()),
            HookSpec::PowerSgd(c) => Box::new(PowerSgd::new(backend, group, c.clone())?),
            HookSpec::BatchedPowerSgd(c) => {
                Box::new(BatchedPowerSgd::new(backend, group, c.clone())?)
            }
            HookSpec::QuantizePerTensor { error_feedback } => Box::new(
                QuantizePerTensor::with_error_feedback(backend, group, *error_feedback),
            ),
            HookSpec::QuantizePerChannel {
                bucket_size,
                error_feedback,
            } => Box::new(QuantizePerChannel::with_error_feedback(
                backend,
                group,
                *bucket_size,
                *error_feedback,
            )?),
            HookSpec::PostLocalSgd {
                start_iter,
                subgroup_size,
                allreduce,
            } => {
                let sub = match (allreduce, subgroup_size) {
                    (true, Some(k)) => crate::averaging::new_subgroups(&*group, *k)?,
                    _ => group.clone(),
                };
                Box::new(crate::averaging::PostLocalSgd::new(
                    backend,
                    group,
                    sub,
                    *start_iter,
                    *allreduce,
                )?)
            }
            HookSpec::Fp16Wrapped(inner) => {
                inner.build(backend, Arc::new(HalfWire::<f16>::new(group)))?
            }
            HookSpec::Bf16Wrapped(inner) => {
                inner.build(backend, Arc::new(HalfWire::<bf16>::new(group)))?
            }
        })
    }
}
