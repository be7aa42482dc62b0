//! `cargo xtask test`: every test that can run on this machine, and a line for each
//! optional suite that cannot.

use crate::{cargo, on_path, run_status, Failure};

/// A suite that needs system software this machine may lack.
struct Optional {
    name: &'static str,
    /// Programs that must be on `PATH`.
    needs: &'static [&'static str],
    /// Debian packages that provide them.
    packages: &'static str,
    /// The `cargo` arguments that run it.
    cargo_args: &'static [&'static str],
}

/// The optional suites. The MPI backend of `collectives` (issue 3) will add its
/// `mpirun -np 2` suite here.
const OPTIONAL: &[Optional] = &[];

pub fn run(args: &[String]) -> Result<(), Failure> {
    if let Some(a) = args.first() {
        return Err(Failure(format!("`test` takes no arguments, got `{a}`")));
    }
    run_status(cargo(&["test", "--workspace"]))?;
    // The CUDA backend's tests, compiled with the `cuda` feature. Without a GPU they
    // prove that a missing driver is a clean error, and print `skipped: no CUDA driver`.
    run_status(cargo(&[
        "test",
        "-p",
        "lowrank",
        "--features",
        "cuda",
        "--test",
        "primitives",
        "--",
        "cuda",
        "--nocapture",
    ]))?;
    let mut skipped = Vec::new();
    for suite in OPTIONAL {
        if suite.needs.iter().all(|p| on_path(p)) {
            run_status(cargo(suite.cargo_args))?;
        } else {
            skipped.push(suite);
        }
    }
    for s in &skipped {
        println!(
            "skipped: {} (needs {}; install the Debian packages: {})",
            s.name,
            s.needs.join(", "),
            s.packages
        );
    }
    println!(
        "xtask test: all suites passed ({} optional suite(s) skipped)",
        skipped.len()
    );
    Ok(())
}
