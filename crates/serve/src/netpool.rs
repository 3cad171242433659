//! Networks built ahead of need (`mayfly serve --net-pool N`). Building a VM's network (a
//! namespace, its tap, a veth out to the uplink, addresses, routes and the nftables ruleset:
//! `ip` twice and `nft` once) takes ~9 ms; taking one built already takes ~0.6 ms (the net
//! benchmark: 9.17 against 0.59 ms for a pool held as this one is, medians of 100, host). Every VMM (or its jail's waiter)
//! looks in the pool first (`mayfly_network::Network::create`), so the manager only keeps
//! it filled: a thread of its own builds slots until N are ready, with the configuration
//! its VMMs get, and holds their namespaces and attached taps open (a VMM takes them from
//! this process with pidfd_getfd), so the pool mounts nothing and dies with the manager. It starts at the
//! first sandbox with a network, so a manager whose sandboxes have none builds nothing, and
//! the pool is let go when the manager stops. A slot carries nothing of a VM: its MAC,
//! policy and never-reached networks are set when a VM takes it.

use std::sync::{Arc, Condvar, Mutex, Once};
use std::time::Duration;

use serde_json::json;

use crate::config::NetPoolConfig;
use crate::events::EventLog;
use crate::util::lock;

/// How often a full pool is looked at again (a VM took a slot meanwhile, or not): one read
/// of the directory.
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// Every this many looks, each held slot's ready file is read too (a slot taken and its
/// index built again meanwhile by another keeper sharing the directory has a file that is
/// not this one's).
const READ_EVERY: u32 = 20;
/// After a failed build, the wait before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How long a stopping manager waits for a build under way to end (whatever the pool holds
/// goes with the process anyway; its ready files are then removed by the next claim).
const STOP_WAIT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Stop {
    stopping: bool,
    ended: bool,
}

pub struct NetPool {
    config: NetPoolConfig,
    started: Once,
    /// Set when the manager stops (the thread gives the pool up and ends), and when the
    /// thread has ended.
    state: Mutex<Stop>,
    wake: Condvar,
    /// The thread, joined at the stop.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl NetPool {
    pub fn new(config: NetPoolConfig) -> Arc<NetPool> {
        Arc::new(NetPool {
            config,
            started: Once::new(),
            state: Mutex::new(Stop::default()),
            wake: Condvar::new(),
            thread: Mutex::new(None),
        })
    }

    /// A sandbox with a network is being made: keep the pool filled from now on.
    pub fn want(self: &Arc<Self>, events: &Arc<EventLog>) {
        if self.config.size == 0 {
            return;
        }
        self.started.call_once(|| {
            let pool = Arc::clone(self);
            let events = Arc::clone(events);
            let spawned = std::thread::Builder::new()
                .name("net-pool".into())
                .spawn(move || pool.keep(&events));
            if let Ok(handle) = spawned {
                *lock(&self.thread) = Some(handle);
            }
        });
    }

    /// Stop filling the pool and give its slots up (the manager stops); waits at most
    /// [`STOP_WAIT`] for a build under way.
    pub fn stop(&self) {
        let thread = lock(&self.thread).take();
        let mut state = lock(&self.state);
        state.stopping = true;
        self.wake.notify_all();
        if thread.is_none() {
            return;
        }
        let (state, _) = self
            .wake
            .wait_timeout_while(state, STOP_WAIT, |s| !s.ended)
            .unwrap_or_else(|p| p.into_inner());
        if state.ended {
            drop(state);
            if let Some(thread) = thread {
                let _ = thread.join();
            }
        }
    }

    /// Wait `how_long` unless the manager stops meanwhile; true if it stops.
    fn pause(&self, how_long: Duration) -> bool {
        let state = lock(&self.state);
        if state.stopping {
            return true;
        }
        let (state, _) = self
            .wake
            .wait_timeout_while(state, how_long, |s| !s.stopping)
            .unwrap_or_else(|p| p.into_inner());
        state.stopping
    }

    fn keep(&self, events: &EventLog) {
        self.fill(events);
        lock(&self.state).ended = true;
        self.wake.notify_all();
    }

    fn fill(&self, events: &EventLog) {
        // Built at the lowest priority (the `ip` and `nft` it runs inherit it): a refill after
        // a fork into 100 is ~1 s of work, which at normal priority took CPU from the next
        // creates and forks themselves. Nice 19 rather than SCHED_IDLE: the builds take the
        // kernel's network locks (rtnl), which a task that never gets CPU on a busy host
        // would hold against every VM's network.
        // SAFETY: gettid has no preconditions; setpriority on this thread alone (a tid is a
        // PRIO_PROCESS target on Linux).
        unsafe {
            let tid = libc::gettid();
            libc::setpriority(
                libc::PRIO_PROCESS,
                libc::id_t::try_from(tid).unwrap_or(0),
                19,
            );
        }
        let network = match mayfly_network::Network::new(self.config.network.clone()) {
            Ok(network) => network,
            Err(e) => {
                events.write(
                    "net_pool_off",
                    "",
                    json!({ "error": e.to_string(), "why": "each VM builds its own network" }),
                );
                return;
            }
        };
        // What dead VMMs left in the directory goes first (a VM taking a pooled slot does not
        // sweep).
        let _ = network.sweep();
        events.write("net_pool_filling", "", json!({ "size": self.config.size }));
        // The pool's namespaces, held by this process (not mounted: see prewarm_held).
        let mut held: Vec<mayfly_network::HeldSlot> = Vec::new();
        let mut failing = false;
        let mut looks = 0u32;
        loop {
            let ready: std::collections::HashSet<u32> = network.ready_slots().into_iter().collect();
            looks = looks.wrapping_add(1);
            let read = looks.is_multiple_of(READ_EVERY);
            held.retain(|slot| ready.contains(&slot.index) && !(read && network.is_claimed(slot)));
            let wait = if held.len() >= self.config.size {
                LOOK_EVERY
            } else {
                match network.prewarm_held() {
                    Ok(slot) => {
                        held.push(slot);
                        failing = false;
                        Duration::ZERO
                    }
                    Err(e) => {
                        // Said once per run of failures, not every few seconds.
                        if !failing {
                            events.write(
                                "net_pool_build_failed",
                                "",
                                json!({ "error": e.to_string(), "retry_s": RETRY_AFTER.as_secs() }),
                            );
                        }
                        failing = true;
                        RETRY_AFTER
                    }
                }
            };
            if self.pause(wait) {
                break;
            }
        }
        // A slot a VMM is taking right now is left to it: it has its descriptors already, or
        // will find them gone and build its own.
        for slot in held {
            network.release_held(&slot);
            drop(slot);
        }
    }
}
