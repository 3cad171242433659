//! The host side of the vsock socket: accepting host clients, reading their `CONNECT <port>`
//! line, and dropping clients (and host-initiated connections) that wait too long.

use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use vmm_sys_util::epoll::EventSet;

use super::conn::{Key, Pending, State};
use super::consts::{HANDSHAKE_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECT_LINE, MAX_PENDING};
use super::device::{Source, Vsock};

impl Vsock {
    pub(super) fn accept(&mut self) {
        loop {
            let Some(listener) = &self.listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => {
                    if self.pending.len() >= MAX_PENDING
                        || self.conns.len() >= MAX_CONNECTIONS
                        || stream.set_nonblocking(true).is_err()
                    {
                        self.counters.refused += 1;
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    self.sources.insert(fd, Source::Pending);
                    self.ops_todo.push((fd, Some(EventSet::IN)));
                    self.pending.insert(
                        fd,
                        Pending {
                            stream,
                            line: Vec::new(),
                            since: Instant::now(),
                        },
                    );
                    self.arm_timer();
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Out of descriptors or the like: try again on the next event.
                Err(_) => return,
            }
        }
    }

    /// Read a pending client's `CONNECT` line; once complete, start the connection.
    pub(super) fn read_connect_line(&mut self, fd: RawFd) {
        let Some(pending) = self.pending.get_mut(&fd) else {
            return;
        };
        let mut buf = [0u8; MAX_CONNECT_LINE];
        let room = MAX_CONNECT_LINE - pending.line.len();
        let result = pending.stream.read(&mut buf[..room.max(1)]);
        let done = match result {
            Ok(0) => Err(()),
            Ok(n) => {
                pending.line.extend_from_slice(&buf[..n]);
                match pending.line.iter().position(|&b| b == b'\n') {
                    // Anything after the line would be data before the connection exists.
                    Some(end) if end + 1 == pending.line.len() => Ok(Some(end)),
                    Some(_) => Err(()),
                    None if pending.line.len() >= MAX_CONNECT_LINE => Err(()),
                    None => Ok(None),
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                Ok(None)
            }
            Err(_) => Err(()),
        };
        match done {
            Ok(None) => {}
            Err(()) => self.drop_pending(fd),
            Ok(Some(end)) => {
                let port = parse_connect_line(&pending.line[..end]);
                let Some(pending) = self.remove_pending(fd) else {
                    return;
                };
                match port {
                    Some(port) if self.conns.len() < MAX_CONNECTIONS => {
                        self.start_host_connection(pending.stream, port)
                    }
                    _ => {
                        self.counters.refused += 1;
                        self.graveyard.push(pending.stream);
                    }
                }
            }
        }
    }

    fn remove_pending(&mut self, fd: RawFd) -> Option<Pending> {
        let pending = self.pending.remove(&fd)?;
        self.sources.remove(&fd);
        self.ops_todo.push((fd, None));
        Some(pending)
    }

    fn drop_pending(&mut self, fd: RawFd) {
        if let Some(pending) = self.remove_pending(fd) {
            self.graveyard.push(pending.stream);
        }
    }
    /// Drop what waited too long: silent host clients, unanswered requests.
    pub(super) fn expire(&mut self) {
        let late: Vec<RawFd> = self
            .pending
            .iter()
            .filter(|(_, p)| p.since.elapsed() > HANDSHAKE_TIMEOUT)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in late {
            self.drop_pending(fd);
        }
        let late: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.state == State::Connecting && c.since.elapsed() > HANDSHAKE_TIMEOUT)
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            self.close(key, true);
        }
    }
}

/// `CONNECT <port>` (without the newline) to the port.
fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line).ok()?;
    let port = text.strip_prefix("CONNECT ")?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
}
