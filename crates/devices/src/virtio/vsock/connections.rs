//! The device's connections: opening them (a host client's `CONNECT`, a guest's request), the
//! control packets about them, the guest's data written on to their host sockets, and closing
//! them.

use std::collections::VecDeque;
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use vmm_sys_util::epoll::EventSet;

use super::conn::{credit_bytes, header, Conn, Key, State};
use super::consts::{BUF_ALLOC, FIRST_LOCAL_PORT, MAX_CONNECTIONS};
use super::device::{Source, Vsock};
use super::packet::*;

impl Vsock {
    fn header(&self, local_port: u32, peer_port: u32, op: u16) -> Header {
        header(self.guest_cid, local_port, peer_port, op)
    }

    /// Queue a control packet about a connection (with its credit figures).
    pub(super) fn send_control(&mut self, key: Key, op: u16, flags: u32) {
        let mut hdr = self.header(key.0, key.1, op);
        hdr.flags = flags;
        if let Some(conn) = self.conns.get_mut(&key) {
            hdr.fwd_cnt = conn.fwd_cnt;
            conn.fwd_cnt_told = conn.fwd_cnt;
        }
        self.control.push_back(hdr);
    }

    /// Refuse or end a connection the device has no (more) state for.
    pub(super) fn send_rst(&mut self, local_port: u32, peer_port: u32) {
        self.control
            .push_back(self.header(local_port, peer_port, OP_RST));
    }

    /// Forget a connection: its host socket closes, the guest gets RST if `tell_guest`.
    pub(super) fn close(&mut self, key: Key, tell_guest: bool) {
        if let Some(conn) = self.conns.remove(&key) {
            let fd = conn.stream.as_raw_fd();
            self.sources.remove(&fd);
            self.ops_todo.push((fd, None));
            // The fd is removed from epoll before it is closed (when `conn` drops after the
            // removal is applied): keep the stream alive until then.
            self.graveyard.push(conn.stream);
            if tell_guest {
                self.send_rst(key.0, key.1);
            }
        }
        self.ready.retain(|k| *k != key);
    }

    fn allocate_local_port(&mut self) -> u32 {
        loop {
            let port = self.next_local_port;
            self.next_local_port = self.next_local_port.wrapping_add(1).max(FIRST_LOCAL_PORT);
            if !self.conns.keys().any(|k| k.0 == port) {
                return port;
            }
        }
    }

    pub(super) fn start_host_connection(&mut self, stream: UnixStream, peer_port: u32) {
        let local_port = self.allocate_local_port();
        let key = (local_port, peer_port);
        let fd = stream.as_raw_fd();
        self.sources.insert(fd, Source::Conn(key));
        self.ops_todo.push((fd, Some(EventSet::empty())));
        self.conns.insert(
            key,
            Conn {
                stream,
                state: State::Connecting,
                local_port,
                since: Instant::now(),
                peer_buf_alloc: 0,
                peer_fwd_cnt: 0,
                tx_cnt: 0,
                fwd_cnt: 0,
                fwd_cnt_told: 0,
                pending: VecDeque::new(),
                readable: false,
                host_eof: false,
                guest_done_sending: false,
                interest: EventSet::empty(),
            },
        );
        self.send_control(key, OP_REQUEST, 0);
        self.arm_timer();
    }

    /// The guest connects to host port `local_port`: reach `<path>_<port>`.
    pub(super) fn guest_connects(&mut self, hdr: &Header) {
        let (dst_port, src_port) = (hdr.dst_port, hdr.src_port);
        let (buf_alloc, fwd_cnt) = (hdr.buf_alloc, hdr.fwd_cnt);
        let key = (dst_port, src_port);
        if self.conns.contains_key(&key) || self.conns.len() >= MAX_CONNECTIONS {
            self.counters.refused += 1;
            self.send_rst(key.0, key.1);
            return;
        }
        let Some(path) = &self.path else {
            self.counters.refused += 1;
            self.send_rst(key.0, key.1);
            return;
        };
        let mut target = path.as_os_str().to_owned();
        target.push(format!("_{dst_port}"));
        let stream = match UnixStream::connect(&target) {
            Ok(stream) if stream.set_nonblocking(true).is_ok() => stream,
            _ => {
                self.counters.refused += 1;
                self.send_rst(key.0, key.1);
                return;
            }
        };
        let fd = stream.as_raw_fd();
        self.sources.insert(fd, Source::Conn(key));
        self.ops_todo.push((fd, Some(EventSet::empty())));
        self.conns.insert(
            key,
            Conn {
                stream,
                state: State::Established,
                local_port: key.0,
                since: Instant::now(),
                peer_buf_alloc: buf_alloc,
                peer_fwd_cnt: fwd_cnt,
                tx_cnt: 0,
                fwd_cnt: 0,
                fwd_cnt_told: 0,
                pending: VecDeque::new(),
                readable: false,
                host_eof: false,
                guest_done_sending: false,
                interest: EventSet::empty(),
            },
        );
        self.send_control(key, OP_RESPONSE, 0);
    }

    /// Write what the guest sent to the host socket; keep what does not fit (bounded by the
    /// credit the guest was given).
    pub(super) fn flush_to_host(&mut self, key: Key) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        while !conn.pending.is_empty() {
            let (front, _) = conn.pending.as_slices();
            match conn.stream.write(front) {
                Ok(0) => break,
                Ok(n) => {
                    conn.pending.drain(..n);
                    conn.fwd_cnt = conn.fwd_cnt.wrapping_add(credit_bytes(n));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    // The host side is gone.
                    self.close(key, true);
                    return;
                }
            }
        }
        if conn.pending.is_empty() && conn.guest_done_sending {
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
        // Tell the guest about freed room before it runs out.
        if conn.fwd_cnt.wrapping_sub(conn.fwd_cnt_told) >= BUF_ALLOC / 4 {
            self.send_control(key, OP_CREDIT_UPDATE, 0);
        }
    }
}
