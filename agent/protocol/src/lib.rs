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
pub mod error_code;
pub mod frame;
pub mod frame_type;
pub mod messages;
pub mod params;

pub use client::{
    entry_bytes, AgentClient, Duplex, ExecOutput, ExecStatus, ListLimits, Listing, Signaller,
    WriteFileOptions, DEFAULT_OUTPUT_LIMIT, MAX_HELLO,
};
pub use error::{Error, FrameError, ProtocolError};
pub use frame::{encode_frame, read_frame, write_frame, Frame, FrameDecoder};
pub use frame_type::FrameType;
pub use messages::*;
pub use params::{CHUNK_SIZE, DEFAULT_VSOCK_PORT, MAX_FRAME, MAX_PAYLOAD, PROTOCOL_VERSION};
