//! Hooks by name, as PyTorch's `DDPCommHookType`: a spec string such as `allreduce`,
//! `fp16`, `bf16`, `noop` or `powersgd:rank=2,start_iter=10` parsed into a
//! [`HookSpec`], which builds the hook.

use crate::{
    AllReduce, BatchedPowerSgd, CommBackend, CommHook, Compress, Error, HalfWire, Noop, PowerSgd,
    PowerSgdConfig, Result,
};
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
    /// Another hook whose transfers go as f16 (`fp16+powersgd:...`, PyTorch's
    /// `fp16_compress_wrapper`).
    Fp16Wrapped(Box<HookSpec>),
    /// Another hook whose transfers go as bf16 (`bf16+...`).
    Bf16Wrapped(Box<HookSpec>),
}

const NAMES: &str = "allreduce, fp16, bf16, noop, powersgd, batched_powersgd";
const POWERSGD_KEYS: &str = "rank, start_iter, min_compression_rate, error_feedback, warm_start, epsilon, seed, stats_every, batch_same_shape";

impl FromStr for HookSpec {
    type Err = Error;

    /// Parses `name`, `name:key=value,key=value`, or `fp16+<spec>` / `bf16+<spec>` for a
    /// hook whose transfers go in 16 bits. PowerSGD keys: `rank`,
    /// `start_iter`, `min_compression_rate`, `error_feedback`, `warm_start`, `epsilon`,
    /// `seed`, `stats_every`, `batch_same_shape`; unset keys keep PyTorch's defaults (as
    /// in `DDPCommHookType`, `start_iter` defaults to 1000).
    fn from_str(spec: &str) -> Result<Self> {
        let err = |why: String| Error::Spec {
            spec: spec.to_string(),
            why,
        };
        if let Some((wrap, inner)) = spec.trim().split_once('+') {
            let inner = Box::new(inner.parse::<HookSpec>().map_err(|e| err(e.to_string()))?);
            return match wrap.trim().to_ascii_lowercase().as_str() {
                "fp16" => Ok(HookSpec::Fp16Wrapped(inner)),
                "bf16" => Ok(HookSpec::Bf16Wrapped(inner)),
                other => Err(err(format!("unknown wrapper `{other}`; known: fp16, bf16"))),
            };
        }
        let (name, opts) = match spec.trim().split_once(':') {
            Some((n, o)) => (n.trim(), Some(o)),
            None => (spec.trim(), None),
        };
        let simple = |h: HookSpec| match opts {
            Some(o) if !o.trim().is_empty() => {
                Err(err(format!("`{name}` takes no options, got `{o}`")))
            }
            _ => Ok(h),
        };
        match name.to_ascii_lowercase().as_str() {
            "allreduce" => simple(HookSpec::AllReduce),
            "fp16" | "fp16_compress" => simple(HookSpec::Fp16),
            "bf16" | "bf16_compress" => simple(HookSpec::Bf16),
            "noop" => simple(HookSpec::Noop),
            "powersgd" | "power_sgd" | "batched_powersgd" | "batched_power_sgd" => {
                let mut c = PowerSgdConfig::default();
                for kv in opts
                    .unwrap_or("")
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                {
                    let (k, v) = kv
                        .split_once('=')
                        .ok_or_else(|| err(format!("`{kv}` is not key=value")))?;
                    let (k, v) = (k.trim(), v.trim());
                    let bad = |what: &str| err(format!("`{k}={v}`: expected {what}"));
                    match k {
                        "rank" => {
                            c.matrix_approximation_rank =
                                v.parse().map_err(|_| bad("an integer"))?
                        }
                        "start_iter" => {
                            c.start_powersgd_iter = v.parse().map_err(|_| bad("an integer"))?
                        }
                        "min_compression_rate" => {
                            c.min_compression_rate = v.parse().map_err(|_| bad("a number"))?
                        }
                        "error_feedback" => {
                            c.use_error_feedback = v.parse().map_err(|_| bad("true or false"))?
                        }
                        "warm_start" => {
                            c.warm_start = v.parse().map_err(|_| bad("true or false"))?
                        }
                        "epsilon" => {
                            c.orthogonalization_epsilon = v.parse().map_err(|_| bad("a number"))?
                        }
                        "seed" => c.random_seed = v.parse().map_err(|_| bad("an integer"))?,
                        "stats_every" => {
                            c.compression_stats_logging_frequency =
                                v.parse().map_err(|_| bad("an integer"))?
                        }
                        "batch_same_shape" => {
                            c.batch_tensors_with_same_shape =
                                v.parse().map_err(|_| bad("true or false"))?
                        }
                        _ => {
                            return Err(err(format!(
                                "unknown PowerSGD option `{k}`; known: {POWERSGD_KEYS}"
                            )))
                        }
                    }
                }
                c.validate().map_err(|e| err(e.to_string()))?;
                Ok(if name.to_ascii_lowercase().starts_with("batched") {
                    HookSpec::BatchedPowerSgd(c)
                } else {
                    HookSpec::PowerSgd(c)
                })
            }
            other => Err(err(format!("unknown hook `{other}`; known: {NAMES}"))),
        }
    }
}

impl HookSpec {
    /// Builds the hook over `group`.
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
            ("fp8+allreduce", "unknown wrapper `fp8`"),
        ] {
            let e = spec.parse::<HookSpec>().unwrap_err().to_string();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }
}
