//! The job's store token: from `--token-file` (which node 0 creates when it is
//! missing), from `LOWRANK_STORE_TOKEN`, or, for a one-node job, a fresh one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use collectives::store::{StoreToken, MAX_TOKEN_LEN, TOKEN_ENV};

use crate::args::Options;
use crate::{signals, Failure};

/// How long a node waits for node 0 to write the token file without `--timeout`
/// (torchrun's default time for a rendezvous to gather its nodes).
const TOKEN_FILE_WAIT: Duration = Duration::from_secs(600);

/// How often a missing token file is looked for.
const TOKEN_FILE_POLL: Duration = Duration::from_millis(50);

/// The token every rank of this node gets; `start` is when the launch began (the
/// wait for a token file counts against `--timeout`).
pub(crate) fn resolve(options: &Options, start: Instant) -> Result<StoreToken, Failure> {
    let from_env = StoreToken::from_env().map_err(|e| Failure::Setup(e.to_string()))?;
    if let Some(path) = &options.token_file {
        let token = from_file(path, options, start)?;
        if from_env.as_ref().is_some_and(|env| *env != token) {
            eprintln!(
                "launch: the token of --token-file {} replaces the different one in {TOKEN_ENV}",
                path.display()
            );
        }
        return Ok(token);
    }
    if let Some(token) = from_env {
        return Ok(token);
    }
    if options.nnodes > 1 {
        return Err(Failure::Usage(format!(
            "a job of {} nodes needs one store token shared by its nodes: give every node \
             --token-file PATH on a filesystem they share (node 0 writes a fresh token \
             there, mode 0600, when it is missing), or the same {TOKEN_ENV} (e.g. \
             `export {TOKEN_ENV}=$(openssl rand -hex 16)`)",
            options.nnodes
        )));
    }
    StoreToken::generate().map_err(|e| Failure::Setup(format!("cannot make a store token: {e}")))
}

/// What a token file holds.
enum Held {
    /// Nothing yet: the file is missing, or empty.
    Nothing,
    /// A valid token.
    Token(StoreToken),
}

/// The token in `path`. Node 0 creates the file when it is missing; the others wait
/// for it, up to `--timeout` (from `start`) or [`TOKEN_FILE_WAIT`], or a signal.
fn from_file(path: &Path, options: &Options, start: Instant) -> Result<StoreToken, Failure> {
    let setup = |why: String| Failure::Setup(format!("--token-file {}: {why}", path.display()));
    let limit = options.timeout.unwrap_or(TOKEN_FILE_WAIT);
    let mut announced = false;
    loop {
        let exists = match read(path).map_err(setup)? {
            Held::Token(token) => return Ok(token),
            Held::Nothing => path.exists(),
        };
        if options.node_rank == 0 {
            if exists {
                return Err(setup(
                    "holds no token; remove it (node 0 then writes a fresh one) or write one \
                     into it"
                        .into(),
                ));
            }
            if let Some(token) = create(path).map_err(setup)? {
                eprintln!(
                    "launch: wrote a fresh store token to {} for the other nodes",
                    path.display()
                );
                return Ok(token);
            }
            // Another process created it meanwhile: read that one.
            continue;
        }
        if let Some(signal) = signals::take() {
            return Err(Failure::Interrupted { signal });
        }
        if start.elapsed() >= limit {
            return Err(Failure::TokenWait {
                path: path.display().to_string(),
                after: limit,
                timed_out: options.timeout.is_some(),
            });
        }
        if !announced {
            eprintln!(
                "launch: node {}: waiting for node 0 to write the store token to {}",
                options.node_rank,
                path.display()
            );
            announced = true;
        }
        thread::sleep(TOKEN_FILE_POLL);
    }
}

/// Reads the token in `path`, surrounding white space (a final newline) left out; a
/// token file readable by others is warned of.
fn read(path: &Path) -> Result<Held, String> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Held::Nothing),
        Err(e) => return Err(e.to_string()),
    };
    let mut bytes = Vec::new();
    // A little more than the longest token and its white space: a bigger file is no
    // token, and is not read whole.
    let most = MAX_TOKEN_LEN as u64 + 64;
    (&mut file)
        .take(most + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > most {
        return Err(format!("more than {most} bytes: not a store token"));
    }
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| "not a store token (not UTF-8)".to_owned())?
        .trim();
    if text.is_empty() {
        return Ok(Held::Nothing);
    }
    // The error describes the token without repeating it.
    let token = StoreToken::new(text).map_err(|e| e.to_string())?;
    if let Ok(meta) = file.metadata() {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            eprintln!(
                "launch: warning: the token file {} can be read by other users (mode {mode:03o}); \
                 `chmod 600` it",
                path.display()
            );
        }
    }
    Ok(Held::Token(token))
}

/// Writes a fresh token to `path`, mode 0600, unless the file exists (`Ok(None)`).
///
/// The token is written to a temporary file next to `path` and linked into place, so
/// that a node that reads `path` finds the whole token or no file; where the
/// filesystem has no hard links the file is created in place.
fn create(path: &Path) -> Result<Option<StoreToken>, String> {
    let token = StoreToken::generate().map_err(|e| e.to_string())?;
    let name = path
        .file_name()
        .ok_or("not a file name")?
        .to_string_lossy()
        .into_owned();
    let temporary: PathBuf = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    // A stale one of a launch that had this pid.
    let _ = fs::remove_file(&temporary);
    write_new(&temporary, &token).map_err(|e| format!("writing {}: {e}", temporary.display()))?;
    let linked = fs::hard_link(&temporary, path);
    let _ = fs::remove_file(&temporary);
    match linked {
        Ok(()) => Ok(Some(token)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(None),
        Err(e) if no_hard_links(&e) => match write_new(path, &token) {
            Ok(()) => Ok(Some(token)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(e.to_string()),
        },
        Err(e) => Err(e.to_string()),
    }
}

/// Whether `e` says the filesystem does not do hard links.
fn no_hard_links(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPERM | libc::EOPNOTSUPP | libc::EMLINK | libc::ENOSYS)
    )
}

/// Creates `path` (it must not exist), mode 0600, holding `token` and a newline.
fn write_new(path: &Path, token: &StoreToken) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(format!("{}\n", token.secret()).as_bytes())?;
    file.sync_all()
}
