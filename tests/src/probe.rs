//! The probe guest (guest-kernel/probe): a tiny guest that runs in user mode on any KVM, the
//! host's own included, and reports through mayfly's probe device. Tests that need a running
//! VM but no Linux guest use it.

use std::path::Path;
use std::time::Duration;

use crate::guest::{request, Guest};

/// The probe guest's ELF, built by this crate's build script.
pub const ELF: &str = env!("MAYFLY_PROBE_ELF");

/// How long a probe may take to report (it reports in milliseconds; this only stops a hang).
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Boot the probe with `mem_mib` of RAM, a control socket at `sock` and its console discarded;
/// returns once it has written its pages and waits for a restore (a snapshot taken earlier
/// would not notice it was restored).
pub fn boot(mem_mib: u64, sock: &Path, name: &str) -> Guest {
    boot_with(mem_mib, sock, name, &[])
}

/// [`boot`] with more `mayfly run` options (a disk, a vsock path, a jail).
pub fn boot_with(mem_mib: u64, sock: &Path, name: &str, extra: &[&str]) -> Guest {
    let mem_mib = mem_mib.to_string();
    let sock = sock.to_string_lossy();
    let mut args = vec![
        "run",
        "--probe",
        "--kernel",
        ELF,
        "--mem-mib",
        &mem_mib,
        "--cmdline",
        "touch=1",
        "--console",
        "/dev/null",
        "--name",
        name,
        "--api-sock",
        &sock,
    ];
    args.extend_from_slice(extra);
    let guest = Guest::start(&args);
    assert!(
        guest.wait_stderr("mayfly-probe: waiting", TIMEOUT),
        "the probe did not boot: {}",
        guest.stderr()
    );
    guest
}

/// The probe's report lines on a VMM's stderr: `mayfly-probe: <kind> <value> <ns>`, in order.
pub fn reports(stderr: &str) -> Vec<(String, u64, u64)> {
    stderr
        .lines()
        .filter_map(|line| {
            let mut w = line.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("mayfly-probe:"), Some(kind), Some(value), Some(ns)) => {
                    Some((kind.to_string(), value.parse().ok()?, ns.parse().ok()?))
                }
                _ => None,
            }
        })
        .collect()
}

/// Wait until the probe VM `guest` reports `kind` (e.g. "resumed"); on a timeout, ask the VMM
/// for its state dump and fail with everything it printed.
pub fn wait_report(guest: &Guest, kind: &str) {
    let pattern = format!("mayfly-probe: {kind}");
    if guest.wait_stderr(&pattern, TIMEOUT) {
        return;
    }
    // SAFETY: kill(2) asking our own child VMM for a state dump.
    unsafe {
        libc::kill(
            libc::pid_t::try_from(guest.pid()).expect("a pid"),
            libc::SIGUSR1,
        )
    };
    std::thread::sleep(Duration::from_secs(2));
    panic!(
        "the probe did not report {kind:?} within {TIMEOUT:?}; the VMM's stderr:\n{}",
        guest.stderr()
    );
}

/// Pause the VM on `sock` and snapshot it into `snap` through its control socket; both must
/// succeed. The snapshot's report (its answer).
pub fn snapshot(sock: &Path, snap: &Path) -> serde_json::Value {
    let (status, body) = request(sock, "PUT", "/vm/pause", None);
    assert_eq!(status, 204, "{body}");
    let (status, body) = request(
        sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": snap })),
    );
    assert_eq!(status, 200, "{body}");
    body
}

/// `mayfly restore --standby` on `sock`, its console discarded, with `extra` options.
pub fn standby(sock: &Path, extra: &[&str]) -> Guest {
    let sock = sock.to_string_lossy();
    let mut args = vec![
        "restore",
        "--standby",
        "--api-sock",
        &sock,
        "--console",
        "/dev/null",
    ];
    args.extend_from_slice(extra);
    Guest::start(&args)
}

/// The probe's first report in a clone's console log that it resumed: its VM generation ID
/// (a fork's clone writes its console, and so its probe's reports, to its log).
pub fn resumed_generation(log: &Path) -> u64 {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(r) = reports(&text).into_iter().find(|r| r.0 == "resumed") {
            return r.1;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} never reported: {text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
