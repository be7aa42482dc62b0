//! The store server's bounded resources on loopback (issue 9, defect 1): the connection
//! cap, the read and idle timeouts, waits that end with their client, the byte quota,
//! and a prompt stop. Each server's limits are set small so that each test runs in
//! seconds; bounds on time are generous, since other builds share the machine.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use collectives::store::{StoreLimits, StoreOptions, StoreStats, TcpStore};
use collectives::{Error, Result};

/// The timeout of operations that should succeed.
const T: Duration = Duration::from_secs(20);

/// How long a condition that should come true soon may take on a loaded machine.
const SOON: Duration = Duration::from_secs(15);

fn serve(limits: StoreLimits) -> Result<TcpStore> {
    let mut options = StoreOptions::default();
    options.limits = limits;
    TcpStore::server_with(("127.0.0.1", 0), 1, T, &options)
}

fn stats(server: &TcpStore) -> StoreStats {
    server.stats().expect("the server's own store has stats")
}

/// Polls `done` until it holds or `within` passes; whether it held.
fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Connects without a hello.
fn raw(server: &TcpStore) -> TcpStream {
    let stream = TcpStream::connect(server.addr()).expect("connect");
    stream.set_read_timeout(Some(SOON)).expect("configure");
    stream
}

/// Reads what the server sends until it closes the connection; `Err` if it has not
/// closed within the stream's read timeout.
fn read_until_closed(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut got = Vec::new();
    match stream.read_to_end(&mut got) {
        Ok(_) => Ok(got),
        // A close with unread data in its buffers is a reset: closed too.
        Err(e) if e.kind() == ErrorKind::ConnectionReset => Ok(got),
        Err(e) => Err(e),
    }
}

#[test]
fn the_connection_cap_holds_and_a_well_behaved_client_is_still_served() -> Result<()> {
    // Regression: 1,000 idle connections held 1,000 threads forever.
    let mut limits = StoreLimits::default();
    limits.max_connections = 4;
    limits.read_timeout = Duration::from_secs(2);
    let server = serve(limits)?;
    // The server's own client holds one connection; three idle ones fill the cap.
    let mut idle: Vec<TcpStream> = (0..3).map(|_| raw(&server)).collect();
    assert!(
        eventually(SOON, || stats(&server).connections == 4),
        "{:?}",
        stats(&server)
    );
    // One more is told so and closed at once, long before the read timeout.
    let start = Instant::now();
    let mut over = raw(&server);
    let reply = read_until_closed(&mut over).map_err(|e| Error::io("reading the refusal", e))?;
    let text = String::from_utf8_lossy(&reply);
    assert!(text.contains("limit of 4 connections"), "{text:?}");
    assert_eq!(stats(&server).connections, 4);
    // A client already connected is served while the cap is full.
    server.set("k", b"v")?;
    assert_eq!(server.get("k")?, b"v");
    assert!(start.elapsed() < SOON);
    // A new well-behaved client is served once the idle connections time out: it
    // retries while the server is busy.
    let client = TcpStore::client("127.0.0.1", server.port(), T)?;
    assert_eq!(client.get("k")?, b"v");
    for stream in &mut idle {
        read_until_closed(stream).map_err(|e| Error::io("an idle connection stayed open", e))?;
    }
    assert!(stats(&server).connections <= 4);
    Ok(())
}

#[test]
fn idle_and_half_sent_connections_are_closed_after_their_timeouts() -> Result<()> {
    // Regression: 300 connections stuck mid-header never timed out.
    let mut limits = StoreLimits::default();
    limits.read_timeout = Duration::from_millis(500);
    limits.idle_timeout = Duration::from_secs(1);
    let server = serve(limits)?;
    let start = Instant::now();
    let mut silent = raw(&server);
    let mut half_header = raw(&server);
    half_header
        .write_all(&[0, 0])
        .map_err(|e| Error::io("write", e))?;
    let mut half_frame = raw(&server);
    half_frame
        .write_all(&[0, 0, 0, 100, 1, 2, 3])
        .map_err(|e| Error::io("write", e))?;
    for stream in [&mut silent, &mut half_header, &mut half_frame] {
        read_until_closed(stream).map_err(|e| Error::io("a stuck connection stayed open", e))?;
    }
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );

    // A greeted client that goes quiet is closed after the idle timeout, and the
    // server's own connection with it; both reconnect on their next request.
    let client = TcpStore::client("127.0.0.1", server.port(), T)?;
    client.set("k", b"v")?;
    let quiet = Instant::now();
    assert!(
        eventually(SOON, || stats(&server).connections == 0),
        "{:?}",
        stats(&server)
    );
    assert!(
        quiet.elapsed() >= Duration::from_secs(1),
        "{:?}",
        quiet.elapsed()
    );
    assert_eq!(client.get("k")?, b"v");
    assert_eq!(server.get("k")?, b"v");
    assert_eq!(stats(&server).connections, 2);
    Ok(())
}

/// Set by [`a_wait_ends_when_its_client_disconnects`] to the port a child process
/// connects to, with waits that never end.
const WAIT_CHILD_PORT: &str = "COLLECTIVES_STORE_WAIT_CHILD_PORT";
/// How many waits the child parks.
const CHILD_WAITS: usize = 3;

/// The child process of [`a_wait_ends_when_its_client_disconnects`]: parks
/// [`CHILD_WAITS`] waits on the store and stays until it is killed. Without
/// [`WAIT_CHILD_PORT`] (a normal test run) this returns at once.
#[test]
fn parked_waits_child() -> Result<()> {
    let Some(port) = std::env::var_os(WAIT_CHILD_PORT) else {
        return Ok(());
    };
    let port: u16 = port.to_string_lossy().parse().expect("a port");
    thread::scope(|s| {
        for i in 0..CHILD_WAITS {
            s.spawn(move || {
                let store = TcpStore::client("127.0.0.1", port, Duration::from_secs(60))?;
                store.get(&format!("never/{i}"))
            });
        }
    });
    Ok(())
}

#[test]
fn a_wait_ends_when_its_client_disconnects() -> Result<()> {
    // Regression: parked waits outlived their clients (200 threads remained).
    let server = serve(StoreLimits::default())?;
    let baseline = stats(&server);
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["parked_waits_child", "--exact", "--test-threads=1"])
        .env(WAIT_CHILD_PORT, server.port().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| Error::io("starting the child", e))?;
    let parked = eventually(SOON, || stats(&server).waiting == CHILD_WAITS);
    let _ = child.kill();
    let _ = child.wait();
    assert!(parked, "{:?}", stats(&server));
    assert!(
        eventually(SOON, || {
            let now = stats(&server);
            now.waiting == 0 && now.connections == baseline.connections
        }),
        "{:?} (baseline {baseline:?})",
        stats(&server)
    );
    Ok(())
}

#[test]
fn the_byte_quota_rejects_with_a_typed_error() -> Result<()> {
    // Regression: 16 values of 63 MiB made 1 GB resident; nothing bounded the total.
    const LIMIT: usize = 1 << 20;
    let mut limits = StoreLimits::default();
    limits.max_bytes = LIMIT;
    let server = serve(limits)?;
    let client = TcpStore::client("127.0.0.1", server.port(), T)?;
    let value = vec![7u8; 600 << 10];
    client.set("a", &value)?;
    let full = client.set("b", &value);
    assert!(
        matches!(full, Err(Error::StoreQuota { limit: LIMIT, needed, held }) if needed > 0 && held + needed > LIMIT),
        "{full:?}"
    );
    // A request larger than the whole quota is refused before it is allocated.
    let huge = client.set("c", &vec![1u8; 2 << 20]);
    assert!(matches!(huge, Err(Error::StoreQuota { .. })), "{huge:?}");
    // Neither refusal broke the connection; freeing room makes the set fit.
    assert_eq!(client.get("a")?, value);
    assert!(stats(&server).bytes_held <= LIMIT);
    assert!(client.delete_key("a")?);
    client.set("b", &value)?;
    assert_eq!(server.get("b")?, value);
    let held = stats(&server).bytes_held;
    assert!(held >= value.len() && held <= LIMIT, "{held}");
    Ok(())
}

/// Polls what `stream` has received, without reading it, until the count has stayed
/// the same for a while (the sender is stuck: the receive window is closed) or
/// [`SOON`] passes; the count.
fn received_stops_growing(stream: &TcpStream, at_most: usize) -> std::io::Result<usize> {
    const STILL_FOR: u32 = 5;
    let mut buf = vec![0u8; at_most];
    let (mut last, mut still) = (0, 0);
    let deadline = Instant::now() + SOON;
    while Instant::now() < deadline {
        // Blocks, up to the read timeout, only while nothing has arrived.
        let now = stream.peek(&mut buf)?;
        still = if now == last { still + 1 } else { 0 };
        last = now;
        if now > 0 && still >= STILL_FOR {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    Ok(last)
}

/// Regression: dropping the server took 26 s while one client did not read its reply
/// (the write timeout applied per system call). The server is dropped only once it is
/// seen stuck in that reply's write (the client holds the reply's first bytes, and no
/// more arrive), and its reply timeout is far longer than the bound on the drop, so the
/// drop must cut the connection rather than wait the write out.
#[test]
fn dropping_the_server_is_prompt_while_a_client_does_not_read() -> Result<()> {
    const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
    let mut limits = StoreLimits::default();
    limits.shutdown_grace = Duration::from_millis(500);
    limits.reply_timeout = REPLY_TIMEOUT;
    limits.max_bytes = 256 << 20;
    let mut options = StoreOptions::default();
    options.limits = limits;
    let server = TcpStore::server_with(("127.0.0.1", 0), 1, T, &options)?;
    let value = vec![3u8; 32 << 20];
    server.set("big", &value)?;
    // A client asks for the value, a reply far larger than the socket buffers, and
    // never reads it: hand-made frames, since the store's client always reads.
    let mut stuck = raw(&server);
    let hello = [&[0u8][..], b"ctstore2", &[0], &0u32.to_be_bytes()].concat();
    let get = [&[2u8][..], &0u64.to_be_bytes(), &3u32.to_be_bytes(), b"big"].concat();
    for frame in [hello, get] {
        let framed = [(frame.len() as u32).to_be_bytes().to_vec(), frame].concat();
        stuck
            .write_all(&framed)
            .map_err(|e| Error::io("write", e))?;
    }
    assert!(
        eventually(SOON, || stats(&server).connections == 2),
        "{:?}",
        stats(&server)
    );
    // The hello's reply and part of the value's: the server is inside the value's write,
    // which cannot finish while the client does not read.
    let received = received_stops_growing(&stuck, value.len())
        .map_err(|e| Error::io("peeking at the reply", e))?;
    assert!(
        received > 64 && received < value.len(),
        "the client holds {received} bytes: the server is not stuck in its reply"
    );
    let start = Instant::now();
    drop(server);
    let took = start.elapsed();
    assert!(took < Duration::from_secs(10), "{took:?}");
    Ok(())
}
