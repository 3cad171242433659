//! Frames: a 4-byte big-endian length L, then L bytes: the type byte and the payload.
//! `1 <= L <= MAX_FRAME`. Readers check the length before they allocate or read anything
//! else, so a hostile peer can make us hold at most one `MAX_FRAME` buffer.

use std::io::{self, Read, Write};

use crate::error::{FrameError, ProtocolError};
use crate::frame_type::FrameType;
use crate::params::MAX_FRAME;

/// One frame: its type and its raw payload (JSON text or bytes, depending on the type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameType,
    pub payload: Vec<u8>,
}

/// Checks a length prefix: the one place that decides whether a length is acceptable.
fn check_length(len: u32) -> Result<usize, ProtocolError> {
    let len = len as usize;
    if len == 0 {
        Err(ProtocolError::EmptyFrame)
    } else if len > MAX_FRAME {
        Err(ProtocolError::FrameTooLarge(len as u64))
    } else {
        Ok(len)
    }
}

fn check_type(byte: u8) -> Result<FrameType, ProtocolError> {
    FrameType::from_byte(byte).ok_or(ProtocolError::UnknownType(byte))
}

/// The bytes of one frame, ready to be written in one piece (so that writers sharing a
/// stream under a lock never interleave parts of frames).
pub fn encode_frame(kind: FrameType, payload: &[u8]) -> Result<Vec<u8>, ProtocolError> {
    if payload.len() > MAX_FRAME - 1 {
        return Err(ProtocolError::PayloadTooLarge {
            frame: kind,
            len: payload.len(),
        });
    }
    // At most MAX_FRAME (checked above), which fits the u32 length field.
    let len = u32::try_from(payload.len() + 1).expect("a frame length within MAX_FRAME");
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.push(kind.as_byte());
    buf.extend_from_slice(payload);
    Ok(buf)
}

/// Writes one frame.
pub fn write_frame<W: Write + ?Sized>(
    w: &mut W,
    kind: FrameType,
    payload: &[u8],
) -> Result<(), FrameError> {
    let buf = encode_frame(kind, payload)?;
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame. `Ok(None)` means the stream ended cleanly at a frame boundary; an end
/// anywhere else is [`ProtocolError::Truncated`].
pub fn read_frame<R: Read + ?Sized>(r: &mut R) -> Result<Option<Frame>, FrameError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(ProtocolError::Truncated.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = check_length(u32::from_be_bytes(header))?;
    let mut kind = [0u8; 1];
    read_exact_or_truncated(r, &mut kind)?;
    let kind = check_type(kind[0])?;
    let payload = read_payload(r, len - 1)?;
    Ok(Some(Frame { kind, payload }))
}

/// How far ahead of the bytes received a payload buffer grows.
const PAYLOAD_STEP: usize = 64 * 1024;

/// Reads a payload of exactly `len` bytes (at most `MAX_FRAME - 1`: checked by the caller),
/// growing its buffer as the bytes arrive: a peer that announces a full frame and then stalls
/// makes the reader hold what it sent (plus one step), not what it announced.
fn read_payload<R: Read + ?Sized>(r: &mut R, len: usize) -> Result<Vec<u8>, FrameError> {
    let mut payload = Vec::with_capacity(len.min(PAYLOAD_STEP));
    while payload.len() < len {
        let start = payload.len();
        payload.resize(start + (len - start).min(PAYLOAD_STEP), 0);
        read_exact_or_truncated(r, &mut payload[start..])?;
    }
    Ok(payload)
}

fn read_exact_or_truncated<R: Read + ?Sized>(r: &mut R, buf: &mut [u8]) -> Result<(), FrameError> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Protocol(ProtocolError::Truncated)
        } else {
            FrameError::Io(e)
        }
    })
}

/// An incremental decoder for readers that cannot block (an event loop): push whatever bytes
/// arrived, then take complete frames out. Bad lengths and types are reported as soon as
/// the header is in, before the payload arrives.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes. The caller bounds how much it pushes between calls to
    /// [`FrameDecoder::next_frame`]; the decoder itself never holds more than one frame
    /// plus that.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ProtocolError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = check_length(u32::from_be_bytes([
            self.buf[0],
            self.buf[1],
            self.buf[2],
            self.buf[3],
        ]))?;
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let kind = check_type(self.buf[4])?;
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let payload = self.buf[5..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(Frame { kind, payload }))
    }

    /// Whether the stream may end here: no partial frame is buffered.
    pub fn at_boundary(&self) -> bool {
        self.buf.is_empty()
    }
}
