//! The shared secret a store's clients present in their hello, and the randomness it
//! and a join's identity are made from.

use std::fmt;
use std::io::Read;

use crate::{Error, Result};

/// The environment variable that carries the store's token to every rank: `launch`
/// sets it (to the value in its own environment, or a fresh random one), and
/// [`EnvInfo`](crate::env::EnvInfo) reads it.
pub const TOKEN_ENV: &str = "LOWRANK_STORE_TOKEN";

/// The fewest bytes a token may have: 16 printable characters.
pub const MIN_TOKEN_LEN: usize = 16;

/// The most bytes a token may have.
pub const MAX_TOKEN_LEN: usize = 1024;

/// A shared secret: a store's server refuses every client whose hello does not carry
/// it, before serving any other request.
///
/// It is printable ASCII without spaces (so that it travels in an environment variable),
/// [`MIN_TOKEN_LEN`] to [`MAX_TOKEN_LEN`] bytes. Its `Debug` output never shows it, and
/// comparing two tokens takes a time that depends only on their lengths.
///
/// The token travels in the clear: it keeps out other users of a shared host or
/// network, not someone who can read the job's traffic.
///
/// ```
/// use collectives::store::StoreToken;
///
/// let token = StoreToken::generate()?;
/// assert_eq!(token.secret().len(), 32);
/// assert_eq!(format!("{token:?}"), "StoreToken(<32 bytes, not shown>)");
/// assert!(StoreToken::new("short").is_err());
/// # Ok::<(), collectives::Error>(())
/// ```
#[derive(Clone, Eq)]
pub struct StoreToken(String);

impl StoreToken {
    /// A token with this text; one too short, too long or with a character other than
    /// printable ASCII is [`Error::InvalidArgument`] (which does not repeat it).
    pub fn new(token: impl Into<String>) -> Result<StoreToken> {
        let token = token.into();
        check(&token).map_err(|why| Error::InvalidArgument(format!("a store token {why}")))?;
        Ok(StoreToken(token))
    }

    /// A fresh token of 128 random bits (32 hexadecimal digits) from the operating
    /// system's generator; [`Error::Io`] when it cannot be read.
    pub fn generate() -> Result<StoreToken> {
        let bytes = random_bytes::<16>().map_err(|e| Error::io("reading /dev/urandom", e))?;
        Ok(StoreToken(hex(&bytes)))
    }

    /// The token in [`TOKEN_ENV`], `None` when it is unset; a value that is not a valid
    /// token is [`Error::InvalidEnv`] (its value not shown).
    pub fn from_env() -> Result<Option<StoreToken>> {
        StoreToken::from_var(std::env::var_os(TOKEN_ENV).map(|v| v.to_string_lossy().into_owned()))
    }

    /// The token in `value`, read from [`TOKEN_ENV`].
    pub(crate) fn from_var(value: Option<String>) -> Result<Option<StoreToken>> {
        let Some(value) = value else {
            return Ok(None);
        };
        match check(&value) {
            Ok(()) => Ok(Some(StoreToken(value))),
            Err(why) => Err(Error::InvalidEnv {
                name: TOKEN_ENV.into(),
                value: format!("<{} bytes, not shown>", value.len()),
                why: format!("a store token {why} (e.g. `openssl rand -hex 16`)"),
            }),
        }
    }

    /// The token's text, to hand to the processes that share it.
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Whether `offered` is this token, in a time that depends only on the lengths.
    pub(super) fn matches(&self, offered: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), offered)
    }
}

impl PartialEq for StoreToken {
    fn eq(&self, other: &Self) -> bool {
        self.matches(other.0.as_bytes())
    }
}

impl fmt::Debug for StoreToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreToken(<{} bytes, not shown>)", self.0.len())
    }
}

/// Why `token` is not a valid token, completing "a store token ...".
fn check(token: &str) -> std::result::Result<(), String> {
    if token.len() < MIN_TOKEN_LEN {
        return Err(format!(
            "has {} bytes, fewer than {MIN_TOKEN_LEN}",
            token.len()
        ));
    }
    if token.len() > MAX_TOKEN_LEN {
        return Err(format!(
            "has {} bytes, more than {MAX_TOKEN_LEN}",
            token.len()
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("has a character that is not printable ASCII (or a space)".into());
    }
    Ok(())
}

/// Compares every byte of the longer input whatever the bytes hold, so that the time
/// taken depends on the lengths only, never on where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    // Keeps the compiler from turning the loop into an early exit.
    std::hint::black_box(diff) == 0
}

/// `N` bytes from the operating system's random generator.
pub(super) fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// A process-unique identity for a join: random where the system offers it, else the
/// process id, the time and a counter (unique enough to tell two processes apart).
pub(super) fn join_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    match random_bytes::<16>() {
        Ok(bytes) => hex(&bytes),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let count = COUNTER.fetch_add(1, Ordering::Relaxed);
            format!("{}-{nanos}-{count}", std::process::id())
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_by_content_and_length() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"abc", b""));
        assert!(constant_time_eq(b"", b""));
        let token = StoreToken::new("0123456789abcdef").expect("valid");
        assert!(token.matches(b"0123456789abcdef"));
        assert!(!token.matches(b"0123456789abcdeF"));
    }

    #[test]
    fn bad_tokens_are_named_but_not_shown() {
        for bad in ["short", "has a space inside it", "tab\there-and-more-text"] {
            assert!(StoreToken::new(bad).is_err(), "{bad:?}");
        }
        let e = StoreToken::from_var(Some("tooshort-secret".into())).expect_err("15 bytes");
        let message = e.to_string();
        assert!(
            message.contains(TOKEN_ENV) && !message.contains("tooshort"),
            "{message}"
        );
        assert_eq!(StoreToken::from_var(None).expect("unset is fine"), None);
    }

    #[test]
    fn generated_tokens_differ() {
        let (a, b) = (StoreToken::generate(), StoreToken::generate());
        let (a, b) = (a.expect("random"), b.expect("random"));
        assert_ne!(a, b);
        assert!(StoreToken::new(a.secret()).is_ok());
        assert_ne!(join_id(), join_id());
    }
}
