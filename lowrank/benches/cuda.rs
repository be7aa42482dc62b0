//! The CUDA backend's products and Gram-Schmidt against the device's copy bandwidth.
//!
//! Built by `cargo xtask gpu-check` and run on a GPU machine by `gpu-check/run.sh`. The
//! reference is a device-to-device copy of the same matrix: it reads and writes every
//! byte, so the device bandwidth is `2 x bytes / time`; each product reports the rate at
//! which it reads `M` as a fraction of that. Times are medians of repetitions between
//! stream synchronisations. Without a GPU it prints one line and exits 0.

use lowrank::{Backend, CudaBackend, Dims, Error};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<F: FnMut() -> lowrank::Result<()>>(
    be: &CudaBackend,
    reps: usize,
    mut f: F,
) -> lowrank::Result<Duration> {
    f()?;
    be.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        be.synchronize()?;
        times.push(t.elapsed());
    }
    Ok(median(times))
}

fn main() -> lowrank::Result<()> {
    let be = match CudaBackend::new(0) {
        Ok(be) => be,
        Err(Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA driver ({why})");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    println!("device: {}", be.name());
    println!(
        "{:<22} {:>3} {:>10} {:>9} {:>9}",
        "shape", "r", "op", "GB/s", "fraction"
    );
    let reps = 20;
    // One large matrix (1 GiB) and a batch of 64 ResNet-like conv weights.
    for (label, batch, n, m) in [
        ("16384x16384", 1, 16384, 16384),
        ("64x512x4608", 64, 512, 4608),
    ] {
        let len = batch * n * m;
        let mat = be.alloc::<f32>(len)?;
        let mut copy = be.alloc::<f32>(len)?;
        let bytes = (len * 4) as f64;
        let t_copy = time(&be, reps, || {
            be.copy(
                CudaBackend::view(&mat, ..)?,
                CudaBackend::view_mut(&mut copy, ..)?,
            )
        })?;
        let device_gbs = 2.0 * bytes / t_copy.as_secs_f64() / 1e9;
        println!(
            "{label:<22} {:>3} {:>10} {:>9.1} {:>8.1}%",
            "-", "copy", device_gbs, 100.0
        );
        for r in [1, 2, 4, 8, 32] {
            let d = Dims::new(batch, n, m, r)?;
            let mut p = be.alloc::<f32>(d.p_len())?;
            let mut q = be.alloc::<f32>(d.q_len())?;
            let mut e = be.alloc::<f32>(d.m_len())?;
            let t_mq = time(&be, reps, || {
                be.mq(
                    d,
                    CudaBackend::view(&mat, ..)?,
                    CudaBackend::view(&q, ..)?,
                    CudaBackend::view_mut(&mut p, ..)?,
                )
            })?;
            let t_mtp = time(&be, reps, || {
                be.mtp(
                    d,
                    CudaBackend::view(&mat, ..)?,
                    CudaBackend::view(&p, ..)?,
                    CudaBackend::view_mut(&mut q, ..)?,
                )
            })?;
            let t_err = time(&be, reps, || {
                be.pqt_error(
                    d,
                    CudaBackend::view(&p, ..)?,
                    CudaBackend::view(&q, ..)?,
                    CudaBackend::view_mut(&mut copy, ..)?,
                    CudaBackend::view_mut(&mut e, ..)?,
                )
            })?;
            let t_orth = time(&be, reps, || {
                be.orthogonalize(batch, n, r, CudaBackend::view_mut(&mut p, ..)?, 0.0)
            })?;
            for (op, t, moved) in [
                ("mq", t_mq, bytes),
                ("mtp", t_mtp, bytes),
                ("pqt_error", t_err, 3.0 * bytes),
            ] {
                let gbs = moved / t.as_secs_f64() / 1e9;
                println!(
                    "{label:<22} {r:>3} {op:>10} {gbs:>9.1} {:>8.1}%",
                    100.0 * gbs / device_gbs
                );
            }
            println!(
                "{label:<22} {r:>3} {:>10} {:>8.1}us",
                "orth",
                t_orth.as_secs_f64() * 1e6
            );
        }
    }
    Ok(())
}
