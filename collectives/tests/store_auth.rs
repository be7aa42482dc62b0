//! Who the store serves (issue 9, defect 2): the hello first, the token checked in it
//! before any key is read, and rank 0 bound to the address `MASTER_ADDR` names.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream, UdpSocket};
use std::time::Duration;

use collectives::env::EnvInfo;
use collectives::store::{StoreOptions, StoreToken, TcpStore, TOKEN_ENV};
use collectives::{Error, Result};

const T: Duration = Duration::from_secs(20);

/// What rank 0 keeps in the store: what an intruder is after.
const SECRET_VALUE: &[u8] = b"the NCCL unique id";

fn options(token: Option<&str>) -> StoreOptions {
    let mut options = StoreOptions::default();
    options.token = token.map(|t| StoreToken::new(t).expect("a valid token"));
    options
}

const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const WRONG: &str = "0123456789abcdef0123456789abcdeF";

fn server(token: Option<&str>) -> Result<TcpStore> {
    let server = TcpStore::server_with(("127.0.0.1", 0), 2, T, &options(token))?;
    server.set("nccl_id", SECRET_VALUE)?;
    Ok(server)
}

fn unauthorized(result: Result<TcpStore>, expected: &str) {
    match result {
        Err(Error::Unauthorized(message)) => {
            assert!(message.contains(expected), "{message}");
            assert!(!message.contains(TOKEN), "the token leaked: {message}");
        }
        other => panic!("expected Unauthorized ({expected}), got {other:?}"),
    }
}

#[test]
fn a_wrong_or_missing_token_is_refused() -> Result<()> {
    let server = server(Some(TOKEN))?;
    let port = server.port();
    unauthorized(TcpStore::client("127.0.0.1", port, T), "requires a token");
    unauthorized(
        TcpStore::client_with("127.0.0.1", port, T, &options(Some(WRONG))),
        "token is wrong",
    );
    let client = TcpStore::client_with("127.0.0.1", port, T, &options(Some(TOKEN)))?;
    assert_eq!(client.get("nccl_id")?, SECRET_VALUE);
    // A client with a token refuses a server that checks none: rank 0 without the token
    // would serve anyone.
    let open = self::server(None)?;
    unauthorized(
        TcpStore::client_with("127.0.0.1", open.port(), T, &options(Some(TOKEN))),
        "accepts clients without a token",
    );
    Ok(())
}

// ---- hand-made frames, mirroring the private format of `store/wire.rs` ----

fn frame(payload: &[u8]) -> Vec<u8> {
    [&(payload.len() as u32).to_be_bytes()[..], payload].concat()
}

fn hello(token: Option<&str>) -> Vec<u8> {
    let token = token.unwrap_or_default().as_bytes();
    let has = u8::from(!token.is_empty());
    frame(
        &[
            &[0u8][..],
            b"ctstore2",
            &[has],
            &(token.len() as u32).to_be_bytes(),
            token,
        ]
        .concat(),
    )
}

fn get(key: &str) -> Vec<u8> {
    let timeout_ms = 1000u64.to_be_bytes();
    let len = (key.len() as u32).to_be_bytes();
    frame(&[&[2u8][..], &timeout_ms, &len, key.as_bytes()].concat())
}

/// Reply type bytes.
const HELLO: u8 = 0;
const VALUE: u8 = 2;
const REFUSED: u8 = 8;

/// The next frame from the server, `None` once it closed the connection.
fn read_reply(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).ok()?;
    let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
    stream.read_exact(&mut payload).ok()?;
    Some(payload)
}

fn connect(server: &TcpStore) -> TcpStream {
    let stream = TcpStream::connect(server.addr()).expect("connect");
    stream.set_read_timeout(Some(T)).expect("configure");
    stream
}

/// Sends `first`, then a get of the secret if the connection is still open; returns
/// the type bytes of the replies to the two, as long as the server answers.
fn exchange(server: &TcpStore, first: &[u8]) -> Vec<u8> {
    let mut stream = connect(server);
    stream.write_all(first).expect("send the first request");
    let mut types = Vec::new();
    let Some(reply) = read_reply(&mut stream) else {
        return types;
    };
    types.push(reply[0]);
    // A closed connection may take the get (or fail it): either way nothing comes back.
    if stream.write_all(&get("nccl_id")).is_ok() {
        types.extend(read_reply(&mut stream).map(|reply| reply[0]));
    }
    types
}

#[test]
fn no_key_is_read_before_a_successful_hello() -> Result<()> {
    // Regression: requests were served without the hello, and with no authentication.
    // The control: the frames are right, so a store that checks no token serves them.
    let open = server(None)?;
    assert_eq!(exchange(&open, &hello(None)), [HELLO, VALUE]);

    let guarded = server(Some(TOKEN))?;
    assert_eq!(exchange(&guarded, &hello(Some(TOKEN))), [HELLO, VALUE]);
    // A request before the hello, no token, a wrong one: refused, then closed, and the
    // get that follows is never answered.
    assert_eq!(exchange(&guarded, &get("nccl_id")), [REFUSED]);
    assert_eq!(exchange(&guarded, &hello(None)), [REFUSED]);
    assert_eq!(exchange(&guarded, &hello(Some(WRONG))), [REFUSED]);
    // Nothing of it disturbed the store.
    assert_eq!(guarded.get("nccl_id")?, SECRET_VALUE);
    Ok(())
}

/// An IPv4 address of this host other than loopback, found without sending anything.
fn non_loopback_address() -> Option<Ipv4Addr> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    socket.connect(("10.255.255.255", 1)).ok()?;
    match socket.local_addr().ok()?.ip() {
        std::net::IpAddr::V4(ip) if !ip.is_loopback() && !ip.is_unspecified() => Some(ip),
        _ => None,
    }
}

#[test]
fn rank_0_binds_only_the_address_master_addr_names() -> Result<()> {
    // Regression: a non-loopback MASTER_ADDR made rank 0's server bind 0.0.0.0.
    let Some(ip) = non_loopback_address() else {
        println!("no non-loopback IPv4 address on this host: the named bind is not tested");
        return Ok(());
    };
    let port = std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::io("finding a free port", e))?
        .port();
    let vars = HashMap::from([
        ("RANK", "0".to_owned()),
        ("WORLD_SIZE", "1".to_owned()),
        ("LOCAL_RANK", "0".to_owned()),
        ("MASTER_ADDR", ip.to_string()),
        ("MASTER_PORT", port.to_string()),
        (TOKEN_ENV, TOKEN.to_owned()),
    ]);
    let info = EnvInfo::from_vars(|name| vars.get(name).cloned())?;
    let store = info.connect_store(T)?;
    assert_eq!(store.addr(), (ip, port).into());
    // Reachable where it was told to listen, and nowhere else.
    assert!(TcpStream::connect((ip, port)).is_ok());
    let elsewhere = TcpStream::connect((Ipv4Addr::LOCALHOST, port));
    assert!(elsewhere.is_err(), "the store also listens on loopback");
    Ok(())
}
