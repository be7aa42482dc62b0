//! A pipe's stages on ranks: where each stage runs ([`Ranks`]), and how a worker's
//! messages to a stage on another rank become frames on the [`Transport`] and back (the
//! receiving side of a run is `receiver.rs`).
//!
//! Every run is framed the same way on every stream between two ranks: the data frames
//! of the run, possibly one `Abort`, then one `Done`. Each rank sends `Done` to every peer
//! when its workers have ended (after a failure too) and waits for every peer's `Done`
//! before the run returns, so the streams stay aligned from one run to the next and no
//! thread outlives the run. A failure on one rank reaches the others as an `Abort` at
//! once (not at the end), and stops their workers as a local failure does.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::frame::{self, Control, Frame};
use crate::message::Msg;
use crate::transport::Transport;
use crate::vocab::Device;
use crate::wire::Wire;

/// Encodes a worker's message as a frame, in a buffer from the transport.
pub(crate) type Encode<T> = fn(&Msg<T>, &dyn Transport) -> Result<Vec<u8>, Error>;
/// Decodes a frame; tensors land on the device the closure gives for their stage.
pub(crate) type Decode<T> =
    fn(&[u8], &dyn Fn(usize) -> Result<Device, Error>) -> Result<Frame<T>, Error>;

/// Where the stages of a pipe run, and the transport between them.
pub(crate) struct Ranks<T> {
    pub transport: Arc<dyn Transport>,
    /// `stage_rank[j]`: the rank that runs stage `j`.
    pub stage_rank: Vec<usize>,
    encode: Encode<T>,
    decode: Decode<T>,
}

fn encode_dyn<T: Wire>(msg: &Msg<T>, transport: &dyn Transport) -> Result<Vec<u8>, Error> {
    frame::encode_msg(msg, transport.buffer(msg_bytes(msg)))
}

fn decode_dyn<T: Wire>(
    bytes: &[u8],
    device_of: &dyn Fn(usize) -> Result<Device, Error>,
) -> Result<Frame<T>, Error> {
    frame::decode(bytes, device_of)
}

impl<T: Wire> Ranks<T> {
    /// The stages of `stage_rank` over `transport`, for a tensor type that crosses ranks.
    pub fn new(transport: Arc<dyn Transport>, stage_rank: Vec<usize>) -> Self {
        Ranks {
            transport,
            stage_rank,
            encode: encode_dyn::<T>,
            decode: decode_dyn::<T>,
        }
    }
}

impl<T> Ranks<T> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Whether stage `stage` runs on this rank.
    pub fn is_local(&self, stage: usize) -> bool {
        self.stage_rank.get(stage) == Some(&self.rank())
    }

    /// The other ranks that run stages, in order.
    pub fn peers(&self) -> Vec<usize> {
        let me = self.rank();
        let mut peers: Vec<usize> = self
            .stage_rank
            .iter()
            .copied()
            .filter(|&r| r != me)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    fn transport_error(&self, peer: usize, source: crate::transport::TransportError) -> Error {
        Error::Transport {
            rank: self.rank(),
            peer,
            source,
        }
    }

    /// Sends a worker's message to the rank of its stage.
    pub fn send_msg(&self, stage: usize, msg: &Msg<T>) -> Result<(), Error> {
        let to = self.stage_rank[stage];
        let frame = (self.encode)(msg, &*self.transport)?;
        self.transport
            .send(to, frame)
            .map_err(|e| self.transport_error(to, e))
    }

    /// Sends a control frame to `to`.
    pub fn send_control(&self, to: usize, control: &Control) -> Result<(), Error> {
        let frame = frame::encode_control(control)?;
        self.transport
            .send(to, frame)
            .map_err(|e| self.transport_error(to, e))
    }

    /// The next frame from `from`, its tensors on `device_of(stage)`.
    pub fn recv(
        &self,
        from: usize,
        timeout: Duration,
        device_of: &dyn Fn(usize) -> Result<Device, Error>,
    ) -> Result<Frame<T>, Error> {
        let bytes = self
            .transport
            .recv(from, timeout)
            .map_err(|e| self.transport_error(from, e))?;
        let frame = (self.decode)(&bytes, device_of);
        self.transport.recycle(bytes);
        frame
    }

    /// The next frame from `from`, which must be a control frame.
    pub fn recv_control(&self, from: usize, timeout: Duration) -> Result<Control, Error> {
        match self.recv(from, timeout, &|_| Ok(Device::Cpu))? {
            Frame::Control(c) => Ok(c),
            Frame::Msg(_) => Err(Error::Frame(format!(
                "rank {from} sent a worker's message where a control frame was due"
            ))),
        }
    }

    /// Tells every peer that this rank failed with `error` (best effort: a peer that is
    /// gone learns nothing, and its own failure reaches this rank).
    pub fn abort_peers(&self, error: &Error) {
        let abort = Control::Abort {
            rank: self.rank(),
            site: error.site().cloned(),
            message: error.to_string(),
        };
        for peer in self.peers() {
            let _ = self.send_control(peer, &abort);
        }
    }
}

/// About how many bytes `msg`'s frame takes: its tensors' storage and room for the
/// header (a capacity hint; the frame grows if it needs more).
fn msg_bytes<T: crate::tensor::Tensor>(msg: &Msg<T>) -> usize {
    let tensors = match msg {
        Msg::Activation { batch, .. } | Msg::Gradient { batch, .. } => batch.size_bytes(),
        Msg::Skip { value: t, .. } | Msg::SkipGrad { grad: t, .. } => {
            t.as_ref().map_or(0, crate::tensor::Tensor::size_bytes)
        }
        Msg::Abort => 0,
    };
    tensors + 256
}
