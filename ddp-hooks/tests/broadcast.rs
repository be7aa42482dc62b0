//! `broadcast_parameters`: every rank ends with the root's parameters bit for bit;
//! lengths that differ between ranks fail on every rank before anything is copied; the
//! reducer's and candle's entry points.

use collectives::{run_local, run_local_with_timeout, ProcessGroup};
use ddp_hooks::{
    broadcast_parameters, broadcast_parameters_bucketed, AllReduce, Error, Reducer, ReducerConfig,
};
use lowrank::CpuBackend;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rank `rank`'s parameters of `lens`: different on every rank, with bit patterns a
/// value-wise copy could lose (-0.0, a NaN payload, subnormals).
fn init(rank: usize, lens: &[usize]) -> Vec<Vec<f32>> {
    lens.iter()
        .enumerate()
        .map(|(p, &n)| {
            (0..n)
                .map(|i| match (i + p + rank) % 5 {
                    0 => -0.0,
                    1 => f32::from_bits(0x7fc0_0000 | (rank as u32 + 1) << 4 | p as u32),
                    2 => f32::from_bits(1 + rank as u32), // subnormal
                    _ => (rank * 1000 + p * 100 + i) as f32 * 0.37,
                })
                .collect()
        })
        .collect()
}

fn bits(params: &[Vec<f32>]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| p.iter().map(|x| x.to_bits()).collect())
        .collect()
}

fn slices(params: &mut [Vec<f32>]) -> Vec<&mut [f32]> {
    params.iter_mut().map(Vec::as_mut_slice).collect()
}

const LENS: &[usize] = &[7, 0, 1, 12, 5, 3];

#[test]
fn every_rank_ends_with_the_roots_parameters() {
    // 12 bytes: three elements a broadcast, so parameters straddle broadcasts; and the
    // default size (one broadcast); for roots 0 and 2.
    for (root, bucket) in [
        (0, 12),
        (2, 12),
        (0, ddp_hooks::BROADCAST_BUCKET_BYTES),
        (1, 1),
    ] {
        let out = run_local(3, |g| {
            let mut params = init(g.rank(), LENS);
            broadcast_parameters_bucketed(&g, &mut slices(&mut params), root, bucket)?;
            Ok::<_, Error>(bits(&params))
        })
        .unwrap();
        let want = bits(&init(root, LENS));
        assert_ne!(
            want,
            bits(&init((root + 1) % 3, LENS)),
            "the ranks start alike"
        );
        for (rank, got) in out.into_iter().enumerate() {
            assert_eq!(
                got.unwrap().unwrap(),
                want,
                "root {root}, bucket {bucket}: rank {rank}"
            );
        }
    }
}

#[test]
fn no_parameters_is_fine() {
    let out = run_local(2, |g| broadcast_parameters(&g, &mut [], 0)).unwrap();
    for r in out {
        r.unwrap().unwrap();
    }
}

/// Lengths that differ (one rank with a longer parameter; one with a parameter more; one
/// with the same count and total in another order) fail on every rank, naming the ranks,
/// and nothing is written.
#[test]
fn mismatched_lengths_fail_on_every_rank() {
    let cases: [(usize, &[usize]); 3] = [
        (1, &[7, 0, 1, 13, 5, 3]),
        (2, &[7, 0, 1, 12, 5, 3, 1]),
        (1, &[0, 7, 1, 12, 5, 3]),
    ];
    for (odd, lens) in cases {
        let out = run_local(3, |g| {
            let rank = g.rank();
            let mine = if rank == odd { lens } else { LENS };
            let mut params = init(rank, mine);
            let r = broadcast_parameters_bucketed(&g, &mut slices(&mut params), 0, 8);
            (r, bits(&params) == bits(&init(rank, mine)))
        })
        .unwrap();
        for (rank, r) in out.into_iter().enumerate() {
            let (result, untouched) = r.unwrap();
            let e = result.expect_err("a mismatch must fail on every rank");
            let Error::Comm(collectives::Error::Mismatch(why)) = &e else {
                panic!("rank {rank}: not a mismatch: {e:?}")
            };
            assert!(
                why.contains(&format!("rank(s) {odd} differ")),
                "rank {rank}: {why}"
            );
            assert!(
                why.contains("6 parameters of 28 elements"),
                "rank {rank}: {why}"
            );
            if rank == odd {
                assert!(why.contains(&format!("this rank ({odd}) holds")), "{why}");
            }
            assert!(
                untouched,
                "rank {rank}: parameters written despite the mismatch"
            );
        }
    }
}

#[test]
fn a_root_outside_the_group_is_a_config_error() {
    let out = run_local(2, |g| broadcast_parameters(&g, &mut [&mut [1.0f32][..]], 2)).unwrap();
    for r in out {
        assert!(matches!(r.unwrap(), Err(Error::Config(_))));
    }
}

/// A rank that never calls leaves the others with an error within the group's timeout,
/// not a hang.
#[test]
fn a_missing_rank_fails_within_the_timeout() {
    let start = Instant::now();
    let out = run_local_with_timeout(2, Duration::from_millis(300), |g| {
        if g.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let mut p = vec![1.0f32; 4];
        Some(broadcast_parameters(&g, &mut [&mut p], 0))
    })
    .unwrap();
    let r0 = out[0].clone().unwrap().unwrap();
    assert!(matches!(r0, Err(Error::Comm(_))), "{r0:?}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// The reducer broadcasts rank 0's parameters over its process group; without one it is
/// a configuration error.
#[test]
fn the_reducer_broadcasts_from_rank_0() {
    let shapes = vec![vec![4, 3], vec![3]];
    let out = run_local(2, |g| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = Arc::new(CpuBackend::new());
        let hook = AllReduce::new(be.clone(), group.clone());
        let reducer = Reducer::new(be, &shapes, hook, ReducerConfig::default())?;
        assert!(matches!(
            reducer.broadcast_parameters(&mut []),
            Err(Error::Config(_))
        ));
        let reducer = reducer.with_process_group(group.clone());
        let mut params = init(group.rank(), &[12, 3]);
        reducer.broadcast_parameters(&mut slices(&mut params))?;
        Ok::<_, Error>(bits(&params))
    })
    .unwrap();
    for r in out {
        assert_eq!(r.unwrap().unwrap(), bits(&init(0, &[12, 3])));
    }
}

#[cfg(feature = "candle")]
mod candle {
    use super::*;
    use candle_core::{Device, Tensor, Var};
    use ddp_hooks::candle::{broadcast_vars, CandleDdp, CandleError};
    use ddp_hooks::HookSpec;

    fn vars(rank: usize) -> Vec<Var> {
        init(rank, &[6, 3])
            .into_iter()
            .zip([vec![2, 3], vec![3]])
            .map(|(v, shape)| {
                Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
            })
            .collect()
    }

    fn values(vars: &[Var]) -> Vec<Vec<u32>> {
        vars.iter()
            .map(|v| {
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn candle_ddp_broadcasts_rank_0s_vars() {
        let out = run_local(3, |g| -> Result<_, CandleError> {
            let vars = vars(g.rank());
            let ddp = CandleDdp::from_spec(&vars, &HookSpec::AllReduce, Arc::new(g))?;
            ddp.broadcast_parameters()?;
            // The vars given are the model's: they changed in place, shapes kept.
            assert_eq!(vars[0].dims(), [2, 3]);
            Ok(values(&vars))
        })
        .unwrap();
        let want = values(&vars(0));
        assert_ne!(want, values(&vars(1)));
        for r in out {
            assert_eq!(r.unwrap().unwrap(), want);
        }
    }

    #[test]
    fn broadcast_vars_from_any_root_and_mismatches_fail_everywhere() {
        let out = run_local(2, |g| -> Result<_, CandleError> {
            let vars = vars(g.rank());
            broadcast_vars(&g, &vars, 1)?;
            Ok(values(&vars))
        })
        .unwrap();
        for r in out {
            assert_eq!(r.unwrap().unwrap(), values(&vars(1)));
        }
        let out = run_local(2, |g| {
            let mut vars = vars(g.rank());
            if g.rank() == 1 {
                vars.pop();
            }
            broadcast_vars(&g, &vars, 0)
        })
        .unwrap();
        for r in out {
            let e = r.unwrap().unwrap_err();
            assert!(
                matches!(
                    e,
                    CandleError::Reducer(Error::Comm(collectives::Error::Mismatch(_)))
                ),
                "{e:?}"
            );
        }
    }
}
