//! The receiving side of a run on ranks: one thread per peer rank files what arrives in
//! the local workers' inboxes until that peer's `Done` (see `ranks.rs` for how every run
//! is framed).

use std::time::Duration;

use crate::error::Error;
use crate::frame::{Control, Frame};
use crate::message::Msg;
use crate::protocol::Shared;
use crate::ranks::Ranks;
use crate::schedule::Schedule;
use crate::vocab::Device;

/// The receiving side of a run for the frames of `peer`: files each message in the inbox
/// of the local worker of its stage, records a peer's failure (which stops the local
/// workers), and returns at the peer's `Done`. A transport failure or a frame that does
/// not belong is this rank's failure, and ends the stream.
pub(crate) fn receive_from<T>(
    ranks: &Ranks<T>,
    peer: usize,
    shared: &Shared<T>,
    schedule: &Schedule,
    devices: &[Device],
    timeout: Duration,
) {
    let device_of = |stage: usize| -> Result<Device, Error> {
        if ranks.is_local(stage) {
            Ok(devices[stage])
        } else {
            Err(Error::Frame(format!(
                "rank {peer} sent data for stage {stage}, which does not run on rank {}",
                ranks.rank()
            )))
        }
    };
    loop {
        let frame = match ranks.recv(peer, timeout, &device_of) {
            Ok(frame) => frame,
            Err(e) => {
                shared.fail(e);
                return;
            }
        };
        match frame {
            Frame::Msg(msg) => {
                let stage = match &msg {
                    Msg::Activation { stage, .. }
                    | Msg::Gradient { stage, .. }
                    | Msg::Skip { stage, .. }
                    | Msg::SkipGrad { stage, .. } => *stage,
                    Msg::Abort => continue,
                };
                if let Some(w) = schedule.worker_of(stage) {
                    // A worker that has returned has dropped its inbox: the run is ending.
                    let _ = shared.senders[w].send(msg);
                }
            }
            Frame::Control(Control::Abort {
                rank,
                site,
                message,
            }) => shared.fail(Error::Remote {
                rank,
                site,
                message,
            }),
            Frame::Control(Control::Done) => return,
            Frame::Control(other) => {
                shared.fail(Error::Frame(format!(
                    "rank {peer} sent {other:?} in the middle of a run"
                )));
                return;
            }
        }
    }
}
