//! `GroupTransport` over `collectives::ThreadGroup` ranks: frame order, both directions,
//! large and empty frames, concurrent senders, timeouts (which lose nothing), flush, a lost
//! peer and bad arguments.

use collectives::{run_local_with_timeout, ProcessGroup, ThreadGroup, MAX_TAG};
use pipe::group_transport::DEFAULT_TAG;
use pipe::{GroupTransport, Transport, TransportError};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

/// Runs `f` on two thread ranks and unwraps every rank's result.
fn two<R: Send>(f: impl Fn(GroupTransport<ThreadGroup>) -> R + Sync) -> Vec<R> {
    run_local_with_timeout(2, Duration::from_secs(60), |g| f(GroupTransport::new(g)))
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

#[test]
fn frames_arrive_in_order_both_ways() {
    two(|t| {
        assert_eq!(t.ranks(), 2);
        assert_eq!(t.tag(), DEFAULT_TAG);
        let peer = 1 - t.rank();
        for i in 0..100u32 {
            let frame: Vec<u8> = [t.rank() as u32, i]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            t.send(peer, frame).unwrap();
        }
        for i in 0..100u32 {
            let f = t.recv(peer, WAIT).unwrap();
            assert_eq!(f[..4], (peer as u32).to_le_bytes());
            assert_eq!(f[4..], i.to_le_bytes());
        }
        t.flush(WAIT).unwrap();
    });
}

#[test]
fn large_and_empty_frames() {
    let big: Vec<u8> = (0..10_000_000u32).map(|i| (i % 251) as u8).collect();
    two(|t| {
        if t.rank() == 0 {
            t.send(1, Vec::new()).unwrap();
            t.send(1, big.clone()).unwrap();
            t.send(1, Vec::new()).unwrap();
            t.send(1, vec![7]).unwrap();
            t.flush(WAIT).unwrap();
        } else {
            assert_eq!(t.recv(0, WAIT).unwrap(), Vec::<u8>::new());
            assert!(t.recv(0, WAIT).unwrap() == big);
            assert_eq!(t.recv(0, WAIT).unwrap(), Vec::<u8>::new());
            assert_eq!(t.recv(0, WAIT).unwrap(), vec![7]);
        }
    });
}

/// Thread `t`'s frame `i`: its number, then bytes of a length and pattern of its own.
fn frame(t: u32, i: u32) -> Vec<u8> {
    let len = (i as usize * 37 + t as usize * 101) % 3000;
    let mut f: Vec<u8> = [t, i].iter().flat_map(|v| v.to_le_bytes()).collect();
    f.extend((0..len).map(|k| (t as usize * 31 + i as usize + k) as u8));
    f
}

#[test]
fn concurrent_senders_to_one_receiver() {
    const PER: u32 = 150;
    two(|t| {
        if t.rank() == 0 {
            std::thread::scope(|s| {
                for th in 0..4u32 {
                    let t = &t;
                    s.spawn(move || {
                        for i in 0..PER {
                            t.send(1, frame(th, i)).unwrap();
                        }
                    });
                }
            });
            t.flush(WAIT).unwrap();
        } else {
            let mut next = [0u32; 4];
            for _ in 0..4 * PER {
                let f = t.recv(0, WAIT).unwrap();
                let th = u32::from_le_bytes(f[..4].try_into().unwrap());
                let i = u32::from_le_bytes(f[4..8].try_into().unwrap());
                assert_eq!(i, next[th as usize], "thread {th}'s frames out of order");
                assert!(f == frame(th, i), "thread {th}'s frame {i} is not intact");
                next[th as usize] += 1;
            }
            assert_eq!(next, [PER; 4]);
        }
    });
}

#[test]
fn recv_timeout_loses_nothing() {
    two(|t| {
        if t.rank() == 0 {
            let start = Instant::now();
            let e = t.recv(1, Duration::from_millis(50)).unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e:?}");
            assert!(start.elapsed() >= Duration::from_millis(50));
            // Again, with the header's receive still posted.
            let e = t.recv(1, Duration::from_millis(10)).unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e:?}");
            t.group().barrier().wait().unwrap();
            assert_eq!(t.recv(1, WAIT).unwrap(), b"first");
            assert_eq!(t.recv(1, WAIT).unwrap(), b"second");
        } else {
            t.group().barrier().wait().unwrap();
            t.send(0, b"first".to_vec()).unwrap();
            t.send(0, b"second".to_vec()).unwrap();
            t.flush(WAIT).unwrap();
        }
    });
}

#[test]
fn flush_waits_for_the_receiver() {
    two(|t| {
        if t.rank() == 0 {
            t.send(1, vec![1, 2, 3]).unwrap();
            let e = t.flush(Duration::from_millis(50)).unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e:?}");
            t.group().barrier().wait().unwrap();
            t.flush(WAIT).unwrap();
        } else {
            t.group().barrier().wait().unwrap();
            assert_eq!(t.recv(0, WAIT).unwrap(), vec![1, 2, 3]);
        }
    });
}

#[test]
fn dropped_peer_is_lost_after_its_frames() {
    let results = run_local_with_timeout(2, Duration::from_secs(60), |g| {
        // A boxed group works as well.
        let t = GroupTransport::new(Box::new(g) as Box<dyn ProcessGroup>);
        if t.rank() == 1 {
            t.send(0, vec![1]).unwrap();
            t.send(0, vec![2]).unwrap();
            t.flush(WAIT).unwrap();
            drop(t); // and its group
        } else {
            assert_eq!(t.recv(1, WAIT).unwrap(), vec![1]);
            assert_eq!(t.recv(1, WAIT).unwrap(), vec![2]);
            let e = t.recv(1, WAIT).unwrap_err();
            assert!(
                matches!(e, TransportError::PeerLost { rank: 1, .. }),
                "{e:?}"
            );
        }
    })
    .unwrap();
    for r in results {
        r.unwrap();
    }
}

#[test]
fn bad_arguments_are_invalid() {
    two(|t| {
        assert!(matches!(
            t.send(2, vec![0]),
            Err(TransportError::InvalidArgument(_))
        ));
        assert!(matches!(
            t.recv(5, WAIT),
            Err(TransportError::InvalidArgument(_))
        ));
        let t = t.with_tag(12).unwrap();
        assert_eq!(t.tag(), 12);
        assert!(matches!(
            t.with_tag(MAX_TAG),
            Err(TransportError::InvalidArgument(_))
        ));
    });
}

#[test]
fn oversized_header_is_invalid() {
    // A foreign message on the transport's tag announcing 2^41 bytes.
    two(|t| {
        if t.rank() == 0 {
            let header = (1u64 << 41).to_le_bytes().to_vec();
            t.group()
                .send(collectives::Buffer::U8(header), 1, DEFAULT_TAG)
                .wait()
                .unwrap();
        } else {
            let e = t.recv(0, WAIT).unwrap_err();
            assert!(matches!(e, TransportError::InvalidArgument(_)), "{e:?}");
        }
    });
}

#[test]
fn kept_buffers_are_reused_and_never_leak_old_bytes() {
    two(|t| {
        let peer = 1 - t.rank();
        // Frames of shrinking sizes: each receive may land in a kept buffer of an earlier,
        // larger frame, whose old bytes must not show through.
        for (i, len) in [200_000usize, 150_000, 150_000, 64 << 10, 7]
            .into_iter()
            .enumerate()
        {
            let fill = (t.rank() * 16 + i) as u8;
            let mut frame = t.buffer(len);
            assert!(frame.is_empty() && frame.capacity() >= len);
            frame.resize(len, fill);
            t.send(peer, frame).unwrap();
            let got = t.recv(peer, WAIT).unwrap();
            let want = (peer * 16 + i) as u8;
            assert_eq!(got.len(), len);
            assert!(got.iter().all(|&b| b == want), "frame {i} of {len} bytes");
            t.recycle(got);
        }
        t.flush(WAIT).unwrap();
        // After the flush the sent buffers are back: a frame's buffer comes from them.
        let again = t.buffer(100_000);
        assert!(again.capacity() >= 100_000 && again.is_empty());
    });
}
