//! One CPU-capability detector for the workspace's explicit-vector loops (`lowrank`'s
//! kernels, `collectives`' 16-bit rounding loops, `pipe`'s matmul).
//!
//! A [`Level`] is a set of x86-64 features that a loop may assume, the same set for every
//! crate, so that one environment variable caps them all:
//!
//! - [`Level::Avx2`]: AVX, AVX2, FMA and F16C (every AVX2 CPU has the other three:
//!   `lowrank`'s kernels need FMA, `collectives`' f16 loops F16C);
//! - [`Level::Avx512`]: AVX-512F as well;
//! - [`Level::Portable`]: nothing beyond the build target; runs everywhere.
//!
//! [`detected`] is what the CPU has; [`level`] is that, capped once by the environment
//! variable [`ENV`] (`LOWRANK_CPU_CAPABILITY`), like PyTorch's `ATEN_CPU_CAPABILITY`:
//!
//! | value               | loops                                                  |
//! |---------------------|--------------------------------------------------------|
//! | unset, empty, `avx512` | the widest the CPU has                              |
//! | `avx2`              | at most AVX2 (what an AVX2-only CPU runs)              |
//! | `default`, `portable` | the portable loops                                   |
//!
//! The variable only ever narrows what the CPU has. An unknown value is ignored (no cap);
//! this crate has no dependencies and does not log, so it keeps a description of the
//! problem for the first caller of [`take_warnings`], which logs it (`lowrank` and
//! `collectives` do, through `tracing`), once per process. `COLLECTIVES_CPU_CAPABILITY`
//! ([`DEPRECATED_ENV`]), the older name, is still read when `LOWRANK_CPU_CAPABILITY` is
//! unset, with a deprecation warning.
//!
//! Explicit choices (`lowrank::CpuBackend::with_isa`, tests that run every instance of a
//! loop) ask [`Level::is_supported`], which the variable does not cap.
//!
//! ```
//! use cpucap::Level;
//! assert!(cpucap::level() <= cpucap::detected());
//! assert!(Level::Portable.is_supported());
//! assert_eq!(cpucap::capped(Level::Avx512, Some("avx2")), Level::Avx2);
//! ```
#![deny(missing_docs)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The environment variable that caps [`level`]: `avx512`, `avx2`, `default` or
/// `portable`.
pub const ENV: &str = "LOWRANK_CPU_CAPABILITY";

/// The deprecated name of [`ENV`], read only when [`ENV`] is unset.
pub const DEPRECATED_ENV: &str = "COLLECTIVES_CPU_CAPABILITY";

/// A set of CPU features explicit-vector loops may assume, ordered narrowest first.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Level {
    /// No features beyond the build target's.
    Portable,
    /// AVX, AVX2, FMA and F16C.
    Avx2,
    /// AVX-512F, and everything of [`Level::Avx2`].
    Avx512,
}

impl Level {
    /// Every level, widest first.
    pub const ALL: [Level; 3] = [Level::Avx512, Level::Avx2, Level::Portable];

    /// Lower-case name: `"avx512"`, `"avx2"`, `"portable"`.
    pub fn name(self) -> &'static str {
        match self {
            Level::Avx512 => "avx512",
            Level::Avx2 => "avx2",
            Level::Portable => "portable",
        }
    }

    /// The cap a value of [`ENV`] sets: `avx512` (no cap on today's levels), `avx2`,
    /// `default` or `portable` (the portable loops); `None` for any other value.
    pub fn from_cap(value: &str) -> Option<Level> {
        match value {
            "avx512" => Some(Level::Avx512),
            "avx2" => Some(Level::Avx2),
            "default" | "portable" => Some(Level::Portable),
            _ => None,
        }
    }

    /// Whether this CPU has every feature of `self` (whatever [`ENV`] says).
    pub fn is_supported(self) -> bool {
        self <= detected()
    }

    /// Every level this CPU supports, widest first (whatever [`ENV`] says).
    pub fn supported() -> impl Iterator<Item = Level> {
        Level::ALL.into_iter().filter(|l| l.is_supported())
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The widest [`Level`] this CPU has, ignoring [`ENV`]; detected once.
pub fn detected() -> Level {
    static DETECTED: OnceLock<Level> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx") && has!("avx2") && has!("fma") && has!("f16c") {
            if has!("avx512f") {
                return Level::Avx512;
            }
            return Level::Avx2;
        }
    }
    Level::Portable
}

/// `cpu` capped by `value`, a value of [`ENV`] (`None` when unset). An empty or unknown
/// value sets no cap. Never wider than `cpu`.
pub fn capped(cpu: Level, value: Option<&str>) -> Level {
    match value.and_then(Level::from_cap) {
        Some(cap) => cpu.min(cap),
        None => cpu,
    }
}

/// What the environment decided, once per process.
struct Decision {
    level: Level,
    warnings: Vec<String>,
}

fn decision() -> &'static Decision {
    static DECISION: OnceLock<Decision> = OnceLock::new();
    DECISION.get_or_init(|| {
        let current = std::env::var(ENV).ok();
        let old = std::env::var(DEPRECATED_ENV).ok();
        decide(detected(), current.as_deref(), old.as_deref())
    })
}

/// The decision for a CPU of `cpu` with [`ENV`] = `current` and [`DEPRECATED_ENV`] =
/// `old`.
fn decide(cpu: Level, current: Option<&str>, old: Option<&str>) -> Decision {
    let mut warnings = Vec::new();
    let (name, value) = match (current, old) {
        (Some(v), _) => (ENV, Some(v)),
        (None, Some(v)) => {
            warnings.push(format!("{DEPRECATED_ENV} is deprecated; set {ENV} instead"));
            (DEPRECATED_ENV, Some(v))
        }
        (None, None) => (ENV, None),
    };
    if let Some(v) = value {
        if !v.is_empty() && Level::from_cap(v).is_none() {
            warnings.push(format!(
                "{name}={v:?} is not avx512, avx2, default or portable; ignored"
            ));
        }
    }
    Decision {
        level: capped(cpu, value),
        warnings,
    }
}

/// The [`Level`] this process's loops use: [`detected`] capped by [`ENV`] (or
/// [`DEPRECATED_ENV`]), read once, at the first call.
pub fn level() -> Level {
    decision().level
}

/// What was wrong with the environment [`level`] read (an unknown value, the deprecated
/// name), for the caller to log; the first call in the process gets them, every later
/// call an empty list.
pub fn take_warnings() -> Vec<String> {
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let d = decision();
    if d.warnings.is_empty() || TAKEN.swap(true, Ordering::Relaxed) {
        Vec::new()
    } else {
        d.warnings.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Level::*;

    #[test]
    fn a_cap_only_ever_narrows() {
        assert_eq!(capped(Avx512, None), Avx512);
        assert_eq!(capped(Avx512, Some("avx512")), Avx512);
        assert_eq!(capped(Avx512, Some("avx2")), Avx2);
        assert_eq!(capped(Avx512, Some("default")), Portable);
        assert_eq!(capped(Avx512, Some("portable")), Portable);
        assert_eq!(capped(Avx512, Some("sse9")), Avx512);
        assert_eq!(capped(Avx2, Some("avx512")), Avx2);
        assert_eq!(capped(Portable, Some("avx2")), Portable);
        assert_eq!(capped(Avx2, Some("")), Avx2);
        assert_eq!(capped(Avx2, Some("AVX2")), Avx2);
    }

    #[test]
    fn names_round_trip() {
        for l in Level::ALL {
            assert_eq!(Level::from_cap(l.name()), Some(l));
            assert_eq!(l.to_string(), l.name());
        }
        assert_eq!(Level::from_cap("default"), Some(Portable));
        assert_eq!(Level::from_cap("avx"), None);
        assert!(Portable < Avx2 && Avx2 < Avx512);
    }

    #[test]
    fn the_new_name_wins_and_problems_are_reported() {
        let d = decide(Avx512, Some("avx2"), Some("default"));
        assert_eq!(d.level, Avx2);
        assert!(d.warnings.is_empty());

        let d = decide(Avx512, None, Some("default"));
        assert_eq!(d.level, Portable);
        assert_eq!(d.warnings.len(), 1);
        assert!(d.warnings[0].contains("deprecated"), "{:?}", d.warnings);

        let d = decide(Avx2, Some("sse9"), None);
        assert_eq!(d.level, Avx2);
        assert_eq!(d.warnings.len(), 1);
        assert!(d.warnings[0].contains("\"sse9\""), "{:?}", d.warnings);

        let d = decide(Avx2, Some(""), None);
        assert_eq!(d.level, Avx2);
        assert!(d.warnings.is_empty());
    }

    #[test]
    fn detection_matches_the_cpu() {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx") && has!("avx2") && has!("fma") && has!("f16c");
            assert_eq!(Avx2.is_supported(), avx2);
            assert_eq!(Avx512.is_supported(), avx2 && has!("avx512f"));
        }
        #[cfg(not(target_arch = "x86_64"))]
        assert_eq!(detected(), Portable);
        assert!(Portable.is_supported());
        assert!(level() <= detected());
        assert_eq!(Level::supported().next(), Some(detected()));
        assert_eq!(Level::supported().last(), Some(Portable));
        // A second take never repeats the first's warnings.
        let _ = take_warnings();
        assert!(take_warnings().is_empty());
    }
}
