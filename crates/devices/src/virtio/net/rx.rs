//! RX, the tap's frames to the guest: one frame read into mayfly's buffer, then copied into
//! as many of the guest's buffers as it takes (see the parent module's docs for the rules).

use super::*;

impl Net {
    /// Deliver frames from the tap, at most [`RX_BUDGET`] of them.
    pub(super) fn process_rx(&mut self) {
        let Some(mut active) = self.active.take() else {
            return;
        };
        let mut notify = false;
        for _ in 0..RX_BUDGET {
            if self.rx_pending == 0 {
                // Read the tap only with a buffer to put the frame in.
                if !has_avail(&mut active.queues[RX], &active.mem) {
                    self.rx_starved = true;
                    break;
                }
                match self.backend.read(&mut self.rx_buf) {
                    // A socket backend whose peer is gone.
                    Ok(0) => break,
                    Ok(n) if n < VNET_HDR_LEN + MIN_FRAME_LEN => {
                        self.counters.rx_dropped += 1;
                        continue;
                    }
                    Ok(n) => self.rx_pending = n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    // WouldBlock: nothing more now. Anything else (the tap went away): the
                    // next readiness event says so again.
                    Err(_) => break,
                }
            }
            match self.deliver(&mut active) {
                Ok(needs) => {
                    notify |= needs;
                    self.counters.rx_frames += 1;
                    self.counters.rx_bytes += (self.rx_pending - VNET_HDR_LEN) as u64;
                    self.rx_pending = 0;
                }
                Err(Deliver::NoRoom) => {
                    self.rx_starved = true;
                    break;
                }
                Err(Deliver::Dropped(needs)) => {
                    notify |= needs;
                    self.counters.rx_dropped += 1;
                    self.rx_pending = 0;
                }
                Err(Deliver::Broken) => break,
            }
        }
        if notify {
            let _ = active.interrupt.signal_used_queue();
        }
        self.active = Some(active);
    }

    /// Copy the pending frame into the guest's RX buffers.
    fn deliver(&mut self, active: &mut Active) -> Result<bool, Deliver> {
        let Active { mem, queues, .. } = active;
        let queue = &mut queues[RX];
        let frame = &self.rx_buf[..self.rx_pending];
        let mergeable = self.acked_features & bit(VIRTIO_NET_F_MRG_RXBUF) != 0;
        let start = queue.next_avail();
        self.rx_used.clear();
        let mut written = 0usize;
        // Where bytes 10 and 11 of the header (num_buffers) went.
        let mut num_buffers_at = [None::<GuestAddress>; 2];
        let mut malformed = false;
        let mut rechecked = false;
        while written < frame.len() {
            if !mergeable && !self.rx_used.is_empty() {
                // One buffer per frame, and this one did not fit: drop the frame and leave the
                // buffer to the next one.
                queue.set_next_avail(start);
                return Err(Deliver::Dropped(false));
            }
            let chain = match queue.iter(&*mem) {
                Ok(mut iter) => iter.next(),
                Err(_) => {
                    queue.set_next_avail(start);
                    return Err(Deliver::Broken);
                }
            };
            let Some(chain) = chain else {
                // Not enough buffers yet. Ask to be told of more (the driver's notification
                // threshold is what was taken so far), unless more arrived meanwhile: once
                // (see the TX side: overlapping rings would make this spin).
                match queue.enable_notification(&*mem) {
                    Ok(true) if !rechecked => {
                        rechecked = true;
                        continue;
                    }
                    _ => {
                        // Put back what was taken; the frame waits for more buffers.
                        queue.set_next_avail(start);
                        return Err(Deliver::NoRoom);
                    }
                }
            };
            rechecked = false;
            let head = chain.head_index();
            if head >= queue.size() {
                // A head beyond the table: nothing to write into or give back.
                self.counters.rx_malformed += 1;
                continue;
            }
            let mut chain_written = 0u32;
            let mut last_next = true;
            let mut any = false;
            for desc in chain {
                any = true;
                last_next = desc.has_next();
                if !desc.is_write_only() {
                    malformed = true;
                    break;
                }
                let take = (desc.len() as usize).min(frame.len() - written);
                if take == 0 {
                    continue;
                }
                if mem
                    .write_slice(&frame[written..written + take], desc.addr())
                    .is_err()
                {
                    malformed = true;
                    break;
                }
                for (i, at) in num_buffers_at.iter_mut().enumerate() {
                    let index = 10 + i;
                    if at.is_none() && (written..written + take).contains(&index) {
                        *at = desc.addr().checked_add((index - written) as u64);
                    }
                }
                written += take;
                // At most the descriptor's own (u32) length.
                chain_written += u32::try_from(take).expect("a piece of one descriptor");
            }
            if !any || last_next {
                // The chain ended early (a loop, a `next` past the table): it is broken.
                malformed = true;
            }
            self.rx_used.push((head, chain_written));
            if malformed {
                break;
            }
        }
        if malformed {
            // Give back every chain taken for this frame, empty, and drop the frame: the
            // driver counts each as a length error.
            self.counters.rx_malformed += 1;
            let mut needs = false;
            for &(head, _) in &self.rx_used {
                match complete(queue, mem, head, 0) {
                    Ok(n) => needs |= n,
                    Err(_) => return Err(Deliver::Broken),
                }
            }
            return Err(Deliver::Dropped(needs));
        }
        // At most a queue's worth of buffers.
        let count = u16::try_from(self.rx_used.len())
            .unwrap_or(u16::MAX)
            .to_le_bytes();
        for (at, byte) in num_buffers_at.iter().zip(count) {
            if let Some(at) = at {
                let _ = mem.write_obj(byte, *at);
            }
        }
        let mut needs = false;
        for &(head, len) in &self.rx_used {
            match complete(queue, mem, head, len) {
                Ok(n) => needs |= n,
                Err(_) => return Err(Deliver::Broken),
            }
        }
        Ok(needs)
    }
}

enum Deliver {
    /// The guest has not posted enough buffers for this frame.
    NoRoom,
    /// The frame was dropped; whether the guest should be interrupted.
    Dropped(bool),
    /// The queue cannot be used (its rings are not where they can be read or written).
    Broken,
}

/// Whether the guest posted a buffer not yet taken.
fn has_avail(queue: &mut Queue, mem: &GuestMemory) -> bool {
    let next = queue.next_avail();
    match queue.avail_idx(mem, Ordering::Acquire) {
        Ok(idx) if idx.0 != next => true,
        Ok(_) => matches!(queue.enable_notification(mem), Ok(true)),
        Err(_) => false,
    }
}
