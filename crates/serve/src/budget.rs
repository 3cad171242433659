//! The manager's budgets as plain accounting: guest memory its running VMMs may hold
//! (`--mem-budget-mib`) and disk its sandboxes may keep (`--disk-budget-mib`), with what
//! starts and suspends under way hold meanwhile ([`Reservation`]s, given back when dropped).
//! It knows no sandbox: what is in use, and which sandbox could sleep to make room, the
//! caller says.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use crate::error::ServeError;
use crate::metrics::Metrics;
use crate::util::lock;

/// Part of a budget held while what it is for is under way: memory for a VMM while it starts
/// (see [`MemoryBudget::reserve`]), disk for a snapshot while it is written (see
/// [`DiskBudget::reserve_for_suspend`]). Given back when dropped.
pub struct Reservation<'a> {
    held: &'a Mutex<u64>,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut held = lock(self.held);
        *held = held.saturating_sub(self.bytes);
    }
}

/// A part of a budget held (`None`: there is no budget), or why not.
pub type Reserved<'a> = Result<Option<Reservation<'a>>, ServeError>;

/// A sandbox that could sleep to make room: its name, and whatever the caller suspends.
pub type Victim<V> = Option<(String, V)>;

/// The memory budget.
pub struct MemoryBudget {
    /// Bytes (`mayfly serve --mem-budget-mib`); `None`: no budget.
    budget: Option<u64>,
    /// Past it, suspend the longest-idle sandboxes instead of refusing.
    make_room: bool,
    /// Guest memory of starts in flight (reserved, not yet in a record as running), bytes;
    /// its lock also makes each check-and-reserve one step.
    starting: Mutex<u64>,
}

impl MemoryBudget {
    pub fn new(budget: Option<u64>, make_room: bool) -> MemoryBudget {
        MemoryBudget {
            budget,
            make_room,
            starting: Mutex::new(0),
        }
    }

    /// Hold `bytes` of the budget for `name`'s VMM about to start (none without a budget):
    /// refused when what runs (`in_use`) and the starts in flight already hold too much.
    /// The reservation ends when the returned guard drops, by when the started VMM is in its
    /// record (so it is counted there: for a moment twice, never not at all).
    ///
    /// With make-room, `pick` names a sandbox that could sleep to free the shortfall (given
    /// it and the names tried already), under the budget's lock; `suspend` puts it to sleep
    /// after the lock is released (a suspend takes a while, and other starts need the lock),
    /// and the check starts over; each sandbox is tried once.
    pub fn reserve<V>(
        &self,
        name: &str,
        bytes: u64,
        metrics: &Metrics,
        in_use: &dyn Fn() -> u64,
        pick: &dyn Fn(u64, &[String]) -> Victim<V>,
        suspend: &dyn Fn(V),
    ) -> Reserved<'_> {
        let Some(budget) = self.budget else {
            return Ok(None);
        };
        if bytes > budget {
            return Err(ServeError::BadRequest(format!(
                "{name} needs {} MiB (its guest memory and its VMM's allowance, mayfly serve \
                 --vmm-allowance-mib), more than the whole memory budget of {} MiB (mayfly \
                 serve --mem-budget-mib): give it less memory or the manager a larger budget",
                bytes >> 20,
                budget >> 20
            )));
        }
        let mut tried: Vec<String> = Vec::new();
        loop {
            let mut starting = lock(&self.starting);
            let in_use = in_use().saturating_add(*starting);
            if in_use.saturating_add(bytes) <= budget {
                *starting += bytes;
                return Ok(Some(Reservation {
                    held: &self.starting,
                    bytes,
                }));
            }
            let shortfall = in_use.saturating_add(bytes) - budget;
            let victim = if self.make_room {
                pick(shortfall, &tried)
            } else {
                None
            };
            let Some((victim_name, victim)) = victim else {
                metrics.over_budget.fetch_add(1, Ordering::Relaxed);
                return Err(ServeError::OverBudget(format!(
                    "memory budget: {} needs {} MiB, and sandboxes running hold {} MiB of the \
                     {} MiB budget (mayfly serve --mem-budget-mib): pause or delete one (PUT \
                     /sandboxes/NAME/pause sleeps it to disk), or start the manager with a \
                     larger budget",
                    name,
                    bytes >> 20,
                    in_use >> 20,
                    budget >> 20
                )));
            };
            drop(starting);
            tried.push(victim_name);
            suspend(victim);
        }
    }
}

/// The disk budget.
pub struct DiskBudget {
    /// Bytes (`--disk-budget-mib`); `None`: no budget.
    budget: Option<u64>,
    /// Disk held by the snapshots being written for suspends now.
    writing: Mutex<u64>,
}

impl DiskBudget {
    pub fn new(budget: Option<u64>) -> DiskBudget {
        DiskBudget {
            budget,
            writing: Mutex::new(0),
        }
    }

    /// Whether a VMM for `name` may start: not while what the sandboxes keep (`kept`, their
    /// snapshots and the disk layers of running ones, asked only with a budget) and what
    /// suspends under way may write fill the budget already (a running VMM's disk layers
    /// grow as its guest writes).
    pub fn check_start(
        &self,
        name: &str,
        metrics: &Metrics,
        kept: &dyn Fn() -> u64,
    ) -> Result<(), ServeError> {
        let Some(budget) = self.budget else {
            return Ok(());
        };
        let in_use = kept().saturating_add(*lock(&self.writing));
        if in_use >= budget {
            metrics.over_budget.fetch_add(1, Ordering::Relaxed);
            return Err(ServeError::OverBudget(format!(
                "disk budget: sandboxes keep (or are writing) {} MiB, running ones' disk layers \
                 included, of the {} MiB budget (mayfly serve --disk-budget-mib), so {} cannot \
                 start: delete a sandbox, or start the manager with a larger budget",
                in_use >> 20,
                budget >> 20,
                name
            )));
        }
        Ok(())
    }

    /// Whether the sandboxes keep more than the budget (`kept`, asked only with a budget).
    pub fn over(&self, kept: &dyn Fn() -> u64) -> Option<(u64, u64)> {
        let budget = self.budget?;
        let kept = kept();
        (kept >= budget).then_some((kept, budget))
    }

    /// Whether sandbox `name` may write a snapshot of `guest_bytes` of memory within the
    /// budget: a snapshot takes at most its memory and a MiB (a diff is usually far less, but
    /// a compacting one can be all of it). What suspends under way may write is held until
    /// they are done (the returned guard), so two at once are counted against each other.
    /// `kept` says what the sandboxes keep on disk now (asked only with a budget).
    pub fn reserve_for_suspend(
        &self,
        name: &str,
        guest_bytes: u64,
        metrics: &Metrics,
        kept: &dyn Fn() -> u64,
    ) -> Reserved<'_> {
        let Some(budget) = self.budget else {
            return Ok(None);
        };
        // The whole of it: the new snapshot is written beside the old one before the old
        // goes, and the old one's files may be linked by clones and stay.
        let needs = guest_bytes.saturating_add(1 << 20);
        // The walk of the sandboxes' files outside the lock (it takes a while with many).
        let kept = kept();
        let mut writing = lock(&self.writing);
        let in_use = kept.saturating_add(*writing);
        if in_use.saturating_add(needs) > budget {
            metrics.over_budget.fetch_add(1, Ordering::Relaxed);
            return Err(ServeError::OverBudget(format!(
                "disk budget: suspending {} may write up to {} MiB, and sandboxes keep (or are \
                 writing) {} MiB of the {} MiB budget (mayfly serve --disk-budget-mib): delete \
                 a sleeping sandbox, or start the manager with a larger budget; it stays awake \
                 meanwhile",
                name,
                needs >> 20,
                in_use >> 20,
                budget >> 20
            )));
        }
        *writing += needs;
        Ok(Some(Reservation {
            held: &self.writing,
            bytes: needs,
        }))
    }
}
