//! The same reducer run on two CPU instruction sets (2 thread ranks): the compressed
//! results agree within `common::tolerance`. Plain hooks and PowerSGD in `f32` differ
//! only in summation order (1e-5 relative, and in fact about 1e-6); PowerSGD behind a
//! 16-bit wire rounds its factors, so last-place differences can cross a 16-bit rounding
//! boundary and grow through error feedback: that is what the looser tolerance of
//! `fp16+`/`bf16+` PowerSGD is for, and this test shows that it holds between two real
//! backends on the machine that runs it (the device path's test, `cuda.rs`, uses the same
//! tolerance against the CPU).

mod common;

use collectives::{run_local, ProcessGroup};
use common::{assert_close, train};
use lowrank::{CpuBackend, Isa};
use std::sync::Arc;

const SPECS: &[&str] = &[
    "allreduce",
    "fp16",
    "powersgd:rank=2,start_iter=2",
    "fp16+powersgd:rank=2,start_iter=2",
    "bf16+powersgd:rank=2,start_iter=2",
];

fn run(isa: Isa, spec: &'static str) -> Vec<Vec<f32>> {
    run_local(2, move |g| {
        let rank = g.rank();
        let be = CpuBackend::new().with_isa(isa).unwrap();
        train(
            Arc::new(be),
            Arc::new(g) as Arc<dyn ProcessGroup>,
            spec,
            rank,
        )
    })
    .unwrap()
    .remove(0)
    .unwrap()
}

#[test]
fn instruction_sets_agree_within_the_wire_tolerance() {
    let isas = Isa::supported();
    let Some((&best, others)) = isas.split_first().filter(|(_, o)| !o.is_empty()) else {
        println!("skipped: one instruction set here ({isas:?}), nothing to compare");
        return;
    };
    for &spec in SPECS {
        let a = run(best, spec);
        for &isa in others {
            assert_close(
                &format!("{isa:?} against {best:?}"),
                spec,
                &a,
                &run(isa, spec),
            );
            println!("{spec}: {isa:?} agrees with {best:?}");
        }
    }
}
