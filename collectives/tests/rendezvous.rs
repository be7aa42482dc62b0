//! Rendezvous on loopback: the TCP store, the environment, and the `launch` binary.
//!
//! Every server binds port 0 (or a port just found free), so these tests run in parallel.
//! The launcher tests run `launch` on this very test binary, which then acts as one rank
//! in [`launched_rank_child`].

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use collectives::env::{EnvInfo, EnvSource};
use collectives::store::TcpStore;
use collectives::{Error, Result};

/// The timeout of operations that should succeed.
const T: Duration = Duration::from_secs(5);

fn server(world_size: usize) -> Result<TcpStore> {
    TcpStore::server(("127.0.0.1", 0), world_size, T)
}

fn client(server: &TcpStore) -> Result<TcpStore> {
    TcpStore::client("127.0.0.1", server.port(), T)
}

/// A port that was free a moment ago.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// The timeout error of `result`, whose `missing` ranks must be `missing`.
fn assert_timeout(result: Result<impl std::fmt::Debug>, missing: &[usize]) -> Error {
    match result {
        Err(e) => {
            match &e {
                Error::Timeout { missing: got, .. } => assert_eq!(got, missing, "{e}"),
                other => panic!("expected a timeout, got {other:?}"),
            }
            e
        }
        Ok(value) => panic!("expected a timeout, got Ok({value:?})"),
    }
}

// ---- the store ----

#[test]
fn set_get_add_check_delete_across_threads() -> Result<()> {
    let server = server(5)?;
    assert!(server.is_server());
    assert_eq!(server.world_size(), 5);
    thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|i| {
                let server = &server;
                s.spawn(move || -> Result<()> {
                    let store = client(server)?;
                    assert!(!store.is_server());
                    assert_eq!(store.world_size(), 5);
                    store.set(&format!("k{i}"), format!("value {i}").as_bytes())?;
                    for _ in 0..10 {
                        store.add("counter", 1)?;
                    }
                    // Every thread sees every other thread's key.
                    store.wait(&["k0", "k1", "k2", "k3"], T)?;
                    for j in 0..4 {
                        assert_eq!(
                            store.get(&format!("k{j}"))?,
                            format!("value {j}").as_bytes()
                        );
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("worker panicked"))
    })?;
    assert_eq!(server.add("counter", 0)?, 40);
    assert_eq!(server.get("counter")?, b"40");
    assert_eq!(server.add("counter", -41)?, -1);
    assert!(server.check(&["k0", "k1", "k2", "k3", "counter"])?);
    assert!(server.check(&[])?);
    assert!(server.delete_key("k0")?);
    assert!(!server.check(&["k0", "k1"])?);
    assert!(!server.delete_key("k0")?);
    server.set("k1", b"")?;
    assert_eq!(server.get("k1")?, b"");
    Ok(())
}

#[test]
fn get_waits_for_a_later_set() -> Result<()> {
    let server = server(2)?;
    let waiter = client(&server)?;
    let (started, wait_started) = mpsc::channel();
    thread::scope(|s| {
        let got = s.spawn(|| {
            started.send(()).expect("main is waiting");
            waiter.get("later")
        });
        wait_started.recv().expect("waiter started");
        server.set("later", b"v")?;
        assert_eq!(got.join().expect("waiter panicked")?, b"v");
        Ok(())
    })
}

#[test]
fn get_of_a_key_never_set_times_out_in_time() -> Result<()> {
    let timeout = Duration::from_millis(300);
    let store = TcpStore::server(("127.0.0.1", 0), 1, timeout)?;
    let start = Instant::now();
    let e = assert_timeout(store.get("never"), &[]);
    let elapsed = start.elapsed();
    assert!(elapsed >= timeout && elapsed < timeout * 5, "{elapsed:?}");
    assert!(e.to_string().contains("never"), "{e}");
    // The connection stays usable after a timed-out wait.
    store.set("now", b"1")?;
    assert_eq!(store.get("now")?, b"1");
    Ok(())
}

#[test]
fn wait_times_out_naming_the_missing_keys() -> Result<()> {
    let server = server(1)?;
    server.set("here", b"")?;
    let start = Instant::now();
    let e = assert_timeout(
        server.wait(&["here", "absent"], Duration::from_millis(200)),
        &[],
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    let message = e.to_string();
    assert!(message.contains("still missing: [\"absent\"]"), "{message}");
    server.wait(&["here"], Duration::ZERO)
}

#[test]
fn add_to_a_non_integer_is_an_invalid_argument() -> Result<()> {
    let server = server(1)?;
    server.set("text", b"abc")?;
    assert!(matches!(
        server.add("text", 1),
        Err(Error::InvalidArgument(_))
    ));
    server.set("max", i64::MAX.to_string().as_bytes())?;
    assert!(matches!(
        server.add("max", 1),
        Err(Error::InvalidArgument(_))
    ));
    // Neither error broke the connection.
    assert_eq!(server.add("fresh", 7)?, 7);
    Ok(())
}

#[test]
fn a_client_started_before_the_server_joins_when_it_appears() -> Result<()> {
    let port = free_port();
    thread::scope(|s| {
        let early = s.spawn(|| -> Result<()> {
            let store = TcpStore::client("127.0.0.1", port, T)?;
            store.barrier("late", 2, 1, T)
        });
        // The point of the test: the server does not exist for a while.
        thread::sleep(Duration::from_millis(200));
        let server = TcpStore::server(("127.0.0.1", port), 2, T)?;
        server.barrier("late", 2, 0, T)?;
        early.join().expect("early client panicked")
    })
}

#[test]
fn a_client_with_no_server_times_out() {
    let start = Instant::now();
    let e = assert_timeout(
        TcpStore::client("127.0.0.1", free_port(), Duration::from_millis(300)),
        &[],
    );
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(e.to_string().contains("connecting"), "{e}");
}

#[test]
fn a_barrier_names_the_rank_that_never_arrived() -> Result<()> {
    let timeout = Duration::from_secs(1);
    let server = server(3)?;
    let start = Instant::now();
    let errors: Vec<Error> = thread::scope(|s| {
        let rank1 = s.spawn(|| -> Result<Error> {
            let store = client(&server)?;
            Ok(assert_timeout(store.barrier("b", 3, 1, timeout), &[2]))
        });
        let rank0 = assert_timeout(server.barrier("b", 3, 0, timeout), &[2]);
        Ok::<_, Error>(vec![rank0, rank1.join().expect("rank 1 panicked")?])
    })?;
    let elapsed = start.elapsed();
    assert!(elapsed >= timeout && elapsed < timeout * 3, "{elapsed:?}");
    for e in errors {
        let message = e.to_string();
        assert!(
            message.contains("ranks that never got there: [2]"),
            "{message}"
        );
    }
    Ok(())
}

#[test]
fn a_barrier_name_can_be_reused() -> Result<()> {
    let server = server(3)?;
    thread::scope(|s| {
        let ranks: Vec<_> = (1..3)
            .map(|rank| {
                let server = &server;
                s.spawn(move || -> Result<()> {
                    let store = client(server)?;
                    for _ in 0..5 {
                        store.barrier("again", 3, rank, T)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for _ in 0..5 {
            server.barrier("again", 3, 0, T)?;
        }
        ranks
            .into_iter()
            .try_for_each(|r| r.join().expect("rank panicked"))
    })
}

#[test]
fn a_barrier_rejects_a_rank_outside_the_world() -> Result<()> {
    let server = server(2)?;
    assert!(matches!(
        server.barrier("b", 2, 2, T),
        Err(Error::InvalidArgument(_))
    ));
    Ok(())
}

#[test]
fn dropping_the_server_fails_pending_and_later_operations_with_io() -> Result<()> {
    let server = server(2)?;
    let store = client(&server)?;
    let (started, wait_started) = mpsc::channel();
    thread::scope(|s| {
        let pending = s.spawn(|| {
            started.send(()).expect("main is waiting");
            store.get("never")
        });
        wait_started.recv().expect("waiter started");
        // Whether the get reached the server before it stopped or not, it fails promptly.
        let start = Instant::now();
        drop(server);
        let result = pending.join().expect("waiter panicked");
        assert!(matches!(result, Err(Error::Io { .. })), "{result:?}");
        assert!(start.elapsed() < Duration::from_secs(3));
    });
    assert!(matches!(store.set("k", b"v"), Err(Error::Io { .. })));
    Ok(())
}

#[test]
fn a_peer_that_is_not_a_store_is_a_protocol_error() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    thread::scope(|s| {
        s.spawn(|| {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut hello = [0u8; 13];
            stream.read_exact(&mut hello).expect("read the greeting");
            // A well-framed reply of an unknown type.
            stream.write_all(&[0, 0, 0, 1, 0xee]).expect("reply");
        });
        let result = TcpStore::client("127.0.0.1", port, T);
        assert!(matches!(result, Err(Error::Protocol(_))), "{result:?}");
    });
}

#[test]
fn a_malformed_request_is_answered_and_the_server_keeps_serving() -> Result<()> {
    let server = server(1)?;
    let mut raw = TcpStream::connect(server.addr()).map_err(|e| Error::io("connect", e))?;
    raw.set_read_timeout(Some(T))
        .map_err(|e| Error::io("configure", e))?;
    // A frame holding an unknown request type.
    raw.write_all(&[0, 0, 0, 1, 0x42])
        .map_err(|e| Error::io("write", e))?;
    let mut reply = Vec::new();
    raw.read_to_end(&mut reply)
        .map_err(|e| Error::io("read", e))?;
    // The server answers with a protocol error (type 7) and closes the connection.
    assert!(reply.len() > 5 && reply[4] == 7, "{reply:?}");
    assert!(String::from_utf8_lossy(&reply).contains("unknown request type"));
    // A frame longer than the limit is refused without reading it.
    let mut raw = TcpStream::connect(server.addr()).map_err(|e| Error::io("connect", e))?;
    raw.write_all(&[0xff, 0xff, 0xff, 0xff])
        .map_err(|e| Error::io("write", e))?;
    let mut reply = Vec::new();
    raw.read_to_end(&mut reply)
        .map_err(|e| Error::io("read", e))?;
    assert!(String::from_utf8_lossy(&reply).contains("exceeds the limit"));
    server.set("still", b"serving")?;
    assert_eq!(client(&server)?.get("still")?, b"serving");
    Ok(())
}

// ---- the environment ----

fn env(vars: &[(&str, &str)]) -> Result<EnvInfo> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    EnvInfo::from_vars(|name| vars.get(name).cloned())
}

const TORCHRUN: [(&str, &str); 5] = [
    ("RANK", "2"),
    ("WORLD_SIZE", "4"),
    ("LOCAL_RANK", "0"),
    ("MASTER_ADDR", "node7"),
    ("MASTER_PORT", "29500"),
];
const SLURM: [(&str, &str); 3] = [
    ("SLURM_PROCID", "5"),
    ("SLURM_NTASKS", "8"),
    ("SLURM_LOCALID", "1"),
];
const OPENMPI: [(&str, &str); 3] = [
    ("OMPI_COMM_WORLD_RANK", "1"),
    ("OMPI_COMM_WORLD_SIZE", "2"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
];

#[test]
fn env_reads_torchrun_variables() -> Result<()> {
    let info = env(&TORCHRUN)?;
    assert_eq!(
        info,
        EnvInfo {
            rank: 2,
            world_size: 4,
            local_rank: 0,
            master_addr: Some("node7".into()),
            master_port: Some(29500),
            source: EnvSource::Torchrun,
            token: None,
            agent_store: false,
            restart_count: 0,
            max_restarts: None,
            run_id: None,
            group_rank: None,
            group_world_size: None,
            local_world_size: None,
        }
    );
    Ok(())
}

#[test]
fn env_reads_slurm_and_openmpi_with_optional_master() -> Result<()> {
    let slurm = env(&SLURM)?;
    assert_eq!((slurm.rank, slurm.world_size, slurm.local_rank), (5, 8, 1));
    assert_eq!(slurm.source, EnvSource::Slurm);
    assert_eq!((slurm.master_addr, slurm.master_port), (None, None));

    let mut vars = OPENMPI.to_vec();
    vars.extend([("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "1234")]);
    let mpi = env(&vars)?;
    assert_eq!((mpi.rank, mpi.world_size, mpi.local_rank), (1, 2, 1));
    assert_eq!(mpi.source, EnvSource::OpenMpi);
    assert_eq!(mpi.master_addr.as_deref(), Some("10.0.0.1"));
    assert_eq!(mpi.master_port, Some(1234));
    Ok(())
}

#[test]
fn env_prefers_torchrun_then_slurm_then_openmpi() -> Result<()> {
    let all: Vec<_> = TORCHRUN
        .iter()
        .chain(&SLURM)
        .chain(&OPENMPI)
        .copied()
        .collect();
    assert_eq!(env(&all)?.source, EnvSource::Torchrun);
    let no_torchrun: Vec<_> = SLURM.iter().chain(&OPENMPI).copied().collect();
    assert_eq!(env(&no_torchrun)?.source, EnvSource::Slurm);
    Ok(())
}

#[test]
fn env_errors_name_the_variable() {
    let with = |name: &'static str, value: &'static str| -> Vec<(&str, &str)> {
        let mut vars: Vec<_> = TORCHRUN
            .iter()
            .filter(|(k, _)| *k != name)
            .copied()
            .collect();
        vars.push((name, value));
        vars
    };
    let without = |name: &str| -> Vec<(&str, &str)> {
        TORCHRUN
            .iter()
            .filter(|(k, _)| *k != name)
            .copied()
            .collect()
    };
    let invalid = |vars: &[(&str, &str)], expected: &str| match env(vars) {
        Err(Error::InvalidEnv { name, why, .. }) => assert_eq!(name, expected, "{why}"),
        other => panic!("expected {expected} to be invalid, got {other:?}"),
    };
    let missing = |vars: &[(&str, &str)], expected: &str| match env(vars) {
        Err(Error::MissingEnv(name)) => assert_eq!(name, expected),
        other => panic!("expected {expected} to be missing, got {other:?}"),
    };
    missing(&[], "RANK");
    missing(&without("WORLD_SIZE"), "WORLD_SIZE");
    missing(&without("RANK"), "RANK");
    missing(&without("LOCAL_RANK"), "LOCAL_RANK");
    missing(&SLURM[..2], "SLURM_LOCALID");
    invalid(&with("RANK", "two"), "RANK");
    invalid(&with("RANK", "-1"), "RANK");
    invalid(&with("RANK", "4"), "RANK");
    invalid(&with("WORLD_SIZE", "0"), "WORLD_SIZE");
    invalid(&with("LOCAL_RANK", "x"), "LOCAL_RANK");
    invalid(&with("MASTER_PORT", "0"), "MASTER_PORT");
    invalid(&with("MASTER_PORT", "65536"), "MASTER_PORT");
    invalid(&with("MASTER_PORT", "http"), "MASTER_PORT");
    invalid(&with("MASTER_ADDR", " "), "MASTER_ADDR");
    invalid(
        &[
            ("SLURM_PROCID", "8"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "0"),
        ],
        "SLURM_PROCID",
    );
    let message = env(&with("RANK", "4"))
        .expect_err("rank 4 of 4")
        .to_string();
    assert!(
        message.contains("RANK=\"4\"") && message.contains("WORLD_SIZE=4"),
        "{message}"
    );
}

#[test]
fn env_connect_store_needs_the_master_and_meets_at_a_barrier() -> Result<()> {
    let info = env(&SLURM)?;
    assert!(matches!(info.connect_store(T), Err(Error::MissingEnv(name)) if name == "MASTER_ADDR"));

    let port = free_port().to_string();
    let rank = |rank: &'static str| -> Result<EnvInfo> {
        env(&[
            ("RANK", rank),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", rank),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
        ])
    };
    let (rank0, rank1) = (rank("0")?, rank("1")?);
    thread::scope(|s| {
        let other = s.spawn(|| -> Result<()> {
            let store = rank1.connect_store(T)?;
            assert!(!store.is_server());
            store.barrier("env", 2, 1, T)
        });
        let store = rank0.connect_store(T)?;
        assert!(store.is_server());
        assert_eq!(store.world_size(), 2);
        store.barrier("env", 2, 0, T)?;
        other.join().expect("rank 1 panicked")
    })
}

// ---- the launcher ----

/// Set by the launcher tests so that [`launched_rank_child`] acts as a rank.
const CHILD: &str = "COLLECTIVES_RENDEZVOUS_CHILD";
/// The rank that exits with status 3 instead, if any.
const FAIL_RANK: &str = "COLLECTIVES_RENDEZVOUS_FAIL_RANK";

/// One rank of a job that `launch` starts by re-running this test binary with [`CHILD`]
/// set; without it (a normal test run) this returns at once.
#[test]
fn launched_rank_child() -> Result<()> {
    if std::env::var_os(CHILD).is_none() {
        return Ok(());
    }
    let info = EnvInfo::from_env()?;
    if std::env::var(FAIL_RANK).ok() == Some(info.rank.to_string()) {
        std::process::exit(3);
    }
    let store = info.connect_store(T)?;
    store.barrier("launched", info.world_size, info.rank, T)?;
    println!("launched rank {} of {} passed", info.rank, info.world_size);
    Ok(())
}

/// Runs `launch` with `launch_args` on this test binary's [`launched_rank_child`].
fn launch(launch_args: &[&str], fail_rank: Option<usize>) -> std::process::Output {
    let this = std::env::current_exe().expect("the test binary's path");
    let mut command = Command::new(env!("CARGO_BIN_EXE_launch"));
    command
        .args(launch_args)
        .arg("--")
        .arg(this)
        .args([
            "launched_rank_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1");
    match fail_rank {
        Some(rank) => command.env(FAIL_RANK, rank.to_string()),
        None => command.env_remove(FAIL_RANK),
    };
    command.output().expect("run launch")
}

#[test]
fn launch_runs_every_rank_to_success() {
    let out = launch(&["-n", "3", "--timeout", "15"], None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    for rank in 0..3 {
        assert!(
            stdout.contains(&format!("launched rank {rank} of 3 passed")),
            "{stdout}"
        );
    }
}

#[test]
fn launch_reports_the_failing_rank_and_stops_the_others() {
    let start = Instant::now();
    let out = launch(&["-n", "3", "--timeout", "15"], Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 1 failed (exit status: 3)"),
        "{stderr}"
    );
    // The others wait at the barrier for rank 1 until `launch` kills them, long before
    // their store timeout.
    assert!(start.elapsed() < T, "{:?}", start.elapsed());
}

#[test]
fn launch_kills_every_rank_after_its_timeout() {
    let out = Command::new(env!("CARGO_BIN_EXE_launch"))
        .args(["-n", "2", "--timeout", "0.3", "--", "sleep", "10"])
        .output()
        .expect("run launch");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "{stderr}");
    assert!(stderr.contains("killed ranks [0, 1]"), "{stderr}");
}

#[test]
fn launch_usage_errors_are_clear() {
    let cases: [(&[&str], &str); 7] = [
        (&["--", "true"], "-n P (--nproc-per-node P) is required"),
        (&["-n", "0", "true"], "not a number of ranks"),
        (&["-n", "x", "true"], "not a number of ranks"),
        (&["-n", "2"], "no program to launch"),
        (&["-n", "2", "--"], "no program after --"),
        (&["-n", "2", "--port", "99999", "true"], "not a port"),
        (&["-n", "2", "--bogus", "true"], "unknown option --bogus"),
    ];
    for (args, expected) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_launch"))
            .args(args)
            .output()
            .expect("run launch");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(expected) && stderr.contains("usage:"),
            "{args:?}: {stderr}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_launch"))
        .args(["-n", "2", "--", "/nonexistent/program"])
        .output()
        .expect("run launch");
    assert_eq!(out.status.code(), Some(127));
    let ok = Command::new(env!("CARGO_BIN_EXE_launch"))
        .args(["--nproc=2", "--port=0", "true"])
        .status()
        .expect("run launch");
    assert!(ok.success());
}
