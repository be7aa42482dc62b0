//! Text from a peer, made safe to show: no character of it can move the cursor, end
//! the line, or turn the rest of the line around, so a log line or an error message
//! that quotes it cannot be forged.

use std::fmt::{self, Write};

/// Whether `c` is shown escaped: control characters (C0, DEL, C1: ESC, CR, LF, NUL,
/// ...), the bidirectional embeddings, overrides and isolates (U+202A to U+202E, U+2066
/// to U+2069), the direction marks (U+200E, U+200F, U+061C) and the line and paragraph
/// separators (U+2028, U+2029).
fn is_forging(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{061c}'
                | '\u{2028}'
                | '\u{2029}'
        )
}

/// Writes `c` as Rust writes it in a string literal: `\n`, `\r`, `\t`, `\0`, else
/// `\u{hex}`.
fn write_escaped(f: &mut fmt::Formatter<'_>, c: char) -> fmt::Result {
    match c {
        '\n' => f.write_str("\\n"),
        '\r' => f.write_str("\\r"),
        '\t' => f.write_str("\\t"),
        '\0' => f.write_str("\\0"),
        c => write!(f, "\\u{{{:x}}}", u32::from(c)),
    }
}

/// Shows `text` with every character that could forge a log line escaped (see
/// [`EscapedForLog`]), and nothing else changed: for text that is already a message,
/// such as one a peer sent. To quote a name or a key, use [`Quoted`].
///
/// ```
/// use collectives::store::escape_for_log;
///
/// let shown = escape_for_log("ok\r\x1b[2Jforged \u{202e}txt").to_string();
/// assert_eq!(shown, r"ok\r\u{1b}[2Jforged \u{202e}txt");
/// // Escaping what is escaped changes nothing.
/// assert_eq!(escape_for_log(&shown).to_string(), shown);
/// ```
pub fn escape_for_log(text: &str) -> EscapedForLog<'_> {
    EscapedForLog(text)
}

/// The [`Display`](fmt::Display) of [`escape_for_log`]: the text with control
/// characters, bidirectional overrides and isolates, direction marks and line
/// separators written as escapes (`\r`, `\u{1b}`, `\u{202e}`), everything else as it is.
/// Its output holds none of those characters, and escaping it again leaves it as it is.
#[derive(Debug, Clone, Copy)]
pub struct EscapedForLog<'a>(&'a str);

impl fmt::Display for EscapedForLog<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(is_forging) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            write_escaped(f, c)?;
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

/// A client-supplied string (a key, a barrier's name, a host), shown in double quotes
/// with the characters [`escape_for_log`] escapes escaped, and `"` and `\` too, so that
/// the quoted text is unambiguous and cannot forge a log line.
///
/// ```
/// use collectives::store::Quoted;
///
/// assert_eq!(Quoted("a\"b\\c\x1b\0").to_string(), r#""a\"b\\c\u{1b}\0""#);
/// assert_eq!(format!("key {}", Quoted("rank/0")), r#"key "rank/0""#);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Quoted<'a>(pub &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                c if is_forging(c) => write_escaped(f, c)?,
                c => f.write_char(c)?,
            }
        }
        f.write_char('"')
    }
}

/// `text` as [`escape_for_log`] shows it, owned: for text received from a peer that is
/// kept in an error.
pub(super) fn sanitize(text: &str) -> String {
    if text.contains(is_forging) {
        escape_for_log(text).to_string()
    } else {
        text.to_owned()
    }
}

/// `keys`, each [`Quoted`], as a list: `["a", "b"]`.
pub(super) fn quoted_list<S: AsRef<str>>(keys: &[S]) -> String {
    let quoted: Vec<String> = keys
        .iter()
        .map(|key| Quoted(key.as_ref()).to_string())
        .collect();
    format!("[{}]", quoted.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORGE: &str = "\x1b[31m\r\0\u{202e}";

    #[test]
    fn forging_characters_are_escaped_and_others_kept() {
        assert_eq!(escape_for_log(FORGE).to_string(), r"\u{1b}[31m\r\0\u{202e}");
        assert_eq!(Quoted(FORGE).to_string(), r#""\u{1b}[31m\r\0\u{202e}""#);
        for c in [
            '\u{7f}', '\u{85}', '\u{202a}', '\u{2066}', '\u{2069}', '\u{2028}',
        ] {
            let shown = escape_for_log(&c.to_string()).to_string();
            assert_eq!(shown, format!("\\u{{{:x}}}", u32::from(c)));
        }
        // Printable text, accents and other scripts pass unchanged.
        let plain = "rank/0 é ünïcode Ω 漢字 \\ \"";
        assert_eq!(escape_for_log(plain).to_string(), plain);
        assert_eq!(sanitize(plain), plain);
        assert_eq!(sanitize(FORGE), r"\u{1b}[31m\r\0\u{202e}");
        assert_eq!(quoted_list(&["a", "\n"]), r#"["a", "\n"]"#);
    }
}
