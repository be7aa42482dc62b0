//! The examples' argument values, read with lexopt: one way to say what is wrong.

/// The next value, as UTF-8 text.
pub fn text(p: &mut lexopt::Parser) -> Result<String, String> {
    use lexopt::ValueExt;
    p.value()
        .and_then(|v| v.string())
        .map_err(|e| e.to_string())
}

/// The next value, a positive integer (`name` for the message).
pub fn positive(p: &mut lexopt::Parser, name: &str) -> Result<usize, String> {
    let v = text(p)?;
    v.parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{name} {v}: expected a positive integer"))
}
