//! The vsock device's fixed numbers: its virtio id and queues, the receive room it gives each
//! connection, how many connections and waiting host clients it takes, and its timeouts.

use std::time::Duration;

/// `VIRTIO_ID_VSOCK`.
pub const VIRTIO_ID_VSOCK: u32 = 19;
pub(super) const RX: usize = 0;
pub(super) const TX: usize = 1;
pub(super) const EVT: usize = 2;
pub(super) const QUEUE_SIZE: u16 = 256;
/// Receive room mayfly advertises per connection: what the guest may send before mayfly has
/// passed it on to the host socket.
pub const BUF_ALLOC: u32 = 256 << 10;
/// Connections at once; past this a new one is refused (RST).
pub const MAX_CONNECTIONS: usize = 1024;
/// Host clients that connected but have not sent their `CONNECT` line yet.
pub(super) const MAX_PENDING: usize = 256;
/// The longest `CONNECT <port>\n` line.
pub(super) const MAX_CONNECT_LINE: usize = 64;
/// How long a host client may take to send its `CONNECT` line, and the guest to answer it (the
/// device then closes the connection).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// After a transport reset: how long new connections wait for the guest to handle it.
pub const RESET_HOLD_LIMIT: Duration = Duration::from_secs(5);
/// First host-side port of host-initiated connections.
pub(super) const FIRST_LOCAL_PORT: u32 = 1 << 30;
/// virtio_vsock_event id.
pub(super) const EVENT_TRANSPORT_RESET: u32 = 0;
