//! Allocation limits: a buffer request too large for the address space, or one the
//! allocator refuses, is `Error::Alloc`, never a panic ("capacity overflow") or an abort
//! (the allocator's `handle_alloc_error`).
//!
//! The refused case runs in a child process (this test binary again, one `#[ignore]`d
//! test, under `ulimit -v` of 8 GiB), so that the refusal does not depend on the
//! machine's memory or overcommit policy and an abort shows as the child's signal.

use lowrank::{Backend, CpuBackend, Dims, Error};
use std::process::Command;

/// Set in the child's environment: the `#[ignore]`d tests below run only there.
const CHILD: &str = "LOWRANK_ALLOC_TEST_CHILD";
/// The child's address-space limit in KiB (8 GiB).
const LIMIT_KIB: u64 = 8 << 20;

/// Whether `r` is the allocation error for `elements` of `bytes` bytes each.
fn is_alloc_error<T>(r: &lowrank::Result<Vec<T>>, elements: usize, bytes: usize) -> bool {
    matches!(r, Err(Error::Alloc { elements: e, element_bytes: b }) if (*e, *b) == (elements, bytes))
}

#[test]
fn requests_beyond_the_address_space_are_errors() {
    let cpu = CpuBackend::new();
    // More than isize::MAX bytes: refused before the allocator is asked, so this holds in
    // any process (AddressSanitizer runs included).
    for len in [usize::MAX / 2, usize::MAX, 1 << 62] {
        let r = cpu.alloc::<f32>(len);
        assert!(
            is_alloc_error(&r, len, 4),
            "alloc::<f32>({len}): {:?}",
            r.map(|v| v.len())
        );
    }
    let r = cpu.alloc::<lowrank::f16>(usize::MAX / 2);
    assert!(
        is_alloc_error(&r, usize::MAX / 2, 2),
        "{:?}",
        r.map(|v| v.len())
    );
    let e = cpu.alloc::<f32>(usize::MAX / 2).unwrap_err().to_string();
    assert!(e.contains("isize::MAX"), "{e}");
    // A shape whose element count overflows is refused by its constructor.
    assert!(matches!(
        Dims::new(1 << 32, 1 << 16, 1 << 16, 1),
        Err(Error::Overflow(_))
    ));
    // Valid sizes are unchanged: zeroed, exactly `len` long.
    let v = cpu.alloc::<f32>(1 << 20).unwrap();
    assert!(v.len() == 1 << 20 && v.iter().all(|&x| x == 0.0));
    assert_eq!(cpu.upload(&[1.0f32, 2.0]).unwrap(), vec![1.0, 2.0]);
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
    let cpu = CpuBackend::new();
    // 4 TiB: within isize::MAX, beyond the 8 GiB limit.
    let r = cpu.alloc::<f32>(1 << 40);
    println!("alloc::<f32>(2^40): {:?}", r.as_ref().map(|v| v.len()));
    assert!(is_alloc_error(&r, 1 << 40, 4));
    assert!(r.unwrap_err().to_string().contains("out of memory"));
    // 5 GiB fit (zeroed lazily, never touched here); a copy of them does not.
    let big = cpu.alloc::<f32>(5 << 28).unwrap();
    let r = cpu.upload(std::hint::black_box(&big));
    println!("upload of 5 GiB: {:?}", r.as_ref().map(|v| v.len()));
    assert!(is_alloc_error(&r, 5 << 28, 4));
    drop(big);
    // Memory is usable again afterwards.
    assert_eq!(cpu.alloc::<f32>(1 << 20).unwrap().len(), 1 << 20);
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
