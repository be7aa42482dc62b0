//! The teacher-student task of the `train` example, shortened: PowerSGD with error
//! feedback trains as well as the exact all-reduce (the full 1000-step comparison is
//! `cargo run --release -p ddp-hooks --example train -- --compare`).

#[path = "../examples/mlp/mod.rs"]
mod mlp;

use ddp_hooks::HookSpec;

#[test]
fn powersgd_with_error_feedback_matches_allreduce() {
    let steps = 300;
    let (base, initial) = mlp::train(2, steps, &"allreduce".parse::<HookSpec>().unwrap());
    assert!(
        base < 0.5 * initial,
        "training must learn: {initial} -> {base}"
    );
    for rank in [1, 4] {
        let spec: HookSpec = format!("powersgd:rank={rank},start_iter=10")
            .parse()
            .unwrap();
        let (loss, _) = mlp::train(2, steps, &spec);
        assert!(
            loss <= 1.01 * base,
            "rank {rank}: {loss} vs allreduce {base}"
        );
    }
}
