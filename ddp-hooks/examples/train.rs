//! Data-parallel training of the teacher-student regression task with a chosen
//! communication hook, on thread ranks: PyTorch's PowerSGD measurement, reproduced.
//! `cargo xtask train` builds and drives it (progress bar, comparison table, the resume
//! check); it also runs on its own:
//!
//! ```sh
//! cargo run --release -p ddp-hooks --example train -- --hook powersgd:rank=2,start_iter=10 --accumulate 4
//! cargo run --release -p ddp-hooks --example train -- --compare     # allreduce vs PowerSGD ranks 1, 2, 4
//! cargo run --release -p ddp-hooks --example train -- --local-sgd 16  # post-local SGD, averaging every 16 steps
//! cargo run --release -p ddp-hooks --example train -- --diloco 64     # DiLoCo, H = 64, allreduce of the pseudo-gradient
//! ```
//!
//! Besides a per-step hook, two methods that communicate less often: post-local SGD
//! (`--local-sgd PERIOD`: the `PostLocalSgd` hook averages gradients for the first
//! `--local-sgd-start` steps, then nothing per step, and a `PeriodicModelAverager`
//! averages the parameters every PERIOD steps) and DiLoCo (`--diloco H`: H local steps,
//! then an outer Nesterov step on the pseudo-gradient that `--hook` reduces). Both end
//! with one more parameter average so that every rank ends with the same model. Rank 0
//! reports its held-out loss every `--eval-every` steps (25).
//!
//! MLP 64 -> 128 -> 128 -> 32 (tanh), teacher a fixed random model of the same shape,
//! inputs N(0, I), target noise 0.01, 2048 samples and batch 64 per rank, SGD lr 0.05
//! momentum 0.9; 4 ranks and 1000 steps by default. Prints the final loss on 512
//! held-out samples, the bytes each rank sent and the step time predicted at 1 and
//! 10 Gbit/s (`collectives::link`). `--help` lists the arguments; a bad one exits with
//! status 2. The same loop runs across processes in `train_mpi.rs`.

#[path = "mlp/mod.rs"]
mod mlp;

use mlp::{cli, trainer};
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{}", cli::USAGE);
        return ExitCode::SUCCESS;
    }
    let c = match cli::parse(&args, 4) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("train: {e}\n\n{}", cli::USAGE);
            return ExitCode::from(2);
        }
    };
    for hook in &c.hooks {
        let mut config = c.config.clone();
        config.hook_text = hook.clone();
        config.hook = match cli::spec(hook) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("train: {e}");
                return ExitCode::from(2);
            }
        };
        if let Some(note) = cli::start_iter_note(&config) {
            eprintln!("train: {note}");
        }
        cli::print_start(c.json, &config, "threads");
        let json = c.json;
        match trainer::run_threads(&config, &c.plan, &|e| cli::print_event(json, e)) {
            Ok(out) => cli::print_done(c.json, &config, &out),
            Err(e) => {
                eprintln!("train: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
