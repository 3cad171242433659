//! What `GET /metrics` says (Prometheus text format 0.0.4): counters and latency histograms
//! the manager keeps, and gauges read when scraped (sandboxes by state, memory and disk in
//! use).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds: a restore is milliseconds, a cold boot in
/// the test rig tens of seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A latency histogram: a count per bucket (not cumulative; summed when written), the sum and
/// the count.
#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|bound| secs <= *bound) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        // Microseconds to seconds: a sum of latencies stays far below 2^53 µs.
        #[allow(clippy::cast_precision_loss)]
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// The manager's counters.
#[derive(Default)]
pub struct Metrics {
    pub create: Histogram,
    pub wake: Histogram,
    pub suspend: Histogram,
    pub creates_failed: AtomicU64,
    pub wakes_failed: AtomicU64,
    pub suspends_failed: AtomicU64,
    pub vmm_deaths: AtomicU64,
    pub execs: AtomicU64,
    pub execs_failed: AtomicU64,
    pub requests: AtomicU64,
    pub requests_refused: AtomicU64,
    /// Creates, wakes and fork clones refused by the memory budget, suspends by the disk
    /// budget.
    pub over_budget: AtomicU64,
    /// Sandboxes deleted after sleeping past `--expire-after`.
    pub expired: AtomicU64,
    /// Sandboxes put to sleep to make room in the memory budget.
    pub made_room: AtomicU64,
}

/// What is read at scrape time.
pub struct Gauges {
    /// (state, number of sandboxes in it), for every state.
    pub by_state: Vec<(&'static str, usize)>,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
}

fn counter(out: &mut String, name: &str, help: &str, value: &AtomicU64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} counter");
    let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
}

fn gauge(out: &mut String, name: &str, help: &str, value: u64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name} {value}");
}

impl Metrics {
    pub fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP mayfly_sandboxes Sandboxes by state.");
        let _ = writeln!(out, "# TYPE mayfly_sandboxes gauge");
        for (state, n) in &gauges.by_state {
            let _ = writeln!(out, "mayfly_sandboxes{{state=\"{state}\"}} {n}");
        }
        gauge(
            &mut out,
            "mayfly_memory_bytes",
            "Resident memory of the running sandboxes' VMMs.",
            gauges.memory_bytes,
        );
        gauge(
            &mut out,
            "mayfly_disk_bytes",
            "Disk the sandboxes' snapshots and files take (allocated blocks).",
            gauges.disk_bytes,
        );
        self.create.write(
            &mut out,
            "mayfly_create_seconds",
            "From a create request to its sandbox answering.",
        );
        self.wake.write(
            &mut out,
            "mayfly_wake_seconds",
            "From the start of a wake to the restored sandbox answering.",
        );
        self.suspend.write(
            &mut out,
            "mayfly_suspend_seconds",
            "From the start of a suspend to the VMM gone and its snapshot on disk.",
        );
        counter(
            &mut out,
            "mayfly_creates_failed_total",
            "Creates that failed (nothing of them is left).",
            &self.creates_failed,
        );
        counter(
            &mut out,
            "mayfly_wakes_failed_total",
            "Wakes that failed.",
            &self.wakes_failed,
        );
        counter(
            &mut out,
            "mayfly_suspends_failed_total",
            "Suspends that failed (the sandbox kept running).",
            &self.suspends_failed,
        );
        counter(
            &mut out,
            "mayfly_vmm_deaths_total",
            "Sandbox VMMs that ended without being asked to.",
            &self.vmm_deaths,
        );
        counter(
            &mut out,
            "mayfly_execs_total",
            "Exec requests passed to sandboxes.",
            &self.execs,
        );
        counter(
            &mut out,
            "mayfly_execs_failed_total",
            "Exec requests answered with an error status.",
            &self.execs_failed,
        );
        counter(
            &mut out,
            "mayfly_requests_total",
            "Requests to the manager.",
            &self.requests,
        );
        counter(
            &mut out,
            "mayfly_requests_refused_total",
            "Requests the manager refused (4xx and 5xx).",
            &self.requests_refused,
        );
        counter(
            &mut out,
            "mayfly_over_budget_total",
            "VMM starts (creates, wakes, fork clones) refused by the memory budget, and suspends by the disk budget.",
            &self.over_budget,
        );
        counter(
            &mut out,
            "mayfly_expired_total",
            "Sandboxes deleted after sleeping past --expire-after.",
            &self.expired,
        );
        counter(
            &mut out,
            "mayfly_made_room_total",
            "Sandboxes put to sleep to make room in the memory budget (--when-over-budget suspend-idle).",
            &self.made_room,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_end_at_the_count() {
        let m = Metrics::default();
        m.wake.observe(Duration::from_millis(3));
        m.wake.observe(Duration::from_millis(40));
        m.wake.observe(Duration::from_secs(60));
        let text = m.render(&Gauges {
            by_state: vec![("running", 2)],
            memory_bytes: 7,
            disk_bytes: 9,
        });
        assert!(text.contains("mayfly_wake_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("mayfly_wake_seconds_bucket{le=\"0.05\"} 2\n"));
        assert!(text.contains("mayfly_wake_seconds_bucket{le=\"30\"} 2\n"));
        assert!(text.contains("mayfly_wake_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("mayfly_wake_seconds_count 3\n"));
        assert!(text.contains("mayfly_sandboxes{state=\"running\"} 2\n"));
        assert!(text.contains("mayfly_memory_bytes 7\n"));
    }
}
