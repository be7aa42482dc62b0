//! The options of a hook spec (`key=value,...`): each option under our name or
//! PyTorch's, each at most once, values checked where they are read, and errors that
//! name the option as the user typed it and say what to type instead.

use super::names::closest;
use super::{excerpt, QUOTE_PART};

/// Characters of an option's key an error quotes: every known key whole (the longest,
/// `compression_stats_logging_frequency`, has 35).
const QUOTE_KEY: usize = 40;

/// One option: our name, and PyTorch's where it differs.
pub(super) struct Opt {
    /// Our name (in [`CommHook::name`](crate::CommHook::name) and the docs).
    pub(super) ours: &'static str,
    /// PyTorch's name for it (`PowerSGDState`'s field, a hook function's argument), if
    /// it differs from ours.
    pub(super) pytorch: Option<&'static str>,
}

impl Opt {
    fn names(&self) -> impl Iterator<Item = &'static str> + Clone {
        std::iter::once(self.ours).chain(self.pytorch)
    }
}

/// One option as given: its place in the hook's table, its key as typed, its value.
#[derive(Debug)]
pub(super) struct Given<'a> {
    /// Index into the table.
    pub(super) index: usize,
    /// The key as the user typed it (trimmed).
    pub(super) key: &'a str,
    /// The value (trimmed).
    pub(super) value: &'a str,
}

impl Given<'_> {
    /// The error for this option's value: `<hook> option `key=value`: expected <what>`.
    pub(super) fn bad(&self, hook: &str, what: &str) -> String {
        format!(
            "{} option `{}={}`: expected {what}",
            excerpt(hook, QUOTE_PART),
            excerpt(self.key, QUOTE_KEY),
            excerpt(self.value, QUOTE_PART)
        )
    }

    /// The value as a boolean: `true`, `false`, `True`, `False`, `1` or `0`.
    pub(super) fn bool(&self, hook: &str) -> Result<bool, String> {
        parse_bool(self.value).ok_or_else(|| self.bad(hook, BOOL))
    }

    /// The value parsed as `T` and accepted by `ok`, or the error saying `what`.
    pub(super) fn parse<T: std::str::FromStr>(
        &self,
        hook: &str,
        what: &str,
        ok: impl Fn(&T) -> bool,
    ) -> Result<T, String> {
        self.value
            .parse::<T>()
            .ok()
            .filter(|x| ok(x))
            .ok_or_else(|| self.bad(hook, what))
    }
}

/// What a boolean option takes.
pub(super) const BOOL: &str = "true or false (also True, False, 1, 0)";

/// `true`/`True`/`1` or `false`/`False`/`0` (Rust's and Python's spellings).
pub(super) fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "true" | "True" | "1" => Some(true),
        "false" | "False" | "0" => Some(false),
        _ => None,
    }
}

/// Splits `opts` (`key=value,...`, empty entries skipped) into the options of `table`,
/// matching each key to our name or PyTorch's (ignoring ASCII case). Errors: an entry
/// that is not `key=value`; an unknown key (listing the hook's options, ours and
/// PyTorch's, and the closest one); an option given twice, under one name or under both.
pub(super) fn split<'a>(
    hook: &str,
    opts: Option<&'a str>,
    table: &[Opt],
) -> Result<Vec<Given<'a>>, String> {
    let mut given: Vec<Given<'a>> = Vec::new();
    for kv in opts
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let Some((key, value)) = kv.split_once('=') else {
            return Err(format!("`{}` is not key=value", excerpt(kv, QUOTE_PART)));
        };
        let (key, value) = (key.trim(), value.trim());
        let index = table
            .iter()
            .position(|o| o.names().any(|n| n.eq_ignore_ascii_case(key)))
            .ok_or_else(|| unknown(hook, key, table))?;
        if let Some(first) = given.iter().find(|g| g.index == index) {
            return Err(if first.key.eq_ignore_ascii_case(key) {
                format!("option `{}` is given twice", excerpt(key, QUOTE_KEY))
            } else {
                format!(
                    "options `{}` and `{}` are one option (our name and PyTorch's): give it once",
                    excerpt(first.key, QUOTE_KEY),
                    excerpt(key, QUOTE_KEY)
                )
            });
        }
        given.push(Given { index, key, value });
    }
    Ok(given)
}

/// The error for the unknown option `key` of `hook`.
fn unknown(hook: &str, key: &str, table: &[Opt]) -> String {
    let ours: Vec<&str> = table.iter().map(|o| o.ours).collect();
    let theirs: Vec<&str> = table.iter().filter_map(|o| o.pytorch).collect();
    let mut why = format!(
        "unknown {} option `{}`",
        excerpt(hook, QUOTE_PART),
        excerpt(key, QUOTE_KEY)
    );
    if ours.is_empty() {
        return why + " (it takes none)";
    }
    if let Some(near) = closest(key, table.iter().flat_map(Opt::names)) {
        why += &format!("; did you mean `{near}`?");
    }
    why += &format!("; known: {}", ours.join(", "));
    let longest = table.iter().flat_map(Opt::names).map(str::len).max();
    if !theirs.is_empty() {
        // A key longer than every option is no typo: the short list keeps the error
        // short.
        if key.len() > longest.unwrap_or(0) {
            why += " (or PyTorch's names for them)";
        } else {
            why += &format!("; PyTorch's: {}", theirs.join(", "));
        }
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &[Opt] = &[
        Opt {
            ours: "rank",
            pytorch: Some("matrix_approximation_rank"),
        },
        Opt {
            ours: "warm_start",
            pytorch: None,
        },
    ];

    #[test]
    fn keys_under_either_name_once() {
        let g = split("h", Some("Rank=2, matrix_approximation_rank2=1"), TABLE);
        assert!(g
            .unwrap_err()
            .contains("did you mean `matrix_approximation_rank`?"));
        let g = split("h", Some("matrix_approximation_rank=3,warm_start=1"), TABLE).unwrap();
        assert_eq!(
            g.iter()
                .map(|g| (g.index, g.key, g.value))
                .collect::<Vec<_>>(),
            [
                (0, "matrix_approximation_rank", "3"),
                (1, "warm_start", "1")
            ]
        );
        let e = split("h", Some("rank=1,matrix_approximation_rank=1"), TABLE).unwrap_err();
        assert!(
            e.contains("`rank` and `matrix_approximation_rank` are one option"),
            "{e}"
        );
        let e = split("h", Some("rank=1,RANK=1"), TABLE).unwrap_err();
        assert!(e.contains("option `RANK` is given twice"), "{e}");
    }

    #[test]
    fn booleans_in_rust_and_python_spellings() {
        for (v, b) in [("true", true), ("True", true), ("1", true)] {
            assert_eq!(parse_bool(v), Some(b));
        }
        for (v, b) in [("false", false), ("False", false), ("0", false)] {
            assert_eq!(parse_bool(v), Some(b));
        }
        for v in ["yes", "TRUE", "", "2", "t"] {
            assert_eq!(parse_bool(v), None, "{v}");
        }
    }
}
