//! PowerSGD on CUDA buckets against the same run on the CPU (2 thread ranks sharing one
//! GPU; the process group stages device buffers through host memory). Without a GPU it
//! prints one `skipped:` line.
#![cfg(feature = "cuda")]

mod common;

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{CommHook, GradBucket, Layout, PowerSgd, PowerSgdConfig};
use lowrank::{Backend, CpuBackend, CudaBackend, NormalRng};
use std::sync::Arc;

fn grad(rank: usize, step: usize, len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new((rank * 100 + step) as u64).fill(&mut v);
    v
}

/// GPU 0, or `None` after printing one `skipped:` line where there is no driver.
fn gpu() -> Option<Arc<CudaBackend>> {
    match CudaBackend::new(0) {
        Ok(b) => Some(Arc::new(b)),
        Err(lowrank::Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA driver ({why})");
            None
        }
        Err(e) => panic!("CUDA present but failed to start: {e}"),
    }
}

/// Issue 29 on CUDA buckets: a step whose gradient holds an infinity on one rank is held
/// on the device (the flag never reaches the host within the step): its output is
/// non-finite, the saved memories are those from before it, the count reads 1, and the
/// next step is finite. Both PowerSGD hooks.
/// One bucket step of `hook` on CUDA from host values, back on the host.
fn cuda_step(
    gpu: &CudaBackend,
    hook: &mut dyn CommHook<CudaBackend>,
    layout: &Arc<Layout>,
    host: Vec<f32>,
) -> Vec<f32> {
    let buf = gpu.upload(&host).unwrap();
    let out = hook
        .run(GradBucket::new(0, 1, buf, layout.clone()).unwrap())
        .wait()
        .unwrap();
    let mut back = vec![0.0; host.len()];
    gpu.download(CudaBackend::view(&out, ..).unwrap(), &mut back)
        .unwrap();
    back
}

#[test]
fn cuda_powersgd_holds_a_non_finite_step() {
    let Some(gpu) = gpu() else { return };
    let layout = Arc::new(Layout::packed(&[vec![64, 96], vec![64], vec![32, 40]]).unwrap());
    let cfg = PowerSgdConfig {
        matrix_approximation_rank: 2,
        start_powersgd_iter: 2,
        ..Default::default()
    };
    for batched in [false, true] {
        let out = run_local(2, |g| {
            let rank = g.rank();
            let g = Arc::new(g) as Arc<dyn ProcessGroup>;
            let mut hook: Box<dyn CommHook<CudaBackend>> = if batched {
                Box::new(ddp_hooks::BatchedPowerSgd::new(gpu.clone(), g, cfg.clone()).unwrap())
            } else {
                Box::new(PowerSgd::new(gpu.clone(), g, cfg.clone()).unwrap())
            };
            for s in 0..4 {
                cuda_step(&gpu, &mut *hook, &layout, grad(rank, s, layout.len()));
            }
            let mut poisoned = grad(rank, 4, layout.len());
            if rank == 1 {
                poisoned[100] = f32::INFINITY;
            }
            let held = cuda_step(&gpu, &mut *hook, &layout, poisoned);
            let before_next = hook.save_state().unwrap();
            let stats = hook.compression_stats().unwrap();
            let next = cuda_step(&gpu, &mut *hook, &layout, grad(rank, 5, layout.len()));
            (held, before_next, stats, next)
        })
        .unwrap();
        for r in out {
            let (held, saved, stats, next) = r.unwrap();
            assert!(
                held.iter().any(|x| !x.is_finite()),
                "batched {batched}: held output finite"
            );
            assert_eq!(stats.nonfinite_steps, 1, "batched {batched}");
            // `save` refuses a non-finite memory: the state saved, so the memories are finite.
            let (ddp_hooks::HookState::PowerSgd(s) | ddp_hooks::HookState::BatchedPowerSgd(s)) =
                saved
            else {
                panic!("not a PowerSGD state")
            };
            assert_eq!(s.nonfinite_steps, 1);
            assert!(
                next.iter().all(|x| x.is_finite()),
                "batched {batched}: next step"
            );
        }
        println!("cuda held non-finite step, batched {batched}: ok");
    }
}

#[test]
fn cuda_powersgd_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let layout = Arc::new(Layout::packed(&[vec![64, 96], vec![64], vec![32, 40]]).unwrap());
    let cfg = PowerSgdConfig {
        matrix_approximation_rank: 2,
        start_powersgd_iter: 2,
        // Unset ("auto"): the backend's choice (the default is PyTorch's off).
        batch_tensors_with_same_shape: None,
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
        // `cfg` leaves `batch_tensors_with_same_shape` unset (auto): on CUDA that is on.
        assert!(hook.batches_same_shape(), "unset must batch on CUDA");
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

// ---------------------------------------------------------------------------------------
// The device path (issue 17): hooks through the reducer hand device buffers to the group.
// ---------------------------------------------------------------------------------------

mod device_path {
    use collectives::nccl::{NcclGroup, NcclId};
    use collectives::{run_local, Buffer, DType, DeviceBuffer, ProcessGroup, ReduceOp, Work};
    use lowrank::CpuBackend;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::common::{assert_close, train, STEPS};
    use super::gpu;

    const SPECS: &[&str] = &[
        "allreduce",
        "fp16",
        "bf16",
        "powersgd:rank=2,start_iter=2",
        "batched_powersgd:rank=2,start_iter=2",
        "fp16+powersgd:rank=2,start_iter=2",
        "bf16+powersgd:rank=2,start_iter=2",
        "bf16+allreduce",
    ];

    /// Counts what the hooks hand to the group it wraps: host buffers of gradient data
    /// (any all-reduce of a host buffer) and device buffers.
    struct Recording {
        inner: Arc<dyn ProcessGroup>,
        host_reductions: Arc<AtomicUsize>,
        device_reductions: Arc<AtomicUsize>,
    }

    collectives::forward_group! {
        impl ProcessGroup for Recording {
            inner: |s| &s.inner;
            fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
                self.host_reductions.fetch_add(1, Ordering::Relaxed);
                self.inner.all_reduce(buf, op)
            }
            fn all_reduce_wire(&self, buf: Buffer, wire: DType, op: ReduceOp) -> Work<Buffer> {
                self.host_reductions.fetch_add(1, Ordering::Relaxed);
                self.inner.all_reduce_wire(buf, wire, op)
            }
            fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
                self.host_reductions.fetch_add(1, Ordering::Relaxed);
                self.inner.all_reduce_coalesced(bufs, op)
            }
            fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
                // The reducer's one broadcast (rank 0's bucket order, `f64` indices) is not
                // gradient data; a floating-point gradient type would be.
                if buf.dtype() != DType::F64 {
                    self.host_reductions.fetch_add(1, Ordering::Relaxed);
                }
                self.inner.broadcast(buf, root)
            }
            fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
                self.host_reductions.fetch_add(1, Ordering::Relaxed);
                self.inner.reduce_scatter(buf, op)
            }
            fn all_reduce_device(&self, buf: DeviceBuffer, op: ReduceOp) -> Work<DeviceBuffer> {
                self.device_reductions.fetch_add(1, Ordering::Relaxed);
                self.inner.all_reduce_device(buf, op)
            }
            fn broadcast_device(&self, buf: DeviceBuffer, root: usize) -> Work<DeviceBuffer> {
                self.device_reductions.fetch_add(1, Ordering::Relaxed);
                self.inner.broadcast_device(buf, root)
            }
        }
    }

    fn recording(
        inner: Arc<dyn ProcessGroup>,
    ) -> (Arc<Recording>, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let (host, device) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let g = Arc::new(Recording {
            inner,
            host_reductions: host.clone(),
            device_reductions: device.clone(),
        });
        (g, host, device)
    }

    /// World size 1 on NCCL: every hook through the reducer equals the CPU backend's
    /// result within `common::tolerance` (1e-5 relative but for PowerSGD behind a 16-bit wire),
    /// and no gradient data reaches the group in host memory.
    #[test]
    fn hooks_on_nccl_match_cpu_without_host_copies() {
        let Some(gpu) = gpu() else { return };
        let nccl = match NcclId::new()
            .and_then(|id| NcclGroup::new(0, 1, 0, id, Duration::from_secs(120)))
        {
            Ok(g) => Arc::new(g) as Arc<dyn ProcessGroup>,
            Err(e) => {
                println!("skipped: NCCL unavailable ({e})");
                return;
            }
        };
        assert!(nccl.device_native());
        for spec in SPECS {
            let cpu = run_local(1, |g| {
                train(Arc::new(CpuBackend::new()), Arc::new(g), spec, 0)
            })
            .unwrap()
            .remove(0)
            .unwrap();
            let (group, host, device) = recording(nccl.clone());
            let dev = train(gpu.clone(), group, spec, 0);
            assert_close("the NCCL device path against the CPU", spec, &cpu, &dev);
            assert_eq!(
                host.load(Ordering::Relaxed),
                0,
                "{spec}: gradient data reached the NCCL group in host memory"
            );
            assert!(
                device.load(Ordering::Relaxed) >= STEPS,
                "{spec}: no device collective"
            );
            println!("nccl device path, {spec}: ok");
        }
    }

    /// Two thread ranks sharing one GPU (the thread backend stages device buffers in
    /// `collectives::device`): every hook equals the CPU backend's result within `common::tolerance`
    /// relative, and the hooks still hand the group device buffers only.
    #[test]
    fn hooks_on_thread_device_path_match_cpu() {
        let Some(gpu) = gpu() else { return };
        for spec in SPECS {
            let cpu = run_local(2, |g| {
                let rank = g.rank();
                train(Arc::new(CpuBackend::new()), Arc::new(g), spec, rank)
            })
            .unwrap();
            let dev = run_local(2, |g| {
                let rank = g.rank();
                let (group, host, _) = recording(Arc::new(g));
                let out = train(gpu.clone(), group, spec, rank);
                (out, host.load(Ordering::Relaxed))
            })
            .unwrap();
            for (c, d) in cpu.into_iter().zip(dev) {
                let (d, host) = d.unwrap();
                assert_close(
                    "the thread device path against the CPU",
                    spec,
                    &c.unwrap(),
                    &d,
                );
                assert_eq!(host, 0, "{spec}: a hook handed the group a host buffer");
            }
            println!("thread device path, {spec}: ok");
        }
    }
}
