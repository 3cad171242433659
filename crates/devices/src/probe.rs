//! The probe device: where mayfly's probe guest (guest-kernel/probe) reports what it did, so a
//! benchmark can time a restore or a fork from the VMM's side on any KVM. Each report is a line
//! on the VMM's stderr, `mayfly-probe: <kind> <value> <CLOCK_MONOTONIC ns>`, comparable with
//! the benchmark's own clock. Other guests never touch it.
//!
//! Registers (MMIO, 64-bit): offset 8, the value; offset 0, the kind, which sends the report;
//! offset 16, "wait": a read returns after [`WAIT_LIMIT`] or as soon as the VMM wakes it (to
//! pause or stop the VM), so an idle probe sleeps instead of spinning and thousands of idle
//! clones do not starve the host.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::bus::BusDevice;

/// Where the probe device sits, in the MMIO gap below 4 GiB.
pub const PROBE_ADDR: u64 = 0xd000_0000;
pub const PROBE_SIZE: u64 = 0x1000;

const KIND_OFFSET: u64 = 0;
const VALUE_OFFSET: u64 = 8;
const WAIT_OFFSET: u64 = 16;
/// The longest a "wait" read blocks: an idle probe exits to the VMM once per limit. Every
/// wait the VMM needs back (pause, stop) it ends itself ([`ProbeWaker::hold`]), so the limit
/// only bounds what an idle VM costs. At 100 ms, a fork of 1,000 probe clones spent 28% of
/// this 2-core host's samples in the clones' vCPU threads; at 1 s, one idle clone's vCPU took
/// 136 us of CPU a second (one exit and re-entry into the guest costs that much on this nested
/// host) and 1,000 of them 0.6 CPU-seconds a second, so that past ~3,000 idle clones the host
/// had no CPU left for the fork that was making more (10,000 clones: 1.4 ms a clone for the
/// first half, 5.5 ms for the second).
pub const WAIT_LIMIT: Duration = Duration::from_secs(30);

/// Ends the probe's waits early: the VMM holds it (every wait returns at once) while it pauses
/// or stops the vCPUs, so a vCPU that comes back from one wait and goes straight into the next
/// before its pause request arrives does not sleep out the next one (a fork's pause took a
/// whole [`WAIT_LIMIT`] now and then that way).
pub struct ProbeWaker {
    state: Mutex<WakerState>,
    woken: Condvar,
    limit: Duration,
}

impl Default for ProbeWaker {
    fn default() -> Self {
        Self::with_limit(WAIT_LIMIT)
    }
}

#[derive(Default)]
struct WakerState {
    wakeups: u64,
    holding: bool,
    /// The next wait (or the one under way) returns at once, once.
    pending: bool,
}

impl ProbeWaker {
    /// A waker whose waits last at most `limit`.
    pub fn with_limit(limit: Duration) -> Self {
        Self {
            state: Mutex::default(),
            woken: Condvar::new(),
            limit,
        }
    }

    /// End every wait now and return from those that begin, until [`ProbeWaker::release`].
    pub fn hold(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.wakeups += 1;
        state.holding = true;
        self.woken.notify_all();
    }

    /// End the wait under way, or else the next one, once: a restored VM's generation ID has
    /// changed, and its probe may have been caught just before going into a wait (it looks at
    /// the ID first), so it would sleep out a whole limit before seeing the new one.
    pub fn wake_once(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.pending = true;
        self.woken.notify_all();
    }

    /// Let waits last again (the vCPUs are paused, or resume).
    pub fn release(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).holding = false;
    }

    fn wait(&self) {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let seen = guard.wakeups;
        let (mut state, _) = self
            .woken
            .wait_timeout_while(guard, self.limit, |s| {
                s.wakeups == seen && !s.holding && !s.pending
            })
            .unwrap_or_else(|p| p.into_inner());
        state.pending = false;
    }
}

/// What a report says.
pub fn kind_name(kind: u64) -> &'static str {
    match kind {
        1 => "booted",
        2 => "written",
        3 => "resumed",
        4 => "verified",
        5 => "mismatch",
        6 => "waiting",
        _ => "unknown",
    }
}

#[derive(Default)]
pub struct Probe {
    value: u64,
    waker: Arc<ProbeWaker>,
}

impl Probe {
    pub fn new(waker: Arc<ProbeWaker>) -> Self {
        Self { value: 0, waker }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: what probe reports (and mayfly's trace lines) are stamped
/// with, a number another process on the host can compare with its own clock.
pub use mayfly_sys::trace::monotonic_ns;

fn to_u64(data: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    let n = data.len().min(8);
    bytes[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(bytes)
}

impl BusDevice for Probe {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset == WAIT_OFFSET {
            self.waker.wait();
        }
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            VALUE_OFFSET => self.value = to_u64(data),
            KIND_OFFSET => {
                let kind = to_u64(data);
                let line = format!(
                    "mayfly-probe: {} {} {}\n",
                    kind_name(kind),
                    self.value,
                    monotonic_ns()
                );
                // One write per line, so reports from several vCPUs never interleave.
                let _ = std::io::stderr().lock().write_all(line.as_bytes());
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_name_their_kind() {
        assert_eq!(kind_name(3), "resumed");
        assert_eq!(kind_name(99), "unknown");
        let mut probe = Probe::default();
        probe.write(VALUE_OFFSET, &42u64.to_le_bytes());
        assert_eq!(probe.value, 42);
        probe.write(VALUE_OFFSET, &[7]);
        assert_eq!(probe.value, 7);
    }

    #[test]
    fn waits_end_when_woken_or_after_the_limit() {
        const WAIT_LIMIT: Duration = Duration::from_millis(300);
        let waker = Arc::new(ProbeWaker::with_limit(WAIT_LIMIT));
        let mut probe = Probe::new(waker.clone());
        let start = std::time::Instant::now();
        let mut data = [0u8; 8];
        probe.read(WAIT_OFFSET, &mut data);
        assert!(start.elapsed() >= WAIT_LIMIT);

        let thread = std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let mut data = [0u8; 8];
            probe.read(WAIT_OFFSET, &mut data);
            (probe, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(10));
        waker.hold();
        let (probe, waited) = thread.join().unwrap();
        assert!(waited < WAIT_LIMIT);
        // Held: a wait that begins now returns at once (the vCPU is about to pause) ...
        let mut probe = probe;
        let start = std::time::Instant::now();
        probe.read(WAIT_OFFSET, &mut data);
        assert!(start.elapsed() < WAIT_LIMIT);
        // ... until released.
        waker.release();
        let start = std::time::Instant::now();
        probe.read(WAIT_OFFSET, &mut data);
        assert!(start.elapsed() >= WAIT_LIMIT);
        // Woken once (a restore): the next wait returns at once, the one after lasts.
        waker.wake_once();
        let start = std::time::Instant::now();
        probe.read(WAIT_OFFSET, &mut data);
        assert!(start.elapsed() < WAIT_LIMIT);
        let start = std::time::Instant::now();
        probe.read(WAIT_OFFSET, &mut data);
        assert!(start.elapsed() >= WAIT_LIMIT);
    }
}
