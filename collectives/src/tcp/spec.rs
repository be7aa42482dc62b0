//! What a collective's frames say about the call, and how a difference is printed.

use super::frame::dtype_code;
use crate::{DType, ReduceOp};

/// The kinds of collective, as frames carry them.
pub(crate) mod coll {
    pub const ALL_REDUCE: u8 = 1;
    pub const COALESCED: u8 = 2;
    pub const BROADCAST: u8 = 3;
    pub const ALL_GATHER: u8 = 4;
    pub const REDUCE_SCATTER: u8 = 5;
    pub const BARRIER: u8 = 6;
    pub const NEW_GROUP: u8 = 7;
    pub const REJECTED: u8 = 8;
}

fn coll_name(c: u8) -> &'static str {
    match c {
        coll::ALL_REDUCE => "all_reduce",
        coll::COALESCED => "all_reduce_coalesced",
        coll::BROADCAST => "broadcast",
        coll::ALL_GATHER => "all_gather",
        coll::REDUCE_SCATTER => "reduce_scatter",
        coll::BARRIER => "barrier",
        coll::NEW_GROUP => "new_group",
        coll::REJECTED => "a collective it rejected",
        _ => "an unknown collective",
    }
}

/// The code of a reduction in a description.
pub(crate) fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

/// A buffer's type (as its wire code) and length, printed.
pub(crate) fn shape(dtype: u32, len: u64) -> String {
    match super::frame::dtype_from(dtype as u8) {
        Ok(d) => format!("{d:?} x {len}"),
        Err(_) => format!("? x {len}"),
    }
}

/// What a rank calls: the collective, its parameter (op, root, hash) and its buffers.
pub(crate) struct Spec {
    pub coll: u8,
    pub desc: u64,
    pub parts: Vec<(DType, usize)>,
}

impl Spec {
    pub(crate) fn describe(coll: u8, desc: u64, parts: u32, first: Option<(u32, u64)>) -> String {
        let what = match coll {
            coll::BROADCAST => format!("broadcast from root {desc}"),
            coll::ALL_REDUCE | coll::COALESCED | coll::REDUCE_SCATTER => {
                let op = ["Sum", "Avg", "Max", "Min"]
                    .get(desc as usize)
                    .unwrap_or(&"?");
                format!("{} with {op}", coll_name(coll))
            }
            c => coll_name(c).to_string(),
        };
        match first {
            Some((dtype, len)) if parts > 0 => {
                format!(
                    "{what} on {parts} buffer(s), the first {}",
                    shape(dtype, len)
                )
            }
            _ => format!("{what} on {parts} buffer(s)"),
        }
    }

    pub(crate) fn mine(&self) -> String {
        let first = self
            .parts
            .first()
            .map(|&(d, n)| (u32::from(dtype_code(d)), n as u64));
        Spec::describe(self.coll, self.desc, self.parts.len() as u32, first)
    }
}
