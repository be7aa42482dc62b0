//! The client of PyTorch's c10d `TCPStore` (`TcpStore::torch_client`) and running
//! under `torchrun`.
//!
//! - Against a recording: [`RECORDING`] is a real exchange between torch's own client
//!   and torch's libuv server, captured once; a fake server here replays the server's
//!   side byte for byte and checks that our client sends exactly the bytes torch's
//!   client sent. This is a recording, not a mock: no byte of it was written by hand.
//! - Against a real torch server, in a `python3` subprocess, when `python3 -c "import
//!   torch"` works: every operation, timeouts, Python reading what Rust wrote (and the
//!   other way round), join and barrier of 2 and 4 ranks and their mistakes; on both of
//!   torch's server backends (libuv, torch's default, and the classic one).
//! - Under real `torchrun --no-python --standalone`, on the `launch_demo` example.
//!
//! Without torch, the live tests print `skipped: torch not importable (pip install
//! torch)` and pass. They are slow (each python start imports torch) but not ignored:
//! `cargo test -p collectives` runs them.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use collectives::env::EnvInfo;
use collectives::store::{TcpStore, TOKEN_ENV};
use collectives::{Error, Result};

/// The timeout of operations that should succeed.
const T: Duration = Duration::from_secs(10);

// ---- the recording ----

/// One segment of the recorded exchange: bytes the client sent on connection `n`
/// (1-based, in the order the connections were opened), or bytes the server sent.
#[derive(Clone, Copy)]
enum Step {
    Client(u8, &'static [u8]),
    Server(u8, &'static [u8]),
}

/// The process id torch's client sent as its ping nonce when [`RECORDING`] was made;
/// the replay puts our own process id in its place (bytes 6..10 of a connection's first
/// segment, and the server's echo), since our client sends its pid as torch's does.
const RECORDED_PID: u32 = 13878;

/// Recorded on 2026-12-01 with torch 2.15.0 (`2.15.0+cu132`, CPU only), by a Python
/// TCP proxy between `TCPStore("127.0.0.1", port, None, False, timeout=1 s)` and
/// `TCPStore("127.0.0.1", 0, 1, True)` (the libuv server, torch's default; the
/// classic server, `use_libuv=False`, sent the same bytes), logging both directions;
/// consecutive segments of one direction merged. Each comment is the Python call that
/// sent the segments below it. Integers are little-endian (x86-64).
const RECORDING: &[Step] = &[
    // connect: VALIDATE + magic, PING + nonce (the pid); the nonce echoed
    Step::Client(
        1,
        &[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 0x36, 0x36, 0x00, 0x00],
    ),
    Step::Server(1, &[0x36, 0x36, 0x00, 0x00]),
    // set("k", "v1"): no reply
    Step::Client(
        1,
        &[
            0x01, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6b, 0x02, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x76, 0x31,
        ],
    ),
    // get("k"): WAIT, STOP_WAITING, GET, the value
    Step::Client(
        1,
        &[
            0x06, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6b,
        ],
    ),
    Step::Server(1, &[0x00]),
    Step::Client(
        1,
        &[
            0x03, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6b,
        ],
    ),
    Step::Server(
        1,
        &[0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x76, 0x31],
    ),
    // add("n", 5) = 5
    Step::Client(
        1,
        &[
            0x04, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6e, 0x05, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00,
        ],
    ),
    Step::Server(1, &[0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
    // add("n", -2) = 3
    Step::Client(
        1,
        &[
            0x04, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6e, 0xfe, 0xff, 0xff,
            0xff, 0xff, 0xff, 0xff, 0xff,
        ],
    ),
    Step::Server(1, &[0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
    // compare_set("k", "v1", "v2") = "v2"
    Step::Client(
        1,
        &[
            0x02, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6b, 0x02, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x76, 0x31, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x76, 0x32,
        ],
    ),
    Step::Server(
        1,
        &[0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x76, 0x32],
    ),
    // compare_set("k", "zz", "v3") = "v2" (no match)
    Step::Client(
        1,
        &[
            0x02, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6b, 0x02, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x7a, 0x7a, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x76, 0x33,
        ],
    ),
    Step::Server(
        1,
        &[0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x76, 0x32],
    ),
    // compare_set("absent", "", "new") = "new" (set_if_absent)
    Step::Client(
        1,
        &[
            0x02, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x61, 0x62, 0x73, 0x65,
            0x6e, 0x74, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x6e, 0x65, 0x77,
        ],
    ),
    Step::Server(
        1,
        &[
            0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x6e, 0x65, 0x77,
        ],
    ),
    // compare_set("absent2", "x", "new") = "x" (absent, not set)
    Step::Client(
        1,
        &[
            0x02, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x61, 0x62, 0x73, 0x65,
            0x6e, 0x74, 0x32, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x78, 0x03, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x6e, 0x65, 0x77,
        ],
    ),
    Step::Server(1, &[0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x78]),
    // check(["k", "n"]) = READY
    Step::Client(
        1,
        &[
            0x05, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6b, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f,
            0x6e,
        ],
    ),
    Step::Server(1, &[0x00]),
    // check(["k", "nope"]) = NOT_READY
    Step::Client(
        1,
        &[
            0x05, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6b, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f,
            0x6e, 0x6f, 0x70, 0x65,
        ],
    ),
    Step::Server(1, &[0x01]),
    // wait(["k"]): STOP_WAITING
    Step::Client(
        1,
        &[
            0x06, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6b,
        ],
    ),
    Step::Server(1, &[0x00]),
    // wait(["never"], 300 ms): WAIT, (timeout) CANCEL_WAIT, WAIT_CANCELED
    Step::Client(
        1,
        &[
            0x06, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x06, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6e, 0x65, 0x76, 0x65, 0x72, 0x0c,
        ],
    ),
    Step::Server(1, &[0x01]),
    // num_keys() = 3
    Step::Client(1, &[0x07]),
    Step::Server(1, &[0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
    // delete_key("k") = 1 deleted
    Step::Client(
        1,
        &[
            0x08, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6b,
        ],
    ),
    Step::Server(1, &[0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
    // delete_key("k") = 0 deleted
    Step::Client(
        1,
        &[
            0x08, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6b,
        ],
    ),
    Step::Server(1, &[0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
    // multi_set(["m1", "m2"], ["1", "22"]): no reply
    Step::Client(
        1,
        &[
            0x0b, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6d, 0x31, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x31, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x6d, 0x32, 0x02, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x32, 0x32,
        ],
    ),
    // multi_get(["m1", "m2"]): WAIT, STOP_WAITING, MULTI_GET, 2 values
    Step::Client(
        1,
        &[
            0x06, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6d, 0x31, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x2f, 0x6d, 0x32,
        ],
    ),
    Step::Server(1, &[0x00]),
    Step::Client(
        1,
        &[
            0x0a, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6d, 0x31, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x2f, 0x6d, 0x32,
        ],
    ),
    Step::Server(
        1,
        &[
            0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x31, 0x02, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x32, 0x32,
        ],
    ),
    // get("missing") with the 1 s timeout: WAIT, CANCEL_WAIT, WAIT_CANCELED
    Step::Client(
        1,
        &[
            0x06, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x2f, 0x6d, 0x69, 0x73, 0x73, 0x69, 0x6e, 0x67, 0x0c,
        ],
    ),
    Step::Server(1, &[0x01]),
    // a second connection, through PrefixStore("worker/attempt_0", store)
    Step::Client(
        2,
        &[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 0x36, 0x36, 0x00, 0x00],
    ),
    Step::Server(2, &[0x36, 0x36, 0x00, 0x00]),
    // set("x", "1") travels as "/worker/attempt_0/x"
    Step::Client(
        2,
        &[
            0x01, 0x13, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x77, 0x6f, 0x72, 0x6b,
            0x65, 0x72, 0x2f, 0x61, 0x74, 0x74, 0x65, 0x6d, 0x70, 0x74, 0x5f, 0x30, 0x2f, 0x78,
            0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x31,
        ],
    ),
    // add("cnt", 2) = 2
    Step::Client(
        2,
        &[
            0x04, 0x15, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2f, 0x77, 0x6f, 0x72, 0x6b,
            0x65, 0x72, 0x2f, 0x61, 0x74, 0x74, 0x65, 0x6d, 0x70, 0x74, 0x5f, 0x30, 0x2f, 0x63,
            0x6e, 0x74, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        ],
    ),
    Step::Server(2, &[0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
];

/// `bytes` with [`RECORDED_PID`] replaced by ours where it is the ping nonce.
fn with_our_pid(bytes: &[u8], first_client_segment: bool) -> Vec<u8> {
    let mut bytes = bytes.to_vec();
    let pid = std::process::id().to_le_bytes();
    let recorded = RECORDED_PID.to_le_bytes();
    if first_client_segment && bytes.len() >= 10 {
        assert_eq!(bytes[6..10], recorded, "the recording's nonce");
        bytes[6..10].copy_from_slice(&pid);
    } else if !first_client_segment && bytes == recorded {
        bytes = pid.to_vec();
    }
    bytes
}

/// Serves the recording's server side on a loopback port, one connection after the
/// other; the thread's result says whether the client sent exactly the recorded bytes.
fn replay(steps: &'static [Step]) -> (u16, thread::JoinHandle<std::result::Result<(), String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = thread::spawn(move || {
        let mut conns: Vec<TcpStream> = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let (n, bytes, from_client) = match *step {
                Step::Client(n, b) => (n as usize, b, true),
                Step::Server(n, b) => (n as usize, b, false),
            };
            while conns.len() < n {
                let (conn, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
                conn.set_read_timeout(Some(T)).map_err(|e| e.to_string())?;
                conns.push(conn);
            }
            let first = from_client
                && !steps[..i]
                    .iter()
                    .any(|s| matches!(*s, Step::Client(m, _) if m as usize == n));
            let expected = with_our_pid(bytes, first);
            let conn = &mut conns[n - 1];
            if from_client {
                let mut got = vec![0u8; expected.len()];
                conn.read_exact(&mut got).map_err(|e| {
                    format!("step {i}: reading {} recorded bytes: {e}", expected.len())
                })?;
                if got != expected {
                    return Err(format!(
                        "step {i} on connection {n}: the client sent {got:02x?}, torch's sent {expected:02x?}"
                    ));
                }
            } else {
                conn.write_all(&expected)
                    .map_err(|e| format!("step {i}: {e}"))?;
            }
        }
        // Nothing more may come: the client has sent all that torch's did.
        for (n, conn) in conns.iter_mut().enumerate() {
            conn.set_read_timeout(Some(Duration::from_millis(200)))
                .map_err(|e| e.to_string())?;
            let mut extra = [0u8; 64];
            match conn.read(&mut extra) {
                Ok(0) => {}
                Ok(k) => {
                    return Err(format!(
                        "connection {}: {:02x?} beyond the recording",
                        n + 1,
                        &extra[..k]
                    ))
                }
                Err(_) => {}
            }
        }
        Ok(())
    });
    (port, server)
}

/// The expected timeout of `result`, whose message must mention `needle`.
fn assert_timeout<T: std::fmt::Debug>(result: Result<T>, needle: &str) -> Error {
    match result {
        Err(e @ Error::Timeout { .. }) => {
            assert!(e.to_string().contains(needle), "{e}");
            e
        }
        other => panic!("expected a timeout naming {needle}, got {other:?}"),
    }
}

#[test]
fn our_client_sends_exactly_what_torchs_client_sent() -> Result<()> {
    let (port, server) = replay(RECORDING);
    let client = || -> Result<()> {
        let store = TcpStore::torch_client("127.0.0.1", port, "", Duration::from_secs(1))?;
        assert!(store.is_torch() && !store.is_server() && store.stats().is_none());
        assert_eq!(store.key_prefix(), Some(""));
        store.set("k", b"v1")?;
        assert_eq!(store.get("k")?, b"v1");
        assert_eq!(store.add("n", 5)?, 5);
        assert_eq!(store.add("n", -2)?, 3);
        assert_eq!(store.compare_set("k", b"v1", b"v2")?, b"v2");
        assert_eq!(store.compare_set("k", b"zz", b"v3")?, b"v2");
        assert_eq!(store.set_if_absent("absent", b"new")?, None);
        assert_eq!(store.compare_set("absent2", b"x", b"new")?, b"x");
        assert!(store.check(&["k", "n"])?);
        assert!(!store.check(&["k", "nope"])?);
        store.wait(&["k"], T)?;
        let start = Instant::now();
        assert_timeout(store.wait(&["never"], Duration::from_millis(300)), "never");
        assert!(start.elapsed() >= Duration::from_millis(300));
        assert_eq!(store.num_keys()?, 3);
        assert!(store.delete_key("k")?);
        assert!(!store.delete_key("k")?);
        store.multi_set(&[("m1", b"1"), ("m2", b"22")])?;
        assert_eq!(
            store.multi_get(&["m1", "m2"])?,
            [b"1".to_vec(), b"22".to_vec()]
        );
        assert_timeout(store.get("missing"), "missing");
        // The timed-out waits were cancelled in step: the recording goes on in order.
        let prefixed = TcpStore::torch_client("127.0.0.1", port, "worker/attempt_0", T)?;
        prefixed.set("x", b"1")?;
        assert_eq!(prefixed.add("cnt", 2)?, 2);
        drop((store, prefixed));
        Ok(())
    };
    let outcome = client();
    // The replay's verdict first: a client that strays from the recording fails there.
    server
        .join()
        .expect("replay thread")
        .map_err(Error::Protocol)?;
    outcome
}

// ---- broken peers ----

/// A peer that reads the handshake (10 bytes), answers the ping with `echo` (if any),
/// then reads a request and answers `reply`, or closes when `reply` is `None`.
fn broken_peer(echo: Option<[u8; 4]>, request_len: usize, reply: Option<Vec<u8>>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let _ = conn.set_read_timeout(Some(T));
        let mut hello = [0u8; 10];
        if conn.read_exact(&mut hello).is_err() {
            return;
        }
        let echo = echo.unwrap_or([hello[6], hello[7], hello[8], hello[9]]);
        let _ = conn.write_all(&echo);
        let mut request = vec![0u8; request_len];
        if conn.read_exact(&mut request).is_err() {
            return;
        }
        match reply {
            Some(bytes) => {
                let _ = conn.write_all(&bytes);
                // Hold the connection until the client leaves.
                let _ = conn.read(&mut [0u8; 1]);
            }
            None => drop(conn),
        }
    });
    port
}

#[test]
fn a_broken_peer_is_a_typed_error_never_a_hang() {
    let short = Duration::from_millis(500);
    // Not a store: the ping comes back wrong.
    let port = broken_peer(Some(*b"nope"), 0, None);
    let e = TcpStore::torch_client("127.0.0.1", port, "", short).unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ref m) if m.contains("not a torch store")),
        "{e}"
    );

    // CHECK ["/k"] (1 + 8 + 8 + 2 bytes) answered with neither READY nor NOT_READY; the
    // connection is unusable afterwards, and says so.
    let port = broken_peer(None, 19, Some(vec![7]));
    let store = TcpStore::torch_client("127.0.0.1", port, "", short).expect("connect");
    assert!(matches!(store.check(&["k"]), Err(Error::Protocol(_))));
    let e = store.check(&["k"]).unwrap_err();
    assert!(
        matches!(e, Error::Io { ref message, .. } if message.contains("unusable")),
        "{e}"
    );

    // ADD "/k" (1 + 8 + 2 + 8 bytes) never answered: a timeout after the store's.
    let port = broken_peer(None, 19, Some(Vec::new()));
    let store = TcpStore::torch_client("127.0.0.1", port, "", short).expect("connect");
    let start = Instant::now();
    assert_timeout(store.add("k", 1), "add");
    assert!(start.elapsed() < short * 4, "{:?}", start.elapsed());

    // COMPARE_SET "/k" "" "v" answered with a length of 2^62: refused, not allocated.
    let port = broken_peer(
        None,
        1 + 10 + 8 + 9,
        Some((1u64 << 62).to_le_bytes().to_vec()),
    );
    let store = TcpStore::torch_client("127.0.0.1", port, "", short).expect("connect");
    assert!(matches!(
        store.set_if_absent("k", b"v"),
        Err(Error::Protocol(_))
    ));

    // The connection closed instead of a reply.
    // DELETE_KEY "/k" (1 + 8 + 2 bytes).
    let port = broken_peer(None, 11, None);
    let store = TcpStore::torch_client("127.0.0.1", port, "", short).expect("connect");
    let e = store.delete_key("k").unwrap_err();
    assert!(
        matches!(e, Error::Io { ref message, .. } if message.contains("closed")),
        "{e}"
    );

    // A key longer than torch's server reads is refused before it is sent.
    let long = "k".repeat(collectives::store::TORCH_MAX_KEY_LEN);
    let port = broken_peer(None, 0, None);
    let store = TcpStore::torch_client("127.0.0.1", port, "", short).expect("connect");
    assert!(matches!(
        store.set(&long, b"v"),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn connecting_to_nothing_times_out() {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free")
        .port();
    let start = Instant::now();
    let e = TcpStore::torch_client("127.0.0.1", port, "", Duration::from_millis(400)).unwrap_err();
    assert_timeout::<()>(Err(e), "connecting to the torch store");
    assert!(start.elapsed() < Duration::from_secs(3));
}

// ---- a real torch server ----

/// Whether `python3 -c "import torch"` works; prints the skip line once when not.
fn torch_importable() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    let ok = *OK.get_or_init(|| {
        Command::new("python3")
            .args(["-c", "import torch"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !ok {
        println!("skipped: torch not importable (pip install torch)");
    }
    ok
}

/// A torch `TCPStore` server on `127.0.0.1:PORT` (0: any), libuv or classic. It prints
/// its port, then serves until its standard input closes, answering lines
/// `get|set|add PREFIX KEY [VALUE]` through `PrefixStore(PREFIX, its own client)`
/// (`-` for no prefix) with one line each: how Python sees what Rust wrote.
const SERVER_PY: &str = r#"
import sys, datetime
from torch.distributed import TCPStore, PrefixStore
port, libuv = int(sys.argv[1]), sys.argv[2] == "1"
s = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=30),
             use_libuv=libuv, wait_for_workers=False)
print(s.port, flush=True)
for line in sys.stdin:
    op, prefix, key, *rest = line.split()
    st = s if prefix == "-" else PrefixStore(prefix, s)
    if op == "get": print(st.get(key).hex(), flush=True)
    elif op == "set": st.set(key, bytes.fromhex(rest[0])); print("ok", flush=True)
    elif op == "add": print(st.add(key, int(rest[0])), flush=True)
"#;

/// A running [`SERVER_PY`]; it exits when this is dropped (its stdin closes) or when
/// the test process ends.
struct TorchServer {
    port: u16,
    // Declared first: closing stdin first ends the script.
    stdin: Mutex<ChildStdin>,
    lines: Mutex<mpsc::Receiver<String>>,
    child: Child,
}

impl TorchServer {
    fn start(port: u16, libuv: bool) -> TorchServer {
        let mut child = Command::new("python3")
            .args([
                "-c",
                SERVER_PY,
                &port.to_string(),
                if libuv { "1" } else { "0" },
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start python3");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout)
                .lines()
                .map_while(std::io::Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take().expect("stdin");
        let mut server = TorchServer {
            port: 0,
            stdin: Mutex::new(stdin),
            lines: Mutex::new(rx),
            child,
        };
        server.port = server.line().parse().expect("the server prints its port");
        server
    }

    fn line(&self) -> String {
        let lines = self.lines.lock().expect("lines");
        lines
            .recv_timeout(Duration::from_secs(60))
            .expect("a line from the torch server")
    }

    /// What Python answers to `op prefix key [value]`.
    fn python(&self, command: &str) -> String {
        let mut stdin = self.stdin.lock().expect("stdin");
        writeln!(stdin, "{command}").expect("write to python");
        stdin.flush().expect("flush");
        drop(stdin);
        self.line()
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One shared server per backend, started once (each start imports torch).
fn torch_server(libuv: bool) -> Option<&'static TorchServer> {
    static SERVERS: [OnceLock<TorchServer>; 2] = [OnceLock::new(), OnceLock::new()];
    if !torch_importable() {
        return None;
    }
    Some(SERVERS[usize::from(libuv)].get_or_init(|| TorchServer::start(0, libuv)))
}

/// A prefix no other test uses.
fn fresh_prefix(test: &str) -> String {
    format!("test/{test}/{}", std::process::id())
}

fn primitives(libuv: bool) -> Result<()> {
    let Some(server) = torch_server(libuv) else {
        return Ok(());
    };
    let prefix = fresh_prefix(if libuv {
        "primitives_libuv"
    } else {
        "primitives_classic"
    });
    let short = Duration::from_millis(400);
    let store = TcpStore::torch_client("127.0.0.1", server.port, &prefix, short)?;
    assert_eq!(store.port(), server.port);
    store.set("k", b"v1")?;
    assert_eq!(store.get("k")?, b"v1");
    assert_eq!(store.add("n", 5)?, 5);
    assert_eq!(store.add("n", -7)?, -2);
    assert_eq!(
        store.get("n")?,
        b"-2",
        "add keeps decimal text, as torch does"
    );
    assert_eq!(store.set_if_absent("k", b"other")?, Some(b"v1".to_vec()));
    assert_eq!(store.set_if_absent("fresh", b"first")?, None);
    assert_eq!(store.get("fresh")?, b"first");
    // Over the libuv server's limits: refused before sending, the connection still usable.
    let big = vec![0u8; collectives::store::TORCH_MAX_VALUE_LEN + 1];
    assert!(matches!(
        store.set("big", &big),
        Err(collectives::Error::InvalidArgument(_))
    ));
    assert_eq!(
        store.get("k")?,
        b"v1",
        "the connection survives a refused value"
    );

    assert_eq!(store.compare_set("k", b"v1", b"v2")?, b"v2");
    assert_eq!(store.compare_set("k", b"wrong", b"v3")?, b"v2");
    assert_eq!(store.compare_set("nothing", b"x", b"y")?, b"x");
    assert!(
        !store.check(&["nothing"])?,
        "compare_set of an absent key with a non-empty expected value sets nothing"
    );
    assert!(store.check(&["k", "n", "fresh"])?);
    assert!(!store.check(&["k", "absent"])?);
    store.wait(&["k", "n"], T)?;
    store.multi_set(&[("a", b"1"), ("b", b"")])?;
    assert_eq!(
        store.multi_get(&["a", "b", "k"])?,
        [b"1".to_vec(), Vec::new(), b"v2".to_vec()]
    );
    assert!(store.delete_key("a")?);
    assert!(!store.delete_key("a")?);
    assert!(store.num_keys()? >= 4);

    // Timeouts: bounded, naming the keys, and the connection still in step after.
    let start = Instant::now();
    assert_timeout(
        store.wait(&["k", "late"], Duration::from_millis(300)),
        "late",
    );
    assert_timeout(store.get("absent"), "absent");
    assert_timeout(store.multi_get(&["k", "absent"]), "absent");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(store.get("k")?, b"v2");

    // A wait another client ends.
    thread::scope(|s| -> Result<()> {
        let waiter = s.spawn(|| store.wait(&["later"], T));
        thread::sleep(Duration::from_millis(100));
        let other = TcpStore::torch_client("127.0.0.1", server.port, &prefix, T)?;
        other.set("later", b"now")?;
        waiter.join().expect("waiter")
    })?;

    // Python sees what Rust wrote, through PrefixStore, and the other way round.
    assert_eq!(server.python(&format!("get {prefix} k")), hex(b"v2"));
    assert_eq!(server.python(&format!("add {prefix} n 10")), "8");
    assert_eq!(
        server.python(&format!("set {prefix} py {}", hex(b"from python"))),
        "ok"
    );
    assert_eq!(store.get("py")?, b"from python");
    let bare = TcpStore::torch_client("127.0.0.1", server.port, "", T)?;
    bare.set(&format!("{prefix}-bare"), b"b")?;
    assert_eq!(server.python(&format!("get - {prefix}-bare")), hex(b"b"));

    // Add to a key holding no integer: torch's server closes the connection.
    let e = store.add("k", 1).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(
        matches!(store.get("k"), Err(Error::Io { ref message, .. }) if message.contains("unusable"))
    );
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn live_primitives_on_the_libuv_server() -> Result<()> {
    primitives(true)
}

#[test]
fn live_primitives_on_the_classic_server() -> Result<()> {
    primitives(false)
}

/// Joins `world_size` ranks, each a thread with its own client, then meets at two
/// barriers; every rank's outcome.
fn ranks_join(
    server: &TorchServer,
    prefix: &str,
    ranks: &[(usize, usize)],
    timeout: Duration,
) -> Vec<Result<()>> {
    thread::scope(|s| {
        let threads: Vec<_> = ranks
            .iter()
            .map(|&(rank, world_size)| {
                s.spawn(move || -> Result<()> {
                    let store = TcpStore::torch_client("127.0.0.1", server.port, prefix, T)?;
                    store.join(rank, world_size, timeout)?;
                    assert_eq!(store.world_size(), world_size);
                    store.barrier("b", world_size, rank, timeout)?;
                    store.barrier("b", world_size, rank, timeout)?;
                    Ok(())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("rank thread"))
            .collect()
    })
}

#[test]
fn live_join_and_barrier_of_2_and_4_ranks() -> Result<()> {
    let Some(server) = torch_server(true) else {
        return Ok(());
    };
    for world_size in [2, 4] {
        let prefix = fresh_prefix(&format!("join{world_size}"));
        let ranks: Vec<_> = (0..world_size).map(|r| (r, world_size)).collect();
        for (rank, outcome) in ranks_join(server, &prefix, &ranks, T)
            .into_iter()
            .enumerate()
        {
            outcome.unwrap_or_else(|e| panic!("rank {rank} of {world_size}: {e}"));
        }
    }
    Ok(())
}

#[test]
fn live_join_mistakes_fail_every_rank_by_name() {
    let Some(server) = torch_server(true) else {
        return;
    };
    // Ranks that disagree on the world size.
    let prefix = fresh_prefix("disagree");
    for (i, outcome) in ranks_join(server, &prefix, &[(0, 2), (1, 3)], T)
        .into_iter()
        .enumerate()
    {
        match outcome {
            Err(Error::Rendezvous { why, ranks }) => {
                assert_eq!(ranks, [0, 1], "{why}");
                assert!(
                    why.contains("WORLD_SIZE=2") && why.contains("WORLD_SIZE=3"),
                    "{why}"
                );
            }
            other => panic!("rank {i}: expected a rendezvous error, got {other:?}"),
        }
    }
    // Two processes with one rank, while rank 0 is still to come: the second claim
    // fails, and the first claimant, waiting, learns of it; rank 0, arriving after,
    // too. (A claim after the rendezvous is complete can only fail its own process
    // at once; the others learn of it at their next join or barrier.)
    let prefix = fresh_prefix("twice");
    let mut outcomes = ranks_join(server, &prefix, &[(1, 2), (1, 2)], T);
    outcomes.extend(ranks_join(server, &prefix, &[(0, 2)], T));
    for (i, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Err(Error::Rendezvous { why, ranks }) => {
                assert_eq!(ranks, [1], "{why}");
                assert!(why.contains("claimed by two processes"), "{why}");
            }
            other => panic!("process {i}: expected a rendezvous error, got {other:?}"),
        }
    }
    // A rank that never comes is named on every rank.
    let prefix = fresh_prefix("missing");
    let start = Instant::now();
    let timeout = Duration::from_secs(1);
    for outcome in ranks_join(server, &prefix, &[(0, 3), (1, 3)], timeout) {
        match outcome {
            Err(Error::Timeout { missing, .. }) => assert_eq!(missing, [2]),
            other => panic!("expected a timeout missing rank 2, got {other:?}"),
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn live_client_waits_for_a_server_that_starts_late() -> Result<()> {
    if !torch_importable() {
        return Ok(());
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free")
        .port();
    thread::scope(|s| -> Result<()> {
        let client =
            s.spawn(|| TcpStore::torch_client("127.0.0.1", port, "", Duration::from_secs(60)));
        // The client is already retrying while python imports torch.
        let server = TorchServer::start(port, true);
        let store = client.join().expect("client")?;
        store.set("up", b"1")?;
        assert_eq!(server.python("get - up"), hex(b"1"));
        Ok(())
    })
}

// ---- torchrun ----

/// The `launch_demo` example, built once per test binary.
fn demo() -> &'static Path {
    static DEMO: OnceLock<PathBuf> = OnceLock::new();
    DEMO.get_or_init(|| common::example("launch_demo"))
}

/// Runs `torchrun --no-python --standalone --nproc-per-node N options` on `program args`,
/// killed after two minutes.
fn torchrun(nproc: usize, options: &[&str], program: &[&str]) -> Output {
    let mut child = Command::new("python3")
        .args(["-m", "torch.distributed.run", "--no-python", "--standalone"])
        .args(["--nproc-per-node", &nproc.to_string()])
        .args(options)
        .args(program)
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .env_remove("LOWRANK_STORE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start torchrun");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("poll torchrun").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("torchrun's output")
}

#[test]
fn torchrun_runs_launch_demo_unchanged_on_2_and_4_ranks() {
    if !torch_importable() {
        return;
    }
    let demo = demo().to_str().expect("a UTF-8 path");
    for nproc in [2, 4] {
        let out = torchrun(nproc, &[], &[demo]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "torchrun -n {nproc}: {}\n{stdout}\n{stderr}",
            out.status
        );
        for rank in 0..nproc {
            let passed = format!("rank {rank} of {nproc} (local rank {rank}) passed the barrier");
            assert!(
                stdout.contains(&passed),
                "no {passed:?} in:\n{stdout}\n{stderr}"
            );
        }
    }
}

#[test]
fn torchrun_restarts_join_afresh_under_the_attempts_prefix() {
    if !torch_importable() {
        return;
    }
    let demo = demo().to_str().expect("a UTF-8 path");
    // Attempt 0: rank 1 fails before joining, after rank 0 has joined; torchrun stops
    // rank 0 and restarts both. Attempt 1 joins under its own prefix: rank 0's key of
    // attempt 0, still on the agent's store, is no second process with RANK=0.
    let script = r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then sleep 1; exit 3; fi; exec "$0""#;
    let out = torchrun(2, &["--max-restarts", "1"], &["sh", "-c", script, demo]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    for rank in 0..2 {
        let passed = format!("rank {rank} of 2 (local rank {rank}) passed the barrier");
        assert_eq!(stdout.matches(&passed).count(), 1, "{stdout}\n{stderr}");
    }
}

#[test]
fn torchrun_with_a_wrong_world_size_fails_clearly() {
    if !torch_importable() {
        return;
    }
    let demo = demo().to_str().expect("a UTF-8 path");
    // One rank's WORLD_SIZE overridden: the join names both ranks and both sizes.
    // (LOCAL_WORLD_SIZE too, or the variables alone would show it: see below.)
    let script =
        r#"if [ "$RANK" = 1 ]; then export WORLD_SIZE=3 LOCAL_WORLD_SIZE=3; fi; exec "$0""#;
    let out = torchrun(2, &[], &["sh", "-c", script, demo]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("ranks disagree on the world size: rank 0 joined with WORLD_SIZE=2, rank 1 with WORLD_SIZE=3")
            || stderr.contains("ranks disagree on the world size: rank 1 joined with WORLD_SIZE=3, rank 0 with WORLD_SIZE=2"),
        "{stderr}"
    );
    // Every rank's overridden alike: the variables themselves say it is wrong.
    let out = torchrun(
        2,
        &[],
        &["sh", "-c", r#"export WORLD_SIZE=3; exec "$0""#, demo],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("LOCAL_WORLD_SIZE=2") && stderr.contains("\"WORLD_SIZE\""),
        "{stderr}"
    );
}

// ---- the environment torchrun sets ----

/// What torchrun's agent sets for rank 1 of 4 on node 0 of 2, in its third attempt,
/// with `extra` on top (or removed, for an empty value).
fn agent_vars(extra: &[(&str, &str)]) -> Result<EnvInfo> {
    let mut vars: HashMap<&str, String> = HashMap::from([
        ("RANK", "1".into()),
        ("WORLD_SIZE", "4".into()),
        ("LOCAL_RANK", "1".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", "29500".into()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ("TORCHELASTIC_RESTART_COUNT", "2".into()),
        ("TORCHELASTIC_MAX_RESTARTS", "3".into()),
        ("TORCHELASTIC_RUN_ID", "job-7".into()),
        ("GROUP_RANK", "0".into()),
        ("GROUP_WORLD_SIZE", "2".into()),
        ("LOCAL_WORLD_SIZE", "2".into()),
    ]);
    for &(name, value) in extra {
        if value.is_empty() {
            vars.remove(name);
        } else {
            vars.insert(name, value.into());
        }
    }
    EnvInfo::from_vars(|name| vars.get(name).cloned())
}

fn invalid_env(result: Result<EnvInfo>) -> (String, String) {
    match result {
        Err(Error::InvalidEnv { name, value, why }) => (name, format!("{value}: {why}")),
        other => panic!("expected an invalid variable, got {other:?}"),
    }
}

#[test]
fn env_reads_torchelastic_variables() -> Result<()> {
    let info = agent_vars(&[])?;
    assert!(info.agent_store);
    assert_eq!(info.restart_count, 2);
    assert_eq!(info.max_restarts, Some(3));
    assert_eq!(info.run_id.as_deref(), Some("job-7"));
    assert_eq!((info.group_rank, info.group_world_size), (Some(0), Some(2)));
    assert_eq!(info.local_world_size, Some(2));
    assert_eq!(info.store_prefix(), "worker/attempt_2");
    // torch compares the flag with str(True), exactly.
    for flag in ["False", "true", "1", ""] {
        let info = agent_vars(&[("TORCHELASTIC_USE_AGENT_STORE", flag)])?;
        assert!(!info.agent_store, "{flag:?}");
    }
    // Without the agent's variables, nothing of them.
    let plain = agent_vars(&[
        ("TORCHELASTIC_USE_AGENT_STORE", ""),
        ("TORCHELASTIC_RESTART_COUNT", ""),
        ("TORCHELASTIC_MAX_RESTARTS", ""),
        ("TORCHELASTIC_RUN_ID", ""),
        ("GROUP_RANK", ""),
        ("GROUP_WORLD_SIZE", ""),
        ("LOCAL_WORLD_SIZE", ""),
    ])?;
    assert!(!plain.agent_store && plain.restart_count == 0 && plain.run_id.is_none());
    assert_eq!(plain.store_prefix(), "worker/attempt_0");

    // Bad values are named.
    let (name, why) = invalid_env(agent_vars(&[("TORCHELASTIC_RESTART_COUNT", "x")]));
    assert_eq!(name, "TORCHELASTIC_RESTART_COUNT", "{why}");
    let (name, why) = invalid_env(agent_vars(&[("LOCAL_WORLD_SIZE", "5")]));
    assert_eq!(name, "LOCAL_WORLD_SIZE", "{why}");
    // One node that runs 2 ranks cannot have WORLD_SIZE=4: said at once, by name.
    let (name, why) = invalid_env(agent_vars(&[("GROUP_WORLD_SIZE", "1")]));
    assert_eq!(name, "WORLD_SIZE");
    assert!(why.contains("LOCAL_WORLD_SIZE=2"), "{why}");
    // Not under the agent's store (this crate's launch), the same values pass.
    agent_vars(&[
        ("GROUP_WORLD_SIZE", "1"),
        ("TORCHELASTIC_USE_AGENT_STORE", ""),
    ])?;
    Ok(())
}

#[test]
fn a_token_with_the_agent_store_is_refused() -> Result<()> {
    let info = agent_vars(&[(TOKEN_ENV, "0123456789abcdef0123456789abcdef")])?;
    match info.connect_store(Duration::from_millis(200)) {
        Err(Error::InvalidEnv { name, value, why }) => {
            assert_eq!(name, TOKEN_ENV);
            assert!(!value.contains("0123"), "the token is not shown: {value}");
            assert!(why.contains("checks no token"), "{why}");
        }
        other => panic!("expected the token to be refused, got {other:?}"),
    }
    Ok(())
}

#[test]
fn live_connect_store_joins_the_agent_store_under_the_attempts_prefix() -> Result<()> {
    let Some(server) = torch_server(true) else {
        return Ok(());
    };
    let port = server.port.to_string();
    // A restart count no other test uses: the server lives as long as this process.
    let attempt = "41";
    let stores: Vec<TcpStore> = thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let port = &port;
                s.spawn(move || -> Result<TcpStore> {
                    let rank = rank.to_string();
                    let info = agent_vars(&[
                        ("RANK", &rank),
                        ("LOCAL_RANK", &rank),
                        ("WORLD_SIZE", "2"),
                        ("GROUP_WORLD_SIZE", "1"),
                        ("MASTER_PORT", port),
                        ("TORCHELASTIC_RESTART_COUNT", attempt),
                    ])?;
                    let store = info.connect_store(T)?;
                    store.barrier("after_join", 2, info.rank, T)?;
                    Ok(store)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().expect("rank thread"))
            .collect::<Result<_>>()
    })?;
    for store in &stores {
        assert!(store.is_torch() && !store.is_server());
        assert_eq!(store.key_prefix(), Some("worker/attempt_41"));
        assert_eq!(store.world_size(), 2);
    }
    // Python sees both ranks' registrations under PrefixStore("worker/attempt_41", ...).
    for rank in 0..2 {
        let id = server.python(&format!(
            "get worker/attempt_41 collectives/join/rank/{rank}"
        ));
        assert!(!id.is_empty(), "rank {rank} registered an id");
    }
    Ok(())
}
