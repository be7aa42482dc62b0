//! Data-parallel training of the teacher-student regression task with a chosen
//! communication hook, on thread ranks: PyTorch's PowerSGD measurement, reproduced.
//!
//! ```sh
//! cargo run --release -p ddp-hooks --example train -- --ranks 2 --steps 1000 --hook powersgd:rank=2,start_iter=10
//! cargo run --release -p ddp-hooks --example train -- --compare     # allreduce vs PowerSGD ranks 1, 2, 4
//! ```
//!
//! MLP 64 -> 128 -> 128 -> 32 (tanh), teacher a fixed random model of the same shape,
//! inputs N(0, I), target noise 0.01, 2048 samples and batch 64 per rank, SGD lr 0.05
//! momentum 0.9. Prints the final loss on 512 held-out samples.

#[path = "mlp/mod.rs"]
mod mlp;

use ddp_hooks::HookSpec;
use mlp::train;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let ranks: usize = get("--ranks").and_then(|v| v.parse().ok()).unwrap_or(2);
    let steps: usize = get("--steps").and_then(|v| v.parse().ok()).unwrap_or(1000);
    let specs: Vec<String> = if args.iter().any(|a| a == "--compare") {
        [
            "allreduce",
            "powersgd:rank=1,start_iter=10",
            "powersgd:rank=2,start_iter=10",
            "powersgd:rank=4,start_iter=10",
        ]
        .map(String::from)
        .to_vec()
    } else {
        vec![get("--hook").unwrap_or_else(|| "allreduce".into())]
    };
    let mut base = None;
    for spec in specs {
        let hook: HookSpec = match spec.parse() {
            Ok(h) => h,
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        };
        let t = std::time::Instant::now();
        let (loss, _) = train(ranks, steps, &hook);
        let rel = base
            .map(|b: f32| format!(" ({:+.2}% vs allreduce)", 100.0 * (loss / b - 1.0)))
            .unwrap_or_default();
        base.get_or_insert(loss);
        println!(
            "{spec:<34} ranks {ranks} steps {steps}: final loss {loss:.6}{rel} [{:.1}s]",
            t.elapsed().as_secs_f64()
        );
    }
}
