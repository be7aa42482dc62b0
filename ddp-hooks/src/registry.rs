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
    /// `QUANTIZE_PER_TENSOR`): [`QuantizePerTensor`].
    QuantizePerTensor,
    /// 8-bit quantisation in rows of `bucket_size` elements, one scale each
    /// (`quantize_per_channel[:bucket_size=N]`, PyTorch's `QUANTIZE_PER_CHANNEL`; 512
    /// unless given): [`QuantizePerChannel`].
    QuantizePerChannel {
        /// Elements per row (at least 1).
        bucket_size: usize,
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
    fn from_str(spec: &str) -> Result<Self> {
        let err = |why: String| Error::Spec {
            spec: excerpt(spec, QUOTE_SPEC),
            why,
        };
        // A wrapper's `+` comes before the options: a `+` inside an option value
        // (`epsilon=1e+3`) is the value's.
        let spec_t = spec.trim();
        let name_end = spec_t.find(':').unwrap_or(spec_t.len());
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
            HookSpec::QuantizePerTensor | HookSpec::QuantizePerChannel { .. }
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
        Some((n, o)) => (n.trim(), Some(o)),
        None => (spec, None),
    };
    let simple = |h: HookSpec| match opts {
        Some(o) if !o.trim().is_empty() => Err(format!(
            "`{}` takes no options, got `{}`",
            excerpt(name, QUOTE_PART),
            excerpt(o, QUOTE_PART)
        )),
        _ => Ok(h),
    };
    let is = |n: &str| name.eq_ignore_ascii_case(n);
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
    } else if is("quantize_per_tensor") {
        simple(HookSpec::QuantizePerTensor)
    } else if is("quantize_per_channel") {
        per_channel_bucket_size(opts)
            .map(|bucket_size| HookSpec::QuantizePerChannel { bucket_size })
    } else {
        Err(format!(
            "unknown hook `{}`; known: {NAMES}",
            excerpt(name, QUOTE_PART)
        ))
    }
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

/// `quantize_per_channel`'s one option, `bucket_size=N` (N ≥ 1; 512 unless given).
fn per_channel_bucket_size(opts: Option<&str>) -> Result<usize, String> {
    let mut bucket_size = None;
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
        if k != "bucket_size" {
            return Err(format!(
                "unknown quantize_per_channel option `{}`; known: bucket_size",
                excerpt(k, QUOTE_PART)
            ));
        }
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
    Ok(bucket_size.unwrap_or(crate::quantize::DEFAULT_BUCKET_SIZE))
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
            HookSpec::QuantizePerTensor => Box::new(QuantizePerTensor::new(backend, group)),
            HookSpec::QuantizePerChannel { bucket_size } => {
                Box::new(QuantizePerChannel::new(backend, group, *bucket_size)?)
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
        assert_eq!(parse("quantize_per_tensor"), HookSpec::QuantizePerTensor);
        assert_eq!(parse(" QUANTIZE_PER_TENSOR "), HookSpec::QuantizePerTensor);
        assert_eq!(parse("quantize_per_tensor:"), HookSpec::QuantizePerTensor);
        let channel = |bucket_size| HookSpec::QuantizePerChannel { bucket_size };
        assert_eq!(parse("quantize_per_channel"), channel(512));
        assert_eq!(parse("QUANTIZE_PER_CHANNEL"), channel(512));
        assert_eq!(parse("quantize_per_channel:bucket_size=1"), channel(1));
        assert_eq!(
            parse("quantize_per_channel: bucket_size = 64 ,"),
            channel(64)
        );
        assert!(NAMES.contains("quantize_per_tensor") && NAMES.contains("quantize_per_channel"));
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
            HookSpec::QuantizePerChannel { bucket_size: 64 }
        );
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
            HookSpec::QuantizePerChannel { bucket_size: 0 }.build(be.clone(), group.clone()),
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
            ("quantize_per_tensor:bits=8", "takes no options"),
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
