//! Which parameters share a bucket: DDP's assignment by size, and the wire form of a
//! rebuilt assignment broadcast from rank 0.

use super::ReducerConfig;

/// Bucket capacities in bytes, truncated from MiB as DDP's `int(mb * 1024 * 1024)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Caps {
    first: usize,
    rest: usize,
}

impl Caps {
    /// The caps of a validated config (finite, positive sizes; `as` saturates).
    pub(super) fn new(config: &ReducerConfig) -> Caps {
        let bytes = |mb: f64| (mb * (1u64 << 20) as f64) as usize;
        Caps {
            first: bytes(config.first_cap_mb()),
            rest: bytes(config.bucket_cap_mb),
        }
    }
}

/// DDP's `compute_bucket_assignment_by_size` for one dtype and device: walks `order`
/// (the order gradients are expected to become ready) and closes a bucket as soon as its
/// `f32` bytes reach its cap, the first bucket's cap being `caps.first`, every later one's
/// `caps.rest`. The buckets come out in launch order, each listing its parameters in
/// `order`'s order.
pub(super) fn by_size(order: &[usize], lens: &[usize], caps: Caps) -> Vec<Vec<usize>> {
    let mut buckets = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0usize;
    for &p in order {
        current.push(p);
        bytes = bytes.saturating_add(lens[p].saturating_mul(size_of::<f32>()));
        let cap = if buckets.is_empty() {
            caps.first
        } else {
            caps.rest
        };
        if bytes >= cap {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// Errors unless `buckets` are non-empty and hold every parameter of `0..params` exactly
/// once.
pub(super) fn check_partition(buckets: &[Vec<usize>], params: usize) -> Result<(), String> {
    let mut seen = vec![false; params];
    for (b, bucket) in buckets.iter().enumerate() {
        if bucket.is_empty() {
            return Err(format!("bucket {b} is empty"));
        }
        for &p in bucket {
            match seen.get_mut(p) {
                None => {
                    return Err(format!(
                        "bucket {b} names parameter {p}, but there are {params}"
                    ))
                }
                Some(true) => return Err(format!("parameter {p} is listed twice")),
                Some(s) => *s = true,
            }
        }
    }
    match seen.iter().position(|s| !s) {
        Some(p) => Err(format!("parameter {p} is in no bucket")),
        None => Ok(()),
    }
}

/// The wire form of an assignment of `n` parameters, `2n` numbers (exact in `f64` below
/// 2⁵³): the parameters in bucket order, then each one's bucket index.
pub(super) fn encode(buckets: &[Vec<usize>]) -> Vec<f64> {
    let order = buckets.iter().flatten().map(|&p| p as f64);
    let ids = buckets
        .iter()
        .enumerate()
        .flat_map(|(b, bucket)| bucket.iter().map(move |_| b as f64));
    order.chain(ids).collect()
}

/// Reads [`encode`]'s form back for `params` parameters, checking that it describes a
/// partition of `0..params` into consecutive buckets numbered from 0.
pub(super) fn decode(wire: &[f64], params: usize) -> Result<Vec<Vec<usize>>, String> {
    if wire.len() != 2 * params {
        return Err(format!(
            "{} numbers for {params} parameters (expected {})",
            wire.len(),
            2 * params
        ));
    }
    let index = |x: f64, what: &str| -> Result<usize, String> {
        if x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x < params as f64 {
            Ok(x as usize)
        } else {
            Err(format!("{what} {x} is not an index below {params}"))
        }
    };
    let (order, ids) = wire.split_at(params);
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    for (&p, &b) in order.iter().zip(ids) {
        let (p, b) = (index(p, "parameter")?, index(b, "bucket")?);
        if b == buckets.len() {
            buckets.push(Vec::new());
        } else if b + 1 != buckets.len() {
            return Err(match buckets.len() {
                0 => format!("the first bucket is {b}, not 0"),
                n => format!(
                    "bucket {b} follows bucket {}: buckets must be consecutive",
                    n - 1
                ),
            });
        }
        buckets[b].push(p);
    }
    check_partition(&buckets, params)?;
    Ok(buckets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(first: usize, rest: usize) -> Caps {
        Caps { first, rest }
    }

    #[test]
    fn by_size_closes_a_bucket_once_it_reaches_its_cap_as_ddp() {
        // 4-byte elements: lens 1, 2, 3, 1, 5 → 4, 8, 12, 4, 20 bytes.
        let lens = [1, 2, 3, 1, 5];
        // First cap 8 bytes: [4] (4 < 8), then +8 → 12 ≥ 8 closes. Rest 16: 12 < 16,
        // +4 → 16 ≥ 16 closes; 20 ≥ 16 closes.
        assert_eq!(
            by_size(&[0, 1, 2, 3, 4], &lens, caps(8, 16)),
            vec![vec![0, 1], vec![2, 3], vec![4]]
        );
        // The order is kept inside buckets; a remainder forms the last bucket.
        assert_eq!(
            by_size(&[4, 2, 0, 1, 3], &lens, caps(1, 1000)),
            vec![vec![4], vec![2, 0, 1, 3]]
        );
        assert!(by_size(&[], &[], caps(1, 1)).is_empty());
    }

    #[test]
    fn caps_truncate_to_whole_bytes_as_ddp() {
        let c = Caps::new(&ReducerConfig {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            ..ReducerConfig::default()
        });
        assert_eq!((c.first, c.rest), (1 << 20, 25 << 20));
        let c = Caps::new(&ReducerConfig {
            bucket_cap_mb: 1e-6,
            first_bucket_mb: 2e-6,
            ..ReducerConfig::default()
        });
        assert_eq!((c.first, c.rest), (2, 1));
        // DDP: with bucket_cap_mb given, the first bucket takes it too (8 x 1 MiB at a
        // cap of 4 MiB: two buckets of 4 MiB, not 1 + 4 + 3).
        let c = Caps::new(&ReducerConfig {
            bucket_cap_mb: 4.0,
            ..ReducerConfig::default()
        });
        assert_eq!((c.first, c.rest), (4 << 20, 4 << 20));
        let lens = vec![1 << 18; 8];
        let order: Vec<usize> = (0..8).rev().collect();
        assert_eq!(by_size(&order, &lens, c).len(), 2);
    }

    #[test]
    fn wire_form_round_trips_and_rejects_what_is_not_a_partition() {
        let buckets = vec![vec![3, 1], vec![0], vec![2, 4]];
        let wire = encode(&buckets);
        assert_eq!(wire, vec![3., 1., 0., 2., 4., 0., 0., 1., 2., 2.]);
        assert_eq!(decode(&wire, 5).unwrap(), buckets);
        let bad = |w: &[f64], n: usize| decode(w, n).unwrap_err();
        assert!(bad(&wire, 4).contains("10 numbers for 4 parameters"));
        assert!(bad(&[0., 0., 0., 0.], 2).contains("parameter 0 is listed twice"));
        assert!(bad(&[0., 5., 0., 0.], 2).contains("parameter 5 is not an index"));
        assert!(bad(&[0., 1., 0., 2.], 2).contains("bucket 2 is not an index"));
        assert!(bad(&[0., 1., 1., 1.], 2).contains("the first bucket is 1, not 0"));
        assert!(bad(&[0., 1., 2., 0., 1., 0.], 3).contains("bucket 0 follows bucket 1"));
        assert!(bad(&[0.5, 1., 0., 0.], 2).contains("not an index"));
        assert!(bad(&[f64::NAN, 1., 0., 0.], 2).contains("not an index"));
        assert_eq!(decode(&[], 0).unwrap(), Vec::<Vec<usize>>::new());
    }

    #[test]
    fn check_partition_names_the_problem() {
        assert!(check_partition(&[vec![0, 1]], 2).is_ok());
        assert!(check_partition(&[vec![0], vec![]], 1)
            .unwrap_err()
            .contains("bucket 1 is empty"));
        assert!(check_partition(&[vec![0]], 2)
            .unwrap_err()
            .contains("parameter 1 is in no bucket"));
        assert!(check_partition(&[vec![0, 2]], 2)
            .unwrap_err()
            .contains("names parameter 2, but there are 2"));
    }
}
