//! The bind rule: a store serves an address other hosts may reach only with a token,
//! unless the user opts out of that on purpose.

use std::net::{IpAddr, SocketAddr};

use crate::{Error, Result};

use super::{StoreOptions, TOKEN_ENV};

/// The environment variable that lets a store without a token serve a non-loopback
/// address: `1` opts in; unset, empty or `0` does not; any other value is
/// [`Error::InvalidEnv`]. [`StoreOptions::allow_insecure_bind`] is the same opt-in in
/// code.
pub const INSECURE_ENV: &str = "LOWRANK_STORE_INSECURE";

/// Whether `ip` reaches only this host: 127.0.0.0/8, `::1`, or either mapped into IPv6.
fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Whether [`INSECURE_ENV`] opts in.
fn insecure_from_env() -> Result<bool> {
    let Some(value) = std::env::var_os(INSECURE_ENV) else {
        return Ok(false);
    };
    match value.to_str().map(str::trim) {
        Some("1") => Ok(true),
        Some("" | "0") => Ok(false),
        _ => Err(Error::InvalidEnv {
            name: INSECURE_ENV.into(),
            value: super::escape::sanitize(&value.to_string_lossy()),
            why: "expected 1 (serve without a token on a non-loopback address) or 0".into(),
        }),
    }
}

/// `Ok` when a store with `options` may serve `addrs`: every address is loopback, or
/// the store has a token, or the user opted in ([`StoreOptions::allow_insecure_bind`],
/// [`INSECURE_ENV`]). Otherwise [`Error::InvalidArgument`] saying how to set a token.
pub(crate) fn check_bind(addrs: &[SocketAddr], options: &StoreOptions) -> Result<()> {
    let Some(open) = addrs.iter().find(|addr| !is_loopback(addr.ip())) else {
        return Ok(());
    };
    if options.token.is_some() || options.allow_insecure_bind || insecure_from_env()? {
        if options.token.is_none() {
            tracing::warn!(
                addr = %open,
                "the rendezvous store serves a non-loopback address without a token ({INSECURE_ENV}=1): \
                 anyone who reaches it can join the job"
            );
        }
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "refusing to serve the rendezvous store on {open} without a token: anyone who \
         reaches that address could join the job and read or change its keys. Set the \
         same token on every rank in {TOKEN_ENV} (16 to 1024 printable ASCII characters, \
         e.g. `export {TOKEN_ENV}=$(openssl rand -hex 16)`; `launch` makes one per job), \
         or StoreOptions::token in code; serve a loopback address (MASTER_ADDR=127.0.0.1) \
         for a job on one host; or, on a network you trust, opt in with {INSECURE_ENV}=1 \
         (StoreOptions::allow_insecure_bind)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_127_8_and_colon_colon_1_mapped_or_not() {
        for ip in ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"] {
            assert!(is_loopback(ip.parse().expect("an address")), "{ip}");
        }
        for ip in [
            "0.0.0.0",
            "::",
            "10.0.0.1",
            "192.168.1.1",
            "::ffff:10.0.0.1",
            "fe80::1",
        ] {
            assert!(!is_loopback(ip.parse().expect("an address")), "{ip}");
        }
    }
}
