//! Allocation limits: a tensor or buffer whose size comes from the caller (a shape, a
//! batch of zero-width samples, a micro-batch count) is checked, and one too large for the
//! address space or refused by the allocator is `Error::ShapeOverflow` or `Error::Alloc`,
//! never a panic ("capacity overflow", an arithmetic overflow) or an abort (the
//! allocator's `handle_alloc_error`).
//!
//! The refused cases run in a child process (this test binary again, one `#[ignore]`d
//! test, under `ulimit -v` of 8 GiB), so that the refusal does not depend on the
//! machine's memory or overcommit policy and an abort shows as the child's signal.

use pipe::cpu::{BatchNorm, CpuTensor, Linear};

use pipe::{Batch, Context, Error, Layer, MicroBatch, Tensor};
use std::process::Command;

/// Set in the child's environment: the `#[ignore]`d test below runs only there.
const CHILD: &str = "PIPE_ALLOC_TEST_CHILD";
/// The child's address-space limit in KiB (8 GiB).
const LIMIT_KIB: u64 = 8 << 20;

/// `Linear(inputs, outputs)`'s forward pass on `x`.
fn linear_forward(inputs: usize, outputs: usize, x: CpuTensor) -> Result<CpuTensor, Error> {
    let mut ctx = Context::new(true, 0, 0, 1);
    let (y, _saved) = Linear::new(inputs, outputs, 1).forward(Batch::single(x), &mut ctx)?;
    y.into_single()
}

#[test]
fn requests_beyond_the_address_space_are_errors() {
    // Shapes whose element count overflows, or whose f32s exceed isize::MAX bytes: refused
    // before the allocator is asked, so this holds in any process (AddressSanitizer runs
    // included).
    for shape in [
        &[1usize << 32, 1 << 32][..],
        &[0, 1 << 40, 1 << 40],
        &[usize::MAX, 2],
    ] {
        assert!(
            matches!(
                CpuTensor::try_zeros(shape),
                Err(Error::ShapeOverflow { .. })
            ),
            "{shape:?}"
        );
        assert!(matches!(
            CpuTensor::try_ones(shape),
            Err(Error::ShapeOverflow { .. })
        ));
    }
    let r = CpuTensor::try_zeros(&[usize::MAX / 2]);
    assert!(
        matches!(r, Err(Error::Alloc { elements, element_bytes: 4, .. }) if elements == usize::MAX / 2),
        "{r:?}"
    );
    assert!(matches!(
        Linear::try_new(1 << 32, 1 << 32, 0),
        Err(Error::ShapeOverflow { .. })
    ));
    assert!(matches!(
        BatchNorm::try_with(usize::MAX / 2, 0.1, 1e-5),
        Err(Error::Alloc { .. })
    ));
    // A micro-batch plan of usize::MAX / 2 entries (a batch of that many zero-width
    // samples): more than isize::MAX bytes.
    let r = MicroBatch::plan(usize::MAX / 2, usize::MAX / 2);
    assert!(
        matches!(r, Err(Error::Alloc { op: "MicroBatch::plan", elements, .. }) if elements == usize::MAX / 2),
        "{:?}",
        r.map(|p| p.len())
    );
    // A layer whose output size is the product of the input's rows and its own width:
    // [usize::MAX / 2, 0] holds nothing, its output would hold rows x outputs.
    let zero_width = || CpuTensor::zeros(&[usize::MAX / 2, 0]);
    let r = linear_forward(0, 4, zero_width());
    assert!(
        matches!(
            r,
            Err(Error::ShapeOverflow {
                op: "Linear::forward",
                ..
            })
        ),
        "{r:?}"
    );
    let r = linear_forward(0, 1, zero_width());
    assert!(
        matches!(
            r,
            Err(Error::Alloc {
                op: "Linear::forward",
                ..
            })
        ),
        "{r:?}"
    );
    // Split sizes whose sum overflows.
    let r = CpuTensor::zeros(&[1, 2]).split(&[usize::MAX, 2]);
    assert!(matches!(r, Err(Error::SplitSizes { len: 1, .. })), "{r:?}");
    // Valid sizes are unchanged.
    assert_eq!(
        CpuTensor::try_zeros(&[2, 3]).unwrap(),
        CpuTensor::zeros(&[2, 3])
    );
    assert_eq!(CpuTensor::try_ones(&[4]).unwrap().to_vec(), vec![1.0; 4]);
    assert_eq!(CpuTensor::try_zeros(&[]).unwrap().to_vec(), vec![0.0]);
    assert_eq!(MicroBatch::plan(5, 4).unwrap().len(), 4);
    let a = Linear::try_new(3, 2, 7).unwrap();
    assert_eq!(a.weight(), Linear::new(3, 2, 7).weight());
    let y = linear_forward(0, 3, CpuTensor::zeros(&[2, 0])).unwrap();
    assert_eq!(y.shape(), &[2, 3]);
}

#[test]
fn refused_allocations_are_errors_not_aborts() {
    if let Some(why) = no_limited_child() {
        println!("skipped: refused_allocations_are_errors_not_aborts: {why}");
        return;
    }
    let out = run_child("refused_allocations_child");
    println!("{out}");
    assert!(
        out.contains("alloc child: done"),
        "the child did not run:\n{out}"
    );
}

#[test]
#[ignore = "run by refused_allocations_are_errors_not_aborts under a limited address space"]
fn refused_allocations_child() {
    if std::env::var_os(CHILD).is_none() {
        println!("skipped: runs only as the child of refused_allocations_are_errors_not_aborts");
        return;
    }
    // Within isize::MAX, beyond the 8 GiB limit.
    let r = CpuTensor::try_zeros(&[1 << 20, 1 << 20]);
    println!(
        "try_zeros([2^20, 2^20]): {:?}",
        r.as_ref().map(|t| t.size_bytes())
    );
    assert!(matches!(r, Err(Error::Alloc { elements, .. }) if elements == 1 << 40));
    assert!(r.unwrap_err().to_string().contains("out of memory"));
    // A plan of 2^40 micro-batches (24 TiB of them).
    let r = MicroBatch::plan(1 << 40, 1 << 40);
    println!(
        "MicroBatch::plan(2^40, 2^40): {:?}",
        r.as_ref().map(|p| p.len())
    );
    assert!(matches!(
        r,
        Err(Error::Alloc {
            op: "MicroBatch::plan",
            ..
        })
    ));
    // [2^40, 0] holds nothing; Linear(0, 1)'s output of it would hold 2^40 f32s (4 TiB).
    let r = linear_forward(0, 1, CpuTensor::zeros(&[1 << 40, 0]));
    println!("Linear(0, 1).forward([2^40, 0]): {r:?}");
    assert!(
        matches!(r, Err(Error::Alloc { op: "Linear::forward", elements, .. }) if elements == 1 << 40)
    );
    // Memory is usable again afterwards.
    assert_eq!(
        CpuTensor::try_zeros(&[1 << 20]).unwrap().size_bytes(),
        4 << 20
    );
    println!("alloc child: done");
}

/// Why a child under `ulimit -v` cannot run here, if it cannot. AddressSanitizer
/// (`cargo xtask sanitize` sets `ASAN_OPTIONS`) reserves terabytes of shadow memory, so a
/// child under the limit could not start, and it handles huge requests itself.
fn no_limited_child() -> Option<String> {
    if !cfg!(target_os = "linux") {
        return Some("needs Linux (/bin/sh ulimit -v)".into());
    }
    if std::env::var_os("ASAN_OPTIONS").is_some() {
        return Some(
            "ASAN_OPTIONS is set: an AddressSanitizer run cannot start under ulimit -v".into(),
        );
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    (vm_kib > LIMIT_KIB / 2).then(|| {
        format!("this process already maps {vm_kib} KiB of address space (a sanitizer's shadow?)")
    })
}

/// Runs the `#[ignore]`d test `name` of this binary in a child limited to `LIMIT_KIB` of
/// address space and returns its output; panics (naming the signal) unless it passed.
fn run_child(name: &str) -> String {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("ulimit -v {LIMIT_KIB} && exec \"$0\" \"$@\""))
        .arg(exe)
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .expect("starting the child through /bin/sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    use std::os::unix::process::ExitStatusExt;
    assert!(
        out.status.success(),
        "the child {name} failed ({}), output:\n{text}",
        match out.status.signal() {
            Some(s) => format!(
                "killed by signal {s}{}",
                if s == 6 { " (SIGABRT)" } else { "" }
            ),
            None => format!("exit status {:?}", out.status.code()),
        }
    );
    text
}
