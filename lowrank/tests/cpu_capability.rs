//! `LOWRANK_CPU_CAPABILITY` caps the default instruction set of `CpuBackend::new`, read
//! once; explicit choices (`with_isa`) are not capped. One test in its own binary: the
//! variable is read once per process, and must be set before the first backend.

use lowrank::{CpuBackend, Isa};

#[test]
fn the_capability_variable_caps_only_the_default() {
    std::env::set_var("LOWRANK_CPU_CAPABILITY", "default");
    assert_eq!(Isa::detect(), Isa::Portable);
    assert_eq!(CpuBackend::new().isa(), Isa::Portable);
    // Read once: a later change has no effect.
    std::env::set_var("LOWRANK_CPU_CAPABILITY", "avx512");
    assert_eq!(CpuBackend::new().isa(), Isa::Portable);
    // Every instruction set the CPU has stays available explicitly.
    assert_eq!(Isa::supported().last(), Some(&Isa::Portable));
    for isa in Isa::supported() {
        assert_eq!(CpuBackend::new().with_isa(isa).unwrap().isa(), isa);
    }
}
