//! The registry's unit tests.

use super::*;

#[test]
fn parses_post_local_sgd() {
    assert_eq!(
        "post_local_sgd:start_iter=10".parse::<HookSpec>().unwrap(),
        HookSpec::PostLocalSgd {
            start_iter: 10,
            subgroup_size: None,
            allreduce: true
        }
    );
    assert_eq!(
        "post_local_sgd:start_iter=0,subgroup_size=2,allreduce=false"
            .parse::<HookSpec>()
            .unwrap(),
        HookSpec::PostLocalSgd {
            start_iter: 0,
            subgroup_size: Some(2),
            allreduce: false
        }
    );
    for (bad, says) in [
        ("post_local_sgd", "needs start_iter"),
        ("post_local_sgd:start_iter=x", "non-negative integer"),
        (
            "post_local_sgd:start_iter=1,subgroup_size=0",
            "positive integer",
        ),
        (
            "post_local_sgd:start_iter=1,allreduce=maybe",
            "true or false",
        ),
        ("post_local_sgd:start_iter=1,start_iter=2", "given twice"),
        (
            "post_local_sgd:start_iter=1,period=4",
            "unknown post_local_sgd option",
        ),
    ] {
        let e = bad.parse::<HookSpec>().unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

#[test]
fn parses_names_and_options() {
    assert_eq!(
        "allreduce".parse::<HookSpec>().unwrap(),
        HookSpec::AllReduce
    );
    assert_eq!(" FP16 ".parse::<HookSpec>().unwrap(), HookSpec::Fp16);
    assert_eq!("bf16".parse::<HookSpec>().unwrap(), HookSpec::Bf16);
    assert_eq!("noop".parse::<HookSpec>().unwrap(), HookSpec::Noop);
    let HookSpec::PowerSgd(c) = "powersgd:rank=2,start_iter=10,warm_start=false"
        .parse()
        .unwrap()
    else {
        panic!("not PowerSGD")
    };
    assert_eq!(
        (
            c.matrix_approximation_rank,
            c.start_powersgd_iter,
            c.warm_start
        ),
        (2, 10, false)
    );
    assert_eq!(
        "powersgd".parse::<HookSpec>().unwrap(),
        HookSpec::PowerSgd(PowerSgdConfig::default())
    );
}

/// The quantisation hooks, under their names and PyTorch's, with `bucket_size`.
#[test]
fn parses_quantize_hooks() {
    let parse = |s: &str| s.parse::<HookSpec>().unwrap();
    let tensor = |error_feedback| HookSpec::QuantizePerTensor { error_feedback };
    assert_eq!(parse("quantize_per_tensor"), tensor(false));
    assert_eq!(parse(" QUANTIZE_PER_TENSOR "), tensor(false));
    assert_eq!(parse("quantize_per_tensor:"), tensor(false));
    let channel = |bucket_size| HookSpec::QuantizePerChannel {
        bucket_size,
        error_feedback: false,
    };
    assert_eq!(parse("quantize_per_channel"), channel(512));
    assert_eq!(parse("QUANTIZE_PER_CHANNEL"), channel(512));
    assert_eq!(parse("quantize_per_channel:bucket_size=1"), channel(1));
    assert_eq!(
        parse("quantize_per_channel: bucket_size = 64 ,"),
        channel(64)
    );
    assert!(
        names::KNOWN.contains("quantize_per_tensor")
            && names::KNOWN.contains("quantize_per_channel")
    );
}

/// Error feedback: the `+ef` suffix and the `error_feedback` option are the same spec.
#[test]
fn parses_quantize_error_feedback() {
    let parse = |s: &str| s.parse::<HookSpec>().unwrap();
    let tensor = |error_feedback| HookSpec::QuantizePerTensor { error_feedback };
    let channel = |bucket_size, error_feedback| HookSpec::QuantizePerChannel {
        bucket_size,
        error_feedback,
    };
    assert_eq!(parse("quantize_per_tensor+ef"), tensor(true));
    assert_eq!(parse(" Quantize_Per_Tensor +EF "), tensor(true));
    assert_eq!(
        parse("quantize_per_tensor:error_feedback=true"),
        tensor(true)
    );
    assert_eq!(
        parse("quantize_per_tensor:error_feedback=false"),
        tensor(false)
    );
    assert_eq!(parse("quantize_per_channel+ef"), channel(512, true));
    assert_eq!(
        parse("quantize_per_channel+ef:bucket_size=16"),
        channel(16, true)
    );
    assert_eq!(
        parse("quantize_per_channel:bucket_size=16,error_feedback=true"),
        channel(16, true)
    );
    assert_eq!(
        parse("quantize_per_channel:error_feedback=false,bucket_size=3"),
        channel(3, false)
    );
}

/// The built hooks are named as the registry spells them, and save and load their
/// (stateless) state only into their own kind and configuration.
#[test]
fn builds_quantize_hooks() {
    let groups = collectives::ThreadGroup::create(1, std::time::Duration::from_secs(10)).unwrap();
    let group: Arc<dyn ProcessGroup> = Arc::new(groups.into_iter().next().unwrap());
    let be = Arc::new(lowrank::CpuBackend::new());
    let build = |s: &str| {
        s.parse::<HookSpec>()
            .unwrap()
            .build(be.clone(), group.clone())
            .unwrap()
    };
    let t = build("quantize_per_tensor");
    assert_eq!(t.name(), "quantize_per_tensor");
    let c = build("quantize_per_channel");
    assert_eq!(c.name(), "quantize_per_channel");
    let c64 = build("quantize_per_channel:bucket_size=64");
    assert_eq!(c64.name(), "quantize_per_channel:bucket_size=64");
    assert_eq!(
        c64.name().parse::<HookSpec>().unwrap(),
        HookSpec::QuantizePerChannel {
            bucket_size: 64,
            error_feedback: false
        }
    );
    // With error feedback: named with `+ef`, which parses back to the same spec.
    for (spec, name) in [
        (
            "quantize_per_tensor:error_feedback=true",
            "quantize_per_tensor+ef",
        ),
        ("quantize_per_channel+ef", "quantize_per_channel+ef"),
        (
            "quantize_per_channel:bucket_size=64,error_feedback=true",
            "quantize_per_channel+ef:bucket_size=64",
        ),
    ] {
        let h = build(spec);
        assert_eq!(h.name(), name);
        assert_eq!(name.parse::<HookSpec>().unwrap(), spec.parse().unwrap());
        h.load_state(h.save_state().unwrap()).unwrap();
        assert!(matches!(
            h.load_state(c.save_state().unwrap()),
            Err(Error::State(_))
        ));
        assert!(matches!(
            c.load_state(h.save_state().unwrap()),
            Err(Error::State(_))
        ));
    }
    c.load_state(c.save_state().unwrap()).unwrap();
    assert!(matches!(
        c64.load_state(c.save_state().unwrap()),
        Err(Error::State(_))
    ));
    assert!(matches!(
        t.load_state(c.save_state().unwrap()),
        Err(Error::State(_))
    ));
    assert_eq!(t.compression_stats().unwrap().before, 0);
    assert!(matches!(
        HookSpec::QuantizePerChannel {
            bucket_size: 0,
            error_feedback: true
        }
        .build(be.clone(), group.clone()),
        Err(Error::Config(_))
    ));
}

/// `batch_same_shape` absent is PyTorch's `False`; `auto` leaves the flag unset (the
/// backend's choice, resolved when the hook is built); a boolean forces it, in both
/// PowerSGD hooks, under a wrapper and under PyTorch's name.
#[test]
fn batch_same_shape_is_false_unless_given() {
    let batch = |spec: &str| match spec.parse::<HookSpec>().unwrap() {
        HookSpec::PowerSgd(c) | HookSpec::BatchedPowerSgd(c) => c.batch_tensors_with_same_shape,
        HookSpec::Fp16Wrapped(inner) | HookSpec::Bf16Wrapped(inner) => match *inner {
            HookSpec::PowerSgd(c) => c.batch_tensors_with_same_shape,
            other => panic!("{spec}: not PowerSGD inside: {other:?}"),
        },
        other => panic!("{spec}: not PowerSGD: {other:?}"),
    };
    assert_eq!(batch("powersgd:rank=2"), Some(false));
    assert_eq!(batch("powersgd"), Some(false));
    assert_eq!(batch("POWER_SGD"), Some(false));
    assert_eq!(batch("batched_powersgd:rank=2"), Some(false));
    assert_eq!(batch("fp16+powersgd:rank=2"), Some(false));
    assert_eq!(batch("powersgd:rank=2,batch_same_shape=auto"), None);
    assert_eq!(batch("powersgd:batch_tensors_with_same_shape=AUTO"), None);
    assert_eq!(batch("powersgd:rank=2,batch_same_shape=true"), Some(true));
    assert_eq!(batch("powersgd:batch_same_shape=false,rank=2"), Some(false));
    assert_eq!(
        batch("powersgd:batch_tensors_with_same_shape=True"),
        Some(true)
    );
    assert_eq!(
        batch("powersgd:batch_tensors_with_same_shape=0"),
        Some(false)
    );
    assert_eq!(batch("bf16+powersgd:batch_same_shape=1"), Some(true));
}

/// A `+` inside an option value belongs to the value; a wrapper's `+` comes before
/// the options, and a 16-bit hook is not wrapped again.
#[test]
fn plus_signs_in_values_and_wrapped_16_bit_hooks() {
    let HookSpec::PowerSgd(c) = "powersgd:epsilon=1e+3,seed=+7".parse().unwrap() else {
        panic!("not PowerSGD")
    };
    assert_eq!((c.orthogonalization_epsilon, c.random_seed), (1e3, 7));
    let HookSpec::Fp16Wrapped(inner) = "fp16+powersgd:epsilon=1e+3".parse().unwrap() else {
        panic!("not wrapped")
    };
    assert!(matches!(*inner, HookSpec::PowerSgd(_)));
    for spec in ["fp16+bf16", "bf16+fp16", "fp16+fp16", "bf16+bf16_compress"] {
        let e = spec.parse::<HookSpec>().unwrap_err().to_string();
        assert!(e.contains("already sends 16 bits"), "{spec}: {e}");
    }
    let e = "fp16+bf16+powersgd"
        .parse::<HookSpec>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("one wrapper at most"), "{e}");
}

#[test]
fn errors_say_what_is_wrong() {
    for (spec, says) in [
        ("allreduse", "unknown hook `allreduse`"),
        ("fp16:rank=2", "takes no options"),
        ("powersgd:rank", "not key=value"),
        ("powersgd:rank=two", "expected an integer"),
        (
            "powersgd:ranks=2",
            "unknown powersgd option `ranks`; did you mean `rank`?",
        ),
        (
            "powersgd:rank=0",
            "powersgd option `rank=0`: expected an integer in 1..=",
        ),
        ("powersgd:start_iter=1", "start_powerSGD_iter"),
        (
            "powersgd:batch_same_shape=2",
            "true or false (also True, False, 1, 0), or auto",
        ),
        ("powersgd:batch_same_shape=", "true or false"),
        ("fp8+allreduce", "unknown wrapper `fp8`"),
        (
            "quantize_per_tensor:bits=8",
            "unknown quantize_per_tensor option `bits`; known: error_feedback",
        ),
        (
            "quantize_per_tensor:bucket_size=8",
            "unknown quantize_per_tensor option `bucket_size`",
        ),
        (
            "quantize_per_tensor:error_feedback=yes",
            "expected true or false",
        ),
        (
            "quantize_per_channel+ef:error_feedback=true",
            "given with the `+ef` suffix",
        ),
        (
            "quantize_per_channel:error_feedback=true,error_feedback=false",
            "`error_feedback` is given twice",
        ),
        (
            "powersgd+ef",
            "`+ef` (error feedback) follows a quantisation hook",
        ),
        ("fp16+quantize_per_tensor+ef", "one wrapper at most"),
        ("quantize_per_channel:bucket_size", "not key=value"),
        (
            "quantize_per_channel:bucket_size=0",
            "`bucket_size=0`: expected a positive integer",
        ),
        (
            "quantize_per_channel:bucket_size=-1",
            "expected a positive integer",
        ),
        (
            "quantize_per_channel:bucket_size=big",
            "expected a positive integer",
        ),
        (
            "quantize_per_channel:rows=4",
            "unknown quantize_per_channel option `rows`",
        ),
        (
            "quantize_per_channel:bucket_size=4,bucket_size=8",
            "`bucket_size` is given twice",
        ),
        ("fp16+quantize_per_tensor", "already sends 8 bits"),
        (
            "bf16+quantize_per_channel:bucket_size=4",
            "already sends 8 bits",
        ),
        ("quantize", "unknown hook `quantize`"),
    ] {
        let e = spec.parse::<HookSpec>().unwrap_err().to_string();
        assert!(e.contains(says), "{spec}: {e}");
    }
}

/// Regression: the parts of a spec an error quotes were shown raw, so a spec with
/// ESC, CR, NUL or U+202E could forge the log line that reports it.
#[test]
fn errors_quote_the_spec_escaped() {
    let forge = "\x1b[31m\r\0\u{202e}";
    for spec in [
        forge.to_string(),
        format!("fp16+{forge}"),
        format!("{forge}+allreduce"),
        format!("powersgd:{forge}=1"),
        format!("powersgd:rank={forge}"),
        format!("allreduce:{forge}"),
    ] {
        let e = spec.parse::<HookSpec>().unwrap_err().to_string();
        assert!(
            !e.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{spec:?}: {e:?}"
        );
        assert!(e.contains(r"\u{1b}[31m\r\0\u{202e}"), "{spec:?}: {e:?}");
    }
}
