//! The bind rule: without a token, a store serves only loopback addresses; any other
//! address (`0.0.0.0` here) needs a token, `StoreOptions::allow_insecure_bind`, or
//! `LOWRANK_STORE_INSECURE=1`.
//!
//! Whatever a store binds, the tests connect to 127.0.0.1 only. The cases that depend
//! on `LOWRANK_STORE_INSECURE` run in child processes of this test binary, each with
//! the variable set or removed, since the environment is the whole process's.

use std::collections::HashMap;
use std::io::Read;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use collectives::env::EnvInfo;
use collectives::store::{StoreOptions, StoreToken, TcpStore, INSECURE_ENV, TOKEN_ENV};
use collectives::{Error, Result};

const T: Duration = Duration::from_secs(20);

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// Set in a child process: run the child test named.
const CHILD: &str = "COLLECTIVES_STORE_BIND_CHILD";

fn with_token() -> StoreOptions {
    let mut options = StoreOptions::default();
    options.token = Some(StoreToken::new(TOKEN).expect("a valid token"));
    options
}

/// Rank 0 of a one-rank job, its store on `MASTER_ADDR=addr`, with `token` if given.
fn rank_0(addr: &str, token: Option<&str>) -> EnvInfo {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut vars = HashMap::from([
        ("RANK", "0".to_owned()),
        ("WORLD_SIZE", "1".to_owned()),
        ("LOCAL_RANK", "0".to_owned()),
        ("MASTER_ADDR", addr.to_owned()),
        ("MASTER_PORT", port.to_string()),
    ]);
    if let Some(token) = token {
        vars.insert(TOKEN_ENV, token.to_owned());
    }
    EnvInfo::from_vars(|name| vars.get(name).cloned()).expect("valid variables")
}

/// Asserts that a store on all interfaces with `options` serves a client that
/// connects to 127.0.0.1 with `client`.
fn serves(options: &StoreOptions, client: &StoreOptions) -> Result<()> {
    let server = TcpStore::server_with(("0.0.0.0", 0), 2, T, options)?;
    assert!(server.addr().ip().is_loopback(), "{:?}", server.addr());
    let client = TcpStore::client_with("127.0.0.1", server.port(), T, client)?;
    server.set("k", b"v")?;
    assert_eq!(client.get("k")?, b"v");
    Ok(())
}

/// Asserts that `result` is the bind rule's refusal, which says how to set a token.
fn refused<T: std::fmt::Debug>(result: Result<T>) {
    match result {
        Err(Error::InvalidArgument(message)) => {
            for needed in [
                "0.0.0.0",
                "without a token",
                "LOWRANK_STORE_TOKEN",
                "openssl rand -hex 16",
                "LOWRANK_STORE_INSECURE=1",
                "allow_insecure_bind",
            ] {
                assert!(message.contains(needed), "{needed:?} not in {message}");
            }
        }
        other => panic!("expected the bind rule's InvalidArgument, got {other:?}"),
    }
}

/// Runs the child test `name` of this binary with `LOWRANK_STORE_INSECURE` set to
/// `insecure` (or removed), and asserts that it ran and passed.
fn run_child(name: &str, insecure: Option<&str>) {
    let mut command = Command::new(std::env::current_exe().expect("this test binary"));
    command
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match insecure {
        Some(value) => command.env(INSECURE_ENV, value),
        None => command.env_remove(INSECURE_ENV),
    };
    let mut child = command.spawn().expect("start the child test");
    let deadline = Instant::now() + 2 * T;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child test") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child test {name} did not finish within {:?}", 2 * T);
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let _ = child.stdout.take().map(|mut s| s.read_to_string(&mut out));
    let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut out));
    assert!(status.success(), "child test {name}: {status}\n{out}");
    assert!(
        out.contains("1 passed"),
        "child test {name} did not run:\n{out}"
    );
}

/// Whether this process is the child started to run `name`.
fn is_child(name: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|child| child == name)
}

#[test]
fn a_non_loopback_store_without_a_token_is_refused() {
    // Regression: MASTER_ADDR=0.0.0.0 without a token served anyone who reached the
    // port, with only a log message.
    run_child("refused_without_token_child", None);
    run_child("refused_without_token_child", Some("0"));
}

#[test]
fn refused_without_token_child() {
    if !is_child("refused_without_token_child") {
        return;
    }
    refused(TcpStore::server(("0.0.0.0", 0), 2, T));
    refused(TcpStore::server_with(
        ("0.0.0.0", 0),
        2,
        T,
        &StoreOptions::default(),
    ));
    refused(rank_0("0.0.0.0", None).connect_store(T));
}

#[test]
fn a_non_loopback_store_with_a_token_serves() -> Result<()> {
    serves(&with_token(), &with_token())?;
    let store = rank_0("0.0.0.0", Some(TOKEN)).connect_store(T)?;
    let client = TcpStore::client_with("127.0.0.1", store.port(), T, &with_token())?;
    store.set("k", b"v")?;
    assert_eq!(client.get("k")?, b"v");
    Ok(())
}

#[test]
fn the_programmatic_opt_in_serves_without_a_token() -> Result<()> {
    let mut insecure = StoreOptions::default();
    insecure.allow_insecure_bind = true;
    serves(&insecure, &StoreOptions::default())
}

#[test]
fn a_loopback_store_needs_no_token() -> Result<()> {
    let server = TcpStore::server(("127.0.0.1", 0), 2, T)?;
    let client = TcpStore::client("127.0.0.1", server.port(), T)?;
    client.set("k", b"v")?;
    assert_eq!(server.get("k")?, b"v");
    let store = rank_0("127.0.0.1", None).connect_store(T)?;
    store.set("k", b"v")?;
    Ok(())
}

#[test]
fn the_environment_opt_in_serves_without_a_token() {
    run_child("insecure_env_child", Some("1"));
    run_child("bad_insecure_env_child", Some("yes"));
}

#[test]
fn insecure_env_child() -> Result<()> {
    if !is_child("insecure_env_child") {
        return Ok(());
    }
    serves(&StoreOptions::default(), &StoreOptions::default())?;
    let store = rank_0("0.0.0.0", None).connect_store(T)?;
    let client = TcpStore::client("127.0.0.1", store.port(), T)?;
    store.set("k", b"v")?;
    assert_eq!(client.get("k")?, b"v");
    Ok(())
}

#[test]
fn bad_insecure_env_child() {
    if !is_child("bad_insecure_env_child") {
        return;
    }
    match TcpStore::server(("0.0.0.0", 0), 2, T) {
        Err(Error::InvalidEnv { name, .. }) => assert_eq!(name, INSECURE_ENV),
        other => panic!("expected InvalidEnv naming {INSECURE_ENV}, got {other:?}"),
    }
}
