//! Allocation limits: a buffer too large for the address space, or one the allocator
//! refuses, is `Error::Alloc`, never a panic ("capacity overflow") or an abort (the
//! allocator's `handle_alloc_error`), in `Buffer::try_zeros` and in the thread backend's
//! collectives that allocate their output.
//!
//! The refused cases run in a child process (this test binary again, one `#[ignore]`d
//! test, under `ulimit -v` of 8 GiB), so that the refusal does not depend on the
//! machine's memory or overcommit policy and an abort shows as the child's signal.

use collectives::{run_local, Buffer, DType, Error, ProcessGroup, ReduceOp};
use std::process::Command;

/// Set in the child's environment: the `#[ignore]`d test below runs only there.
const CHILD: &str = "COLLECTIVES_ALLOC_TEST_CHILD";
/// The child's address-space limit in KiB (8 GiB).
const LIMIT_KIB: u64 = 8 << 20;

/// Whether `r` is the allocation error for `elements` of `bytes` bytes each.
fn is_alloc_error<T>(r: &collectives::Result<T>, elements: usize, bytes: usize) -> bool {
    matches!(r, Err(Error::Alloc { elements: e, element_bytes: b }) if (*e, *b) == (elements, bytes))
}

#[test]
fn requests_beyond_the_address_space_are_errors() {
    // More than isize::MAX bytes: refused before the allocator is asked, so this holds in
    // any process (AddressSanitizer runs included).
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for len in [usize::MAX / 2, usize::MAX] {
            let r = Buffer::try_zeros(dtype, len);
            assert!(
                is_alloc_error(&r, len, dtype.size()),
                "try_zeros({dtype:?}, {len}): {:?}",
                r.map(|b| b.len())
            );
        }
    }
    // The element count fits, its bytes do not (2^60 f64 are 2^63 bytes).
    let r = Buffer::try_zeros(DType::F64, 1 << 60);
    assert!(is_alloc_error(&r, 1 << 60, 8));
    assert!(r.unwrap_err().to_string().contains("isize::MAX"));
    // Valid sizes are unchanged.
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let b = Buffer::try_zeros(dtype, 1000).unwrap();
        assert_eq!(b, Buffer::zeros(dtype, 1000));
        assert!(b.len() == 1000 && b.as_bytes().iter().all(|&x| x == 0));
    }
    let b = Buffer::F32(vec![1.0, 2.5, -3.0]);
    assert_eq!(b.try_narrowed(DType::F16).unwrap(), b.narrowed(DType::F16));
    assert_eq!(
        b.try_narrowed(DType::F16).unwrap().try_widened().unwrap(),
        b
    );
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
    // 4 TiB: within isize::MAX, beyond the 8 GiB limit.
    let r = Buffer::try_zeros(DType::F32, 1 << 40);
    println!("try_zeros(F32, 2^40): {:?}", r.as_ref().map(|b| b.len()));
    assert!(is_alloc_error(&r, 1 << 40, 4));
    assert!(r.unwrap_err().to_string().contains("out of memory"));
    // Two ranks of 3 GiB each fit (zeroed lazily, never touched); the 3 GiB copy each
    // all_gather needs for its peer does not, on either rank (6 GiB held by the inputs,
    // 3 GiB more asked). Both reject the collective
    // before posting anything, so both get the error and the group stays usable.
    let results = run_local(2, |g| {
        let big = Buffer::try_zeros(DType::F32, 3 << 28)?;
        // Both inputs exist before either rank asks for its copy: a rank that ran ahead
        // would otherwise fit its copy in the room its peer's input still needs.
        g.barrier().wait()?;
        let gathered = g.all_gather(big).wait().map(|v| v.len());
        let after = g.all_reduce(Buffer::F32(vec![1.0]), ReduceOp::Sum).wait()?;
        Ok::<_, Error>((gathered, after))
    })
    .unwrap();
    println!("all_gather of 3 GiB on 2 ranks: {results:?}");
    for r in results {
        let (gathered, after) = r.unwrap().unwrap();
        assert!(is_alloc_error(&gathered, 3 << 28, 4), "{gathered:?}");
        assert_eq!(after, Buffer::F32(vec![2.0]));
    }
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
