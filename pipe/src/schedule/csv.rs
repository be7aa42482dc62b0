//! PyTorch's schedule CSV (`_dump_csv` / `_load_csv`) for [`Order`], both ways.
//!
//! Row `r` is rank `r`; each cell is one action in PyTorch's string form (`2F0`, `1I3`,
//! `(0F3;3B1)OVERLAP_F_B`), an empty cell a bubble. Lines end in `\r\n` (Python's `excel`
//! dialect) and rows are not padded.
//!
//! Loading follows `_Action.from_str`: the cell is trimmed; empty is a bubble; a cell
//! starting with `(` and holding a `)` is a compound `(a;b)TYPE`; otherwise the prefix
//! `(\d+)(TYPE)(\d*)` is matched, types tried longest first, and anything after it is
//! ignored (`0F1xyz` is `0F1`). Communication and FSDP actions (`SEND_F`, `RECV_F`,
//! `SEND_B`, `RECV_B`, `WAIT_SEND_F`, `WAIT_SEND_B`, `UNSHARD`, `RESHARD`, `REDUCE_GRAD`,
//! `WAIT_REDUCE_GRAD`), as in a `compute_comms` file, are accepted and dropped (not made
//! bubbles): our workers move activations and gradients by dataflow, and a stage's
//! parameters are always local. What PyTorch would load and we refuse: `F`, `B`, `I` or
//! `W` without a micro-batch; a compound that is not `OVERLAP_F_B` of exactly two compute
//! actions; non-ASCII digits.

use super::generators::{Cell, Order};
use crate::error::Error;
use crate::vocab::{Action, Pass};

/// What one CSV cell holds.
enum Parsed {
    /// An empty cell.
    Bubble,
    /// A compute cell.
    Cell(Cell),
    /// A communication or FSDP action: dropped.
    Dropped,
}

/// PyTorch's `_ComputationType` values, longest first (the order the prefix is tried in).
const TYPES: [&str; 14] = [
    "WAIT_REDUCE_GRAD",
    "REDUCE_GRAD",
    "WAIT_SEND_F",
    "WAIT_SEND_B",
    "UNSHARD",
    "RESHARD",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "F",
    "I",
    "B",
    "W",
];

fn pass_of(kind: &str) -> Option<Pass> {
    match kind {
        "F" => Some(Pass::Forward),
        "B" => Some(Pass::Backward),
        "I" => Some(Pass::InputGrad),
        "W" => Some(Pass::WeightGrad),
        _ => None,
    }
}

/// Splits off the leading ASCII digits of `s`.
fn digits(s: &str) -> (&str, &str) {
    let end = s
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(s.len());
    s.split_at(end)
}

/// A simple (non-compound) action string: `Ok(Some(action))` for compute,
/// `Ok(None)` for a dropped one.
fn parse_simple(s: &str) -> Result<Option<Action>, String> {
    let invalid = || {
        format!(
            "invalid action string {s:?}, should be formatted as \
             [stage][action type][(microbatch)] e.g. 2F0"
        )
    };
    let (stage, rest) = digits(s);
    if stage.is_empty() {
        return Err(invalid());
    }
    let stage: usize = stage
        .parse()
        .map_err(|_| format!("stage index in {s:?} is too large"))?;
    let kind = TYPES
        .iter()
        .find(|t| rest.starts_with(*t))
        .ok_or_else(invalid)?;
    let (mb, _junk) = digits(&rest[kind.len()..]);
    let Some(pass) = pass_of(kind) else {
        return Ok(None);
    };
    if mb.is_empty() {
        return Err(format!(
            "{s:?}: a {kind} action needs a micro-batch index (e.g. {stage}{kind}0)"
        ));
    }
    let micro_batch: usize = mb
        .parse()
        .map_err(|_| format!("micro-batch index in {s:?} is too large"))?;
    Ok(Some(Action {
        stage,
        micro_batch,
        pass,
    }))
}

/// One cell, by `_Action.from_str`'s rules.
fn parse_cell(raw: &str) -> Result<Parsed, String> {
    let s = raw.trim();
    if s.is_empty() {
        return Ok(Parsed::Bubble);
    }
    if let (true, Some(close)) = (s.starts_with('('), s.find(')')) {
        let (inner, kind) = (&s[1..close], &s[close + 1..]);
        if kind != "OVERLAP_F_B" {
            return Err(format!(
                "{s:?}: a compound action must be (a;b)OVERLAP_F_B, not {kind:?}"
            ));
        }
        let mut subs = Vec::new();
        if !inner.trim().is_empty() {
            for part in inner.split(';') {
                match parse_cell(part)? {
                    Parsed::Bubble => {}
                    Parsed::Cell(Cell::Action(a)) => subs.push(a),
                    Parsed::Cell(Cell::Overlap(..)) | Parsed::Dropped => {
                        return Err(format!(
                            "{s:?}: OVERLAP_F_B holds compute actions only (F, B, I, W)"
                        ))
                    }
                }
            }
        }
        return match subs[..] {
            [a, b] => Ok(Parsed::Cell(Cell::Overlap(a, b))),
            _ => Err(format!(
                "{s:?}: OVERLAP_F_B needs exactly two sub-actions, got {}",
                subs.len()
            )),
        };
    }
    Ok(match parse_simple(s)? {
        Some(a) => Parsed::Cell(Cell::Action(a)),
        None => Parsed::Dropped,
    })
}

/// Splits one CSV line into fields (Python's `excel` dialect: commas, fields optionally in
/// double quotes with `""` for a quote inside).
fn fields(line: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        let mut field = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some('"') => break,
                    Some(c) => field.push(c),
                    None => return Err("a quoted field is not closed".to_string()),
                }
            }
        }
        // Python's reader keeps what follows a closing quote; so do we.
        for c in chars.by_ref() {
            if c == ',' {
                out.push(field);
                field = String::new();
                break;
            }
            field.push(c);
        }
        if chars.peek().is_none() {
            // The last field (after the last comma, or the only one).
            out.push(field);
            break;
        }
    }
    Ok(out)
}

impl Order {
    /// PyTorch's compute-only CSV (`_dump_csv`): a line per rank, a cell per timestep
    /// (`{stage}{letter}{micro_batch}`, `(a;b)OVERLAP_F_B`, empty for a bubble), `\r\n`
    /// line ends, rows not padded. A rank whose only cell is a bubble is written `""`, as
    /// Python's writer does.
    pub fn to_csv(&self) -> String {
        let mut out = String::new();
        for row in &self.ranks {
            if let [None] = row[..] {
                out.push_str("\"\"");
            }
            let cells: Vec<String> = row
                .iter()
                .map(|c| c.map(|c| c.to_string()).unwrap_or_default())
                .collect();
            if row.len() != 1 || row[0].is_some() {
                out.push_str(&cells.join(","));
            }
            out.push_str("\r\n");
        }
        out
    }

    /// Loads PyTorch's CSV (`_load_csv`): line `r` is rank `r` (`\r\n` or `\n`; a final
    /// line end adds no rank, an empty line is a rank without actions; fields may be
    /// double-quoted as in Python's `excel` dialect).
    ///
    /// Cells follow PyTorch's `_Action.from_str`: the cell is trimmed; empty is a bubble; a
    /// cell starting with `(` and holding a `)` is a compound `(a;b)OVERLAP_F_B`;
    /// otherwise the prefix `(\d+)(TYPE)(\d*)` is matched, types tried longest first, and
    /// what follows is ignored (`0F1xyz` is `0F1`). Communication and FSDP actions
    /// (`SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`, `WAIT_SEND_F`, `WAIT_SEND_B`, `UNSHARD`,
    /// `RESHARD`, `REDUCE_GRAD`, `WAIT_REDUCE_GRAD`), as in a `compute_comms` file, are
    /// accepted and dropped (not made bubbles): our workers move activations and
    /// gradients by dataflow and a stage's parameters are always local.
    ///
    /// Refused although PyTorch's parser takes them: `F`, `B`, `I` or `W` without a
    /// micro-batch; a compound other than `OVERLAP_F_B` of exactly two compute actions;
    /// non-ASCII digits.
    ///
    /// The stage and micro-batch counts come from the content ([`Order::stages`],
    /// [`Order::micro_batches`]); nothing else is checked until [`Order::to_schedule`].
    /// A malformed cell is an [`Error::ScheduleName`] naming its rank and cell (0-based),
    /// its line and column (1-based), and the text.
    pub fn from_csv(text: &str) -> Result<Order, Error> {
        let body = text.strip_suffix('\n').unwrap_or(text);
        let mut ranks = Vec::new();
        if text.is_empty() {
            return Ok(Order { ranks });
        }
        for (r, line) in body.split('\n').enumerate() {
            let line = line.strip_suffix('\r').unwrap_or(line);
            let mut row = Vec::new();
            if !line.is_empty() {
                let cells = fields(line).map_err(|why| {
                    Error::ScheduleName(format!("schedule CSV, rank {r} (line {}): {why}", r + 1))
                })?;
                for (c, cell) in cells.iter().enumerate() {
                    match parse_cell(cell) {
                        Ok(Parsed::Bubble) => row.push(None),
                        Ok(Parsed::Cell(cell)) => row.push(Some(cell)),
                        Ok(Parsed::Dropped) => {}
                        Err(why) => {
                            return Err(Error::ScheduleName(format!(
                                "schedule CSV, rank {r} cell {c} (line {}, column {}): {why}",
                                r + 1,
                                c + 1
                            )))
                        }
                    }
                }
            }
            ranks.push(row);
        }
        Ok(Order { ranks })
    }
}
