//! The fork path, on this machine's own KVM with the probe guest: clones made by the fork's
//! zygote run apart from each other, and the four cases found by reading the fork code (a lazy
//! restore still loading its memory, descriptors a clone of a clone must not hold, a restored
//! parent's clone numbers, a fork that fails half-way) each end the way they should.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mayfly_api as api;
use mayfly_tests::guest::{request, Guest, TestDir};
use mayfly_tests::probe;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A fork of `count` clones that must succeed: (name, pid, console log) of each.
fn fork(sock: &Path, count: u32) -> Vec<(String, u32, PathBuf)> {
    let (status, body) = request(
        sock,
        "PUT",
        "/vm/fork",
        Some(serde_json::json!({ "count": count })),
    );
    assert_eq!(status, 200, "{body}");
    body["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["pid"].as_u64().unwrap() as u32,
                PathBuf::from(c["console_log"].as_str().unwrap()),
            )
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    // A zombie has ended too.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

fn kill(pid: u32) {
    // SAFETY: kill(2) of a clone this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// The processes whose stderr is `log` (a clone's stderr is its console log).
fn processes_writing(log: &Path) -> Vec<u32> {
    // /proc shows the path a descriptor was opened by, resolved.
    let log = log.canonicalize().unwrap_or_else(|_| log.to_path_buf());
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read_link(entry.path().join("fd/2")).is_ok_and(|p| p == log) && alive(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// Inodes of the memfds a process holds open or maps.
fn memfd_inodes(pid: u32) -> Vec<u64> {
    let mut inodes = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        if std::fs::read_link(fd.path()).is_ok_and(|p| p.to_string_lossy().contains("memfd:")) {
            if let Ok(meta) = std::fs::metadata(fd.path()) {
                inodes.push(meta.ino());
            }
        }
    }
    for line in std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
    {
        if line.contains("memfd:") {
            if let Some(inode) = line.split_whitespace().nth(4).and_then(|i| i.parse().ok()) {
                inodes.push(inode);
            }
        }
    }
    inodes.sort();
    inodes.dedup();
    inodes
}

#[test]
fn clones_run_as_processes_of_their_own_with_their_own_names_and_generations() {
    let dir = TestDir::new("fork-zygote");
    let sock = dir.join("p.sock");
    let mut parent = probe::boot(64, &sock, "p");
    let clones = fork(&sock, 4);
    let names: Vec<&str> = clones.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, ["p-0", "p-1", "p-2", "p-3"]);
    let mut generations = Vec::new();
    for (name, pid, log) in &clones {
        assert!(alive(*pid), "{name} is not running");
        // Not the parent VMM's child: the zygote made it, and it outlives the fork.
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .unwrap()
            .trim()
            .to_string();
        assert_ne!(ppid, parent.pid().to_string(), "{name}");
        // `ps` and `top` show it by its name, not as the zygote it was forked from.
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
        assert_eq!(comm.trim_end(), name.as_str());
        generations.push(probe::resumed_generation(log));
        let (status, vm) = request(&dir.join(&format!("{name}.sock")), "GET", "/vm", None);
        assert_eq!(status, 200, "{vm}");
        assert_eq!(vm["name"], name.as_str(), "{vm}");
        assert_eq!(vm["origin"], "fork of p", "{vm}");
        assert_eq!(vm["parent"], "p", "{vm}");
    }
    generations.sort();
    generations.dedup();
    assert_eq!(
        generations.len(),
        4,
        "every clone has its own generation ID"
    );
    // One clone killed takes no other down, nor the parent.
    kill(clones[0].1);
    std::thread::sleep(Duration::from_millis(200));
    for (name, pid, _) in &clones[1..] {
        assert!(alive(*pid), "{name} died with its sibling");
    }
    assert_eq!(request(&sock, "GET", "/vm", None).0, 200);
    for (_, pid, _) in &clones {
        kill(*pid);
    }
    parent.signal(libc::SIGTERM);
    parent.wait_exit(TIMEOUT);
}

/// A fork's clones are held until every clone of the fork is ready, then all go at once: no
/// clone's guest runs (its probe reports that it resumed) before the last clone was ready,
/// and all of them run once the fork has answered.
#[test]
fn clones_are_held_until_every_clone_is_ready_then_all_run() {
    let dir = TestDir::new("fork-held");
    let sock = dir.join("p.sock");
    let mut parent = probe::boot(64, &sock, "p");
    let asked = mayfly_sys::trace::monotonic_ns();
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/fork",
        Some(serde_json::json!({ "count": 8 })),
    );
    assert_eq!(status, 200, "{body}");
    let clones = body["clones"].as_array().unwrap();
    // The fork's clock starts after `asked`: the last clone was ready no earlier than this.
    let last_ready_ms = clones
        .iter()
        .map(|c| c["ready_ms"].as_f64().unwrap())
        .fold(0.0, f64::max);
    let last_ready_ns = asked + (last_ready_ms * 1e6) as u64;
    for clone in clones {
        let name = clone["name"].as_str().unwrap();
        let log = PathBuf::from(clone["console_log"].as_str().unwrap());
        probe::resumed_generation(&log);
        let text = std::fs::read_to_string(&log).unwrap();
        let (_, _, resumed_ns) = probe::reports(&text)
            .into_iter()
            .find(|r| r.0 == "resumed")
            .unwrap();
        assert!(
            resumed_ns >= last_ready_ns,
            "{name} ran {:.3} ms before the fork's last clone was ready",
            (last_ready_ns - resumed_ns) as f64 / 1e6
        );
        let (status, vm) = request(&dir.join(&format!("{name}.sock")), "GET", "/vm", None);
        assert_eq!(status, 200, "{vm}");
        assert_eq!(vm["state"], "running", "{vm}");
    }
    for clone in clones {
        kill(clone["pid"].as_u64().unwrap() as u32);
    }
    parent.signal(libc::SIGTERM);
    parent.wait_exit(TIMEOUT);
}

#[test]
fn a_lazy_restore_still_loading_its_memory_can_be_forked() {
    let dir = TestDir::new("fork-lazy");
    // 512 MiB, all of it written: the restored VM's handler has a long prefetch to do.
    let sock = dir.join("l.sock");
    let mut vm = Guest::start(&[
        "run",
        "--probe",
        "--kernel",
        probe::ELF,
        "--mem-mib",
        "512",
        "--cmdline",
        "touch=100",
        "--console",
        "/dev/null",
        "--name",
        "l",
        "--api-sock",
        &sock.to_string_lossy(),
    ]);
    assert!(
        vm.wait_stderr("mayfly-probe: waiting", probe::TIMEOUT),
        "{}",
        vm.stderr()
    );
    // A run through once, so that the snapshot records the whole working set.
    let snap = dir.join("snap");
    probe::snapshot(&sock, &snap);
    vm.signal(libc::SIGTERM);
    vm.wait_exit(TIMEOUT);

    let rsock = dir.join("r.sock");
    let mut restored = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--memory",
        "lazy",
        "--console",
        "/dev/null",
        "--api-sock",
        &rsock.to_string_lossy(),
    ]);
    // Fork as soon as the socket answers: the prefetch of 512 MiB is still under way.
    let deadline = Instant::now() + TIMEOUT;
    while api::request_with_timeout(&rsock, "GET", "/vm", None, TIMEOUT).is_err() {
        assert!(Instant::now() < deadline, "{}", restored.stderr());
        std::thread::sleep(Duration::from_millis(1));
    }
    let clones = fork(&rsock, 1);
    // The parent carries on and reads back every page it wrote, and so does the clone.
    assert!(
        restored.wait_stderr("mayfly-probe: verified", probe::TIMEOUT),
        "{}",
        restored.stderr()
    );
    assert!(
        !restored.stderr().contains("mismatch"),
        "{}",
        restored.stderr()
    );
    assert_eq!(request(&rsock, "GET", "/vm", None).0, 200);
    let log = &clones[0].2;
    let deadline = Instant::now() + probe::TIMEOUT;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let reports = probe::reports(&text);
        assert!(!reports.iter().any(|r| r.0 == "mismatch"), "{text}");
        if reports.iter().any(|r| r.0 == "verified") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the clone never verified: {text}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    kill(clones[0].1);
    restored.signal(libc::SIGTERM);
    restored.wait_exit(TIMEOUT);
}

#[test]
fn a_clone_of_a_clone_holds_nothing_of_its_grandparent() {
    let dir = TestDir::new("fork-grandchild");
    let sock = dir.join("g.sock");
    let mut grandparent = probe::boot(64, &sock, "g");
    let child = fork(&sock, 1).remove(0);
    probe::resumed_generation(&child.2);
    let grandchild = fork(&dir.join("g-0.sock"), 1).remove(0);
    assert_eq!(grandchild.0, "g-0-0");
    probe::resumed_generation(&grandchild.2);
    // The grandparent's guest RAM is the child's base: the child holds it, the grandchild
    // (whose base is the child's memory, copied) must not.
    let theirs = memfd_inodes(grandparent.pid());
    assert!(!theirs.is_empty());
    let mine = memfd_inodes(grandchild.1);
    assert!(!mine.is_empty(), "the grandchild maps its own base");
    for inode in &mine {
        assert!(
            !theirs.contains(inode),
            "the grandchild pins its grandparent's memory (inode {inode})"
        );
    }
    kill(grandchild.1);
    kill(child.1);
    grandparent.signal(libc::SIGTERM);
    grandparent.wait_exit(TIMEOUT);
}

#[test]
fn a_restored_parent_numbers_its_clones_on_and_leaves_the_live_ones_alone() {
    let dir = TestDir::new("fork-renumber");
    let sock = dir.join("n.sock");
    let mut parent = probe::boot(64, &sock, "n");
    let first = fork(&sock, 1).remove(0);
    assert_eq!(first.0, "n-0");
    probe::resumed_generation(&first.2);
    let log_before = std::fs::read(&first.2).unwrap();
    let snap = dir.join("snap");
    probe::snapshot(&sock, &snap);
    parent.signal(libc::SIGTERM);
    parent.wait_exit(TIMEOUT);

    // Restored beside its live clone: its next clone is n-1, and n-0's files are untouched.
    let rsock = dir.join("n-again.sock");
    let mut restored = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--console",
        "/dev/null",
        "--api-sock",
        &rsock.to_string_lossy(),
    ]);
    probe::wait_report(&restored, "resumed");
    let second = fork(&rsock, 1).remove(0);
    assert_eq!(second.0, "n-1");
    probe::resumed_generation(&second.2);
    assert!(alive(first.1), "n-0 still runs");
    let log_after = std::fs::read(&first.2).unwrap();
    assert!(
        log_after.starts_with(&log_before),
        "n-0's log was written over: {}",
        String::from_utf8_lossy(&log_after)
    );
    assert!(std::fs::metadata(dir.join("n-0.in"))
        .unwrap()
        .file_type()
        .is_fifo());
    kill(first.1);
    kill(second.1);
    restored.signal(libc::SIGTERM);
    restored.wait_exit(TIMEOUT);
}

#[test]
fn a_fork_that_fails_half_way_kills_the_clones_it_started_and_names_the_one_that_failed() {
    // A directory whose path makes a Unix socket path of 107 bytes (the most there is) for the
    // vsock socket of clones 0 to 9, and one byte too many for clone 10's.
    let base = TestDir::new("fork-half");
    let target = 97;
    let mut dir = base.0.clone();
    let room = target - dir.as_os_str().len() - 1;
    assert!(
        room > 0 && room < 200,
        "temp dir path too long for this test"
    );
    dir.push("d".repeat(room));
    std::fs::create_dir_all(&dir).unwrap();
    assert_eq!(dir.as_os_str().len(), target);
    let sock = dir.join("h.sock");
    let vsock = base.join("h.vsock");
    let mut parent = Guest::start(&[
        "run",
        "--probe",
        "--kernel",
        probe::ELF,
        "--mem-mib",
        "64",
        "--cmdline",
        "touch=1",
        "--console",
        "/dev/null",
        "--name",
        "h",
        "--api-sock",
        &sock.to_string_lossy(),
        "--vsock",
        &vsock.to_string_lossy(),
    ]);
    assert!(
        parent.wait_stderr("mayfly-probe: waiting", probe::TIMEOUT),
        "{}",
        parent.stderr()
    );
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/fork",
        Some(serde_json::json!({ "count": 11 })),
    );
    assert_eq!(status, 500, "{body}");
    let error = body["error"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("clone h-10 did not start"), "{error}");
    // Clones h-0 to h-9 had been made (each request is served in order, and h-10's came
    // after theirs), and the fork killed them.
    let killed: usize = error
        .split_once("stopped (")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of killed processes in: {error}"));
    assert!(killed >= 10, "{error}");
    // Every clone that did start was killed (through its pidfd).
    let deadline = Instant::now() + Duration::from_secs(10);
    for n in 0..10 {
        let log = dir.join(format!("h-{n}.log"));
        while !processes_writing(&log).is_empty() {
            assert!(Instant::now() < deadline, "h-{n} still runs");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // The parent runs on.
    assert_eq!(request(&sock, "GET", "/vm", None).0, 200);
    parent.signal(libc::SIGTERM);
    parent.wait_exit(TIMEOUT);
}

/// The cgroup hierarchy with the pids controller this machine has: (its mount point, the
/// cgroup of this process in it), v2 first.
fn pids_hierarchy() -> (PathBuf, PathBuf) {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let path = |wanted: &dyn Fn(&str) -> bool| {
        cgroups.lines().find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            wanted(controllers).then(|| path.trim_start_matches('/').to_string())
        })
    };
    let v2 = Path::new("/sys/fs/cgroup/cgroup.subtree_control");
    if std::fs::read_to_string(v2).is_ok_and(|c| c.split_whitespace().any(|c| c == "pids")) {
        let mount = PathBuf::from("/sys/fs/cgroup");
        return (mount.clone(), mount.join(path(&|c| c.is_empty()).unwrap()));
    }
    let v1 = PathBuf::from("/sys/fs/cgroup/pids");
    assert!(
        v1.join("cgroup.procs").exists(),
        "this test needs a pids cgroup controller (cgroup v2 with pids enabled at the root, or a v1 pids hierarchy)"
    );
    let own = path(&|c| c.split(',').any(|c| c == "pids")).unwrap();
    (v1.clone(), v1.join(own))
}

#[test]
fn forks_beyond_the_vmms_descriptor_and_cgroup_limits_are_refused_before_any_clone_starts() {
    let dir = TestDir::new("fork-limits");
    let sock = dir.join("l.sock");
    let mut parent = probe::boot(64, &sock, "l");
    let pid = parent.pid().to_string();
    let refused = |count: u32, what: &str| {
        let (status, body) = request(
            &sock,
            "PUT",
            "/vm/fork",
            Some(serde_json::json!({ "count": count })),
        );
        assert_eq!(status, 507, "{body}");
        let error = body["error"].as_str().unwrap_or_default().to_string();
        assert!(error.contains(what), "{error}");
        assert!(
            !dir.join("l-0.log").exists(),
            "nothing of a clone was made: {error}"
        );
    };

    // Descriptors: a console log and a pidfd per clone while they start. Only the soft limit
    // is lowered (raising a hard limit takes CAP_SYS_RESOURCE, which a container may lack).
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .unwrap()
        .to_string();
    let prlimit = |soft: &str| {
        let status = std::process::Command::new("prlimit")
            .args(["--pid", &pid, &format!("--nofile={soft}:")])
            .status()
            .expect("run prlimit (util-linux)");
        assert!(status.success(), "prlimit --nofile={soft}:");
    };
    prlimit("128");
    refused(100, "RLIMIT_NOFILE");
    prlimit(&soft);

    // Tasks: the parent in a cgroup of its own with room for a few more, made at the top of
    // the hierarchy (under cgroup v2, a cgroup holding processes, such as a login session's,
    // cannot give its children a pids controller).
    let (mount, own) = pids_hierarchy();
    let cgroup = mount.join(format!("mayfly-test-{}", std::process::id()));
    std::fs::create_dir(&cgroup).unwrap();
    std::fs::write(cgroup.join("cgroup.procs"), &pid).unwrap();
    let current: u64 = std::fs::read_to_string(cgroup.join("pids.current"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    std::fs::write(cgroup.join("pids.max"), (current + 20).to_string()).unwrap();
    refused(10, "pids.max of the cgroup");
    std::fs::write(own.join("cgroup.procs"), &pid).unwrap();
    std::fs::remove_dir(&cgroup).unwrap();

    // Back within its limits, the same VM forks.
    let clones = fork(&sock, 2);
    assert_eq!(clones.len(), 2);
    for (_, pid, _) in &clones {
        kill(*pid);
    }
    parent.signal(libc::SIGTERM);
    parent.wait_exit(TIMEOUT);
}

#[test]
fn clones_ready_when_their_forking_vmm_dies_mid_fork_stop_rather_than_run_unknown() {
    let dir = TestDir::new("fork-orphans");
    let sock = dir.join("o.sock");
    // One clone at a time, so that the fork is still under way when its first clones are
    // ready (and held) and the VMM is killed.
    let parent = Guest::start_with(
        std::process::Command::new(mayfly_tests::guest::mayfly_bin())
            .env("MAYFLY_FORK_IN_FLIGHT", "1")
            .args(["run", "--probe", "--kernel", probe::ELF, "--mem-mib", "64"])
            .args(["--cmdline", "touch=1", "--console", "/dev/null"])
            .args(["--name", "orph7"])
            .arg("--api-sock")
            .arg(&sock),
    );
    assert!(
        parent.wait_stderr("mayfly-probe: waiting", probe::TIMEOUT),
        "the probe did not boot: {}",
        parent.stderr()
    );
    let count = 60;
    let forking = {
        let sock = sock.clone();
        std::thread::spawn(move || {
            api::request_with_timeout(
                &sock,
                "PUT",
                "/vm/fork",
                Some(&serde_json::json!({ "count": count })),
                TIMEOUT,
            )
        })
    };
    // Clone 2's control socket is bound before it reports ready: once it is there, clones 0
    // and 1 are ready and held, and the fork (one clone at a time) is far from done.
    let deadline = Instant::now() + TIMEOUT;
    while !dir.join("orph7-2.sock").exists() {
        assert!(Instant::now() < deadline, "the fork's clones never started");
        std::thread::sleep(Duration::from_micros(200));
    }
    let log = |i: u32| dir.join(&format!("orph7-{i}.log"));
    let held: Vec<u32> = processes_writing(&log(0))
        .into_iter()
        .chain(processes_writing(&log(1)))
        .collect();
    assert_eq!(held.len(), 2, "clones 0 and 1 run as processes");
    // SAFETY: kill(2) of the VMM this test started.
    unsafe { libc::kill(parent.pid() as i32, libc::SIGKILL) };
    let answer = forking.join().unwrap();
    assert!(
        !matches!(answer, Ok((200, _))),
        "the fork was answered: {answer:?}"
    );
    // No clone of the fork runs on: the ready ones see their VMM gone without the fork's
    // word and stop, the others die with the zygote.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let left: Vec<(u32, u32)> = (0..count)
            .flat_map(|i| {
                processes_writing(&log(i))
                    .into_iter()
                    .map(move |pid| (i, pid))
            })
            .collect();
        if left.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            left.iter().for_each(|&(_, pid)| kill(pid));
            panic!("clones ran on after their forking VMM died: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let said = std::fs::read_to_string(log(0)).unwrap_or_default();
    assert!(
        said.contains("the VMM that forked it ended before its fork did"),
        "clone 0 says why it stopped: {said}"
    );
    drop(parent);
}

/// A memfd holding `bytes`, with `seals` added (none: writable).
fn memfd_with(bytes: &[u8], seals: libc::c_int) -> std::fs::File {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd = unsafe {
        libc::memfd_create(
            c"liar".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor nothing else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes).unwrap();
    if seals != 0 {
        // SAFETY: fcntl on our own memfd; checked.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) }, 0);
    }
    file
}

/// A fake VMM on `sock` that says it is jailed and answers a fork's capture with `answer`,
/// every request on its own connection, until the test ends.
fn lying_vmm(sock: &Path, answer: serde_json::Value) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let mut length = 0usize;
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                    break;
                }
                if let Some(value) = header.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0u8; length];
            let _ = reader.read_exact(&mut body);
            let reply = if line.starts_with("GET /vm ") {
                serde_json::json!({ "name": "liar", "state": "running", "jail": { "uid": 1 } })
            } else if line.starts_with("PUT /vm/fork/capture") {
                answer.clone()
            } else {
                serde_json::json!({})
            };
            let text = reply.to_string();
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
}

/// A jailed VM's fork is finished outside it, from the descriptors its VMM hands over: a VMM
/// taken over by its guest may hand over anything. Memory its clones would map that it could
/// still change (an unsealed memfd, a memory layer that is a file others may write, too many
/// layers) is refused before any clone is made, and the fork says why.
#[test]
fn a_fork_refuses_memory_its_vmm_could_still_change() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;
    let dir = TestDir::new("fork-liar");
    let all = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    let state = memfd_with(b"state", all);
    let sealed = memfd_with(b"memory", all);
    let writable = memfd_with(b"memory", 0);
    let shared_file = dir.join("others-may-write");
    std::fs::write(&shared_file, b"memory").unwrap();
    std::fs::set_permissions(&shared_file, std::fs::Permissions::from_mode(0o666)).unwrap();
    let shared = std::fs::File::open(&shared_file).unwrap();
    let capture = |memory: &std::fs::File, layers: Vec<i32>| {
        serde_json::json!({
            "state_fd": state.as_raw_fd(),
            "memory_fd": memory.as_raw_fd(),
            "memory_layer_fds": layers,
            "parent": "liar",
            "first_clone": 0,
            "disks": false,
            "copied_bytes": 0,
            "pause_ms": 0.0,
            "state_ms": 0.0,
            "freeze_ms": 0.0,
        })
    };
    let cases = [
        (
            "unsealed",
            capture(&writable, vec![]),
            "is not a sealed file",
        ),
        (
            "shared-layer",
            capture(&sealed, vec![shared.as_raw_fd()]),
            "nor a file only uid 0 may write",
        ),
        (
            "writable-layer",
            capture(&sealed, vec![writable.as_raw_fd()]),
            "nor a file only uid 0 may write",
        ),
        (
            "deep",
            capture(&sealed, vec![sealed.as_raw_fd(); 17]),
            "memory has 18 layers",
        ),
    ];
    for (name, answer, said) in cases {
        let sock = dir.join(&format!("{name}.sock"));
        lying_vmm(&sock, answer);
        let out = std::process::Command::new(mayfly_tests::guest::mayfly_bin())
            .args(["fork", "--sock", &sock.to_string_lossy(), "--count", "1"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains(said), "{name}: {stderr}");
        // Nothing was made beside the socket.
        let made: Vec<_> = std::fs::read_dir(&dir.0)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("liar-"))
            .collect();
        assert!(made.is_empty(), "{name}: {made:?}");
    }
}
