//! Hook names: ours, PyTorch's `DDPCommHookType` members and PyTorch's hook functions,
//! each mapped to one hook kind (with the rank a `*_RANK2` member fixes), and the
//! closest known name for a near miss.

/// What a hook name stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    AllReduce,
    Fp16,
    Bf16,
    Noop,
    /// PowerSGD per layer; `Some(r)`: the name fixes the rank (`POWER_SGD_RANK2`).
    PowerSgd(Option<usize>),
    /// PowerSGD on the whole bucket; `Some(r)` as for [`Kind::PowerSgd`].
    BatchedPowerSgd(Option<usize>),
    PostLocalSgd,
    QuantizePerTensor,
    QuantizePerChannel,
}

impl Kind {
    /// Whether the error-feedback suffix `+ef` applies.
    pub(super) fn is_quantize(self) -> bool {
        matches!(self, Kind::QuantizePerTensor | Kind::QuantizePerChannel)
    }
}

/// Every name a hook is known by, matched ignoring ASCII case: ours first (the name
/// [`CommHook::name`](crate::CommHook::name) gives), then PyTorch's
/// `DDPCommHookType` members (`torch/distributed/algorithms/ddp_comm_hooks/__init__.py`),
/// then PyTorch's hook functions.
const NAMES: &[(&str, Kind)] = &[
    // Ours.
    ("allreduce", Kind::AllReduce),
    ("fp16", Kind::Fp16),
    ("bf16", Kind::Bf16),
    ("noop", Kind::Noop),
    ("powersgd", Kind::PowerSgd(None)),
    ("batched_powersgd", Kind::BatchedPowerSgd(None)),
    ("quantize_per_tensor", Kind::QuantizePerTensor),
    ("quantize_per_channel", Kind::QuantizePerChannel),
    ("post_local_sgd", Kind::PostLocalSgd),
    ("post_localsgd", Kind::PostLocalSgd),
    // `DDPCommHookType` (ALLREDUCE, NOOP, QUANTIZE_PER_TENSOR and QUANTIZE_PER_CHANNEL
    // are ours above, up to case).
    ("FP16_COMPRESS", Kind::Fp16),
    ("BF16_COMPRESS", Kind::Bf16),
    ("POWER_SGD", Kind::PowerSgd(None)),
    ("POWER_SGD_RANK2", Kind::PowerSgd(Some(2))),
    ("BATCHED_POWER_SGD", Kind::BatchedPowerSgd(None)),
    ("BATCHED_POWER_SGD_RANK2", Kind::BatchedPowerSgd(Some(2))),
    // PyTorch's hook functions.
    ("allreduce_hook", Kind::AllReduce),
    ("fp16_compress_hook", Kind::Fp16),
    ("bf16_compress_hook", Kind::Bf16),
    ("noop_hook", Kind::Noop),
    ("powerSGD_hook", Kind::PowerSgd(None)),
    ("batched_powerSGD_hook", Kind::BatchedPowerSgd(None)),
    ("quantization_pertensor_hook", Kind::QuantizePerTensor),
    ("quantization_perchannel_hook", Kind::QuantizePerChannel),
    ("post_localSGD_hook", Kind::PostLocalSgd),
];

/// The names an unknown-hook error lists: ours, then where PyTorch's are.
pub(super) const KNOWN: &str = "allreduce, fp16, bf16, noop, powersgd, batched_powersgd, \
    quantize_per_tensor, quantize_per_channel, post_local_sgd, or PyTorch's \
    DDPCommHookType names (POWER_SGD_RANK2, ...) and hook functions (powerSGD_hook, ...)";

/// The wrappers' names: ours, then PyTorch's functions. `true`: f16, `false`: bf16.
const WRAPPERS: &[(&str, bool)] = &[
    ("fp16", true),
    ("bf16", false),
    ("fp16_compress_wrapper", true),
    ("bf16_compress_wrapper", false),
];

/// The kind `name` stands for, ignoring ASCII case.
pub(super) fn lookup(name: &str) -> Option<Kind> {
    NAMES
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|&(_, k)| k)
}

/// Whether wrapper `name` sends f16 (`Some(true)`) or bf16 (`Some(false)`).
pub(super) fn wrapper(name: &str) -> Option<bool> {
    WRAPPERS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|&(_, f16)| f16)
}

/// The known hook name closest to `name`, if it is a near miss.
pub(super) fn closest_hook(name: &str) -> Option<&'static str> {
    closest(name, NAMES.iter().map(|(n, _)| *n))
}

/// The candidate closest to `typed` by edit distance (ignoring ASCII case), if it is
/// close enough to be a typo: at most 1 edit for short names, a third of the length for
/// longer ones; failing that, the shortest candidate that `typed` (3 characters or more)
/// begins (`bucket` for `bucket_size`). Names far longer than every candidate are not
/// compared, so the cost stays bounded whatever the input.
pub(super) fn closest<'a>(
    typed: &str,
    candidates: impl Iterator<Item = &'a str> + Clone,
) -> Option<&'a str> {
    let typed: Vec<char> = typed.chars().map(|c| c.to_ascii_lowercase()).collect();
    if typed.is_empty() || typed.len() > 64 {
        return None;
    }
    let limit = (typed.len() / 3).max(1);
    let near = candidates
        .clone()
        .map(|c| (edit_distance(&typed, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c);
    let prefix: String = typed.iter().collect();
    near.or_else(|| {
        candidates
            .filter(|c| typed.len() >= 3 && c.to_ascii_lowercase().starts_with(&prefix))
            .min_by_key(|c| c.len())
    })
}

/// Levenshtein distance between `a` (lowercase) and `b` (compared lowercase).
fn edit_distance(a: &[char], b: &str) -> usize {
    let b: Vec<char> = b.chars().map(|c| c.to_ascii_lowercase()).collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if ca == cb {
                diag
            } else {
                1 + diag.min(up).min(row[j])
            };
            diag = up;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances_and_near_misses() {
        let d = |a: &str, b: &str| edit_distance(&a.chars().collect::<Vec<_>>(), b);
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("", "abc"), 3);
        assert_eq!(d("abc", "abc"), 0);
        assert_eq!(closest_hook("allreduse"), Some("allreduce"));
        assert_eq!(closest_hook("PowerSDG"), Some("powersgd"));
        assert_eq!(closest_hook("powerSGD_hok"), Some("powerSGD_hook"));
        assert_eq!(closest_hook("POWER_SGD_RANK3"), Some("POWER_SGD_RANK2"));
        assert_eq!(closest_hook("zzz"), None);
        assert_eq!(closest_hook(&"x".repeat(10_000)), None);
    }

    #[test]
    fn every_pytorch_name_is_known() {
        for (name, kind) in [
            ("ALLREDUCE", Kind::AllReduce),
            ("FP16_COMPRESS", Kind::Fp16),
            ("BF16_COMPRESS", Kind::Bf16),
            ("QUANTIZE_PER_TENSOR", Kind::QuantizePerTensor),
            ("QUANTIZE_PER_CHANNEL", Kind::QuantizePerChannel),
            ("POWER_SGD", Kind::PowerSgd(None)),
            ("POWER_SGD_RANK2", Kind::PowerSgd(Some(2))),
            ("BATCHED_POWER_SGD", Kind::BatchedPowerSgd(None)),
            ("BATCHED_POWER_SGD_RANK2", Kind::BatchedPowerSgd(Some(2))),
            ("NOOP", Kind::Noop),
            ("quantization_pertensor_hook", Kind::QuantizePerTensor),
            ("post_localSGD_hook", Kind::PostLocalSgd),
        ] {
            assert_eq!(lookup(name), Some(kind), "{name}");
        }
        assert_eq!(wrapper("fp16_compress_wrapper"), Some(true));
        assert_eq!(wrapper("BF16"), Some(false));
        assert_eq!(wrapper("fp8"), None);
    }
}
