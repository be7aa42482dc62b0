//! Building the full mesh of one TCP group, and the threads that serve its sockets.
//!
//! Each rank binds a listener (port 0), publishes `host:port` in the store under the
//! group's prefix, connects to every lower rank and accepts every higher one. The
//! connecting side speaks first (a [`Hello`]: its rank, the world size and the job check
//! value that rank 0 put in the store for this group); the accepting side checks all
//! three and answers with its own hello, or refuses with a reason and keeps waiting for
//! the real rank. Every step is bounded by the group's timeout, and a timeout names the
//! ranks that never connected.

use super::frame::{Answer, Header, Hello, HEADER_LEN};
use super::inbox::{Frame, Link, Outgoing, Shared};
use super::TcpOptions;
use crate::store::TcpStore;
use crate::{Error, Result};
use std::io::{ErrorKind, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The sockets of one process's group (the world and every subgroup made from it share
/// it) and the threads that serve them: a reader and a sender per peer, and the
/// point-to-point watchdog. Dropping it closes every socket and joins the threads.
pub(crate) struct Mesh {
    pub shared: Arc<Shared>,
    /// The sender threads and the watchdog, joined on drop (the readers end when their
    /// peers close: see [`Shared::close`]).
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Mesh {{ rank: {}, size: {} }}",
            self.shared.rank, self.shared.size
        )
    }
}

fn timeout_error(what: String, after: Duration, missing: Vec<usize>) -> Error {
    Error::Timeout {
        what,
        after,
        missing,
    }
}

/// The address this rank listens on: the one given, or that of the interface through
/// which the store is reached (a UDP socket "connected" to it sends nothing).
fn listen_ip(store: &TcpStore, options: &TcpOptions) -> Result<IpAddr> {
    if let Some(ip) = options.listen_addr {
        return Ok(ip);
    }
    let to = store.addr();
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let probe = UdpSocket::bind(any).map_err(|e| Error::io("finding the store's interface", e))?;
    probe
        .connect(to)
        .map_err(|e| Error::io("finding the store's interface", e))?;
    Ok(probe
        .local_addr()
        .map_err(|e| Error::io("finding the store's interface", e))?
        .ip())
}

/// What this rank knows of the group while it connects.
struct Setup<'a> {
    store: &'a TcpStore,
    rank: usize,
    size: usize,
    prefix: String,
    check: Vec<u8>,
    deadline: Instant,
    timeout: Duration,
}

impl Setup<'_> {
    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    fn hello(&self) -> Hello {
        Hello {
            rank: self.rank as u64,
            world_size: self.size as u64,
            check: self.check.clone(),
        }
    }

    fn missing(&self, what: &str, ranks: Vec<usize>) -> Error {
        timeout_error(
            format!("rank {} of a TCP group of {} {what}", self.rank, self.size),
            self.timeout,
            ranks,
        )
    }

    /// Connects to lower rank `j`, retrying until the deadline.
    fn connect(&self, j: usize) -> Result<TcpStream> {
        let key = format!("{}/addr/{j}", self.prefix);
        self.store.wait(&[&key], self.left()).map_err(|e| match e {
            Error::Timeout { .. } => {
                self.missing(&format!("waited for rank {j}'s address"), vec![j])
            }
            other => other,
        })?;
        let text = String::from_utf8_lossy(&self.store.get(&key)?).into_owned();
        let addr: SocketAddr = text.parse().map_err(|_| {
            Error::Protocol(format!(
                "rank {j} published a bad TCP group address {text:?}"
            ))
        })?;
        let mut stream = loop {
            let left = self.left();
            if left.is_zero() {
                return Err(
                    self.missing(&format!("could not connect to rank {j} at {addr}"), vec![j])
                );
            }
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
                Ok(s) => break s,
                Err(e) => {
                    tracing::debug!(rank = self.rank, peer = j, error = %e, "TCP group connect, retrying");
                    std::thread::sleep(Duration::from_millis(10).min(self.left()));
                }
            }
        };
        let io = |e| Error::io(format!("greeting rank {j} of a TCP group"), e);
        stream.set_nodelay(true).map_err(io)?;
        stream
            .set_read_timeout(Some(self.left().max(Duration::from_millis(1))))
            .map_err(io)?;
        stream.set_write_timeout(Some(self.timeout)).map_err(io)?;
        self.hello().write_to(&mut stream).map_err(io)?;
        let answer = Answer::read_from(&mut stream).map_err(|e| match e {
            Error::Io { .. } if self.left().is_zero() => {
                self.missing(&format!("waited for rank {j}'s answer"), vec![j])
            }
            e => e,
        })?;
        let refused = |why: String| Error::Rendezvous {
            why: format!(
                "rank {j} of the TCP group refused rank {}: {why}",
                self.rank
            ),
            ranks: vec![self.rank, j],
        };
        match answer {
            Answer::Refused(why) => Err(refused(why)),
            Answer::Accepted(h) => {
                if h.rank != j as u64 || h.world_size != self.size as u64 || h.check != self.check {
                    return Err(Error::Rendezvous {
                        why: format!(
                            "the listener of rank {j} answered as rank {} of {} (or of another job)",
                            h.rank, h.world_size
                        ),
                        ranks: vec![self.rank, j],
                    });
                }
                Ok(stream)
            }
        }
    }

    /// Accepts every higher rank on `listener`; refuses strays and keeps waiting.
    fn accept_all(&self, listener: &TcpListener, links: &mut [Option<TcpStream>]) -> Result<()> {
        let io = |e| Error::io("accepting TCP group peers", e);
        listener.set_nonblocking(true).map_err(io)?;
        let mut waiting = self.size - self.rank - 1;
        while waiting > 0 {
            let mut stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    if self.left().is_zero() {
                        let missing = (self.rank + 1..self.size)
                            .filter(|&r| links[r].is_none())
                            .collect();
                        return Err(self.missing("waited for higher ranks to connect", missing));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => return Err(io(e)),
            };
            // A stray connection may say nothing: it gets at most a moment.
            let greeting = stream
                .set_nonblocking(false)
                .and_then(|()| {
                    stream.set_read_timeout(Some(
                        self.left()
                            .clamp(Duration::from_millis(1), Duration::from_secs(5)),
                    ))
                })
                .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(5))));
            if let Err(e) = greeting {
                tracing::debug!(error = %e, "TCP group: dropping a connection");
                continue;
            }
            let hello = match Hello::read_from(&mut stream) {
                Ok(h) => h,
                Err(e) => {
                    tracing::debug!(rank = self.rank, error = %e, "TCP group: refused a connection");
                    let _ = Answer::Refused(format!("{e}")).write_to(&mut stream);
                    continue;
                }
            };
            let r = hello.rank as usize;
            let why = if hello.check != self.check {
                Some("it does not belong to this group (wrong job check value)".to_string())
            } else if hello.world_size != self.size as u64 {
                Some(format!(
                    "it has world size {}, this group {}",
                    hello.world_size, self.size
                ))
            } else if hello.rank <= self.rank as u64 || hello.rank >= self.size as u64 {
                Some(format!(
                    "rank {} does not connect to rank {}",
                    hello.rank, self.rank
                ))
            } else if links[r].is_some() {
                Some(format!("rank {r} is connected already"))
            } else {
                None
            };
            if let Some(why) = why {
                tracing::debug!(rank = self.rank, claimed = hello.rank, %why, "TCP group: refused a connection");
                let _ = Answer::Refused(why).write_to(&mut stream);
                continue;
            }
            let ready = stream
                .set_nodelay(true)
                .and_then(|()| stream.set_write_timeout(Some(self.timeout)))
                .and_then(|()| Answer::Accepted(self.hello()).write_to(&mut stream));
            if let Err(e) = ready {
                tracing::debug!(rank = self.rank, peer = r, error = %e, "TCP group: answering failed");
                continue;
            }
            links[r] = Some(stream);
            waiting -= 1;
        }
        Ok(())
    }
}

impl Mesh {
    /// Connects rank `rank` of `size` to its peers through `store` (see the module docs).
    pub fn connect(
        store: &TcpStore,
        rank: usize,
        size: usize,
        options: &TcpOptions,
    ) -> Result<Mesh> {
        let timeout = options.timeout;
        let deadline = crate::group::deadline_after(timeout);
        let generation = store.add(&format!("{}/created/{rank}", options.prefix), 1)?;
        let prefix = format!("{}/{generation}", options.prefix);
        let check_key = format!("{prefix}/check");
        if rank == 0 {
            let secret = crate::store::StoreToken::generate()?;
            store.set(&check_key, secret.secret().as_bytes())?;
        }
        let mut setup = Setup {
            store,
            rank,
            size,
            prefix,
            check: Vec::new(),
            deadline,
            timeout,
        };
        store
            .wait(&[&check_key], setup.left())
            .map_err(|e| match e {
                Error::Timeout { .. } => {
                    setup.missing("waited for rank 0 to open the group", vec![0])
                }
                other => other,
            })?;
        setup.check = store.get(&check_key)?;
        let ip = listen_ip(store, options)?;
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::io(format!("binding a TCP group listener on {ip}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("reading the TCP group listener's address", e))?;
        store.set(
            &format!("{}/addr/{rank}", setup.prefix),
            local.to_string().as_bytes(),
        )?;
        tracing::debug!(rank, size, %local, prefix = %setup.prefix, "TCP group listening");
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        for (j, slot) in streams.iter_mut().enumerate().take(rank) {
            *slot = Some(setup.connect(j)?);
        }
        setup.accept_all(&listener, &mut streams)?;
        drop(listener);
        store
            .barrier(&format!("{}/ready", setup.prefix), size, rank, setup.left())
            .map_err(|e| match e {
                Error::Timeout { missing, .. } => {
                    setup.missing("waited at the end of the connection", missing)
                }
                e => e,
            })?;
        Mesh::start(rank, size, timeout, streams)
    }

    /// Starts the threads on connected sockets.
    fn start(
        rank: usize,
        size: usize,
        timeout: Duration,
        streams: Vec<Option<TcpStream>>,
    ) -> Result<Mesh> {
        let io = |e| Error::io("preparing a TCP group socket", e);
        let mut links = Vec::with_capacity(size);
        let mut readers = Vec::new();
        let mut outs = Vec::new();
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                links.push(None);
                continue;
            };
            s.set_read_timeout(None).map_err(io)?;
            let (tx, rx) = mpsc::channel::<Outgoing>();
            readers.push((peer, s.try_clone().map_err(io)?));
            outs.push((peer, rx));
            links.push(Some(Link {
                raw: s.try_clone().map_err(io)?,
                write: Mutex::new(s),
                out: Mutex::new(Some(tx)),
            }));
        }
        let shared = Arc::new(Shared::new(rank, size, timeout, links));
        let mesh = Mesh {
            shared: shared.clone(),
            threads: Mutex::new(Vec::new()),
        };
        let spawn = |name: String, join: bool, f: Box<dyn FnOnce() + Send>| -> Result<()> {
            let h = std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| Error::io("starting a TCP group thread", e))?;
            if join {
                mesh.threads
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(h);
            }
            Ok(())
        };
        for (peer, stream) in readers {
            let sh = shared.clone();
            let f = Box::new(move || read_loop(&sh, peer, stream));
            spawn(format!("tcp-read-{rank}-{peer}"), false, f)?;
        }
        for (peer, rx) in outs {
            let sh = shared.clone();
            let f = Box::new(move || send_loop(&sh, peer, rx));
            spawn(format!("tcp-send-{rank}-{peer}"), true, f)?;
        }
        let sh = shared.clone();
        spawn(
            format!("tcp-watch-{rank}"),
            true,
            Box::new(move || sh.watchdog()),
        )?;
        Ok(mesh)
    }

    /// A mesh of one rank: no sockets, only the watchdog.
    pub fn alone(timeout: Duration) -> Result<Mesh> {
        Mesh::start(0, 1, timeout, vec![None])
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.shared.close();
        // The sender threads flush what is queued (acks a peer waits for) first.
        let me = std::thread::current().id();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for h in threads {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        self.shared.shut_writes();
    }
}

/// Reads frames from world rank `src` until its socket ends, then marks it gone.
fn read_loop(shared: &Shared, src: usize, mut stream: TcpStream) {
    let why = loop {
        let mut head = [0u8; HEADER_LEN];
        if let Err(e) = stream.read_exact(&mut head) {
            break if e.kind() == ErrorKind::UnexpectedEof {
                "it closed its connection (dropped its group or exited)".to_string()
            } else {
                format!("its connection broke: {e}")
            };
        }
        let header = match Header::decode(&head) {
            Ok(h) => h,
            Err(e) => break format!("it sent a malformed frame: {e}"),
        };
        let mut payload = match shared.payload(header.dtype, header.count as usize) {
            Ok(b) => b,
            Err(e) => break format!("its frame cannot be received here: {e}"),
        };
        if let Err(e) = stream.read_exact(payload.as_bytes_mut()) {
            break format!("its connection broke inside a frame: {e}");
        }
        shared.deliver(src, Frame { header, payload });
    };
    shared.mark_dead(src, why);
}

/// Writes world rank `dst`'s point-to-point messages and acks, in order.
fn send_loop(shared: &Shared, dst: usize, rx: mpsc::Receiver<Outgoing>) {
    for out in rx {
        match out {
            Outgoing::Data { header, buf } => {
                if shared.write_frame(dst, &header, buf.as_bytes()).is_ok() {
                    shared.returned(header.desc, buf);
                }
            }
            Outgoing::Ack(h) => {
                let _ = shared.write_frame(dst, &h, &[]);
            }
        }
    }
}
