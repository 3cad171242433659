//! The control socket: bound (claimed, so that two managers never serve one socket), each
//! connection served on a thread of its own (up to [`MAX_CONNECTIONS`] at once), the idle
//! watch started beside it, and everything left as it is when the manager is told to stop.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use mayfly_api::http::{self, Refusal};

use crate::config::ServeConfig;
use crate::error::ServeError;
use crate::manager::Manager;
use crate::routes::{bearer, error_reply, refusal_reply, route, streamed, Refused, REQUEST_IDLE};
use crate::tokens::hash_token;
use crate::util::lock;

/// Connections served at once; more get 503 at once.
const MAX_CONNECTIONS: usize = 256;
/// Of those, how many only the admin's requests may hold: whatever the tenants do, the admin
/// (a list, a delete) always gets a connection. The manager's own calls to its VMMs (pause,
/// snapshot, shutdown, the idle suspend) take none of these: they go to the VMM's socket
/// directly, where the VMM keeps room for them beside its guest calls.
const ADMIN_LANE: usize = 32;
/// How many connections the requests of one token (one sandbox's), or of none, may hold at
/// once: past it, 429 with `Retry-After`.
const PER_TENANT: usize = 16;
/// How long a client may take to send its request, in all.
const REQUEST_TOTAL: Duration = Duration::from_secs(30);
/// How often the idle watch looks at the sandboxes.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Serve until `stop` reads something (or closes): the caller's signal handling.
pub fn serve(config: &ServeConfig, stop: UnixStream) -> Result<(), ServeError> {
    let manager = Arc::new(Manager::open(
        &config.state_dir,
        config.mayfly.clone(),
        &config.policy,
    )?);
    let _ = manager.me.set(Arc::downgrade(&manager));
    manager.recover();
    manager.reopen_ports();
    let mut claim = mayfly_sys::claim::SocketClaim::new(&config.sock)?;
    let listener = claim.bind()?;
    // The socket file this manager made: at the end it removes that one only, never one a
    // newer manager bound at the same path meanwhile.
    let socket_id = std::fs::metadata(&config.sock)
        .ok()
        .map(|m| (m.dev(), m.ino()));
    listener
        .set_nonblocking(true)
        .map_err(|source| ServeError::Io {
            what: "listen on",
            path: config.sock.display().to_string(),
            source,
        })?;
    manager.event(
        "serving",
        "",
        json!({ "socket": config.sock, "state_dir": config.state_dir, "jail": config.policy.jail }),
    );
    {
        let manager = Arc::clone(&manager);
        std::thread::Builder::new()
            .name("idle-watch".into())
            .spawn(move || loop {
                std::thread::sleep(WATCH_EVERY);
                manager.watch_once();
            })
            .map_err(|source| ServeError::Io {
                what: "start",
                path: "the idle watch thread".into(),
                source,
            })?;
    }
    let active = Arc::new(AtomicUsize::new(0));
    let lanes = Arc::new(Lanes::default());
    let unheard = Arc::new(Unheard::default());
    use nix::poll::{poll, PollFd, PollFlags};
    loop {
        let mut fds = [
            PollFd::new(&listener, PollFlags::POLLIN),
            PollFd::new(&stop, PollFlags::POLLIN),
        ];
        let ready = poll(&mut fds, -1);
        if fds[1].revents().is_none_or(|r| !r.is_empty()) {
            break;
        }
        if ready.is_err() {
            continue;
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => {
                // Out of descriptors, most likely: let the moment pass instead of spinning.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        // A connection counts from its accept until its thread ends (the guards give back
        // what it holds even if that thread panics), and as unheard until its request's head
        // is read: past the tenants' pool of those, or when the manager serves all it may,
        // the oldest unheard connection is let go so that this one (the admin's, maybe) is
        // heard.
        let full = active.load(Ordering::SeqCst) >= MAX_CONNECTIONS;
        let Some(hearing) = Unheard::admit(&unheard, &stream, full) else {
            refusal_reply(
                &stream,
                &Refused::later(
                    503,
                    1,
                    format!("the manager serves {MAX_CONNECTIONS} connections at once: try again"),
                ),
            );
            continue;
        };
        let counted = Counted::take(&active);
        let manager = Arc::clone(&manager);
        let lanes = Arc::clone(&lanes);
        // Were the thread not started, the closure (and with it the guards) is dropped.
        let _ = std::thread::Builder::new()
            .name("serve-conn".into())
            .spawn(move || {
                let _counted = counted;
                connection(&manager, &lanes, stream, hearing);
            });
    }
    manager.net_pool.stop();
    manager.event("stopped", "", json!({ "sandboxes": "left as they are" }));
    drop(listener);
    let ours = std::fs::symlink_metadata(&config.sock)
        .is_ok_and(|m| Some((m.dev(), m.ino())) == socket_id);
    if ours {
        let _ = std::fs::remove_file(&config.sock);
    }
    claim.release();
    Ok(())
}

/// A connection counted against [`MAX_CONNECTIONS`], given back when dropped (when its thread
/// ends, however it ends).
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn take(active: &Arc<AtomicUsize>) -> Counted {
        active.fetch_add(1, Ordering::SeqCst);
        Counted(Arc::clone(active))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The connections whose requests' heads are not read yet (none of them known as the admin's
/// or a tenant's): at most the tenants' pool of them, so that a client that opens connections
/// and sends nothing (or a byte at a time) cannot hold the admin's. Past that, the oldest is
/// let go (its reading ends, it is answered 503 with `Retry-After`).
#[derive(Default)]
struct Unheard {
    held: std::sync::Mutex<(u64, BTreeMap<u64, UnixStream>)>,
}

/// An unheard connection's place, given back when dropped.
struct Hearing {
    unheard: Arc<Unheard>,
    id: u64,
}

impl Unheard {
    /// Room for `stream` among the unheard connections, letting the oldest go if they are as
    /// many as the tenants' pool, or if `full` (the manager serves all the connections it
    /// may). `None` if `full` and no connection is unheard: this one is refused.
    fn admit(this: &Arc<Unheard>, stream: &UnixStream, full: bool) -> Option<Hearing> {
        let mut held = lock(&this.held);
        let (next, streams) = &mut *held;
        if full || streams.len() >= MAX_CONNECTIONS - ADMIN_LANE {
            match streams.pop_first() {
                // Its reader sees the end of what it sent; what it may still write is its 503.
                Some((_, oldest)) => {
                    let _ = oldest.shutdown(std::net::Shutdown::Read);
                }
                None if full => return None,
                None => {}
            }
        }
        let id = *next;
        *next += 1;
        // Without a second handle the connection cannot be let go later; it is heard all the
        // same (its own deadlines still bound it).
        if let Ok(handle) = stream.try_clone() {
            streams.insert(id, handle);
        }
        Some(Hearing {
            unheard: Arc::clone(this),
            id,
        })
    }
}

impl Hearing {
    /// Its request's head is read: whether it still had its place (`false`: it was let go
    /// meanwhile, to make room).
    fn heard(self) -> bool {
        lock(&self.unheard.held).1.remove(&self.id).is_some()
    }
}

impl Drop for Hearing {
    fn drop(&mut self) {
        lock(&self.unheard.held).1.remove(&self.id);
    }
}

/// Who holds the manager's connections, past their requests' heads: the tenants' in all,
/// and each token's.
#[derive(Default)]
struct Lanes {
    held: std::sync::Mutex<(usize, HashMap<String, usize>)>,
}

/// A tenant's hold on a connection, given back when dropped.
struct Lease<'a> {
    lanes: &'a Lanes,
    key: String,
}

impl Lanes {
    /// A connection for a request that is not the admin's, if its token (by its hash; none
    /// for a request without one) holds fewer than [`PER_TENANT`] and the tenants together
    /// leave the admin's lane free.
    fn take(&self, token: Option<&str>) -> Result<Lease<'_>, Refused> {
        let key = token.map(hash_token).unwrap_or_default();
        let mut held = lock(&self.held);
        let (all, by_key) = &mut *held;
        let mine = by_key.get(&key).copied().unwrap_or(0);
        if mine >= PER_TENANT {
            return Err(Refused::later(
                429,
                1,
                format!(
                    "this token holds {PER_TENANT} of the manager's connections already (the most \
                     one sandbox's token may): wait for one of its requests to end, then retry"
                ),
            ));
        }
        if *all >= MAX_CONNECTIONS - ADMIN_LANE {
            return Err(Refused::later(
                503,
                1,
                format!(
                    "the sandboxes' requests hold all {} connections the manager gives them (the \
                     rest are kept for the admin): try again",
                    MAX_CONNECTIONS - ADMIN_LANE
                ),
            ));
        }
        *all += 1;
        *by_key.entry(key.clone()).or_insert(0) += 1;
        Ok(Lease { lanes: self, key })
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let mut held = lock(&self.lanes.held);
        let (all, by_key) = &mut *held;
        *all = all.saturating_sub(1);
        if let Some(n) = by_key.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                by_key.remove(&self.key);
            }
        }
    }
}

/// Serve one connection: read its request, take its lane (the admin's, or its tenant's
/// share), and answer it.
fn connection(manager: &Manager, lanes: &Lanes, stream: UnixStream, hearing: Hearing) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(REQUEST_TOTAL));
    manager.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let read = http::read_request(&stream, REQUEST_IDLE, REQUEST_TOTAL, streamed);
    if !hearing.heard() {
        manager
            .metrics
            .requests_refused
            .fetch_add(1, Ordering::Relaxed);
        refusal_reply(
            &stream,
            &Refused::later(
                503,
                1,
                format!(
                    "the manager let this connection go before its request's head came whole: \
                     {} connections were waiting to be heard. Send the request at once, and \
                     try again",
                    MAX_CONNECTIONS - ADMIN_LANE
                ),
            ),
        );
        return;
    }
    let request = match read {
        Ok(request) => request,
        Err(Refusal::Silent) => return,
        Err(Refusal::Reply { status, message }) => {
            manager
                .metrics
                .requests_refused
                .fetch_add(1, Ordering::Relaxed);
            error_reply(&stream, status, message);
            return;
        }
    };
    let token = bearer(&request);
    let _lease = if token.is_some_and(|t| manager.is_admin(t)) {
        None
    } else {
        match lanes.take(token) {
            Ok(lease) => Some(lease),
            Err(refused) => {
                manager
                    .metrics
                    .requests_refused
                    .fetch_add(1, Ordering::Relaxed);
                refusal_reply(&stream, &refused);
                return;
            }
        }
    };
    if let Err(refused) = route(manager, &request, &stream) {
        manager
            .metrics
            .requests_refused
            .fetch_add(1, Ordering::Relaxed);
        refusal_reply(&stream, &refused);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_holds_its_share_and_the_tenants_leave_the_admins_lane() {
        let lanes = Lanes::default();
        let mine: Vec<_> = (0..PER_TENANT)
            .map(|_| lanes.take(Some("mfs_a")).expect("within its share"))
            .collect();
        let over = lanes.take(Some("mfs_a")).err().expect("past its share");
        assert_eq!((over.status, over.retry_after), (429, Some(1)));
        // Another token is not held back by it; one given back makes room again.
        drop(lanes.take(Some("mfs_b")).expect("another token's"));
        drop(mine);
        let again = lanes.take(Some("mfs_a")).expect("room again");
        drop(again);
        // The tenants together stop short of the admin's lane.
        let pool = MAX_CONNECTIONS - ADMIN_LANE;
        let held: Vec<_> = (0..pool)
            .map(|i| {
                lanes
                    .take(Some(&format!("mfs_{i}")))
                    .expect("within the pool")
            })
            .collect();
        let full = lanes.take(Some("mfs_new")).err().expect("the pool is full");
        assert_eq!((full.status, full.retry_after), (503, Some(1)));
        drop(held);
        assert_eq!(lock(&lanes.held).0, 0);
        assert!(lock(&lanes.held).1.is_empty());
    }

    #[test]
    fn past_the_tenants_pool_of_unheard_connections_the_oldest_is_let_go() {
        use std::io::Read;
        let unheard = Arc::new(Unheard::default());
        let pool = MAX_CONNECTIONS - ADMIN_LANE;
        let pairs: Vec<_> = (0..=pool)
            .map(|_| UnixStream::pair().expect("a socket pair"))
            .collect();
        let mut hearings: Vec<_> = pairs[..pool]
            .iter()
            .map(|(ours, _)| Unheard::admit(&unheard, ours, false).expect("within the pool"))
            .collect();
        let newest = Unheard::admit(&unheard, &pairs[pool].0, false).expect("let in");
        // The oldest's reading ends; it knows it was let go. The others are still heard.
        let mut buf = [0u8; 1];
        assert_eq!((&pairs[0].0).read(&mut buf).expect("a read"), 0);
        assert!(!hearings.remove(0).heard());
        assert!(hearings.remove(0).heard());
        assert!(newest.heard());
        // Full, with none unheard: refused.
        drop(hearings);
        assert!(lock(&unheard.held).1.is_empty());
        assert!(Unheard::admit(&unheard, &pairs[1].0, true).is_none());
        // Full, with one unheard: that one goes.
        let waiting = Unheard::admit(&unheard, &pairs[1].0, false).expect("let in");
        let admin = Unheard::admit(&unheard, &pairs[2].0, true).expect("let in");
        assert!(!waiting.heard());
        assert!(admin.heard());
    }
}
