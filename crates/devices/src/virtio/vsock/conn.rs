//! One connection as the device keeps it: its state, the credit figures both sides count, the
//! guest's data not yet written to its host socket; a host client still to send its `CONNECT`
//! line; and the header of a packet from the host to the guest.

use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use vmm_sys_util::epoll::EventSet;

use super::consts::BUF_ALLOC;
use super::packet::*;

/// Per connection: (host port, guest port).
pub(super) type Key = (u32, u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// Host-initiated: REQUEST sent (or waiting to be), no answer yet.
    Connecting,
    Established,
}

pub(super) struct Conn {
    pub(super) stream: UnixStream,
    pub(super) state: State,
    pub(super) local_port: u32,
    pub(super) since: Instant,
    /// Credit the guest gave: its buffer and how much of what we sent it has consumed.
    pub(super) peer_buf_alloc: u32,
    pub(super) peer_fwd_cnt: u32,
    /// Bytes sent to the guest (wrapping).
    pub(super) tx_cnt: u32,
    /// Bytes of the guest's data written to the host socket (wrapping).
    pub(super) fwd_cnt: u32,
    /// `fwd_cnt` as the guest last heard it.
    pub(super) fwd_cnt_told: u32,
    /// Guest data the host socket did not take yet (at most BUF_ALLOC).
    pub(super) pending: VecDeque<u8>,
    /// The host socket has data (or EOF) to read.
    pub(super) readable: bool,
    /// The host socket reached EOF: the guest was told SHUTDOWN.
    pub(super) host_eof: bool,
    /// The guest will send no more (SHUTDOWN SEND): the host socket's write side is shut once
    /// `pending` is written.
    pub(super) guest_done_sending: bool,
    /// The epoll interest registered for `stream`.
    pub(super) interest: EventSet,
}

impl Conn {
    pub(super) fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    pub(super) fn want(&self, rx_open: bool) -> EventSet {
        let mut set = EventSet::empty();
        if self.state == State::Established
            && rx_open
            && !self.host_eof
            && !self.readable
            && self.peer_credit() > 0
        {
            set |= EventSet::IN;
        }
        if !self.pending.is_empty() {
            set |= EventSet::OUT;
        }
        set
    }
}

/// A host client that has not sent its `CONNECT` line yet.
pub(super) struct Pending {
    pub(super) stream: UnixStream,
    pub(super) line: Vec<u8>,
    pub(super) since: Instant,
}

/// A packet header from the host to the guest.
pub(super) fn header(guest_cid: u64, local_port: u32, peer_port: u32, op: u16) -> Header {
    Header {
        src_cid: HOST_CID,
        dst_cid: guest_cid,
        src_port: local_port,
        dst_port: peer_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: BUF_ALLOC,
        fwd_cnt: 0,
    }
}

/// A count of bytes moved in one packet or one write (at most [`BUF_ALLOC`] or a packet's
/// payload) as the u32 virtio-vsock counts in; its counters wrap by design.
pub(super) fn credit_bytes(n: usize) -> u32 {
    u32::try_from(n).expect("at most one buffer's worth")
}
