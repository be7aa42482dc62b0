//! One hook without wrapper (`name` or `name:key=value,...`) parsed into a [`HookSpec`]:
//! the name looked up among ours and PyTorch's, the options under either spelling.

use super::names::{self, Kind};
use super::options::{split, Given, Opt, BOOL};
use super::{excerpt, HookSpec, QUOTE_PART};
use crate::PowerSgdConfig;

/// PowerSGD's options, in the order of [`PowerSgdConfig`]'s fields: ours, and
/// `PowerSGDState`'s argument names.
const POWERSGD: &[Opt] = &[
    opt("rank", "matrix_approximation_rank"),
    opt("start_iter", "start_powerSGD_iter"),
    same("min_compression_rate"),
    opt("error_feedback", "use_error_feedback"),
    same("warm_start"),
    opt("epsilon", "orthogonalization_epsilon"),
    opt("seed", "random_seed"),
    opt("stats_every", "compression_stats_logging_frequency"),
    opt("batch_same_shape", "batch_tensors_with_same_shape"),
];

/// Post-local SGD's options: ours, and `PostLocalSGDState`'s argument names.
const POST_LOCAL_SGD: &[Opt] = &[
    opt("start_iter", "start_localSGD_iter"),
    same("subgroup_size"),
    opt("allreduce", "post_local_gradient_allreduce"),
];

/// `quantize_per_tensor`'s options (PyTorch's hook has none).
const PER_TENSOR: &[Opt] = &[same("error_feedback")];

/// `quantize_per_channel`'s options (`bucket_size` is PyTorch's name too).
const PER_CHANNEL: &[Opt] = &[same("bucket_size"), same("error_feedback")];

const fn opt(ours: &'static str, pytorch: &'static str) -> Opt {
    Opt {
        ours,
        pytorch: Some(pytorch),
    }
}

const fn same(ours: &'static str) -> Opt {
    Opt {
        ours,
        pytorch: None,
    }
}

/// Parses a hook without wrapper (`name` or `name:key=value,...`); the error says why.
pub(super) fn parse_hook(spec: &str) -> Result<HookSpec, String> {
    match spec.split_once(':') {
        Some((n, o)) => parse_hook_with(n.trim(), Some(o), false),
        None => parse_hook_with(spec, None, false),
    }
}

/// Parses hook `name` with `opts` (the text after `:`, if any), `ef`: the name had the
/// error-feedback suffix `+ef` (quantisation hooks only).
pub(super) fn parse_hook_with(
    name: &str,
    opts: Option<&str>,
    ef: bool,
) -> Result<HookSpec, String> {
    let Some(kind) = names::lookup(name) else {
        let mut why = format!("unknown hook `{}`", excerpt(name, QUOTE_PART));
        if let Some(near) = names::closest_hook(name) {
            why += &format!("; did you mean `{near}`?");
        }
        return Err(why + "; known: " + names::KNOWN);
    };
    if ef && !kind.is_quantize() {
        return Err(format!(
            "`+ef` (error feedback) follows a quantisation hook (quantize_per_tensor, \
             quantize_per_channel), not `{}`",
            excerpt(name, QUOTE_PART)
        ));
    }
    let simple = |h: HookSpec| match opts {
        Some(o) if !o.trim().is_empty() => Err(format!(
            "`{}` takes no options, got `{}`",
            excerpt(name, QUOTE_PART),
            excerpt(o, QUOTE_PART)
        )),
        _ => Ok(h),
    };
    match kind {
        Kind::AllReduce => simple(HookSpec::AllReduce),
        Kind::Fp16 => simple(HookSpec::Fp16),
        Kind::Bf16 => simple(HookSpec::Bf16),
        Kind::Noop => simple(HookSpec::Noop),
        Kind::PowerSgd(rank) => powersgd_config(name, rank, opts).map(HookSpec::PowerSgd),
        Kind::BatchedPowerSgd(rank) => {
            powersgd_config(name, rank, opts).map(HookSpec::BatchedPowerSgd)
        }
        Kind::PostLocalSgd => post_local_sgd_options(name, opts),
        Kind::QuantizePerTensor => quantize_options(name, PER_TENSOR, opts, ef)
            .map(|(_, error_feedback)| HookSpec::QuantizePerTensor { error_feedback }),
        Kind::QuantizePerChannel => {
            quantize_options(name, PER_CHANNEL, opts, ef).map(|(bucket_size, error_feedback)| {
                HookSpec::QuantizePerChannel {
                    bucket_size: bucket_size.unwrap_or(crate::quantize::DEFAULT_BUCKET_SIZE),
                    error_feedback,
                }
            })
        }
    }
}

/// PowerSGD's options over PyTorch's defaults (`fixed_rank`: the rank a
/// `*_RANK2` name fixes), each checked as it is read.
fn powersgd_config(
    hook: &str,
    fixed_rank: Option<usize>,
    opts: Option<&str>,
) -> Result<PowerSgdConfig, String> {
    let mut c = PowerSgdConfig::default();
    if let Some(r) = fixed_rank {
        c.matrix_approximation_rank = r;
    }
    let rank_range = format!("an integer in 1..={}", lowrank::MAX_RANK);
    let mut start_key = None;
    for g in split(hook, opts, POWERSGD)? {
        let h = hook;
        match g.index {
            0 => {
                if let Some(r) = fixed_rank {
                    return Err(format!(
                        "`{}` is PowerSGD at matrix_approximation_rank={r}; for another rank \
                         write `powersgd:rank=N` or `batched_powersgd:rank=N`, not `{}`",
                        excerpt(hook, QUOTE_PART),
                        excerpt(g.key, QUOTE_PART)
                    ));
                }
                c.matrix_approximation_rank = g.parse(h, &rank_range, |&r: &usize| {
                    (1..=lowrank::MAX_RANK).contains(&r)
                })?
            }
            1 => {
                c.start_powersgd_iter = g.parse(h, "a non-negative integer", |_: &u64| true)?;
                start_key = Some(g);
            }
            2 => {
                c.min_compression_rate = g.parse(h, "a finite number > 0", |x: &f64| {
                    x.is_finite() && *x > 0.0
                })?
            }
            3 => c.use_error_feedback = g.bool(h)?,
            4 => c.warm_start = g.bool(h)?,
            5 => {
                c.orthogonalization_epsilon = g.parse(h, "a finite number >= 0", |x: &f32| {
                    x.is_finite() && *x >= 0.0
                })?
            }
            6 => c.random_seed = g.parse(h, "a non-negative integer", |_: &u64| true)?,
            7 => {
                c.compression_stats_logging_frequency =
                    g.parse(h, "a positive integer", |&n: &u64| n >= 1)?
            }
            _ => c.batch_tensors_with_same_shape = batch(h, &g)?,
        }
    }
    if let Some(g) = start_key {
        if (c.use_error_feedback || c.warm_start) && c.start_powersgd_iter <= 1 {
            return Err(g.bad(
                hook,
                "an integer > 1 while error feedback or warm start is on (PyTorch: Expect \
                 `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, \
                 because PowerSGD can only be applied after the first two iterations in DDP)",
            ));
        }
    }
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

/// `batch_same_shape`: a boolean, or `auto` for the backend's choice (`None`).
fn batch(hook: &str, g: &Given<'_>) -> Result<Option<bool>, String> {
    if g.value.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    g.bool(hook)
        .map(Some)
        .map_err(|_| g.bad(hook, &format!("{BOOL}, or auto (the backend's choice)")))
}

/// Post-local SGD's options: `start_iter` (required), `subgroup_size`, `allreduce`.
fn post_local_sgd_options(hook: &str, opts: Option<&str>) -> Result<HookSpec, String> {
    let (mut start, mut size, mut allreduce) = (None, None, true);
    for g in split(hook, opts, POST_LOCAL_SGD)? {
        match g.index {
            0 => start = Some(g.parse(hook, "a non-negative integer", |_: &u64| true)?),
            1 => size = Some(g.parse(hook, "a positive integer", |&n: &usize| n > 0)?),
            _ => allreduce = g.bool(hook)?,
        }
    }
    let start_iter = start.ok_or_else(|| {
        format!(
            "{} needs start_iter (PyTorch's start_localSGD_iter: the step local SGD starts \
             at), e.g. post_local_sgd:start_iter=10",
            excerpt(hook, QUOTE_PART)
        )
    })?;
    Ok(HookSpec::PostLocalSgd {
        start_iter,
        subgroup_size: size,
        allreduce,
    })
}

/// The options of a quantisation hook (`table`: [`PER_TENSOR`] or [`PER_CHANNEL`]):
/// `error_feedback` (`ef`: the name's `+ef` suffix set it already) and, per channel,
/// `bucket_size` (at least 1): `(bucket_size, error_feedback)`.
fn quantize_options(
    hook: &str,
    table: &[Opt],
    opts: Option<&str>,
    ef: bool,
) -> Result<(Option<usize>, bool), String> {
    let (mut bucket_size, mut error_feedback) = (None, ef);
    for g in split(hook, opts, table)? {
        match table[g.index].ours {
            "bucket_size" => {
                bucket_size = Some(g.parse(hook, "a positive integer", |&n: &usize| n > 0)?)
            }
            _ => {
                if ef {
                    return Err(
                        "`error_feedback` is given with the `+ef` suffix (give one of them)".into(),
                    );
                }
                error_feedback = g.bool(hook)?;
            }
        }
    }
    Ok((bucket_size, error_feedback))
}
