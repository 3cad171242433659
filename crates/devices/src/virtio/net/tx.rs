//! TX, the guest's frames to the tap: each chain checked, its header copied and checked,
//! then sent zero-copy as one `writev` (see the parent module's docs for the rules).

use super::*;

impl Net {
    /// Check a TX header against what was negotiated, and clear what the tap must not see.
    pub(super) fn check_tx_header(
        &self,
        hdr: &mut [u8; VNET_HDR_LEN],
        frame_len: usize,
    ) -> Result<(), Bad> {
        let flags = u32::from(hdr[0]);
        let gso = u32::from(hdr[1]);
        let needs_csum = flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0;
        if needs_csum {
            if !self.has(VIRTIO_NET_F_CSUM) {
                return Err(Bad::Header);
            }
            let start = usize::from(u16::from_le_bytes([hdr[6], hdr[7]]));
            let offset = usize::from(u16::from_le_bytes([hdr[8], hdr[9]]));
            if start + offset + 2 > frame_len {
                return Err(Bad::Header);
            }
        }
        // Only NEEDS_CSUM means anything on transmit.
        hdr[0] &= HDR_F_NEEDS_CSUM;
        let allowed = match gso {
            VIRTIO_NET_HDR_GSO_NONE => true,
            VIRTIO_NET_HDR_GSO_TCPV4 => self.has(VIRTIO_NET_F_HOST_TSO4),
            VIRTIO_NET_HDR_GSO_TCPV6 => self.has(VIRTIO_NET_F_HOST_TSO6),
            // ECN, UFO, USO: never offered.
            _ => false,
        };
        if !allowed {
            return Err(Bad::Header);
        }
        if gso != VIRTIO_NET_HDR_GSO_NONE {
            let gso_size = u16::from_le_bytes([hdr[4], hdr[5]]);
            if gso_size == 0 || !needs_csum {
                return Err(Bad::Header);
            }
        }
        // num_buffers means nothing on transmit.
        hdr[10] = 0;
        hdr[11] = 0;
        Ok(())
    }

    /// Send the TX frames the guest queued, at most [`TX_BUDGET`] of them.
    pub(super) fn process_tx(&mut self) {
        if self.tx_blocked {
            return;
        }
        let Some(mut active) = self.active.take() else {
            return;
        };
        let mut notify = false;
        let mut handled = 0;
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(64);
        let _ = active.queues[TX].disable_notification(&active.mem);
        let mut rechecked = false;
        loop {
            if handled >= TX_BUDGET {
                // More may wait: come back once RX has had its turn.
                let _ = self.queue_events[TX].write(1);
                break;
            }
            let Active { mem, queues, .. } = &mut active;
            let chain = match queues[TX].iter(&*mem) {
                Ok(mut iter) => iter.next(),
                // The avail index is beyond what the queue can hold: the driver is broken.
                Err(_) => break,
            };
            let Some(chain) = chain else {
                match queues[TX].enable_notification(&*mem) {
                    // More arrived meanwhile: once. Pending again with nothing popped means
                    // rings laid over each other, so that turning notifications on or off
                    // moves the avail index (the fuzzer found that spin in the block device):
                    // come back on the loop's next turn instead.
                    Ok(true) if !rechecked => {
                        rechecked = true;
                        let _ = queues[TX].disable_notification(&*mem);
                        continue;
                    }
                    Ok(true) => {
                        let _ = self.queue_events[TX].write(1);
                        break;
                    }
                    _ => break,
                }
            };
            rechecked = false;
            let head = chain.head_index();
            handled += 1;
            let mut hdr = [0u8; VNET_HDR_LEN];
            match gather_tx(mem, chain, &mut iovs, &mut hdr) {
                Ok(len) => match self.check_tx_header(&mut hdr, len - VNET_HDR_LEN) {
                    Ok(()) => {
                        iovs[0] = libc::iovec {
                            iov_base: hdr.as_mut_ptr().cast(),
                            iov_len: VNET_HDR_LEN,
                        };
                        // SAFETY: iovs[0] is our header copy; the others point into guest
                        // memory that `gather_tx` checked and that `active.mem` keeps mapped
                        // throughout the call.
                        match unsafe { self.backend.writev(&iovs) } {
                            Ok(_) => {
                                self.counters.tx_frames += 1;
                                self.counters.tx_bytes += (len - VNET_HDR_LEN) as u64;
                            }
                            Err(e)
                                if e.kind() == ErrorKind::WouldBlock
                                    || e.kind() == ErrorKind::Interrupted =>
                            {
                                // Not now: the chain goes back on the ring, untouched.
                                queues[TX].go_to_previous_position();
                                self.counters.tx_deferred += 1;
                                self.tx_blocked = e.kind() == ErrorKind::WouldBlock;
                                if !self.tx_blocked {
                                    continue;
                                }
                                break;
                            }
                            Err(_) => self.counters.tx_dropped += 1,
                        }
                    }
                    Err(_) => self.counters.tx_malformed += 1,
                },
                Err(_) => self.counters.tx_malformed += 1,
            }
            if head >= queues[TX].size() {
                // A head beyond the table has no used entry to give back: it is lost.
                continue;
            }
            match complete(&mut queues[TX], mem, head, 0) {
                Ok(needs) => notify |= needs,
                // The used ring is not writable: nothing more can be done with this queue.
                Err(_) => break,
            }
        }
        if notify {
            let _ = active.interrupt.signal_used_queue();
        }
        self.active = Some(active);
    }
}

/// The iovecs of a TX chain (index 0 left for mayfly's copy of the header, which goes to
/// `hdr`), and the chain's length. Refuses what the module docs list.
fn gather_tx(
    mem: &GuestMemory,
    chain: virtio_queue::DescriptorChain<&GuestMemory>,
    iovs: &mut Vec<libc::iovec>,
    hdr: &mut [u8; VNET_HDR_LEN],
) -> Result<usize, Bad> {
    iovs.clear();
    iovs.push(libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    });
    let mut total = 0usize;
    let mut hdr_filled = 0usize;
    let mut last_next = true;
    let mut any = false;
    for desc in chain {
        any = true;
        last_next = desc.has_next();
        if desc.is_write_only() {
            return Err(Bad::Direction);
        }
        let len = desc.len() as usize;
        total += len;
        if total > VNET_HDR_LEN + MAX_FRAME_LEN {
            return Err(Bad::TooLong);
        }
        if len == 0 {
            continue;
        }
        let mut covered = 0usize;
        for slice in GuestMemoryBackend::get_slices(mem, desc.addr(), len) {
            let mut slice = slice.map_err(|_| Bad::Chain)?;
            covered += slice.len();
            if hdr_filled < VNET_HDR_LEN {
                let take = (VNET_HDR_LEN - hdr_filled).min(slice.len());
                slice.copy_to(&mut hdr[hdr_filled..hdr_filled + take]);
                hdr_filled += take;
                slice = slice.offset(take).map_err(|_| Bad::Chain)?;
            }
            if !slice.is_empty() {
                if iovs.len() >= libc::UIO_MAXIOV as usize {
                    return Err(Bad::Chain);
                }
                iovs.push(libc::iovec {
                    iov_base: slice.ptr_guard().as_ptr().cast_mut().cast(),
                    iov_len: slice.len(),
                });
            }
        }
        if covered != len {
            return Err(Bad::Chain);
        }
    }
    if !any || last_next {
        // Empty, or cut short by a loop, a `next` past the table or unreadable memory.
        return Err(Bad::Chain);
    }
    if total < VNET_HDR_LEN + MIN_FRAME_LEN {
        return Err(Bad::TooShort);
    }
    Ok(total)
}
