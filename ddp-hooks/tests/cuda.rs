//! PowerSGD on CUDA buckets against the same run on the CPU (2 thread ranks sharing one
//! GPU; the process group stages device buffers through host memory). Without a GPU it
//! prints one `skipped:` line.
#![cfg(feature = "cuda")]

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{CommHook, GradBucket, Layout, PowerSgd, PowerSgdConfig};
use lowrank::{Backend, CpuBackend, CudaBackend, NormalRng};
use std::sync::Arc;

fn grad(rank: usize, step: usize, len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new((rank * 100 + step) as u64).fill(&mut v);
    v
}

#[test]
fn cuda_powersgd_matches_cpu() {
    let gpu = match CudaBackend::new(0) {
        Ok(b) => Arc::new(b),
        Err(lowrank::Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA driver ({why})");
            return;
        }
        Err(e) => panic!("CUDA present but failed to start: {e}"),
    };
    let layout = Arc::new(Layout::packed(&[vec![64, 96], vec![64], vec![32, 40]]).unwrap());
    let cfg = PowerSgdConfig {
        matrix_approximation_rank: 2,
        start_powersgd_iter: 2,
        ..Default::default()
    };
    let steps = 6;
    let cpu_out = run_local(2, |g| {
        let rank = g.rank();
        let mut hook = PowerSgd::new(
            Arc::new(CpuBackend::new()),
            Arc::new(g) as Arc<dyn ProcessGroup>,
            cfg.clone(),
        )
        .unwrap();
        (0..steps)
            .map(|s| {
                hook.run(
                    GradBucket::new(0, 1, grad(rank, s, layout.len()), layout.clone()).unwrap(),
                )
                .wait()
                .unwrap()
            })
            .collect::<Vec<_>>()
    })
    .unwrap();
    let gpu_out = run_local(2, |g| {
        let rank = g.rank();
        let mut hook = PowerSgd::new(
            gpu.clone(),
            Arc::new(g) as Arc<dyn ProcessGroup>,
            cfg.clone(),
        )
        .unwrap();
        (0..steps)
            .map(|s| {
                let buf = gpu.upload(&grad(rank, s, layout.len())).unwrap();
                let out = hook
                    .run(GradBucket::new(0, 1, buf, layout.clone()).unwrap())
                    .wait()
                    .unwrap();
                let mut host = vec![0.0; layout.len()];
                gpu.download(CudaBackend::view(&out, ..).unwrap(), &mut host)
                    .unwrap();
                host
            })
            .collect::<Vec<_>>()
    })
    .unwrap();
    for (c, g) in cpu_out.into_iter().zip(gpu_out) {
        for (s, (a, b)) in c.unwrap().iter().zip(g.unwrap()).enumerate() {
            let diff: f32 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y) * (x - y))
                .sum::<f32>()
                .sqrt();
            let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!(
                diff <= 1e-3 * norm,
                "step {s}: CUDA differs from CPU by {diff} (norm {norm})"
            );
        }
    }
    println!("cuda powersgd: ok");
}
