//! All-reduce algorithm and bus bandwidth of the thread backend, against memcpy.
//!
//! Definitions as nccl-tests: `algbw = bytes / time`, `busbw = algbw · 2(n-1)/n`. The
//! reference, measured in the same run: the aggregate `copy_from_slice` throughput of one
//! thread per rank, 64 MiB per thread, cold cache (512 MiB streamed through the caches
//! before each repetition), destination already faulted in, bytes counted once.
//!
//! Arguments: `--quick` (fewer sizes and repetitions), `--json` (one object per line).
//! Driven by `cargo xtask bench collectives`.

#[path = "common/mod.rs"]
mod common;

use collectives::{run_local, ProcessGroup};

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let quick = argv.iter().any(|a| a == "--quick");
    let json = argv.iter().any(|a| a == "--json");
    let reps = if quick { 3 } else { 5 };
    common::header(json);
    for ranks in [2, 4] {
        let memcpy = common::memcpy_reference(ranks, 7);
        for bytes in common::sizes(quick) {
            let out = run_local(ranks, |g| {
                common::allreduce_time(&g as &dyn ProcessGroup, bytes, reps)
            })
            .expect("ranks");
            let t = out
                .into_iter()
                .map(|r| r.expect("rank").as_secs_f64())
                .fold(0.0, f64::max);
            common::row(json, "threads", ranks, bytes, t, memcpy);
        }
    }
}
