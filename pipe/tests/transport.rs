//! `LocalTransport`: frame order, both directions, concurrent senders, timeouts, a lost
//! peer and bad ranks; and `Wire` round trips of `CpuTensor`.

use pipe::cpu::CpuTensor;
use pipe::{Device, Error, LocalTransport, Transport, TransportError, Wire, WireMeta};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(10);

fn two() -> (LocalTransport, LocalTransport) {
    let mut ranks = LocalTransport::create(2);
    let b = ranks.pop().unwrap();
    let a = ranks.pop().unwrap();
    (a, b)
}

#[test]
fn frames_arrive_in_order_both_ways() {
    let (a, b) = two();
    assert_eq!((a.rank(), a.ranks(), b.rank(), b.ranks()), (0, 2, 1, 2));
    for i in 0..100u32 {
        a.send(1, i.to_le_bytes().to_vec()).unwrap();
        b.send(0, (1000 + i).to_le_bytes().to_vec()).unwrap();
    }
    a.send(1, Vec::new()).unwrap();
    for i in 0..100u32 {
        assert_eq!(b.recv(0, WAIT).unwrap(), i.to_le_bytes());
        assert_eq!(a.recv(1, WAIT).unwrap(), (1000 + i).to_le_bytes());
    }
    assert_eq!(b.recv(0, WAIT).unwrap(), Vec::<u8>::new());
    a.flush(WAIT).unwrap();
    b.flush(WAIT).unwrap();
}

#[test]
fn concurrent_senders_all_arrive_in_per_thread_order() {
    let (a, b) = two();
    const PER: u32 = 200;
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let a = &a;
            s.spawn(move || {
                for i in 0..PER {
                    let frame: Vec<u8> = [t, i].iter().flat_map(|v| v.to_le_bytes()).collect();
                    a.send(1, frame).unwrap();
                }
            });
        }
        let mut next = [0u32; 4];
        for _ in 0..4 * PER {
            let f = b.recv(0, WAIT).unwrap();
            assert_eq!(f.len(), 8);
            let t = u32::from_le_bytes(f[..4].try_into().unwrap()) as usize;
            let i = u32::from_le_bytes(f[4..].try_into().unwrap());
            assert_eq!(i, next[t], "thread {t}'s frames out of order");
            next[t] += 1;
        }
        assert_eq!(next, [PER; 4]);
    });
}

#[test]
fn recv_times_out() {
    let (a, _b) = two();
    let start = Instant::now();
    let e = a.recv(1, Duration::from_millis(50)).unwrap_err();
    assert!(matches!(e, TransportError::Timeout { .. }), "{e:?}");
    assert!(start.elapsed() >= Duration::from_millis(50));
}

#[test]
fn dropped_peer_is_lost_after_its_frames() {
    let (a, b) = two();
    b.send(0, vec![1]).unwrap();
    b.send(0, vec![2]).unwrap();
    drop(b);
    assert_eq!(a.recv(1, WAIT).unwrap(), vec![1]);
    assert_eq!(a.recv(1, WAIT).unwrap(), vec![2]);
    let e = a.recv(1, WAIT).unwrap_err();
    assert!(
        matches!(e, TransportError::PeerLost { rank: 1, .. }),
        "{e:?}"
    );
    let e = a.send(1, vec![3]).unwrap_err();
    assert!(
        matches!(e, TransportError::PeerLost { rank: 1, .. }),
        "{e:?}"
    );
}

#[test]
fn bad_rank_is_invalid_argument() {
    let (a, _b) = two();
    assert!(matches!(
        a.send(2, vec![0]),
        Err(TransportError::InvalidArgument(_))
    ));
    assert!(matches!(
        a.recv(7, WAIT),
        Err(TransportError::InvalidArgument(_))
    ));
}

#[test]
fn cpu_tensor_wire_round_trip() {
    for shape in [vec![3, 4], vec![1], vec![0, 5], vec![2, 3, 2]] {
        let n: usize = shape.iter().product();
        let t = CpuTensor::from_shape_vec(&shape, (0..n).map(|v| v as f32 * 0.5 - 3.0).collect())
            .unwrap();
        let mut frame = vec![9u8; 3]; // write_wire appends
        let meta = t.write_wire(&mut frame).unwrap();
        assert_eq!(meta.shape, shape);
        assert_eq!(frame.len(), 3 + 4 * n);
        let back = CpuTensor::read_wire(&meta, &frame[3..], &Device::Cpu).unwrap();
        assert_eq!(back, t);
        let back = CpuTensor::read_wire(&meta, &frame[3..], &Device::CpuCore(0)).unwrap();
        assert_eq!(back.to_vec(), t.to_vec());
    }
    // Wrong byte counts and types are errors, not panics.
    let meta = WireMeta {
        dtype: 0,
        shape: vec![2, 2],
    };
    assert!(matches!(
        CpuTensor::read_wire(&meta, &[0; 15], &Device::Cpu),
        Err(Error::Shape { .. })
    ));
    let bad = WireMeta {
        dtype: 200,
        shape: vec![1],
    };
    assert!(matches!(
        CpuTensor::read_wire(&bad, &[0; 4], &Device::Cpu),
        Err(Error::WireType { dtype: 200, .. })
    ));
}
