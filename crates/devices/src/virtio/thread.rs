//! The thread a device serves its queues on, and the gate that parks it.
//!
//! A device thread runs an event loop (`event-manager`) over the device's file descriptors.
//! Pausing closes the gate and kicks the loop: the thread finishes the events it was handling,
//! then waits at the gate, outside the loop, where it touches neither guest memory nor the
//! device. [`Gate::pause`] returns only once it waits there, so a snapshot or fork that follows
//! reads a device that nothing changes. File descriptors stay readable meanwhile (the loop is
//! level-triggered), so nothing that arrived during a pause is lost when it resumes.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

#[derive(Default)]
struct GateState {
    /// Someone asked the thread to stop at the gate.
    pause: bool,
    /// The thread is waiting at the gate.
    parked: bool,
    /// The thread should end.
    exit: bool,
}

/// Where a helper thread (a device's, the console's) stops while the VM is paused.
#[derive(Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called by the gated thread between pieces of work: waits while paused. Returns false
    /// when the thread should end.
    pub fn pass(&self) -> bool {
        let mut state = self.lock();
        while state.pause && !state.exit {
            if !state.parked {
                state.parked = true;
                self.changed.notify_all();
            }
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        if state.parked {
            state.parked = false;
            self.changed.notify_all();
        }
        !state.exit
    }

    /// Ask the thread to stop at the gate; `kick` wakes it if it is blocked elsewhere. Returns
    /// once it waits at the gate, or after `timeout` (false then: a thread stuck in a blocking
    /// call it should never make).
    pub fn pause(&self, kick: impl Fn(), timeout: Duration) -> bool {
        self.lock().pause = true;
        kick();
        let deadline = std::time::Instant::now() + timeout;
        let mut state = self.lock();
        while !state.parked && !state.exit {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// Ask for a pause without waiting for anyone to park: for threads that check
    /// [`Gate::is_paused`] under a lock of their own, which the caller then takes once.
    pub fn close(&self) {
        self.lock().pause = true;
    }

    pub fn resume(&self) {
        self.lock().pause = false;
        self.changed.notify_all();
    }

    pub fn is_paused(&self) -> bool {
        self.lock().pause
    }

    fn exit(&self) {
        self.lock().exit = true;
        self.changed.notify_all();
    }
}

/// Wakes the event loop (its only job is to make `run` return so the gate is checked).
struct Kick(EventFd);

impl MutEventSubscriber for Kick {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.0.read();
    }

    fn init(&mut self, ops: &mut EventOps) {
        // Registration only fails for a duplicate fd, which this new eventfd cannot be.
        let _ = ops.add(Events::new(&self.0, EventSet::IN));
    }
}

/// What a device thread runs first (see [`DeviceThread::spawn_with`]). It cannot fail: what
/// a failure means (the VMM's seccomp filter: the process stops) is the caller's to decide.
pub type Prelude = Box<dyn FnOnce() + Send>;

/// A device's thread: its event loop behind a [`Gate`].
pub struct DeviceThread {
    name: String,
    gate: Arc<Gate>,
    kick: EventFd,
    thread: Option<JoinHandle<()>>,
}

/// How long a pause waits for a device thread before it reports it stuck.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

impl DeviceThread {
    /// Start the event loop of `device` on a thread named `name`.
    pub fn spawn(
        name: &str,
        device: Arc<Mutex<dyn MutEventSubscriber + Send>>,
        stack_size: usize,
    ) -> std::io::Result<Self> {
        Self::spawn_gated(name, device, stack_size, false, None)
    }

    /// [`DeviceThread::spawn`] (held at its gate if `paused`, as [`DeviceThread::spawn_paused`]),
    /// with `prelude` run first on the new thread, before it looks at any queue: the VMM's
    /// seccomp filter for the device.
    pub fn spawn_with(
        name: &str,
        device: Arc<Mutex<dyn MutEventSubscriber + Send>>,
        stack_size: usize,
        paused: bool,
        prelude: Prelude,
    ) -> std::io::Result<Self> {
        Self::spawn_gated(name, device, stack_size, paused, Some(prelude))
    }

    /// [`DeviceThread::spawn`], the thread held at its gate until [`DeviceThread::resume`]:
    /// for a restored device, which must not raise an interrupt before the vCPUs' interrupt
    /// controllers are restored (it would be lost).
    pub fn spawn_paused(
        name: &str,
        device: Arc<Mutex<dyn MutEventSubscriber + Send>>,
        stack_size: usize,
    ) -> std::io::Result<Self> {
        Self::spawn_gated(name, device, stack_size, true, None)
    }

    fn spawn_gated(
        name: &str,
        device: Arc<Mutex<dyn MutEventSubscriber + Send>>,
        stack_size: usize,
        paused: bool,
        prelude: Option<Prelude>,
    ) -> std::io::Result<Self> {
        let kick = EventFd::new(libc::EFD_NONBLOCK)?;
        let thread_kick = kick.try_clone()?;
        let gate = Arc::new(Gate::default());
        if paused {
            gate.close();
        }
        let thread_gate = gate.clone();
        let mut manager: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
            EventManager::new().map_err(|e| std::io::Error::other(e.to_string()))?;
        manager.add_subscriber(device);
        manager.add_subscriber(Arc::new(Mutex::new(Kick(thread_kick))));
        // Not waited for: the prelude runs on the new thread before anything else there, and
        // the caller learns nothing from its start a handshake would tell (measured: a
        // handshake per thread cost a clone a scheduler round trip each, milliseconds on a
        // loaded host).
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .stack_size(stack_size)
            .spawn(move || {
                if let Some(prelude) = prelude {
                    prelude();
                }
                while thread_gate.pass() {
                    // A failed epoll_wait (EINTR) is retried; nothing else can fail here.
                    let _ = manager.run();
                }
            })?;
        Ok(Self {
            name: name.to_string(),
            gate,
            kick,
            thread: Some(thread),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether a pause is in force.
    pub fn is_paused(&self) -> bool {
        self.gate.is_paused()
    }

    /// Stop the thread at its gate (see [`Gate::pause`]).
    pub fn pause(&self) -> bool {
        self.gate.pause(|| drop(self.kick.write(1)), PAUSE_TIMEOUT)
    }

    pub fn resume(&self) {
        self.gate.resume();
        // Look at everything again: work may have arrived while paused.
        let _ = self.kick.write(1);
    }

    /// The kick eventfd's descriptor (for tests).
    pub fn kick_fd(&self) -> i32 {
        self.kick.as_raw_fd()
    }
}

impl Drop for DeviceThread {
    fn drop(&mut self) {
        self.gate.exit();
        let _ = self.kick.write(1);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Counts the events on its eventfd.
    struct Counter {
        event: EventFd,
        seen: Arc<AtomicU64>,
    }

    impl MutEventSubscriber for Counter {
        fn process(&mut self, _events: Events, _ops: &mut EventOps) {
            if let Ok(n) = self.event.read() {
                self.seen.fetch_add(n, Ordering::SeqCst);
            }
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.event, EventSet::IN)).unwrap();
        }
    }

    fn wait_for(what: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !what() {
            assert!(std::time::Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_paused_thread_handles_nothing_until_resumed_and_loses_nothing() {
        let event = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let seen = Arc::new(AtomicU64::new(0));
        let device = Arc::new(Mutex::new(Counter {
            event: event.try_clone().unwrap(),
            seen: seen.clone(),
        }));
        let thread = DeviceThread::spawn("test-dev", device, 256 << 10).unwrap();
        event.write(1).unwrap();
        wait_for(|| seen.load(Ordering::SeqCst) == 1);

        assert!(thread.pause());
        event.write(5).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            seen.load(Ordering::SeqCst),
            1,
            "nothing handled while paused"
        );
        thread.resume();
        wait_for(|| seen.load(Ordering::SeqCst) == 6);
        // Pause twice, resume once: still works.
        assert!(thread.pause());
        assert!(thread.pause());
        thread.resume();
        event.write(1).unwrap();
        wait_for(|| seen.load(Ordering::SeqCst) == 7);
        drop(thread);
    }
}
