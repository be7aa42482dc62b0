//! The serving side: binding, the accept thread, one thread per connection, the
//! key-value state with its waits, and shutdown when the server is dropped.

use std::collections::HashMap;
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::{Error, Result};

use super::wire::{self, read_frame, write_frame, FrameError, Request, Response};

/// How long the server tries to write a reply before giving up on its client.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The serving side: an accept thread and one thread per connection.
pub(super) struct Server {
    shared: Arc<Shared>,
    /// Where clients on this host reach the server.
    pub(super) addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    /// Notified whenever a key is set and when the server stops.
    changed: Condvar,
    world_size: usize,
}

/// A clone of a connection's stream, and whether a request of it is being handled.
struct Connection {
    stream: TcpStream,
    busy: bool,
}

struct State {
    data: HashMap<String, Vec<u8>>,
    stopping: bool,
    /// The open connections, so that stopping can shut down the idle ones.
    conns: HashMap<u64, Connection>,
    next_conn: u64,
}

impl Server {
    pub(super) fn start(addr: impl ToSocketAddrs, world_size: usize) -> Result<Server> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::io("binding the store", e))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("binding the store", e))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                data: HashMap::new(),
                stopping: false,
                conns: HashMap::new(),
                next_conn: 0,
            }),
            changed: Condvar::new(),
            world_size,
        });
        let accept = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("tcp-store-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .map_err(|e| Error::io("starting the store's thread", e))?
        };
        tracing::debug!(%bound, world_size, "store serving");
        Ok(Server {
            shared,
            addr: reachable(bound),
            accept: Some(accept),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        {
            let mut state = self.shared.lock();
            state.stopping = true;
            // Idle connections are cut (waking threads blocked reading); busy ones answer
            // the request in hand first, so a rank that has just passed a barrier may
            // drop the server while its peers' replies are still on their way.
            for conn in state.conns.values().filter(|conn| !conn.busy) {
                // An error means the connection is closed already.
                let _ = conn.stream.shutdown(Shutdown::Both);
            }
        }
        self.shared.changed.notify_all();
        // The accept thread blocks in `accept`; a connection of our own wakes it.
        let woke = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).is_ok();
        if let Some(accept) = self.accept.take() {
            if woke {
                if accept.join().is_err() {
                    tracing::warn!("the store's accept thread panicked");
                }
            } else {
                tracing::warn!(addr = %self.addr, "cannot wake the store's accept thread; left running");
            }
        }
    }
}

/// `addr` with an unspecified IP (all interfaces) replaced by loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port())
        }
        _ => addr,
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let accepted = listener.accept();
        if shared.lock().stopping {
            break;
        }
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "store accept failed");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        let id = {
            let mut state = shared.lock();
            // Checked under the lock that `Drop` takes, so no connection escapes shutdown.
            if state.stopping {
                break;
            }
            let id = state.next_conn;
            state.next_conn += 1;
            let conn = Connection {
                stream: clone,
                busy: false,
            };
            state.conns.insert(id, conn);
            id
        };
        let _ = stream.set_nodelay(true);
        // Bounds how long a client that does not read its reply can delay stopping.
        let _ = stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT));
        workers.retain(|worker| !worker.is_finished());
        let worker_shared = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name("tcp-store-conn".into())
            .spawn(move || {
                serve(&worker_shared, id, stream);
                worker_shared.lock().conns.remove(&id);
            });
        match spawned {
            Ok(worker) => workers.push(worker),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a store connection thread");
                shared.lock().conns.remove(&id);
            }
        }
    }
    for worker in workers {
        if worker.join().is_err() {
            tracing::warn!("a store connection thread panicked");
        }
    }
}

/// Answers one connection's requests until it closes, breaks the protocol or the server
/// stops.
fn serve(shared: &Shared, id: u64, mut stream: TcpStream) {
    let set_busy = |busy: bool| -> bool {
        let mut state = shared.lock();
        if let Some(conn) = state.conns.get_mut(&id) {
            conn.busy = busy;
        }
        !state.stopping
    };
    loop {
        let frame = read_frame(&mut stream);
        if !set_busy(true) {
            return;
        }
        let reply = match &frame {
            Ok(Some(frame)) => match Request::decode(frame) {
                Ok(request) => match shared.handle(request) {
                    Some(reply) => reply,
                    None => return,
                },
                Err(message) => Response::Protocol(message),
            },
            Ok(None) | Err(FrameError::Io(_)) => return,
            Err(FrameError::TooLarge(len)) => Response::Protocol(format!(
                "a request of {len} bytes exceeds the limit of {} bytes",
                wire::MAX_FRAME
            )),
        };
        let fatal = matches!(reply, Response::Protocol(_));
        let sent = reply
            .encode()
            .and_then(|payload| write_frame(&mut stream, &payload).map_err(|e| e.to_string()));
        if !set_busy(false) || fatal || sent.is_err() {
            return;
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state if that ever changes.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The reply to `request`, or `None` when the server stops during a wait.
    fn handle(&self, request: Request<'_>) -> Option<Response> {
        Some(match request {
            Request::Hello => Response::Hello {
                world_size: self.world_size as u64,
            },
            Request::Set { key, value } => {
                self.lock().data.insert(key.to_owned(), value.to_vec());
                self.changed.notify_all();
                Response::Unit
            }
            Request::Get { key, timeout } => {
                let (state, missing) = self.wait_for(&[key], timeout)?;
                match state.data.get(key) {
                    Some(value) if missing.is_empty() => Response::Value(value.clone()),
                    _ => Response::TimedOut(missing),
                }
            }
            Request::Add { key, delta } => {
                let reply = add(&mut self.lock().data, key, delta);
                self.changed.notify_all();
                reply
            }
            Request::Check { keys } => {
                let state = self.lock();
                Response::Bool(keys.iter().all(|key| state.data.contains_key(*key)))
            }
            Request::Wait {
                arrive,
                keys,
                timeout,
            } => {
                if let Some(key) = arrive {
                    self.lock().data.insert(key.to_owned(), b"1".to_vec());
                    self.changed.notify_all();
                }
                let (state, missing) = self.wait_for(&keys, timeout)?;
                drop(state);
                if missing.is_empty() {
                    Response::Unit
                } else {
                    Response::TimedOut(missing)
                }
            }
            Request::Delete { key } => Response::Bool(self.lock().data.remove(key).is_some()),
        })
    }

    /// Waits until all `keys` exist or `timeout` passes; returns the lock and the keys
    /// still missing, or `None` when the server stops.
    fn wait_for(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> Option<(MutexGuard<'_, State>, Vec<String>)> {
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|key| !state.data.contains_key(**key))
                .map(|key| (*key).to_owned())
                .collect();
            // A wait already satisfied is answered even while the server stops.
            if missing.is_empty() {
                return Some((state, missing));
            }
            if state.stopping {
                return None;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| d <= now) {
                return Some((state, missing));
            }
            state = match deadline {
                Some(deadline) => {
                    self.changed
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                // A timeout too large for an `Instant` is as good as none.
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
            };
        }
    }
}

fn add(data: &mut HashMap<String, Vec<u8>>, key: &str, delta: i64) -> Response {
    let old = match data.get(key) {
        None => 0,
        Some(bytes) => match std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
        {
            Some(old) => old,
            None => {
                return Response::Invalid(format!(
                    "add to key {key:?}: its {} bytes are not a decimal integer",
                    bytes.len()
                ))
            }
        },
    };
    match old.checked_add(delta) {
        Some(new) => {
            data.insert(key.to_owned(), new.to_string().into_bytes());
            Response::Int(new)
        }
        None => Response::Invalid(format!("add of {delta} to key {key:?} ({old}) overflows")),
    }
}
