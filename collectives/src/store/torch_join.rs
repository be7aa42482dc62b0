//! [`TcpStore::join`](super::TcpStore::join) and
//! [`barrier`](super::TcpStore::barrier) on a torch store, built on its primitives: a
//! torch server knows nothing of ranks, so the checks our own server makes are made here
//! with compare-and-set, and a failure is published under [`FAILED_KEY`] for the other
//! ranks to find.
//!
//! - Joining registers the world size with compare-set (the first rank's wins, written
//!   as `"{world_size} {rank}"`), then claims `collectives/join/rank/{rank}` with
//!   compare-set of this value's join id: another id there is a second process with
//!   the same rank. Then it waits for every rank's key.
//! - A barrier is the one of our own store: `add` to `{name}/calls/{rank}` gives the
//!   generation `g`; `{name}/{g}/rank/{rank}` is set, and every rank's key of `g`
//!   awaited.
//! - Waits go in slices of [`SLICE`]; between slices the failure key is checked, so a
//!   rank that failed (a mismatch, a timeout) fails the others within a slice. The first
//!   failure published wins; each rank returns its own.

use std::time::{Duration, Instant};

use crate::{Error, Result};

use super::escape::sanitize;
use super::state::join_key;
use super::torch::TorchClient;
use super::Quoted;

/// Where a rank that failed the job says why.
pub(super) const FAILED_KEY: &str = "collectives/failed";

/// Where the first rank to join registers the world size.
const WORLD_SIZE_KEY: &str = "collectives/join/world_size";

/// How long a wait goes before it looks for a failure of another rank.
const SLICE: Duration = Duration::from_millis(200);

/// Registers `rank` of `world_size` (under `id`) and waits up to `timeout` for all.
pub(super) fn join(
    client: &TorchClient,
    rank: usize,
    world_size: usize,
    id: &str,
    timeout: Duration,
) -> Result<()> {
    check_failed(client)?;
    let ours = format!("{world_size} {rank}");
    let first = client.compare_set(WORLD_SIZE_KEY, b"", ours.as_bytes())?;
    if first != ours.as_bytes() {
        let text = String::from_utf8_lossy(&first);
        let (size, by) = text
            .split_once(' ')
            .and_then(|(s, r)| Some((s.parse::<usize>().ok()?, r.parse::<usize>().ok()?)))
            .ok_or_else(|| {
                Error::Protocol(format!(
                    "the torch store holds {} under {WORLD_SIZE_KEY}, not \"WORLD_SIZE RANK\"",
                    Quoted(&sanitize(&text))
                ))
            })?;
        if size != world_size {
            return Err(fail(
                client,
                Error::Rendezvous {
                    why: format!(
                        "ranks disagree on the world size: rank {by} joined with \
                         WORLD_SIZE={size}, rank {rank} with WORLD_SIZE={world_size}"
                    ),
                    ranks: sorted(vec![by, rank]),
                },
            ));
        }
    }
    let claim = client.compare_set(&join_key(rank), b"", id.as_bytes())?;
    if claim != id.as_bytes() {
        return Err(fail(
            client,
            Error::Rendezvous {
                why: format!(
                    "rank {rank} was claimed by two processes (two processes with RANK={rank})"
                ),
                ranks: vec![rank],
            },
        ));
    }
    let keys: Vec<String> = (0..world_size).map(join_key).collect();
    let missing = wait_all(client, &keys, timeout)?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(fail(
        client,
        Error::Timeout {
            what: format!("the rendezvous of {world_size} ranks (rank {rank} waited)"),
            after: timeout,
            missing,
        },
    ))
}

/// The barrier `name` of `world_size` ranks, as rank `rank`.
pub(super) fn barrier(
    client: &TorchClient,
    name: &str,
    world_size: usize,
    rank: usize,
    timeout: Duration,
) -> Result<()> {
    check_failed(client)?;
    let generation = client.add(&format!("{name}/calls/{rank}"), 1)?;
    let keys: Vec<String> = (0..world_size)
        .map(|r| format!("{name}/{generation}/rank/{r}"))
        .collect();
    client.set(&keys[rank], b"1")?;
    let missing = wait_all(client, &keys, timeout)?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(fail(
        client,
        Error::Timeout {
            what: format!("barrier {} (rank {rank} of {world_size})", Quoted(name)),
            after: timeout,
            missing,
        },
    ))
}

/// Waits up to `timeout` for all of `keys` (`keys[r]` is rank `r`'s); the ranks whose
/// key is still missing then, or another rank's published failure.
fn wait_all(client: &TorchClient, keys: &[String], timeout: Duration) -> Result<Vec<usize>> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let start = Instant::now();
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if client.wait_for(&refs, left.min(SLICE))? {
            return Ok(Vec::new());
        }
        check_failed(client)?;
        if start.elapsed() >= timeout {
            break;
        }
    }
    let mut missing = Vec::new();
    for (rank, key) in refs.iter().enumerate() {
        if !client.check(&[key])? {
            missing.push(rank);
        }
    }
    Ok(missing)
}

/// Another rank's published failure, as an error.
fn check_failed(client: &TorchClient) -> Result<()> {
    if !client.check(&[FAILED_KEY])? {
        return Ok(());
    }
    let record = client.get_many(&[FAILED_KEY], Duration::from_secs(1))?;
    let record = record.first().map(Vec::as_slice).unwrap_or_default();
    Err(decode_failure(record))
}

/// Publishes `error` for the other ranks (unless one was published first) and returns
/// it. Best effort: the error is this rank's whether it is published or not.
fn fail(client: &TorchClient, error: Error) -> Error {
    if let Some(record) = encode_failure(&error) {
        if let Err(e) = client.compare_set(FAILED_KEY, b"", record.as_bytes()) {
            tracing::debug!(error = %e, "could not publish a failure on the torch store");
        }
    }
    error
}

/// `timeout\n{ms}\n{ranks}\n{what}` or `rendezvous\n{ranks}\n{why}`.
fn encode_failure(error: &Error) -> Option<String> {
    let ranks = |ranks: &[usize]| -> String {
        ranks
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    match error {
        Error::Timeout {
            what,
            after,
            missing,
        } => Some(format!(
            "timeout\n{}\n{}\n{what}",
            after.as_millis(),
            ranks(missing)
        )),
        Error::Rendezvous { why, ranks: r } => Some(format!("rendezvous\n{}\n{why}", ranks(r))),
        _ => None,
    }
}

fn decode_failure(record: &[u8]) -> Error {
    let text = String::from_utf8_lossy(record);
    let ranks = |field: &str| -> Option<Vec<usize>> {
        if field.is_empty() {
            return Some(Vec::new());
        }
        field.split(',').map(|r| r.parse().ok()).collect()
    };
    let decoded = match text.split_once('\n') {
        Some(("timeout", rest)) => {
            let mut parts = rest.splitn(3, '\n');
            let (ms, missing, what) = (parts.next(), parts.next(), parts.next());
            match (
                ms.and_then(|m| m.parse::<u64>().ok()),
                missing.and_then(ranks),
                what,
            ) {
                (Some(ms), Some(missing), Some(what)) => Some(Error::Timeout {
                    what: sanitize(what),
                    after: Duration::from_millis(ms),
                    missing,
                }),
                _ => None,
            }
        }
        Some(("rendezvous", rest)) => rest.split_once('\n').and_then(|(r, why)| {
            Some(Error::Rendezvous {
                why: sanitize(why),
                ranks: ranks(r)?,
            })
        }),
        _ => None,
    };
    decoded.unwrap_or_else(|| {
        Error::Protocol(format!(
            "the torch store holds an unreadable failure under {FAILED_KEY}: {}",
            Quoted(&sanitize(&text))
        ))
    })
}

fn sorted(mut ranks: Vec<usize>) -> Vec<usize> {
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_round_trip_through_their_record() {
        let errors = [
            Error::Timeout {
                what: "barrier \"b\" (rank 0 of 4)".into(),
                after: Duration::from_millis(1500),
                missing: vec![1, 3],
            },
            Error::Rendezvous {
                why: "ranks disagree".into(),
                ranks: vec![0, 2],
            },
            Error::Timeout {
                what: "no missing".into(),
                after: Duration::ZERO,
                missing: vec![],
            },
        ];
        for error in errors {
            let record = encode_failure(&error).expect("a shared failure");
            assert_eq!(decode_failure(record.as_bytes()), error, "{record:?}");
        }
        // Text from a peer is escaped on the way in.
        let forged = Error::Rendezvous {
            why: "a\nforged line".into(),
            ranks: vec![1],
        };
        let record = encode_failure(&forged).expect("a shared failure");
        assert_eq!(
            decode_failure(record.as_bytes()),
            Error::Rendezvous {
                why: sanitize("a\nforged line"),
                ranks: vec![1],
            }
        );
        assert_ne!(sanitize("a\nforged line"), "a\nforged line");
        assert!(encode_failure(&Error::Abandoned).is_none());
        assert!(matches!(decode_failure(b"garbage"), Error::Protocol(_)));
        assert!(matches!(
            decode_failure(b"timeout\nx\n1\nw"),
            Error::Protocol(_)
        ));
        assert!(matches!(
            decode_failure(b"rendezvous\n1,a\nw"),
            Error::Protocol(_)
        ));
    }
}
