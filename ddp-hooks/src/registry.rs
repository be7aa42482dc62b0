//! Hooks by name, as PyTorch's `DDPCommHookType`: a spec string such as `allreduce`,
//! `fp16`, `bf16`, `noop` or `powersgd:rank=2,start_iter=10` parsed into a
//! [`HookSpec`], which builds the hook.

use crate::{
    AllReduce, BatchedPowerSgd, CommBackend, CommHook, Compress, Error, HalfWire, Noop, PowerSgd,
    PowerSgdConfig, QuantizePerChannel, QuantizePerTensor, Result,
};
use collectives::store::escape_for_log;
use collectives::ProcessGroup;
use half::{bf16, f16};
use std::str::FromStr;
use std::sync::Arc;

/// A hook type and its options.
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

const NAMES: &str =
    "allreduce, fp16, bf16, noop, powersgd, batched_powersgd, quantize_per_tensor, quantize_per_channel";
/// PowerSGD's options, in the order of [`PowerSgdConfig`]'s fields.
const POWERSGD_KEYS: [&str; 9] = [
    "rank",
    "start_iter",
    "min_compression_rate",
    "error_feedback",
    "warm_start",
    "epsilon",
    "seed",
    "stats_every",
    "batch_same_shape",
];
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

    /// Parses `name`, `name:key=value,key=value`, or `fp16+<spec>` / `bf16+<spec>` for a
    /// hook whose transfers go in 16 bits (one wrapper: `fp16+fp16+powersgd` is an
    /// error). PowerSGD keys: `rank`, `start_iter`, `min_compression_rate`,
    /// `error_feedback`, `warm_start`, `epsilon`, `seed`, `stats_every`,
    /// `batch_same_shape`, each at most once; unset keys keep PyTorch's defaults (as in
    /// `DDPCommHookType`, `start_iter` defaults to 1000), except `batch_same_shape`,
    /// which unset is the backend's default, resolved when the hook is built (on for
    /// CUDA, off on the CPU: [`PowerSgdConfig::batch_tensors_with_same_shape`]). Parsing
    /// takes time linear in the length of `spec`, and an error quotes at most its first
    /// 100 characters.
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
                return parse_hook_with(head[..cut].trim_end(), &spec_t[name_end..], true)
                    .map_err(err);
            }
        }
        let Some(plus) = spec_t[..name_end].find('+') else {
            return parse_hook(spec_t).map_err(err);
        };
        let (wrap, inner) = (&spec_t[..plus], &spec_t[plus + 1..]);
        let wrap = wrap.trim();
        let wrapped: fn(Box<HookSpec>) -> HookSpec = if wrap.eq_ignore_ascii_case("fp16") {
            HookSpec::Fp16Wrapped
        } else if wrap.eq_ignore_ascii_case("bf16") {
            HookSpec::Bf16Wrapped
        } else {
            return Err(err(format!(
                "unknown wrapper `{}`; known: fp16, bf16",
                excerpt(wrap, QUOTE_PART)
            )));
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

/// Parses a hook without wrapper (`name` or `name:key=value,...`); the error says why.
fn parse_hook(spec: &str) -> Result<HookSpec, String> {
    let (name, opts) = match spec.split_once(':') {
        Some((n, o)) => (n.trim(), ":".to_owned() + o),
        None => (spec, String::new()),
    };
    parse_hook_with(name, &opts, false)
}

/// Parses hook `name` with `opts` (empty, or `:key=value,...`), `ef`: the name had the
/// error-feedback suffix `+ef` (quantisation hooks only).
fn parse_hook_with(name: &str, opts: &str, ef: bool) -> Result<HookSpec, String> {
    let opts = opts.strip_prefix(':');
    let is = |n: &str| name.eq_ignore_ascii_case(n);
    if ef && !is("quantize_per_tensor") && !is("quantize_per_channel") {
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
    if is("allreduce") {
        simple(HookSpec::AllReduce)
    } else if is("fp16") || is("fp16_compress") {
        simple(HookSpec::Fp16)
    } else if is("bf16") || is("bf16_compress") {
        simple(HookSpec::Bf16)
    } else if is("noop") {
        simple(HookSpec::Noop)
    } else if is("powersgd") || is("power_sgd") {
        powersgd_config(opts).map(HookSpec::PowerSgd)
    } else if is("batched_powersgd") || is("batched_power_sgd") {
        powersgd_config(opts).map(HookSpec::BatchedPowerSgd)
    } else if is("post_local_sgd") || is("post_localsgd") {
        post_local_sgd_options(opts)
    } else if is("quantize_per_tensor") {
        quantize_options("quantize_per_tensor", opts, ef)
            .map(|(_, error_feedback)| HookSpec::QuantizePerTensor { error_feedback })
    } else if is("quantize_per_channel") {
        quantize_options("quantize_per_channel", opts, ef).map(|(bucket_size, error_feedback)| {
            HookSpec::QuantizePerChannel {
                bucket_size: bucket_size.unwrap_or(crate::quantize::DEFAULT_BUCKET_SIZE),
                error_feedback,
            }
        })
    } else {
        Err(format!(
            "unknown hook `{}`; known: {NAMES}",
            excerpt(name, QUOTE_PART)
        ))
    }
}

/// Post-local SGD's options: `start_iter` (required), `subgroup_size`, `allreduce`.
fn post_local_sgd_options(opts: Option<&str>) -> Result<HookSpec, String> {
    let (mut start, mut size, mut allreduce) = (None, None, None);
    for kv in opts
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(format!("`{}` is not key=value", excerpt(kv, QUOTE_PART)));
        };
        let (k, v) = (k.trim(), v.trim());
        let twice = || format!("post_local_sgd option `{k}` given twice");
        let bad = |what: &str| {
            format!(
                "post_local_sgd option `{k}`: expected {what}, got `{}`",
                excerpt(v, QUOTE_PART)
            )
        };
        match k {
            "start_iter" | "start_localSGD_iter" => {
                let n: u64 = v.parse().map_err(|_| bad("a non-negative integer"))?;
                if start.replace(n).is_some() {
                    return Err(twice());
                }
            }
            "subgroup_size" => {
                let n: usize = v
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| bad("a positive integer"))?;
                if size.replace(n).is_some() {
                    return Err(twice());
                }
            }
            "allreduce" | "post_local_gradient_allreduce" => {
                let b: bool = v.parse().map_err(|_| bad("true or false"))?;
                if allreduce.replace(b).is_some() {
                    return Err(twice());
                }
            }
            _ => {
                return Err(format!(
                "unknown post_local_sgd option `{}`; known: start_iter, subgroup_size, allreduce",
                excerpt(k, QUOTE_PART)
            ))
            }
        }
    }
    let start_iter = start.ok_or_else(|| {
        "post_local_sgd needs start_iter (the step local SGD starts at), e.g. \
         post_local_sgd:start_iter=10"
            .to_string()
    })?;
    Ok(HookSpec::PostLocalSgd {
        start_iter,
        subgroup_size: size,
        allreduce: allreduce.unwrap_or(true),
    })
}

/// PowerSGD's options (`key=value,...`) over the defaults, validated.
fn powersgd_config(opts: Option<&str>) -> Result<PowerSgdConfig, String> {
    let mut c = PowerSgdConfig::default();
    let mut seen = [false; POWERSGD_KEYS.len()];
    for kv in opts
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(format!("`{}` is not key=value", excerpt(kv, QUOTE_PART)));
        };
        let (k, v) = (k.trim(), v.trim());
        let unknown = || {
            format!(
                "unknown PowerSGD option `{}`; known: {}",
                excerpt(k, QUOTE_PART),
                POWERSGD_KEYS.join(", ")
            )
        };
        let key = POWERSGD_KEYS
            .iter()
            .position(|&known| known == k)
            .ok_or_else(unknown)?;
        if std::mem::replace(&mut seen[key], true) {
            return Err(format!("option `{k}` is given twice"));
        }
        let bad = |what: &str| format!("`{k}={}`: expected {what}", excerpt(v, QUOTE_PART));
        match k {
            "rank" => c.matrix_approximation_rank = v.parse().map_err(|_| bad("an integer"))?,
            "start_iter" => c.start_powersgd_iter = v.parse().map_err(|_| bad("an integer"))?,
            "min_compression_rate" => {
                c.min_compression_rate = v.parse().map_err(|_| bad("a number"))?
            }
            "error_feedback" => {
                c.use_error_feedback = v.parse().map_err(|_| bad("true or false"))?
            }
            "warm_start" => c.warm_start = v.parse().map_err(|_| bad("true or false"))?,
            "epsilon" => c.orthogonalization_epsilon = v.parse().map_err(|_| bad("a number"))?,
            "seed" => c.random_seed = v.parse().map_err(|_| bad("an integer"))?,
            "stats_every" => {
                c.compression_stats_logging_frequency = v.parse().map_err(|_| bad("an integer"))?
            }
            "batch_same_shape" => {
                c.batch_tensors_with_same_shape = Some(v.parse().map_err(|_| bad("true or false"))?)
            }
            _ => return Err(unknown()),
        }
    }
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

/// The options of the quantisation hook `hook`: `error_feedback=true|false` (`ef`: the
/// name's `+ef` suffix set it already) and, for `quantize_per_channel`, `bucket_size=N`
/// (N ≥ 1), each at most once: `(bucket_size, error_feedback)`.
fn quantize_options(
    hook: &str,
    opts: Option<&str>,
    ef: bool,
) -> Result<(Option<usize>, bool), String> {
    let per_channel = hook == "quantize_per_channel";
    let known = if per_channel {
        "bucket_size, error_feedback"
    } else {
        "error_feedback"
    };
    let (mut bucket_size, mut error_feedback) = (None, None);
    for kv in opts
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(format!("`{}` is not key=value", excerpt(kv, QUOTE_PART)));
        };
        let (k, v) = (k.trim(), v.trim());
        match k {
            "bucket_size" if per_channel => {
                let n: usize = v.parse().map_err(|_| {
                    format!(
                        "`{k}={}`: expected a positive integer",
                        excerpt(v, QUOTE_PART)
                    )
                })?;
                if n == 0 {
                    return Err("bucket_size = 0: a row holds at least 1 element".into());
                }
                if bucket_size.replace(n).is_some() {
                    return Err(format!("option `{k}` is given twice"));
                }
            }
            "error_feedback" => {
                if ef {
                    return Err(
                        "`error_feedback` is given with the `+ef` suffix (give one of them)".into(),
                    );
                }
                let b: bool = v.parse().map_err(|_| {
                    format!("`{k}={}`: expected true or false", excerpt(v, QUOTE_PART))
                })?;
                if error_feedback.replace(b).is_some() {
                    return Err(format!("option `{k}` is given twice"));
                }
            }
            _ => {
                return Err(format!(
                    "unknown {hook} option `{}`; known: {known}",
                    excerpt(k, QUOTE_PART)
                ))
            }
        }
    }
    Ok((bucket_size, ef || error_feedback.unwrap_or(false)))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_post_local_sgd() {
        assert_eq!(
            "post_local_sgd:start_iter=10".parse::<HookSpec>().unwrap(),
            HookSpec::PostLocalSgd {
                start_iter: 10,
                subgroup_size: None,
                allreduce: true
            }
        );
        assert_eq!(
            "post_local_sgd:start_iter=0,subgroup_size=2,allreduce=false"
                .parse::<HookSpec>()
                .unwrap(),
            HookSpec::PostLocalSgd {
                start_iter: 0,
                subgroup_size: Some(2),
                allreduce: false
            }
        );
        for (bad, says) in [
            ("post_local_sgd", "needs start_iter"),
            ("post_local_sgd:start_iter=x", "non-negative integer"),
            (
                "post_local_sgd:start_iter=1,subgroup_size=0",
                "positive integer",
            ),
            (
                "post_local_sgd:start_iter=1,allreduce=maybe",
                "true or false",
            ),
            ("post_local_sgd:start_iter=1,start_iter=2", "given twice"),
            (
                "post_local_sgd:start_iter=1,period=4",
                "unknown post_local_sgd option",
            ),
        ] {
            let e = bad.parse::<HookSpec>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn parses_names_and_options() {
        assert_eq!(
            "allreduce".parse::<HookSpec>().unwrap(),
            HookSpec::AllReduce
        );
        assert_eq!(" FP16 ".parse::<HookSpec>().unwrap(), HookSpec::Fp16);
        assert_eq!("bf16".parse::<HookSpec>().unwrap(), HookSpec::Bf16);
        assert_eq!("noop".parse::<HookSpec>().unwrap(), HookSpec::Noop);
        let HookSpec::PowerSgd(c) = "powersgd:rank=2,start_iter=10,warm_start=false"
            .parse()
            .unwrap()
        else {
            panic!("not PowerSGD")
        };
        assert_eq!(
            (
                c.matrix_approximation_rank,
                c.start_powersgd_iter,
                c.warm_start
            ),
            (2, 10, false)
        );
        assert_eq!(
            "powersgd".parse::<HookSpec>().unwrap(),
            HookSpec::PowerSgd(PowerSgdConfig::default())
        );
    }

    /// The quantisation hooks, under their names and PyTorch's, with `bucket_size`.
    #[test]
    fn parses_quantize_hooks() {
        let parse = |s: &str| s.parse::<HookSpec>().unwrap();
        let tensor = |error_feedback| HookSpec::QuantizePerTensor { error_feedback };
        assert_eq!(parse("quantize_per_tensor"), tensor(false));
        assert_eq!(parse(" QUANTIZE_PER_TENSOR "), tensor(false));
        assert_eq!(parse("quantize_per_tensor:"), tensor(false));
        let channel = |bucket_size| HookSpec::QuantizePerChannel {
            bucket_size,
            error_feedback: false,
        };
        assert_eq!(parse("quantize_per_channel"), channel(512));
        assert_eq!(parse("QUANTIZE_PER_CHANNEL"), channel(512));
        assert_eq!(parse("quantize_per_channel:bucket_size=1"), channel(1));
        assert_eq!(
            parse("quantize_per_channel: bucket_size = 64 ,"),
            channel(64)
        );
        assert!(NAMES.contains("quantize_per_tensor") && NAMES.contains("quantize_per_channel"));
    }

    /// Error feedback: the `+ef` suffix and the `error_feedback` option are the same spec.
    #[test]
    fn parses_quantize_error_feedback() {
        let parse = |s: &str| s.parse::<HookSpec>().unwrap();
        let tensor = |error_feedback| HookSpec::QuantizePerTensor { error_feedback };
        let channel = |bucket_size, error_feedback| HookSpec::QuantizePerChannel {
            bucket_size,
            error_feedback,
        };
        assert_eq!(parse("quantize_per_tensor+ef"), tensor(true));
        assert_eq!(parse(" Quantize_Per_Tensor +EF "), tensor(true));
        assert_eq!(
            parse("quantize_per_tensor:error_feedback=true"),
            tensor(true)
        );
        assert_eq!(
            parse("quantize_per_tensor:error_feedback=false"),
            tensor(false)
        );
        assert_eq!(parse("quantize_per_channel+ef"), channel(512, true));
        assert_eq!(
            parse("quantize_per_channel+ef:bucket_size=16"),
            channel(16, true)
        );
        assert_eq!(
            parse("quantize_per_channel:bucket_size=16,error_feedback=true"),
            channel(16, true)
        );
        assert_eq!(
            parse("quantize_per_channel:error_feedback=false,bucket_size=3"),
            channel(3, false)
        );
    }

    /// The built hooks are named as the registry spells them, and save and load their
    /// (stateless) state only into their own kind and configuration.
    #[test]
    fn builds_quantize_hooks() {
        let groups =
            collectives::ThreadGroup::create(1, std::time::Duration::from_secs(10)).unwrap();
        let group: Arc<dyn ProcessGroup> = Arc::new(groups.into_iter().next().unwrap());
        let be = Arc::new(lowrank::CpuBackend::new());
        let build = |s: &str| {
            s.parse::<HookSpec>()
                .unwrap()
                .build(be.clone(), group.clone())
                .unwrap()
        };
        let t = build("quantize_per_tensor");
        assert_eq!(t.name(), "quantize_per_tensor");
        let c = build("quantize_per_channel");
        assert_eq!(c.name(), "quantize_per_channel");
        let c64 = build("quantize_per_channel:bucket_size=64");
        assert_eq!(c64.name(), "quantize_per_channel:bucket_size=64");
        assert_eq!(
            c64.name().parse::<HookSpec>().unwrap(),
            HookSpec::QuantizePerChannel {
                bucket_size: 64,
                error_feedback: false
            }
        );
        // With error feedback: named with `+ef`, which parses back to the same spec.
        for (spec, name) in [
            (
                "quantize_per_tensor:error_feedback=true",
                "quantize_per_tensor+ef",
            ),
            ("quantize_per_channel+ef", "quantize_per_channel+ef"),
            (
                "quantize_per_channel:bucket_size=64,error_feedback=true",
                "quantize_per_channel+ef:bucket_size=64",
            ),
        ] {
            let h = build(spec);
            assert_eq!(h.name(), name);
            assert_eq!(name.parse::<HookSpec>().unwrap(), spec.parse().unwrap());
            h.load_state(h.save_state().unwrap()).unwrap();
            assert!(matches!(
                h.load_state(c.save_state().unwrap()),
                Err(Error::State(_))
            ));
            assert!(matches!(
                c.load_state(h.save_state().unwrap()),
                Err(Error::State(_))
            ));
        }
        c.load_state(c.save_state().unwrap()).unwrap();
        assert!(matches!(
            c64.load_state(c.save_state().unwrap()),
            Err(Error::State(_))
        ));
        assert!(matches!(
            t.load_state(c.save_state().unwrap()),
            Err(Error::State(_))
        ));
        assert_eq!(t.compression_stats().unwrap().before, 0);
        assert!(matches!(
            HookSpec::QuantizePerChannel {
                bucket_size: 0,
                error_feedback: true
            }
            .build(be.clone(), group.clone()),
            Err(Error::Config(_))
        ));
    }

    /// `batch_same_shape` absent leaves the flag unset (the backend's default, resolved
    /// when the hook is built); given, it forces it, in both PowerSGD hooks and under a
    /// wrapper.
    #[test]
    fn batch_same_shape_is_unset_unless_given() {
        let batch = |spec: &str| match spec.parse::<HookSpec>().unwrap() {
            HookSpec::PowerSgd(c) | HookSpec::BatchedPowerSgd(c) => c.batch_tensors_with_same_shape,
            HookSpec::Fp16Wrapped(inner) | HookSpec::Bf16Wrapped(inner) => match *inner {
                HookSpec::PowerSgd(c) => c.batch_tensors_with_same_shape,
                other => panic!("{spec}: not PowerSGD inside: {other:?}"),
            },
            other => panic!("{spec}: not PowerSGD: {other:?}"),
        };
        assert_eq!(batch("powersgd:rank=2"), None);
        assert_eq!(batch("powersgd"), None);
        assert_eq!(batch("batched_powersgd:rank=2"), None);
        assert_eq!(batch("fp16+powersgd:rank=2"), None);
        assert_eq!(batch("powersgd:rank=2,batch_same_shape=true"), Some(true));
        assert_eq!(batch("powersgd:batch_same_shape=false,rank=2"), Some(false));
        assert_eq!(batch("bf16+powersgd:batch_same_shape=true"), Some(true));
    }

    /// A `+` inside an option value belongs to the value; a wrapper's `+` comes before
    /// the options, and a 16-bit hook is not wrapped again.
    #[test]
    fn plus_signs_in_values_and_wrapped_16_bit_hooks() {
        let HookSpec::PowerSgd(c) = "powersgd:epsilon=1e+3,seed=+7".parse().unwrap() else {
            panic!("not PowerSGD")
        };
        assert_eq!((c.orthogonalization_epsilon, c.random_seed), (1e3, 7));
        let HookSpec::Fp16Wrapped(inner) = "fp16+powersgd:epsilon=1e+3".parse().unwrap() else {
            panic!("not wrapped")
        };
        assert!(matches!(*inner, HookSpec::PowerSgd(_)));
        for spec in ["fp16+bf16", "bf16+fp16", "fp16+fp16", "bf16+bf16_compress"] {
            let e = spec.parse::<HookSpec>().unwrap_err().to_string();
            assert!(e.contains("already sends 16 bits"), "{spec}: {e}");
        }
        let e = "fp16+bf16+powersgd"
            .parse::<HookSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("one wrapper at most"), "{e}");
    }

    #[test]
    fn errors_say_what_is_wrong() {
        for (spec, says) in [
            ("allreduse", "unknown hook `allreduse`"),
            ("fp16:rank=2", "takes no options"),
            ("powersgd:rank", "not key=value"),
            ("powersgd:rank=two", "expected an integer"),
            ("powersgd:ranks=2", "unknown PowerSGD option `ranks`"),
            ("powersgd:rank=0", "matrix_approximation_rank = 0"),
            ("powersgd:start_iter=1", "start_powerSGD_iter"),
            ("powersgd:batch_same_shape=1", "true or false"),
            ("powersgd:batch_same_shape=", "true or false"),
            ("fp8+allreduce", "unknown wrapper `fp8`"),
            (
                "quantize_per_tensor:bits=8",
                "unknown quantize_per_tensor option `bits`; known: error_feedback",
            ),
            (
                "quantize_per_tensor:bucket_size=8",
                "unknown quantize_per_tensor option `bucket_size`",
            ),
            (
                "quantize_per_tensor:error_feedback=yes",
                "expected true or false",
            ),
            (
                "quantize_per_channel+ef:error_feedback=true",
                "given with the `+ef` suffix",
            ),
            (
                "quantize_per_channel:error_feedback=true,error_feedback=false",
                "`error_feedback` is given twice",
            ),
            (
                "powersgd+ef",
                "`+ef` (error feedback) follows a quantisation hook",
            ),
            ("fp16+quantize_per_tensor+ef", "one wrapper at most"),
            ("quantize_per_channel:bucket_size", "not key=value"),
            ("quantize_per_channel:bucket_size=0", "bucket_size = 0"),
            (
                "quantize_per_channel:bucket_size=-1",
                "expected a positive integer",
            ),
            (
                "quantize_per_channel:bucket_size=big",
                "expected a positive integer",
            ),
            (
                "quantize_per_channel:rows=4",
                "unknown quantize_per_channel option `rows`",
            ),
            (
                "quantize_per_channel:bucket_size=4,bucket_size=8",
                "`bucket_size` is given twice",
            ),
            ("fp16+quantize_per_tensor", "already sends 8 bits"),
            (
                "bf16+quantize_per_channel:bucket_size=4",
                "already sends 8 bits",
            ),
            ("quantize", "unknown hook `quantize`"),
        ] {
            let e = spec.parse::<HookSpec>().unwrap_err().to_string();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }

    /// Regression: the parts of a spec an error quotes were shown raw, so a spec with
    /// ESC, CR, NUL or U+202E could forge the log line that reports it.
    #[test]
    fn errors_quote_the_spec_escaped() {
        let forge = "\x1b[31m\r\0\u{202e}";
        for spec in [
            forge.to_string(),
            format!("fp16+{forge}"),
            format!("{forge}+allreduce"),
            format!("powersgd:{forge}=1"),
            format!("powersgd:rank={forge}"),
            format!("allreduce:{forge}"),
        ] {
            let e = spec.parse::<HookSpec>().unwrap_err().to_string();
            assert!(
                !e.chars().any(|c| c.is_control() || c == '\u{202e}'),
                "{spec:?}: {e:?}"
            );
            assert!(e.contains(r"\u{1b}[31m\r\0\u{202e}"), "{spec:?}: {e:?}");
        }
    }
}
