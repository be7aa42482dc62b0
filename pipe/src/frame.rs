//! What the ranks of a pipe say to each other, as byte frames for a
//! [`Transport`](crate::Transport): the workers' messages ([`Msg`]: activations,
//! gradients, skip values and their gradients, each tensor with a short shape header)
//! and the control of a run ([`Control`]: the skip declarations when the pipe is built,
//! the start of a run, a failure, the end of a rank's part).
//!
//! Layout: the tensors' bytes first, then the header, then the header's length as a
//! little-endian `u32`, so tensors are written straight into the frame (one copy) and
//! the header is read from the end. Every length and count is checked on the way in: a
//! frame that does not parse is [`Error::Frame`], never a panic or a wrong tensor.

use crate::error::{Error, Site};
use crate::message::Msg;
use crate::microbatch::{Batch, Item};
use crate::vocab::{Device, Task};
use crate::wire::{Wire, WireMeta};

/// What a run is, as its start announces it: every rank must be running the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunKind {
    /// `Pipe::forward`.
    Forward,
    /// `Pipe::backward`.
    Backward,
    /// `Pipe::step` or `step_with`.
    Step,
}

/// A frame that is not a worker's message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Control {
    /// Sent by every rank to every other when the pipe is built: its settings (which
    /// must be the same on every rank) and the skip declarations of its layers, by
    /// global layer index.
    Decls {
        config: String,
        decls: Vec<DeclWire>,
    },
    /// A run begins (sent by the rank of stage 0 to every other): its kind, step number,
    /// mode and the sizes of its micro-batches.
    Start {
        kind: RunKind,
        step: u64,
        train: bool,
        sizes: Vec<usize>,
    },
    /// The sender failed (its first failure): where, and the error's text.
    Abort {
        rank: usize,
        site: Option<Site>,
        message: String,
    },
    /// The sender's part of the run is over: no more frames from it this run.
    Done,
}

/// One layer's skip declaration on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeclWire {
    pub layer: usize,
    pub stash: Vec<String>,
    pub pop: Vec<String>,
    /// (name, namespace number) for every name outside the default namespace.
    pub namespaces: Vec<(String, u64)>,
}

/// A decoded frame.
pub(crate) enum Frame<T> {
    Msg(Msg<T>),
    Control(Control),
}

const MSG_ACTIVATION: u8 = 1;
const MSG_GRADIENT: u8 = 2;
const MSG_SKIP: u8 = 3;
const MSG_SKIP_GRAD: u8 = 4;
const CTL_DECLS: u8 = 10;
const CTL_START: u8 = 11;
const CTL_ABORT: u8 = 12;
const CTL_DONE: u8 = 13;

const ITEM_TENSOR: u8 = 0;
const ITEM_NO_CHUNK: u8 = 1;
const ITEM_NONE: u8 = 2;

/// The header under construction.
#[derive(Default)]
struct Header(Vec<u8>);

impl Header {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    fn str(&mut self, s: &str) {
        self.usize(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn opt(&mut self, v: Option<usize>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.usize(v);
            }
            None => self.u8(0),
        }
    }
    /// Appends the header and its length to the payload: the finished frame.
    fn finish(self, mut payload: Vec<u8>) -> Result<Vec<u8>, Error> {
        let len =
            u32::try_from(self.0.len()).map_err(|_| frame_error("a header longer than 4 GiB"))?;
        payload.extend_from_slice(&self.0);
        payload.extend_from_slice(&len.to_le_bytes());
        Ok(payload)
    }
}

fn frame_error(why: impl Into<String>) -> Error {
    Error::Frame(why.into())
}

/// Reads a header front to back; every read is checked.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| frame_error("the header ends early"))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, Error> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn usize(&mut self) -> Result<usize, Error> {
        usize::try_from(self.u64()?).map_err(|_| frame_error("a count larger than usize"))
    }
    /// A count of things each at least `min_bytes` long in the header: bounded by what
    /// is left, so a corrupt count cannot make a huge allocation.
    fn count(&mut self, min_bytes: usize) -> Result<usize, Error> {
        let n = self.usize()?;
        if n.saturating_mul(min_bytes.max(1)) > self.bytes.len() - self.at {
            return Err(frame_error(format!(
                "a count of {n} that the header cannot hold"
            )));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String, Error> {
        let n = self.count(1)?;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| frame_error("a name that is not UTF-8"))
    }
    fn opt(&mut self) -> Result<Option<usize>, Error> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.usize().map(Some),
            t => Err(frame_error(format!("an option tagged {t}"))),
        }
    }
    fn end(&self) -> Result<(), Error> {
        if self.at != self.bytes.len() {
            return Err(frame_error("bytes left after the header"));
        }
        Ok(())
    }
}

/// Writes one tensor into the payload and its header entry.
fn put_tensor<T: Wire>(h: &mut Header, payload: &mut Vec<u8>, t: &T) -> Result<(), Error> {
    let before = payload.len();
    let meta = t.write_wire(payload)?;
    h.u8(meta.dtype);
    h.usize(meta.shape.len());
    for &d in &meta.shape {
        h.usize(d);
    }
    h.usize(payload.len() - before);
    Ok(())
}

/// Reads one tensor's header entry and its bytes from the payload at `*at`.
fn get_tensor<T: Wire>(
    r: &mut Reader<'_>,
    payload: &[u8],
    at: &mut usize,
    device: &Device,
) -> Result<T, Error> {
    let dtype = r.u8()?;
    let ndim = r.count(8)?;
    let shape = (0..ndim)
        .map(|_| r.usize())
        .collect::<Result<Vec<_>, _>>()?;
    let len = r.usize()?;
    let end = at
        .checked_add(len)
        .filter(|&e| e <= payload.len())
        .ok_or_else(|| frame_error("a tensor's bytes run past the payload"))?;
    let t = T::read_wire(&WireMeta { dtype, shape }, &payload[*at..end], device)?;
    *at = end;
    Ok(t)
}

fn put_items<T: Wire>(
    h: &mut Header,
    payload: &mut Vec<u8>,
    items: &[Item<T>],
) -> Result<(), Error> {
    h.usize(items.len());
    for item in items {
        match item {
            Item::Tensor(t) => {
                h.u8(ITEM_TENSOR);
                put_tensor(h, payload, t)?;
            }
            Item::NoChunk(t) => {
                h.u8(ITEM_NO_CHUNK);
                put_tensor(h, payload, t)?;
            }
            Item::None => h.u8(ITEM_NONE),
        }
    }
    Ok(())
}

fn get_items<T: Wire>(
    r: &mut Reader<'_>,
    payload: &[u8],
    at: &mut usize,
    device: &Device,
) -> Result<Vec<Item<T>>, Error> {
    let n = r.count(1)?;
    (0..n)
        .map(|_| match r.u8()? {
            ITEM_TENSOR => get_tensor(r, payload, at, device).map(Item::Tensor),
            ITEM_NO_CHUNK => get_tensor(r, payload, at, device).map(Item::NoChunk),
            ITEM_NONE => Ok(Item::None),
            t => Err(frame_error(format!("an item tagged {t}"))),
        })
        .collect()
}

/// A worker's message as a frame, built in `payload` (emptied first).
pub(crate) fn encode_msg<T: Wire>(msg: &Msg<T>, mut payload: Vec<u8>) -> Result<Vec<u8>, Error> {
    let mut h = Header::default();
    payload.clear();
    match msg {
        Msg::Activation { stage, mb, batch } | Msg::Gradient { stage, mb, batch } => {
            h.u8(if matches!(msg, Msg::Activation { .. }) {
                MSG_ACTIVATION
            } else {
                MSG_GRADIENT
            });
            h.usize(*stage);
            h.usize(*mb);
            put_items(&mut h, &mut payload, batch.items())?;
        }
        Msg::Skip {
            stage,
            mb,
            route,
            value: t,
        }
        | Msg::SkipGrad {
            stage,
            mb,
            route,
            grad: t,
        } => {
            h.u8(if matches!(msg, Msg::Skip { .. }) {
                MSG_SKIP
            } else {
                MSG_SKIP_GRAD
            });
            h.usize(*stage);
            h.usize(*mb);
            h.usize(*route);
            match t {
                Some(t) => {
                    h.u8(1);
                    put_tensor(&mut h, &mut payload, t)?;
                }
                None => h.u8(0),
            }
        }
        Msg::Abort => return Err(Error::Frame("an abort travels as a control frame".into())),
    }
    h.finish(payload)
}

fn task_code(t: Task) -> u8 {
    match t {
        Task::Forward => 0,
        Task::Recompute => 1,
        Task::Backward => 2,
        Task::Loss => 3,
        Task::GradientsFinal => 4,
    }
}

fn task_of(code: u8) -> Result<Task, Error> {
    Ok(match code {
        0 => Task::Forward,
        1 => Task::Recompute,
        2 => Task::Backward,
        3 => Task::Loss,
        4 => Task::GradientsFinal,
        c => return Err(frame_error(format!("a task numbered {c}"))),
    })
}

/// A control message as a frame.
pub(crate) fn encode_control(c: &Control) -> Result<Vec<u8>, Error> {
    let mut h = Header::default();
    match c {
        Control::Decls { config, decls } => {
            h.u8(CTL_DECLS);
            h.str(config);
            h.usize(decls.len());
            for d in decls {
                h.usize(d.layer);
                h.usize(d.stash.len());
                d.stash.iter().for_each(|s| h.str(s));
                h.usize(d.pop.len());
                d.pop.iter().for_each(|s| h.str(s));
                h.usize(d.namespaces.len());
                for (name, ns) in &d.namespaces {
                    h.str(name);
                    h.u64(*ns);
                }
            }
        }
        Control::Start {
            kind,
            step,
            train,
            sizes,
        } => {
            h.u8(CTL_START);
            h.u8(match kind {
                RunKind::Forward => 0,
                RunKind::Backward => 1,
                RunKind::Step => 2,
            });
            h.u64(*step);
            h.u8(u8::from(*train));
            h.usize(sizes.len());
            sizes.iter().for_each(|&s| h.usize(s));
        }
        Control::Abort {
            rank,
            site,
            message,
        } => {
            h.u8(CTL_ABORT);
            h.usize(*rank);
            match site {
                Some(site) => {
                    h.u8(1);
                    h.usize(site.partition);
                    match &site.layer {
                        Some((index, name)) => {
                            h.u8(1);
                            h.usize(*index);
                            h.str(name);
                        }
                        None => h.u8(0),
                    }
                    h.opt(site.micro_batch);
                    h.u8(task_code(site.task));
                }
                None => h.u8(0),
            }
            h.str(message);
        }
        Control::Done => h.u8(CTL_DONE),
    }
    h.finish(Vec::new())
}

/// Parses a frame; tensors are read onto `device_of(stage)`, the device of the stage
/// they are for.
pub(crate) fn decode<T: Wire>(
    frame: &[u8],
    device_of: impl Fn(usize) -> Result<Device, Error>,
) -> Result<Frame<T>, Error> {
    let n = frame.len();
    if n < 4 {
        return Err(frame_error(format!("a frame of {n} bytes")));
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&frame[n - 4..]);
    let header_len = u32::from_le_bytes(len) as usize;
    let start = (n - 4)
        .checked_sub(header_len)
        .ok_or_else(|| frame_error("a header longer than its frame"))?;
    let (payload, header) = (&frame[..start], &frame[start..n - 4]);
    let mut r = Reader {
        bytes: header,
        at: 0,
    };
    let mut at = 0;
    let kind = r.u8()?;
    let out = match kind {
        MSG_ACTIVATION | MSG_GRADIENT => {
            let (stage, mb) = (r.usize()?, r.usize()?);
            let device = device_of(stage)?;
            let batch = Batch::new(get_items(&mut r, payload, &mut at, &device)?);
            Frame::Msg(if kind == MSG_ACTIVATION {
                Msg::Activation { stage, mb, batch }
            } else {
                Msg::Gradient { stage, mb, batch }
            })
        }
        MSG_SKIP | MSG_SKIP_GRAD => {
            let (stage, mb, route) = (r.usize()?, r.usize()?, r.usize()?);
            let device = device_of(stage)?;
            let t = match r.u8()? {
                0 => None,
                1 => Some(get_tensor(&mut r, payload, &mut at, &device)?),
                t => return Err(frame_error(format!("a skip value tagged {t}"))),
            };
            Frame::Msg(if kind == MSG_SKIP {
                Msg::Skip {
                    stage,
                    mb,
                    route,
                    value: t,
                }
            } else {
                Msg::SkipGrad {
                    stage,
                    mb,
                    route,
                    grad: t,
                }
            })
        }
        CTL_DECLS => {
            let config = r.str()?;
            let n = r.count(24)?;
            let mut decls = Vec::with_capacity(n);
            for _ in 0..n {
                let layer = r.usize()?;
                let k = r.count(8)?;
                let stash = (0..k).map(|_| r.str()).collect::<Result<_, _>>()?;
                let k = r.count(8)?;
                let pop = (0..k).map(|_| r.str()).collect::<Result<_, _>>()?;
                let k = r.count(16)?;
                let namespaces = (0..k)
                    .map(|_| Ok((r.str()?, r.u64()?)))
                    .collect::<Result<_, Error>>()?;
                decls.push(DeclWire {
                    layer,
                    stash,
                    pop,
                    namespaces,
                });
            }
            Frame::Control(Control::Decls { config, decls })
        }
        CTL_START => {
            let kind = match r.u8()? {
                0 => RunKind::Forward,
                1 => RunKind::Backward,
                2 => RunKind::Step,
                k => return Err(frame_error(format!("a run kind numbered {k}"))),
            };
            let step = r.u64()?;
            let train = r.u8()? != 0;
            let k = r.count(8)?;
            let sizes = (0..k).map(|_| r.usize()).collect::<Result<_, _>>()?;
            Frame::Control(Control::Start {
                kind,
                step,
                train,
                sizes,
            })
        }
        CTL_ABORT => {
            let rank = r.usize()?;
            let site = match r.u8()? {
                0 => None,
                _ => {
                    let partition = r.usize()?;
                    let layer = match r.u8()? {
                        0 => None,
                        _ => Some((r.usize()?, r.str()?)),
                    };
                    let micro_batch = r.opt()?;
                    let task = task_of(r.u8()?)?;
                    Some(Site {
                        partition,
                        layer,
                        micro_batch,
                        task,
                    })
                }
            };
            let message = r.str()?;
            Frame::Control(Control::Abort {
                rank,
                site,
                message,
            })
        }
        CTL_DONE => Frame::Control(Control::Done),
        k => return Err(frame_error(format!("a frame of kind {k}"))),
    };
    r.end()?;
    if at != payload.len() {
        return Err(frame_error("payload bytes no tensor claims"));
    }
    Ok(out)
}
