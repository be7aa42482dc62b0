//! scratch
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::time::Instant;
fn main() {
    let n = 4 << 20;
    let src: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    let mut h = vec![f16::ZERO; n];
    let mut b = vec![bf16::ZERO; n];
    let mut back = vec![0f32; n];
    for _ in 0..3 {
        let t = Instant::now(); h.convert_from_f32_slice(&src); let a = t.elapsed();
        let t = Instant::now(); h.convert_to_f32_slice(&mut back); let bb = t.elapsed();
        let t = Instant::now(); b.convert_from_f32_slice(&src); let c = t.elapsed();
        let t = Instant::now(); b.convert_to_f32_slice(&mut back); let d = t.elapsed();
        let t = Instant::now(); back.copy_from_slice(&src); let e = t.elapsed();
        println!("f32->f16 {a:?} f16->f32 {bb:?} f32->bf16 {c:?} bf16->f32 {d:?} memcpy {e:?}");
    }
}
