//! The thread backend with CUDA device buffers (staged through host memory): two ranks
//! sharing one GPU, collectives and point-to-point. Without a driver it prints one `skipped:` line.
#![cfg(feature = "cuda")]

use collectives::{run_local, DeviceBuffer, P2pOp, ProcessGroup, ReduceOp};
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

/// The thread backend's device point-to-point operations are the trait's defaults,
/// staged through host memory: rank 0 sends an `f32` and a `u8` device buffer to rank 1,
/// which sends the floats back doubled in a batch; every buffer comes back whole.
#[test]
fn staged_device_send_and_recv_between_two_thread_ranks() {
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
    let xs: Vec<f32> = (0..257).map(|i| i as f32 * 0.5).collect();
    let bytes: Vec<u8> = (0..=255).collect();
    let out = run_local(2, |g| {
        let stream = ctx.new_stream().unwrap();
        if g.rank() == 0 {
            let sent: CudaSlice<f32> = g
                .send_device(stream.clone_htod(&xs).unwrap().into(), 1, 3)
                .wait()
                .unwrap()
                .try_into()
                .unwrap();
            assert_eq!(
                stream.clone_dtoh(&sent).unwrap(),
                xs,
                "a send gives its buffer back"
            );
            let sent: CudaSlice<u8> = g
                .send_device(stream.clone_htod(&bytes).unwrap().into(), 1, 4)
                .wait()
                .unwrap()
                .try_into()
                .unwrap();
            assert_eq!(stream.clone_dtoh(&sent).unwrap(), bytes);
            let back: CudaSlice<f32> = g
                .recv_device(stream.alloc_zeros::<f32>(xs.len()).unwrap().into(), 1, 3)
                .wait()
                .unwrap()
                .try_into()
                .unwrap();
            stream.clone_dtoh(&back).unwrap()
        } else {
            let works = g.batch_isend_irecv_device(vec![
                P2pOp::recv(stream.alloc_zeros::<f32>(xs.len()).unwrap().into(), 0, 3),
                P2pOp::recv(stream.alloc_zeros::<u8>(bytes.len()).unwrap().into(), 0, 4),
            ]);
            let mut got = works.into_iter().map(|w| w.wait().unwrap());
            let floats: CudaSlice<f32> = got.next().unwrap().try_into().unwrap();
            let raw: CudaSlice<u8> = got.next().unwrap().try_into().unwrap();
            assert_eq!(stream.clone_dtoh(&raw).unwrap(), bytes);
            let doubled: Vec<f32> = stream
                .clone_dtoh(&floats)
                .unwrap()
                .iter()
                .map(|x| x * 2.0)
                .collect();
            let sent = g
                .send_device(stream.clone_htod(&doubled).unwrap().into(), 0, 3)
                .wait()
                .unwrap();
            assert_eq!(sent.len(), xs.len());
            Vec::new()
        }
    })
    .unwrap();
    let mut out = out.into_iter();
    let back = out.next().unwrap().unwrap();
    assert_eq!(back, xs.iter().map(|x| x * 2.0).collect::<Vec<_>>());
    assert!(out.next().unwrap().unwrap().is_empty());
    println!("threads with staged device send/recv: ok");
}
