//! The wire protocol between mayfly (the host) and `mayfly-agent` (inside the guest).
//!
//! Both ends link this crate, so the message types here *are* the protocol; `PROTOCOL.md`
//! beside the agent describes the same thing for clients written in other languages.
//!
//! Layers, bottom up:
//! - [`frame`]: length-prefixed frames (`read_frame`, `write_frame`, and the incremental
//!   [`FrameDecoder`] for non-blocking readers). Every length is checked before it is used.
//! - [`messages`]: the typed payloads ([`Message`], [`Request`] and the per-op replies).
//! - [`client`]: a blocking [`AgentClient`] for the host, over any connected stream.
//!
//! A session is one operation per connection: the agent sends HELLO, the host sends one
//! REQUEST, the agent answers and closes.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

pub mod base64;
pub mod client;
pub mod error;
pub mod frame;
pub mod messages;

pub use client::{AgentClient, Duplex, ExecOutput, Signaller, WriteFileOptions};
pub use error::{Error, FrameError, ProtocolError};
pub use frame::{
    encode_frame, read_frame, read_message, write_frame, write_message, Frame, FrameDecoder,
    FrameType,
};
pub use messages::*;

/// The protocol's version. A new optional field keeps it; a changed meaning bumps it.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest frame length (the 4-byte prefix's value): a type byte plus 1 MiB of payload.
pub const MAX_FRAME: usize = 1024 * 1024 + 1;

/// The largest payload a frame can carry.
pub const MAX_PAYLOAD: usize = MAX_FRAME - 1;

/// How much output or file data one STDOUT, STDERR or DATA frame carries at most.
pub const CHUNK_SIZE: usize = 64 * 1024;

/// The vsock port the agent listens on unless told otherwise.
pub const DEFAULT_VSOCK_PORT: u32 = 52;
