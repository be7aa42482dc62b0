//! How a pipe's parameters are bucketed: DDP's assignment by size, in backward order,
//! with a bucket closing at each partition's end too (see the module docs above).

use crate::ReducerConfig;

/// DDP's assignment by size over the parameters in backward order (the last partition's
/// last parameter first), the first bucket's cap [`ReducerConfig::first_cap_mb`], the
/// others' `bucket_cap_mb` (a bucket closes once its bytes reach its cap), and a bucket also
/// closes at the end of each partition.
pub(super) fn partition_buckets(
    bounds: &[usize],
    lens: &[usize],
    config: &ReducerConfig,
) -> Vec<Vec<usize>> {
    let bytes = |mb: f64| (mb * (1u64 << 20) as f64) as usize;
    let (first, rest) = (bytes(config.first_cap_mb()), bytes(config.bucket_cap_mb));
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    for j in (0..bounds.len().saturating_sub(1)).rev() {
        let mut current = Vec::new();
        let mut size = 0usize;
        for p in (bounds[j]..bounds[j + 1]).rev() {
            current.push(p);
            size = size.saturating_add(lens[p].saturating_mul(size_of::<f32>()));
            let cap = if buckets.is_empty() { first } else { rest };
            if size >= cap {
                buckets.push(std::mem::take(&mut current));
                size = 0;
            }
        }
        if !current.is_empty() {
            buckets.push(current);
        }
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_close_at_caps_and_at_partition_ends() {
        // Two partitions: params 0..3 and 3..5, 1 MiB each (262144 floats).
        let lens = vec![1 << 18; 5];
        let config = ReducerConfig {
            first_bucket_mb: 1.5,
            bucket_cap_mb: 2.5,
            ..ReducerConfig::default()
        };
        let got = partition_buckets(&[0, 3, 5], &lens, &config);
        assert_eq!(got, vec![vec![4, 3], vec![2, 1, 0]]);
        let config = ReducerConfig {
            first_bucket_mb: 0.5,
            ..config
        };
        let got = partition_buckets(&[0, 3, 5], &lens, &config);
        assert_eq!(got, vec![vec![4], vec![3], vec![2, 1, 0]]);
        // DDP: a bucket_cap_mb of the user's caps the first bucket too.
        let config = ReducerConfig {
            bucket_cap_mb: 2.5,
            ..ReducerConfig::default()
        };
        let got = partition_buckets(&[0, 3, 5], &lens, &config);
        assert_eq!(got, vec![vec![4, 3], vec![2, 1, 0]]);
        // A partition without parameters gets no bucket.
        let got = partition_buckets(&[0, 2, 2, 3], &[1, 1, 1], &ReducerConfig::default());
        assert_eq!(got, vec![vec![2], vec![1, 0]]);
    }
}
