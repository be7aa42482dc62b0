//! PowerSGD's compression step on one rank, written once over `Backend`: warm start,
//! `P = G Q`, orthogonalise, `Q = Gᵀ P`, then `M̂ = P Qᵀ` fused with the residual
//! `E = G - M̂` (which PowerSGD's error feedback would add to the next gradient).
//!
//! The gradient is the same matrix every step, with a decaying spectrum (weights 2^-k),
//! so warm start drives the factors to its top singular subspace: the residual falls to
//! the part of the spectrum a rank-4 approximation cannot hold. Run on the CPU:
//!
//! ```sh
//! cargo run --release -p lowrank --example power_iteration
//! ```
//!
//! and with `--features cuda -- --cuda` on a GPU.

use lowrank::{Backend, CpuBackend, Dims, NormalRng};

fn compress<B: Backend>(be: &B, d: Dims, steps: usize) -> lowrank::Result<()> {
    // A gradient with a decaying spectrum: sum of rank-1 terms of weight 2^-k, plus noise.
    let mut rng = NormalRng::new(42);
    let mut u = vec![0.0f32; d.n() * 8];
    let mut v = vec![0.0f32; d.m() * 8];
    rng.fill(&mut u);
    rng.fill(&mut v);
    let mut g_host = vec![0.0f32; d.m_len()];
    rng.fill(&mut g_host);
    for x in g_host.iter_mut() {
        *x *= 1e-3;
    }
    for k in 0..8 {
        let w = 0.5f32.powi(k as i32);
        for i in 0..d.n() {
            for j in 0..d.m() {
                g_host[i * d.m() + j] += w * u[k * d.n() + i] * v[k * d.m() + j];
            }
        }
    }
    let norm: f32 = g_host.iter().map(|x| x * x).sum::<f32>().sqrt();

    let mut e = be.alloc::<f32>(d.m_len())?;
    let mut p = be.alloc::<f32>(d.p_len())?;
    let mut q = be.alloc::<f32>(d.q_len())?;
    be.fill_normal(&mut NormalRng::new(0), B::view_mut(&mut q, ..)?)?;
    let mut host = vec![0.0f32; d.m_len()];
    println!(
        "{} on {d}: compression {:.0}x",
        be.name(),
        d.m_len() as f64 / (d.p_len() + d.q_len()) as f64
    );
    for step in 0..steps {
        let mut x = be.upload(&g_host)?;
        be.orthogonalize(d.batch(), d.m(), d.r(), B::view_mut(&mut q, ..)?, 0.0)?; // warm start
        be.mq(
            d,
            B::view(&x, ..)?,
            B::view(&q, ..)?,
            B::view_mut(&mut p, ..)?,
        )?;
        be.orthogonalize(d.batch(), d.n(), d.r(), B::view_mut(&mut p, ..)?, 0.0)?;
        be.mtp(
            d,
            B::view(&x, ..)?,
            B::view(&p, ..)?,
            B::view_mut(&mut q, ..)?,
        )?;
        be.pqt_error(
            d,
            B::view(&p, ..)?,
            B::view(&q, ..)?,
            B::view_mut(&mut x, ..)?,
            B::view_mut(&mut e, ..)?,
        )?;
        be.download(B::view(&e, ..)?, &mut host)?;
        let err: f32 = host.iter().map(|a| a * a).sum::<f32>().sqrt();
        println!("step {step:>2}: ‖G - M̂‖ / ‖G‖ = {:.4}", err / norm);
    }
    Ok(())
}

fn main() -> lowrank::Result<()> {
    let d = Dims::new(1, 256, 384, 4)?;
    if std::env::args().any(|a| a == "--cuda") {
        #[cfg(feature = "cuda")]
        return compress(&lowrank::CudaBackend::new(0)?, d, 10);
        #[cfg(not(feature = "cuda"))]
        return Err(lowrank::Error::CudaNotCompiled);
    }
    compress(&CpuBackend::new(), d, 10)
}
