//! Hook specs in PyTorch's spellings: `DDPCommHookType` members, hook function names and
//! `PowerSGDState` option names parse to the same hook and configuration as ours, build
//! hooks that reduce the same, and bad specs say what to type.

use collectives::{run_local, ProcessGroup, ThreadGroup};
use ddp_hooks::{CommHook, Error, GradBucket, HookSpec, Layout, PowerSgdConfig};
use lowrank::CpuBackend;
use std::sync::Arc;
use std::time::Duration;

fn parse(spec: &str) -> HookSpec {
    spec.parse()
        .unwrap_or_else(|e| panic!("`{spec}` does not parse: {e}"))
}

fn error(spec: &str) -> String {
    match spec.parse::<HookSpec>() {
        Ok(h) => panic!("`{spec}` parsed as {h:?}"),
        Err(e @ Error::Spec { .. }) => e.to_string(),
        Err(other) => panic!("`{spec}`: not a spec error: {other:?}"),
    }
}

/// PyTorch's spelling, and ours for the same hook and configuration.
const SAME: &[(&str, &str)] = &[
    ("ALLREDUCE", "allreduce"),
    ("allreduce_hook", "allreduce"),
    ("FP16_COMPRESS", "fp16"),
    ("fp16_compress_hook", "fp16"),
    ("BF16_COMPRESS", "bf16"),
    ("bf16_compress_hook", "bf16"),
    ("NOOP", "noop"),
    ("noop_hook", "noop"),
    ("QUANTIZE_PER_TENSOR", "quantize_per_tensor"),
    ("quantization_pertensor_hook", "quantize_per_tensor"),
    (
        "quantization_pertensor_hook+ef",
        "quantize_per_tensor:error_feedback=true",
    ),
    (
        "QUANTIZE_PER_CHANNEL",
        "quantize_per_channel:bucket_size=512",
    ),
    (
        "quantization_perchannel_hook:bucket_size=16",
        "quantize_per_channel:bucket_size=16",
    ),
    // `_powerSGD_comm_hook_wrapper(..., matrix_approximation_rank=k,
    // start_powerSGD_iter=1_000)`, every other `PowerSGDState` default.
    ("POWER_SGD", "powersgd:rank=1,start_iter=1000"),
    ("POWER_SGD_RANK2", "powersgd:rank=2,start_iter=1000"),
    (
        "BATCHED_POWER_SGD",
        "batched_powersgd:rank=1,start_iter=1000",
    ),
    (
        "BATCHED_POWER_SGD_RANK2",
        "batched_powersgd:rank=2,start_iter=1000",
    ),
    ("powerSGD_hook", "powersgd"),
    ("batched_powerSGD_hook", "batched_powersgd"),
    (
        "POWER_SGD_RANK2:start_powerSGD_iter=10",
        "powersgd:rank=2,start_iter=10",
    ),
    (
        "powerSGD_hook:matrix_approximation_rank=4,start_powerSGD_iter=10,\
         min_compression_rate=3,use_error_feedback=False,warm_start=True,\
         orthogonalization_epsilon=1e-8,random_seed=7,\
         compression_stats_logging_frequency=5,batch_tensors_with_same_shape=True",
        "powersgd:rank=4,start_iter=10,min_compression_rate=3,error_feedback=false,\
         warm_start=true,epsilon=1e-8,seed=7,stats_every=5,batch_same_shape=true",
    ),
    // Mixed spellings, one per option.
    (
        "powersgd:matrix_approximation_rank=2,start_iter=10,random_seed=3",
        "powersgd:rank=2,start_iter=10,seed=3",
    ),
    (
        "batched_powerSGD_hook:matrix_approximation_rank=2,start_powerSGD_iter=5",
        "batched_powersgd:rank=2,start_iter=5",
    ),
    (
        "post_localSGD_hook:start_localSGD_iter=5,post_local_gradient_allreduce=False",
        "post_local_sgd:start_iter=5,allreduce=false",
    ),
    (
        "fp16_compress_wrapper+powerSGD_hook:matrix_approximation_rank=2,start_powerSGD_iter=10",
        "fp16+powersgd:rank=2,start_iter=10",
    ),
    ("bf16_compress_wrapper+POWER_SGD", "bf16+powersgd"),
];

#[test]
fn pytorch_names_parse_to_our_specs() {
    for (theirs, ours) in SAME {
        assert_eq!(parse(theirs), parse(ours), "`{theirs}` vs `{ours}`");
    }
}

/// `DDPCommHookType.POWER_SGD` is `PowerSGDState(matrix_approximation_rank=1,
/// start_powerSGD_iter=1_000)` with `PowerSGDState`'s other defaults, written out from
/// PyTorch's signature; `POWER_SGD_RANK2` the same at rank 2.
#[test]
fn power_sgd_members_carry_pytorchs_defaults() {
    let pytorch = |rank| PowerSgdConfig {
        matrix_approximation_rank: rank,
        start_powersgd_iter: 1_000,
        min_compression_rate: 2.0,
        use_error_feedback: true,
        warm_start: true,
        orthogonalization_epsilon: 0.0,
        random_seed: 0,
        compression_stats_logging_frequency: 10_000,
        batch_tensors_with_same_shape: Some(false),
    };
    assert_eq!(parse("POWER_SGD"), HookSpec::PowerSgd(pytorch(1)));
    assert_eq!(parse("POWER_SGD_RANK2"), HookSpec::PowerSgd(pytorch(2)));
    assert_eq!(
        parse("BATCHED_POWER_SGD"),
        HookSpec::BatchedPowerSgd(pytorch(1))
    );
    assert_eq!(
        parse("BATCHED_POWER_SGD_RANK2"),
        HookSpec::BatchedPowerSgd(pytorch(2))
    );
    assert_eq!(PowerSgdConfig::default(), pytorch(1));
}

/// The built hooks are the same: the same `name()` for each pair.
#[test]
fn pytorch_names_build_the_same_hooks() {
    let group: Arc<dyn ProcessGroup> = Arc::new(
        ThreadGroup::create(1, Duration::from_secs(10))
            .unwrap()
            .pop()
            .unwrap(),
    );
    let be = Arc::new(CpuBackend::new());
    for (theirs, ours) in SAME {
        if theirs.starts_with("post_local") {
            continue; // builds subgroups; compared as specs above
        }
        let a = parse(theirs).build(be.clone(), group.clone()).unwrap();
        let b = parse(ours).build(be.clone(), group.clone()).unwrap();
        assert_eq!(a.name(), b.name(), "`{theirs}` vs `{ours}`");
    }
}

/// Three steps of exact all-reduce and three compressed, on two thread ranks: the
/// outputs of each rank and step.
fn reduce(spec: &str) -> Vec<Vec<Vec<f32>>> {
    let spec = parse(spec);
    let layout = Arc::new(Layout::packed(&[vec![16, 12], vec![12], vec![8, 8]]).unwrap());
    let out = run_local(2, |g| {
        let rank = g.rank();
        let mut hook = spec
            .build(Arc::new(CpuBackend::new()), Arc::new(g))
            .unwrap();
        let outs: Vec<Vec<f32>> = (0..6)
            .map(|step| {
                let grad: Vec<f32> = (0..layout.len())
                    .map(|i| ((i * 7 + step * 13 + rank * 29) % 17) as f32 - 8.0)
                    .collect();
                hook.run(GradBucket::new(0, 1, grad, layout.clone()).unwrap())
                    .wait()
                    .unwrap()
            })
            .collect();
        assert!(
            hook.compression_stats().unwrap().ratio > 1.0,
            "never compressed"
        );
        outs
    })
    .unwrap();
    out.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn power_sgd_members_reduce_as_our_spelling() {
    let rank1 = reduce("POWER_SGD:start_powerSGD_iter=3");
    assert_eq!(rank1, reduce("powersgd:rank=1,start_iter=3"));
    let rank2 = reduce("POWER_SGD_RANK2:start_powerSGD_iter=3");
    assert_eq!(rank2, reduce("powersgd:rank=2,start_iter=3"));
    // The comparison sees the rank: rank 1 and rank 2 differ once compressed...
    assert_ne!(rank1[0][3..], rank2[0][3..]);
    // ... and agree on the exact steps before.
    assert_eq!(rank1[0][..3], rank2[0][..3]);
    assert_eq!(
        reduce("BATCHED_POWER_SGD_RANK2:start_powerSGD_iter=3"),
        reduce("batched_powersgd:rank=2,start_iter=3")
    );
}

#[test]
fn booleans_take_rust_and_python_spellings() {
    let ef = |v: &str| match parse(&format!("powersgd:use_error_feedback={v}")) {
        HookSpec::PowerSgd(c) => c.use_error_feedback,
        other => panic!("{other:?}"),
    };
    for v in ["true", "True", "1"] {
        assert!(ef(v), "{v}");
    }
    for v in ["false", "False", "0"] {
        assert!(!ef(v), "{v}");
    }
    assert_eq!(
        parse("quantize_per_tensor:error_feedback=True"),
        HookSpec::QuantizePerTensor {
            error_feedback: true
        }
    );
    let e = error("powersgd:warm_start=yes");
    assert!(
        e.contains(
            "powersgd option `warm_start=yes`: expected true or false (also True, False, 1, 0)"
        ),
        "{e}"
    );
}

/// `batch_tensors_with_same_shape` is PyTorch's `False` unless given; `auto` is the
/// backend's choice (unset).
#[test]
fn batching_defaults_to_pytorchs_false() {
    let batch = |spec: &str| match parse(spec) {
        HookSpec::PowerSgd(c) => c.batch_tensors_with_same_shape,
        other => panic!("{other:?}"),
    };
    assert_eq!(batch("POWER_SGD"), Some(false));
    assert_eq!(batch("powersgd"), Some(false));
    assert_eq!(
        batch("powerSGD_hook:batch_tensors_with_same_shape=auto"),
        None
    );
    assert_eq!(batch("powersgd:batch_same_shape=auto"), None);
    assert_eq!(
        batch("powersgd:batch_tensors_with_same_shape=1"),
        Some(true)
    );
}

#[test]
fn one_option_under_both_names_is_an_error_naming_both() {
    for (spec, a, b) in [
        (
            "powersgd:rank=2,matrix_approximation_rank=2",
            "rank",
            "matrix_approximation_rank",
        ),
        (
            "POWER_SGD:start_powerSGD_iter=10,start_iter=10",
            "start_powerSGD_iter",
            "start_iter",
        ),
        (
            "post_local_sgd:start_iter=1,start_localSGD_iter=1",
            "start_iter",
            "start_localSGD_iter",
        ),
        (
            "powersgd:batch_same_shape=true,batch_tensors_with_same_shape=true",
            "batch_same_shape",
            "batch_tensors_with_same_shape",
        ),
    ] {
        let e = error(spec);
        assert!(
            e.contains(&format!("options `{a}` and `{b}` are one option")),
            "{e}"
        );
    }
}

#[test]
fn a_rank2_member_fixes_its_rank() {
    let e = error("POWER_SGD_RANK2:matrix_approximation_rank=4");
    assert!(
        e.contains("`POWER_SGD_RANK2` is PowerSGD at matrix_approximation_rank=2"),
        "{e}"
    );
    assert!(e.contains("powersgd:rank=N"), "{e}");
}

/// A known hook with a bad value names the option as typed, the value, and what it
/// takes; never "unknown".
#[test]
fn bad_values_say_what_to_type() {
    for (spec, says) in [
        (
            "powersgd:matrix_approximation_rank=zero",
            "powersgd option `matrix_approximation_rank=zero`: expected an integer in 1..=",
        ),
        (
            "powersgd:matrix_approximation_rank=0",
            "powersgd option `matrix_approximation_rank=0`: expected an integer in 1..=",
        ),
        ("POWER_SGD:rank=-1", "POWER_SGD option `rank=-1`: expected an integer in 1..="),
        (
            "powerSGD_hook:min_compression_rate=-2",
            "powerSGD_hook option `min_compression_rate=-2`: expected a finite number > 0",
        ),
        (
            "powersgd:orthogonalization_epsilon=nan",
            "option `orthogonalization_epsilon=nan`: expected a finite number >= 0",
        ),
        (
            "powersgd:compression_stats_logging_frequency=0",
            "option `compression_stats_logging_frequency=0`: expected a positive integer",
        ),
        (
            "powersgd:random_seed=-3",
            "option `random_seed=-3`: expected a non-negative integer",
        ),
        (
            "powersgd:start_powerSGD_iter=1",
            "option `start_powerSGD_iter=1`: expected an integer > 1 while error feedback or warm start is on",
        ),
        (
            "powersgd:batch_tensors_with_same_shape=maybe",
            "option `batch_tensors_with_same_shape=maybe`: expected true or false (also True, False, 1, 0), or auto",
        ),
        (
            "quantization_perchannel_hook:bucket_size=0",
            "quantization_perchannel_hook option `bucket_size=0`: expected a positive integer",
        ),
        (
            "post_localSGD_hook:start_localSGD_iter=soon",
            "post_localSGD_hook option `start_localSGD_iter=soon`: expected a non-negative integer",
        ),
    ] {
        let e = error(spec);
        assert!(e.contains(says), "{spec}: {e}");
        assert!(!e.contains("unknown"), "{spec}: {e}");
    }
    // PyTorch's own rule is legal with both flags off.
    let HookSpec::PowerSgd(c) =
        parse("powersgd:start_powerSGD_iter=1,use_error_feedback=0,warm_start=False")
    else {
        panic!("not PowerSGD")
    };
    assert_eq!(c.start_powersgd_iter, 1);
}

/// An unknown option lists the hook's options, ours and PyTorch's, and the closest.
#[test]
fn unknown_options_list_both_spellings() {
    let e = error("powerSGD_hook:matrix_rank=2");
    assert!(
        e.contains("unknown powerSGD_hook option `matrix_rank`"),
        "{e}"
    );
    for name in [
        "rank",
        "start_iter",
        "min_compression_rate",
        "error_feedback",
        "warm_start",
        "epsilon",
        "seed",
        "stats_every",
        "batch_same_shape",
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "use_error_feedback",
        "orthogonalization_epsilon",
        "random_seed",
        "compression_stats_logging_frequency",
        "batch_tensors_with_same_shape",
    ] {
        assert!(e.contains(name), "{name} missing: {e}");
    }
    let e = error("powersgd:start_powersgd_itr=10");
    assert!(e.contains("did you mean `start_powerSGD_iter`?"), "{e}");
    let e = error("post_localSGD_hook:start_local_sgd_iter=3");
    assert!(e.contains("did you mean `start_localSGD_iter`?"), "{e}");
    assert!(e.contains("post_local_gradient_allreduce"), "{e}");
    let e = error("QUANTIZE_PER_CHANNEL:bucket=4");
    assert!(e.contains("did you mean `bucket_size`?"), "{e}");
}

/// A near-miss hook name suggests the closest known name.
#[test]
fn near_miss_hook_names_suggest_the_closest() {
    for (spec, near) in [
        ("powersdg:rank=2", "powersgd"),
        ("POWER_SGD_RANK4", "POWER_SGD_RANK2"),
        ("allreduce_hok", "allreduce_hook"),
        ("batched_powerSGD_hooks", "batched_powerSGD_hook"),
        (
            "quantization_per_tensor_hook",
            "quantization_pertensor_hook",
        ),
        ("FP16_COMPRES", "FP16_COMPRESS"),
    ] {
        let e = error(spec);
        assert!(e.contains("unknown hook `"), "{spec}: {e}");
        assert!(
            e.contains(&format!("did you mean `{near}`?")),
            "{spec}: {e}"
        );
    }
    let e = error("zstd");
    assert!(!e.contains("did you mean"), "{e}");
    assert!(
        e.contains("powersgd") && e.contains("DDPCommHookType"),
        "{e}"
    );
}
