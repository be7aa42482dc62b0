//! What several integration tests of this crate share: building one of its examples
//! next to the `launch` binary the test was given.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The example `name` of this crate, built if need be (integration tests get only the
/// crate's binaries built for them) into the target directory, target and profile of
/// `launch` (`CARGO_BIN_EXE_launch`).
///
/// `launch` lies in `<target dir>/<profile dir>/` or, for a build with `--target TRIPLE`
/// (the sanitizer runs), `<target dir>/TRIPLE/<profile dir>/`; cargo marks the target
/// directory, and each triple's directory in it, with `CACHEDIR.TAG`. With a triple the example is built with `--target`
/// too, so that `RUSTFLAGS` (`-Zsanitizer=address`) reach the example and not the
/// host's proc macros, as in the outer build.
pub fn example(name: &str) -> PathBuf {
    let launch = Path::new(env!("CARGO_BIN_EXE_launch"));
    let dir = launch.parent().expect("the directory of launch");
    let above = dir.parent().expect("the directory above the profile's");
    // Cargo tags both the target directory and each triple's directory in it.
    let (target_dir, triple) = match above.parent() {
        Some(root) if root.join("CACHEDIR.TAG").exists() => {
            (root, above.file_name().and_then(|t| t.to_str()))
        }
        _ => (above, None),
    };
    let profile = match dir.file_name().and_then(|p| p.to_str()) {
        Some("debug") | None => "dev",
        Some(p) => p,
    };
    let mut build = Command::new(env!("CARGO"));
    build
        .args(["build", "--quiet", "-p", "collectives", "--example", name])
        .args(["--profile", profile])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if let Some(triple) = triple {
        build.args(["--target", triple]);
    }
    let status = build.status().expect("run cargo build");
    assert!(status.success(), "cargo build --example {name}: {status}");
    let exe = dir.join("examples").join(name);
    assert!(exe.exists(), "no {}", exe.display());
    exe
}
