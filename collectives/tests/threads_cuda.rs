//! The thread backend with CUDA device buffers (staged through host memory): two ranks
//! sharing one GPU. Without a driver it prints one `skipped:` line.
#![cfg(feature = "cuda")]

use collectives::{run_local, DeviceBuffer, ProcessGroup, ReduceOp};
use cudarc::driver::CudaSlice;
use half::f16;

#[test]
fn device_buffers_all_reduce_and_broadcast_on_one_gpu() {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library's names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipped: no CUDA driver");
        return;
    }
    let ctx = match cudarc::driver::CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("skipped: no CUDA device ({e:?})");
            return;
        }
    };
    let out = run_local(2, |g| {
        let stream = ctx.new_stream().unwrap();
        let r = g.rank() as f32;
        let buf = stream.clone_htod(&vec![r + 1.0; 1000]).unwrap();
        assert!(
            !g.device_native(),
            "the thread backend stages device buffers"
        );
        let sum: CudaSlice<f32> = g
            .all_reduce_device(DeviceBuffer::from(buf), ReduceOp::Sum)
            .wait()
            .unwrap()
            .try_into()
            .unwrap();
        let halfs = stream.clone_htod(&vec![f16::from_f32(r); 8]).unwrap();
        let avg: CudaSlice<f16> = g
            .all_reduce_device(halfs.into(), ReduceOp::Avg)
            .wait()
            .unwrap()
            .try_into()
            .unwrap();
        let b = stream.clone_htod(&vec![r; 4]).unwrap();
        let root1: CudaSlice<f32> = g
            .broadcast_device(b.into(), 1)
            .wait()
            .unwrap()
            .try_into()
            .unwrap();
        (
            stream.clone_dtoh(&sum).unwrap(),
            stream.clone_dtoh(&avg).unwrap(),
            stream.clone_dtoh(&root1).unwrap(),
        )
    })
    .unwrap();
    for r in out {
        let (sum, avg, root1) = r.unwrap();
        assert_eq!(sum, vec![3.0f32; 1000]);
        assert_eq!(avg, vec![f16::from_f32(0.5); 8]);
        assert_eq!(root1, vec![1.0f32; 4]);
    }
    println!("threads with device buffers: ok");
}
