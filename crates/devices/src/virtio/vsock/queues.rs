//! The guest side of the vsock device: the packets the guest queues on TX, the transport reset
//! on the event queue and the hold after it, filling the guest's RX buffers with control packets
//! and host sockets' data, and the pass of the event loop that works them all through.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::time::Instant;

use event_manager::{EventOps, Events};
use virtio_queue::QueueOwnedT;
use vmm_sys_util::epoll::EventSet;

use super::conn::{credit_bytes, header, Key, State};
use super::consts::{
    BUF_ALLOC, EVENT_TRANSPORT_RESET, EVT, MAX_CONNECTIONS, QUEUE_SIZE, RESET_HOLD_LIMIT, RX, TX,
};
use super::device::Vsock;
use super::packet::*;

impl Vsock {
    fn handle_tx(&mut self, pkt: TxPacket) {
        let hdr = pkt.hdr;
        // Copies of the packed header's fields (references into it would be unaligned).
        let (src_cid, dst_cid, src_port, dst_port) =
            (hdr.src_cid, hdr.dst_cid, hdr.src_port, hdr.dst_port);
        let (type_, op, flags) = (hdr.type_, hdr.op, hdr.flags);
        let (buf_alloc, fwd_cnt) = (hdr.buf_alloc, hdr.fwd_cnt);
        // A guest that claims another CID is spoofing: dropped without a word.
        if src_cid != self.guest_cid {
            self.counters.bad_packets += 1;
            return;
        }
        let key = (dst_port, src_port);
        if dst_cid != HOST_CID || type_ != TYPE_STREAM {
            self.counters.bad_packets += 1;
            if op != OP_RST {
                self.send_rst(key.0, key.1);
            }
            return;
        }
        if op == OP_REQUEST {
            if !self.rx_open() {
                // Answered once the guest has handled the reset: connected now, the reset
                // would kill it on the guest's side without a word to the host.
                if self.held_requests.len() < MAX_CONNECTIONS {
                    self.held_requests.push(hdr);
                } else {
                    self.counters.refused += 1;
                    self.send_rst(key.0, key.1);
                }
                return;
            }
            self.guest_connects(&hdr);
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            if op != OP_RST {
                self.send_rst(key.0, key.1);
            }
            return;
        };
        conn.peer_buf_alloc = buf_alloc;
        conn.peer_fwd_cnt = fwd_cnt;
        match op {
            OP_RESPONSE if conn.state == State::Connecting => {
                conn.state = State::Established;
                let answer = format!("OK {}\n", conn.local_port);
                // A few bytes into a fresh socket's empty buffer: they fit.
                if conn.stream.write_all(answer.as_bytes()).is_err() {
                    self.close(key, true);
                }
            }
            OP_RESPONSE => {
                self.counters.bad_packets += 1;
                self.close(key, true);
            }
            OP_RW if conn.state == State::Established => {
                if conn.pending.len() + pkt.payload.len() > BUF_ALLOC as usize {
                    // More than the credit it was given: the guest is misbehaving.
                    self.counters.bad_packets += 1;
                    self.close(key, true);
                    return;
                }
                conn.pending.extend(pkt.payload.iter());
                self.flush_to_host(key);
            }
            OP_CREDIT_UPDATE => {
                // More room at the guest: its data may flow again.
            }
            OP_CREDIT_REQUEST => self.send_control(key, OP_CREDIT_UPDATE, 0),
            OP_SHUTDOWN => {
                if flags & SHUTDOWN_SEND != 0 {
                    conn.guest_done_sending = true;
                }
                let both = SHUTDOWN_SEND | SHUTDOWN_RCV;
                if flags & both == both {
                    // Nothing more either way: what is pending still goes out, then close.
                    self.flush_to_host(key);
                    self.close(key, true);
                } else {
                    self.flush_to_host(key);
                }
            }
            OP_RST => self.close(key, false),
            _ => {
                self.counters.bad_packets += 1;
                self.close(key, true);
            }
        }
    }

    /// Read and answer every packet the guest queued.
    pub(super) fn process_tx(&mut self) {
        let Some(active) = &mut self.active else {
            return;
        };
        let mem = active.mem.clone();
        let mut packets = Vec::new();
        let mut notify = false;
        // Chains taken this pass, good or bad: at most a queue's worth, then the next turn.
        // (Counting only good packets let a driver with its used ring over its avail ring
        // feed bad chains forever, as the rng device's fuzzer-found spin did.)
        let mut taken = 0usize;
        let mut more = false;
        loop {
            if taken >= usize::from(QUEUE_SIZE) {
                more = true;
                break;
            }
            let chain = match active.queues[TX].iter(&mem) {
                Ok(mut iter) => iter.next(),
                Err(_) => None,
            };
            let Some(chain) = chain else { break };
            taken += 1;
            let head = chain.head_index();
            match parse_tx(&mem, chain) {
                Ok(pkt) => packets.push(pkt),
                Err(_) => self.counters.bad_packets += 1,
            }
            // Every TX descriptor is given back at once: none is ever in flight.
            match crate::virtio::complete(&mut active.queues[TX], &mem, head, 0) {
                Ok(needs) => notify |= needs,
                Err(_) => break,
            }
        }
        if notify {
            let _ = active.interrupt.signal_used_queue();
        }
        // The bound above also keeps a guest that keeps the queue full from starving RX.
        for pkt in packets {
            self.handle_tx(pkt);
        }
        if more {
            // Come back for the rest once RX has had its turn.
            let _ = self.queue_events[TX].write(1);
        }
    }

    /// Send the transport reset if one is due and the guest gave an event buffer.
    fn process_event_queue(&mut self) {
        if !self.reset_pending {
            return;
        }
        let Some(active) = &mut self.active else {
            return;
        };
        let mem = active.mem.clone();
        let chain = match active.queues[EVT].iter(&mem) {
            Ok(mut iter) => iter.next(),
            Err(_) => None,
        };
        let Some(chain) = chain else {
            return;
        };
        let head = chain.head_index();
        let written = chain
            .writer(&mem)
            .ok()
            .and_then(|mut w| w.write_obj(EVENT_TRANSPORT_RESET.to_le()).ok().map(|()| 4))
            .unwrap_or(0);
        if let Ok(true) = crate::virtio::complete(&mut active.queues[EVT], &mem, head, written) {
            let _ = active.interrupt.signal_used_queue();
        }
        self.reset_pending = false;
        self.hold_avail = self.event_avail().unwrap_or(0);
        self.reset_hold = Some(Instant::now());
        self.counters.resets_sent += 1;
        self.arm_timer();
    }

    /// Whether new packets may go to the guest (not while it handles a reset).
    fn rx_open(&mut self) -> bool {
        match self.reset_hold {
            Some(since) if since.elapsed() < RESET_HOLD_LIMIT && !self.reset_handled() => false,
            // Handled, or a guest that does not refill its event queue: go on.
            Some(_) => {
                self.end_hold();
                true
            }
            None => !self.reset_pending,
        }
    }

    /// The event queue's available index (what the guest has posted so far).
    fn event_avail(&self) -> Option<u16> {
        use virtio_queue::QueueT;
        let active = self.active.as_ref()?;
        active.queues[EVT]
            .avail_idx(&active.mem, std::sync::atomic::Ordering::Acquire)
            .ok()
            .map(|idx| idx.0)
    }

    /// Whether the guest posted an event buffer since the reset was sent.
    fn reset_handled(&self) -> bool {
        self.event_avail()
            .is_some_and(|avail| avail != self.hold_avail)
    }

    fn end_hold(&mut self) {
        self.reset_hold = None;
        for hdr in std::mem::take(&mut self.held_requests) {
            self.guest_connects(&hdr);
        }
    }

    /// Fill the guest's RX buffers: control packets first, then data from host sockets in
    /// turn, each within the guest's credit.
    fn process_rx(&mut self) {
        if self.active.is_none() || !self.rx_open() {
            return;
        }
        // Host sockets that became readable join the round.
        let keys: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.readable && c.state == State::Established)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            if !self.ready.contains(&key) {
                self.ready.push_back(key);
            }
        }
        let mut notify = false;
        let mut buf = vec![0u8; MAX_PAYLOAD];
        let guest_cid = self.guest_cid;
        self.rx_starved = false;
        loop {
            if self.control.is_empty() && self.ready.is_empty() {
                break;
            }
            let Some(active) = &mut self.active else {
                break;
            };
            let mem = active.mem.clone();
            let mut iter = match active.queues[RX].iter(&mem) {
                Ok(iter) => iter,
                Err(_) => break,
            };
            let Some(chain) = iter.next() else {
                self.rx_starved = true;
                break;
            };
            let room = rx_room(&mem, &chain);
            let head = chain.head_index();
            let written = if let Some(hdr) = self.control.front().copied() {
                match write_rx(&mem, chain, &hdr, &[]) {
                    Some(n) => {
                        self.control.pop_front();
                        Some(n)
                    }
                    // A buffer too small for a header: the driver's bug; give it back empty.
                    None => Some(0),
                }
            } else {
                let key = self.ready.pop_front().expect("checked non-empty");
                match self.conns.get_mut(&key) {
                    Some(conn) if conn.state == State::Established => {
                        let want = room.min(conn.peer_credit() as usize);
                        if want == 0 {
                            // No credit (or no room): wait for the guest's credit update.
                            iter.go_to_previous_position();
                            continue;
                        }
                        match conn.stream.read(&mut buf[..want]) {
                            Ok(0) => {
                                // EOF: the guest hears SHUTDOWN (it will send no more to us
                                // either way once it closes).
                                conn.readable = false;
                                conn.host_eof = true;
                                iter.go_to_previous_position();
                                self.send_control(key, OP_SHUTDOWN, SHUTDOWN_SEND | SHUTDOWN_RCV);
                                continue;
                            }
                            Ok(n) => {
                                let mut hdr = header(guest_cid, key.0, key.1, OP_RW);
                                hdr.len = credit_bytes(n);
                                hdr.fwd_cnt = conn.fwd_cnt;
                                conn.fwd_cnt_told = conn.fwd_cnt;
                                conn.tx_cnt = conn.tx_cnt.wrapping_add(credit_bytes(n));
                                // More may be there: stay in the round.
                                self.ready.push_back(key);
                                Some(write_rx(&mem, chain, &hdr, &buf[..n]).unwrap_or(0))
                            }
                            Err(e)
                                if e.kind() == ErrorKind::WouldBlock
                                    || e.kind() == ErrorKind::Interrupted =>
                            {
                                conn.readable = false;
                                iter.go_to_previous_position();
                                continue;
                            }
                            Err(_) => {
                                iter.go_to_previous_position();
                                self.close(key, true);
                                continue;
                            }
                        }
                    }
                    _ => {
                        iter.go_to_previous_position();
                        continue;
                    }
                }
            };
            let Some(active) = &mut self.active else {
                break;
            };
            match crate::virtio::complete(
                &mut active.queues[RX],
                &mem,
                head,
                credit_bytes(written.unwrap_or(0)),
            ) {
                Ok(needs) => notify |= needs,
                Err(_) => break,
            }
        }
        if notify {
            if let Some(active) = &self.active {
                let _ = active.interrupt.signal_used_queue();
            }
        }
    }
    /// Work everything through, then bring the event loop's interest up to date.
    pub(super) fn run(&mut self, ops: &mut EventOps) {
        self.process_event_queue();
        self.process_tx();
        self.process_rx();
        self.disarm_timer_if_idle();
        self.sync_interest(ops);
    }

    fn sync_interest(&mut self, ops: &mut EventOps) {
        let rx_open = !self.rx_starved && self.reset_hold.is_none() && !self.reset_pending;
        for (fd, want) in self.ops_todo.drain(..) {
            match want {
                Some(set) => {
                    let _ = ops.add(Events::new_raw(fd, set));
                }
                None => {
                    let _ = ops.remove(Events::new_raw(fd, EventSet::empty()));
                }
            }
        }
        // Closed streams can go now that epoll no longer watches them.
        self.graveyard.clear();
        for conn in self.conns.values_mut() {
            let want = conn.want(rx_open);
            if want != conn.interest
                && ops
                    .modify(Events::new_raw(conn.stream.as_raw_fd(), want))
                    .is_ok()
            {
                conn.interest = want;
            }
        }
    }
}
