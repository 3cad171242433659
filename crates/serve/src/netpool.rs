//! Networks built ahead of need (`mayfly serve --net-pool N`). Building a VM's network (a
//! namespace, its tap, a veth out to the uplink, addresses, routes and the nftables ruleset:
//! `ip` twice and `nft` once) takes ~10 ms; taking one built already takes ~0.5 ms (the net
//! benchmark: 9.4 against 0.46 ms, medians of 100, host). Every VMM (or its jail's waiter)
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

/// How often a full pool is looked at again (a VM took a slot meanwhile, or not).
const LOOK_EVERY: Duration = Duration::from_millis(50);
/// After a failed build, the wait before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(5);

pub struct NetPool {
    config: NetPoolConfig,
    started: Once,
    /// Set when the manager stops: the thread drains the pool and ends.
    stopping: Mutex<bool>,
    wake: Condvar,
    /// The thread, joined at the stop.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl NetPool {
    pub fn new(config: NetPoolConfig) -> Arc<NetPool> {
        Arc::new(NetPool {
            config,
            started: Once::new(),
            stopping: Mutex::new(false),
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

    /// Stop filling the pool and remove its slots (the manager stops).
    pub fn stop(&self) {
        *lock(&self.stopping) = true;
        self.wake.notify_all();
        let thread = lock(&self.thread).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }

    /// Wait `how_long` unless the manager stops meanwhile; true if it stops.
    fn pause(&self, how_long: Duration) -> bool {
        let stopping = lock(&self.stopping);
        if *stopping {
            return true;
        }
        let (stopping, _) = self
            .wake
            .wait_timeout(stopping, how_long)
            .unwrap_or_else(|p| p.into_inner());
        *stopping
    }

    fn keep(&self, events: &EventLog) {
        // Built only with CPU nothing else wants (and the `ip` and `nft` it runs inherit
        // that): a refill after a fork into 100 is ~1 s of work, which at normal priority
        // took CPU from the next creates and forks themselves.
        let idle = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler on this thread (0) with a valid parameter block.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) };
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
        loop {
            held.retain(|slot| !network.is_claimed(slot.index));
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
        // A slot a VMM is taking right now is left to it: it has opened the namespace, or
        // will find it gone and build its own.
        for slot in held {
            let _ = network.release_held(slot.index);
            drop(slot);
        }
    }
}
