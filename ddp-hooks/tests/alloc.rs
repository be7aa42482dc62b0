//! Allocation limits: a buffer too large for the address space, or one the allocator
//! refuses, is `Error::Overflow` or `Error::Alloc` (the 16-bit wire wrapper:
//! `collectives::Error::Alloc`), never a panic ("capacity overflow") or an abort (the
//! allocator's `handle_alloc_error`): bucket storage, `CommBackend::try_alloc`, kernel
//! allocations converted from `lowrank::Error`, and `HalfWire`'s narrowed copies.
//!
//! The refused cases run in a child process (this test binary again, one `#[ignore]`d
//! test, under `ulimit -v` of 8 GiB), so that the refusal does not depend on the
//! machine's memory or overcommit policy and an abort shows as the child's signal.

use collectives::{run_local, Buffer, DType, ProcessGroup};
use ddp_hooks::{CommBackend, Error, HalfWire, Noop, Reducer, ReducerConfig};
use lowrank::{f16, Backend, CpuBackend};
use std::process::Command;
use std::sync::Arc;

/// Set in the child's environment: the `#[ignore]`d test below runs only there.
const CHILD: &str = "DDP_HOOKS_ALLOC_TEST_CHILD";
/// The child's address-space limit in KiB (8 GiB).
const LIMIT_KIB: u64 = 8 << 20;

/// A reducer over parameters of `shapes` (its buckets' storage is allocated at once).
fn reducer(shapes: &[Vec<usize>]) -> ddp_hooks::Result<Reducer<CpuBackend, Noop<CpuBackend>>> {
    let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
    Reducer::new(be, shapes, Noop::new(), ReducerConfig::default())
}

#[test]
fn requests_beyond_the_address_space_are_errors() {
    // More than isize::MAX bytes, or a shape whose element count overflows: refused before
    // the allocator is asked, so this holds in any process.
    let cpu = CpuBackend::new();
    for shape in [vec![usize::MAX / 2], vec![1 << 32, 1 << 32], vec![1 << 62]] {
        let r = reducer(std::slice::from_ref(&shape));
        assert!(
            matches!(r, Err(Error::Overflow(_))),
            "{shape:?}: {:?}",
            r.err()
        );
    }
    let r = cpu.try_alloc::<f32>(usize::MAX / 2);
    assert!(
        matches!(r, Err(Error::Overflow(_))),
        "{:?}",
        r.map(|v| v.len())
    );
    // A kernel-layer allocation error keeps its meaning across the crate boundary.
    let e = Error::from(cpu.alloc::<f32>(usize::MAX / 2).unwrap_err());
    assert!(matches!(e, Error::Overflow(_)), "{e:?}");
    // Valid sizes are unchanged: zeroed storage of the right length.
    let v = cpu.try_alloc::<f32>(1 << 20).unwrap();
    assert!(v.len() == 1 << 20 && v.iter().all(|&x| x == 0.0));
    let r = reducer(&[vec![3, 4], vec![5]]).unwrap();
    assert!(r.grad(0).unwrap().len() == 12 && r.grad(1).unwrap().iter().all(|&x| x == 0.0));
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
    let alloc_2_40 = |e: &Error| matches!(e, Error::Alloc { elements, element_bytes: 4 } if *elements == 1 << 40);
    // 4 TiB: within isize::MAX, beyond the 8 GiB limit.
    let r = reducer(&[vec![1 << 20, 1 << 20]]);
    println!("Reducer::new([[2^20, 2^20]]): {:?}", r.as_ref().err());
    assert!(r.as_ref().is_err_and(alloc_2_40));
    let r = CpuBackend::new().try_alloc::<f32>(1 << 40);
    println!("try_alloc::<f32>(2^40): {:?}", r.as_ref().map(|v| v.len()));
    assert!(r.as_ref().is_err_and(alloc_2_40));
    let e = Error::from(CpuBackend::new().alloc::<f32>(1 << 40).unwrap_err());
    println!("Error::from(alloc::<f32>(2^40) error): {e:?}");
    assert!(alloc_2_40(&e));
    // HalfWire narrows a 6 GiB f32 buffer (it fits, zeroed lazily) into 3 GiB of f16
    // (they do not): an error on the work, and the group stays usable.
    let results = run_local(1, |g| {
        let wire = HalfWire::<f16>::new(Arc::new(g));
        let big = Buffer::try_zeros(DType::F32, 6 << 28)?;
        let failed = wire.broadcast(big, 0).wait().map(|b| b.len());
        let small = wire.broadcast(Buffer::F32(vec![1.5]), 0).wait()?;
        Ok::<_, collectives::Error>((failed, small))
    })
    .unwrap();
    println!("HalfWire<f16>::broadcast of 6 GiB: {results:?}");
    let (failed, small) = results.into_iter().next().unwrap().unwrap().unwrap();
    assert!(
        matches!(failed, Err(collectives::Error::Alloc { elements, element_bytes: 2 }) if elements == 6 << 28)
    );
    assert_eq!(small, Buffer::F32(vec![1.5]));
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
