//! Faults a peer of the store can inject, each answered to that peer alone or made
//! harmless: a malformed join (a rank not below its world size, a world of 0 or of
//! `u64::MAX` ranks), client-supplied text with control characters in errors, and a
//! store that is gone named as such.
//!
//! The hostile peers speak the private wire format of `store/wire.rs` by hand.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use collectives::store::TcpStore;
use collectives::{Error, Result};

/// A timeout no test should reach.
const T: Duration = Duration::from_secs(20);

/// Control characters, a bidi override and an isolate: what forges a log line.
const FORGE: &str = "\x1b[31m\r\0\u{202e}\u{2066}";

// ---- hand-made frames, mirroring the private format of `store/wire.rs` ----

fn frame(payload: &[u8]) -> Vec<u8> {
    [&(payload.len() as u32).to_be_bytes()[..], payload].concat()
}

fn bytes(b: &[u8]) -> Vec<u8> {
    [&(b.len() as u32).to_be_bytes()[..], b].concat()
}

fn hello() -> Vec<u8> {
    frame(&[&[0u8][..], b"ctstore2", &[0], &0u32.to_be_bytes()].concat())
}

fn join(rank: u64, world_size: u64) -> Vec<u8> {
    frame(
        &[
            &[8u8][..],
            &rank.to_be_bytes(),
            &world_size.to_be_bytes(),
            &bytes(b"hostile"),
        ]
        .concat(),
    )
}

/// A `Fail` request: a timeout of `what`, with rank 1 missing.
fn fail_timeout(what: &str) -> Vec<u8> {
    frame(
        &[
            &[9u8, 0][..],
            &bytes(what.as_bytes()),
            &1000u64.to_be_bytes(),
            &1u32.to_be_bytes(),
            &1u64.to_be_bytes(),
        ]
        .concat(),
    )
}

fn check(key: &str) -> Vec<u8> {
    frame(&[&[4u8][..], &1u32.to_be_bytes(), &bytes(key.as_bytes())].concat())
}

/// Reply type bytes.
const HELLO: u8 = 0;
const UNIT: u8 = 1;
const BOOL: u8 = 4;
const INVALID: u8 = 6;
const REFUSED: u8 = 8;
const FAILED: u8 = 11;

fn read_frame(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).ok()?;
    let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
    stream.read_exact(&mut payload).ok()?;
    Some(payload)
}

/// A raw connection to `store`, past the hello.
fn greeted(store: &TcpStore) -> TcpStream {
    let mut stream = TcpStream::connect(store.addr()).expect("connect");
    stream.set_read_timeout(Some(T)).expect("configure");
    stream.write_all(&hello()).expect("send the hello");
    let reply = read_frame(&mut stream).expect("the hello is answered");
    assert_eq!(reply[0], HELLO, "{reply:?}");
    stream
}

/// Sends `request` and returns the reply's type byte and the text it carries (for
/// `Invalid`, the message).
fn ask(stream: &mut TcpStream, request: &[u8]) -> (u8, String) {
    stream.write_all(request).expect("send a request");
    let reply = read_frame(stream).expect("the request is answered");
    let text = if reply[0] == INVALID {
        String::from_utf8_lossy(&reply[5..]).into_owned()
    } else {
        String::from_utf8_lossy(&reply[1..]).into_owned()
    };
    (reply[0], text)
}

/// Whether `text` holds a character that rewrites a terminal line or its direction.
fn has_forging_chars(text: &str) -> bool {
    text.chars()
        .any(|c| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'))
}

fn assert_escaped(error: &Error) {
    let shown = error.to_string();
    assert!(
        !has_forging_chars(&shown),
        "raw control characters: {shown:?}"
    );
    assert!(
        shown.contains(r"\u{1b}[31m") && shown.contains(r"\u{202e}"),
        "{shown:?}"
    );
}

#[test]
fn malformed_joins_are_refused_to_their_client_and_the_rendezvous_completes() -> Result<()> {
    // Regression: a join of rank u64::MAX of a world of u64::MAX ranks, from any client
    // past the hello, failed the rendezvous of every rank ("rank 18446744073709551615
    // has WORLD_SIZE=..."), while rank 5 of a world of 2 was only refused.
    let server = TcpStore::server(("127.0.0.1", 0), 2, T)?;
    let client = TcpStore::client("127.0.0.1", server.port(), T)?;
    let mut hostile = greeted(&server);
    thread::scope(|s| -> Result<()> {
        let rank1 = s.spawn(|| client.join(1, 2, T));
        // Rank 1 is waiting in its join before the hostile joins arrive.
        let deadline = Instant::now() + T;
        while server.stats().map_or(0, |stats| stats.waiting) < 1 {
            assert!(Instant::now() < deadline, "rank 1 never waited");
            thread::sleep(Duration::from_millis(5));
        }
        for (rank, world_size, says) in [
            (u64::MAX, u64::MAX, "more than"),
            (u64::MAX - 1, u64::MAX - 1, "more than"),
            (0, 0, "a world of 0 ranks"),
            (5, 0, "a world of 0 ranks"),
            (2, 2, "not below its world size"),
            (5, 2, "not below its world size"),
            (0, u64::MAX, "more than"),
            (1 << 20, (1 << 20) + 1, "more than"),
        ] {
            let (kind, message) = ask(&mut hostile, &join(rank, world_size));
            assert_eq!(
                kind, INVALID,
                "join({rank}, {world_size}): expected Invalid, got type {kind}: {message}"
            );
            assert!(
                message.contains(says) && message.contains(&rank.to_string()),
                "join({rank}, {world_size}): {message}"
            );
        }
        // The hostile connection is still served, and nothing failed.
        assert_eq!(ask(&mut hostile, &check("anything")).0, BOOL);
        server.join(0, 2, T)?;
        rank1.join().expect("rank 1 panicked")
    })?;
    // The job did not fail: the store serves on.
    server.set("after", b"ok")?;
    assert_eq!(client.get("after")?, b"ok");
    Ok(())
}

#[test]
fn a_failure_reported_with_control_characters_reaches_every_rank_escaped() -> Result<()> {
    // Regression: the text of a client's failure report (what timed out, quoting a key)
    // reached every rank's error, and its log line, with ESC, CR, NUL and U+202E raw.
    let server = TcpStore::server(("127.0.0.1", 0), 2, T)?;
    let mut hostile = greeted(&server);
    let what = format!("store get of key {FORGE}");
    assert_eq!(ask(&mut hostile, &fail_timeout(&what)).0, UNIT);
    let error = server.get("k").expect_err("the job failed");
    assert!(matches!(error, Error::Timeout { .. }), "{error:?}");
    assert_escaped(&error);
    Ok(())
}

#[test]
fn keys_with_control_characters_are_escaped_in_errors() -> Result<()> {
    // A guard (these errors quoted keys escaped already): every error that names a key
    // shows it escaped.
    let server = TcpStore::server(("127.0.0.1", 0), 1, T)?;
    let key = FORGE;
    let short = Duration::from_millis(50);
    let waited = server.wait(&[key], short).expect_err("never set");
    assert_escaped(&waited);
    server.set(key, b"not a number")?;
    let added = server.add(key, 1).expect_err("not an integer");
    assert!(matches!(added, Error::InvalidArgument(_)), "{added:?}");
    assert_escaped(&added);
    let barrier = server.barrier(key, 1, 1, short).expect_err("rank 1 of 1");
    assert_escaped(&barrier);
    Ok(())
}

/// Serves one connection as a store would not: the hello is answered with `hello`
/// (a frame payload), and, when that was a greeting, the first request with `reply`.
fn hostile_server(hello: Vec<u8>, reply: Vec<u8>) -> (u16, mpsc::Receiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    let (done, finished) = mpsc::channel();
    thread::spawn(move || {
        if let Ok((mut stream, _)) = listener.accept() {
            let _ = stream.set_read_timeout(Some(T));
            if read_frame(&mut stream).is_some() && stream.write_all(&frame(&hello)).is_ok() {
                if hello[0] == HELLO && read_frame(&mut stream).is_some() {
                    let _ = stream.write_all(&frame(&reply));
                }
                // Held open until the client has read the reply.
                let _ = read_frame(&mut stream);
            }
        }
        let _ = done.send(());
    });
    (port, finished)
}

fn greeting() -> Vec<u8> {
    [
        &[HELLO][..],
        b"ctstore2",
        &2u64.to_be_bytes(),
        &[0],
        &120_000u64.to_be_bytes(),
    ]
    .concat()
}

#[test]
fn messages_from_a_hostile_store_are_escaped() {
    // Regression: a peer answering on the store's port had its messages shown raw.
    let text = format!("fake {FORGE} message");
    let cases: [(Vec<u8>, Vec<u8>); 3] = [
        (
            greeting(),
            [&[INVALID][..], &bytes(text.as_bytes())].concat(),
        ),
        (
            greeting(),
            [
                &[FAILED, 1][..],
                &bytes(text.as_bytes()),
                &0u32.to_be_bytes(),
            ]
            .concat(),
        ),
        (
            [&[REFUSED][..], &bytes(text.as_bytes())].concat(),
            Vec::new(),
        ),
    ];
    for (hello, reply) in cases {
        let kind = hello[0];
        let (port, finished) = hostile_server(hello, reply);
        let error = match TcpStore::client("127.0.0.1", port, T) {
            Ok(store) => store.set("k", b"v").expect_err("the fake store refuses"),
            Err(e) => e,
        };
        assert_escaped(&error);
        let _ = finished.recv_timeout(T);
        assert!(
            kind == HELLO || matches!(error, Error::Unauthorized(_)),
            "{error:?}"
        );
    }
}

#[test]
fn a_client_finding_no_store_names_the_likely_cause() {
    // Regression: a rank that started after rank 0 had left the rendezvous (the store
    // closed) got only "connection refused ... timed out".
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        listener.local_addr().expect("local address").port()
    };
    let error = TcpStore::client("127.0.0.1", port, Duration::from_millis(300))
        .expect_err("nothing listens");
    assert!(matches!(error, Error::Timeout { .. }), "{error:?}");
    let message = error.to_string();
    for needed in [
        "refused",
        "rendezvous is over",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        assert!(message.contains(needed), "{needed:?} not in {message}");
    }
}
