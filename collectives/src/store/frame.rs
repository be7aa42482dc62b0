//! Frames on a socket: a 4-byte big-endian length and a payload, read and written
//! against a deadline for the whole frame, never per system call.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::codec::MAX_FRAME;

/// `now + within`, or `None` (no deadline) when that is too far to represent.
pub(super) fn deadline_after(within: Duration) -> Option<Instant> {
    Instant::now().checked_add(within)
}

/// The time left until `deadline` as a socket timeout, or `TimedOut` once it passed.
fn time_left(deadline: Option<Instant>) -> io::Result<Option<Duration>> {
    let Some(deadline) = deadline else {
        return Ok(None);
    };
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    // Zero would mean no timeout at all; a sub-millisecond rest rounds up.
    Ok(Some(left.max(Duration::from_millis(1))))
}

/// Whether an I/O error is a socket timeout (reported as `WouldBlock` on Unix).
pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Fills `buf` by `deadline`, however slowly the peer sends: the socket's timeout is
/// set to the time left before each read. `Ok(false)`: the peer closed the connection
/// before sending anything.
pub(super) fn read_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        stream.set_read_timeout(time_left(deadline)?)?;
        match stream.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads and drops `len` bytes by `deadline`, holding no more than a small buffer.
pub(super) fn discard_by(
    stream: &mut TcpStream,
    mut len: usize,
    deadline: Option<Instant>,
) -> io::Result<()> {
    let mut sink = [0u8; 8192];
    while len > 0 {
        let n = len.min(sink.len());
        if !read_by(stream, &mut sink[..n], deadline)? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        len -= n;
    }
    Ok(())
}

/// Writes one frame, its length then `head` then `tail`, all of it by `deadline`
/// (not per system call: a peer that reads slowly cannot stretch it).
pub(super) fn write_frame(
    stream: &mut TcpStream,
    head: &[u8],
    tail: &[u8],
    deadline: Option<Instant>,
) -> io::Result<()> {
    let len = u32::try_from(head.len() + tail.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut first = Vec::with_capacity(4 + head.len());
    first.extend_from_slice(&len.to_be_bytes());
    first.extend_from_slice(head);
    let mut parts = [IoSlice::new(&first), IoSlice::new(tail)];
    let mut parts = &mut parts[..];
    while !parts.is_empty() {
        stream.set_write_timeout(time_left(deadline)?)?;
        match stream.write_vectored(parts) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a frame could not be read.
pub(super) enum FrameError {
    Io(io::Error),
    TooLarge(usize),
}

/// Reads one frame, all of it by `deadline`; `Ok(None)` when the peer closed the
/// connection between frames.
pub(super) fn read_frame(
    stream: &mut TcpStream,
    deadline: Option<Instant>,
) -> std::result::Result<Option<Vec<u8>>, FrameError> {
    let mut len = [0u8; 4];
    if !read_by(stream, &mut len, deadline).map_err(FrameError::Io)? {
        return Ok(None);
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut payload = zeroed_bytes(len).ok_or_else(|| {
        FrameError::Io(io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("no memory for a frame of {len} bytes"),
        ))
    })?;
    if !read_by(stream, &mut payload, deadline).map_err(FrameError::Io)? && len > 0 {
        return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Some(payload))
}

/// `len` zero bytes for a frame's payload, or `None` when the allocator refuses them (a
/// frame is at most [`MAX_FRAME`] bytes, but memory may still run out): the connection
/// is dropped then, never the process aborted.
pub(super) fn zeroed_bytes(len: usize) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.resize(len, 0);
    Some(v)
}
