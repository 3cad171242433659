//! The forking VMM's side of the protocol against a fake zygote on a socket pair: every
//! way the other side can go wrong ends the fork with an error and kills what it started.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use mayfly_sys::pidfd;
use mayfly_sys::seqpacket::{self, Received};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::child::*;
use super::message::*;
use super::parent::*;

fn info(index: u32) -> CloneInfo {
    CloneInfo {
        name: format!("c-{index}"),
        index,
        pid: 0,
        api_sock: format!("/nonexistent/c-{index}.sock").into(),
        console_log: format!("/nonexistent/c-{index}.log").into(),
        console_input: Some(format!("/nonexistent/c-{index}.in").into()),
        vsock: format!("/nonexistent/c-{index}.vsock").into(),
        vsock_cid: 1000 + u64::from(index),
        net: None,
        jail: None,
        vmm_pid: None,
        policy: None,
        layers_moved: None,
        disk_dir: None,
        ready_ms: 0.0,
    }
}

fn clones(count: u32) -> Vec<CloneInfo> {
    (0..count).map(info).collect()
}

/// Follow a fork of `clones` on `ours` (each console log /dev/null) for up to a minute.
fn run(
    ours: &UnixDatagram,
    zygote: &OwnedFd,
    clones: Vec<CloneInfo>,
) -> Result<Vec<(CloneInfo, OwnedFd)>, ZygoteError> {
    let fork = Fork {
        socket: ours,
        zygote,
        parent: "p",
        open_log: &|_| File::open("/dev/null"),
    };
    follow(&fork, clones, Instant::now(), Duration::from_secs(60)).map_err(|(err, _)| err)
}

/// A process standing in for a clone (or the zygote), and its pidfd.
fn process() -> (Child, OwnedFd) {
    let child = Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("start sleep");
    let pidfd = pidfd::open(child.id().try_into().unwrap()).expect("pidfd_open");
    (child, pidfd)
}

/// Whether `child` had been killed by SIGKILL (it is killed and reaped either way).
fn was_killed(mut child: Child) -> bool {
    // The signal is on its way when the fork returns; give it time to land.
    for _ in 0..500 {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status.signal() == Some(libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    false
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn still_running(child: &mut Child) -> bool {
    child.try_wait().expect("try_wait").is_none()
}

fn message(message: &Message) -> Vec<u8> {
    encode(message).expect("encodes")
}

/// The zygote's end: read the requests, answer with `script` (a message and the pidfd to
/// pass with it), then hold the socket open for `hold` before closing it.
fn fake_zygote(
    theirs: UnixDatagram,
    requests: usize,
    script: Vec<(Message, Option<RawFd>)>,
    hold: Duration,
) -> std::thread::JoinHandle<Vec<Message>> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; MAX_MESSAGE];
        let mut got = Vec::new();
        for _ in 0..requests {
            match seqpacket::receive(&theirs, &mut buf).expect("receive a request") {
                Received::Message(len, fd) => {
                    assert!(fd.is_some(), "a request comes with its console log");
                    let fd = fd.unwrap();
                    // SAFETY: F_GETFD on a descriptor this test owns.
                    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
                    assert!(flags & libc::FD_CLOEXEC != 0, "received close-on-exec");
                    got.push(serde_json::from_slice(&buf[..len]).expect("a request parses"));
                }
                // The fork ended before it sent them all.
                Received::End => break,
                Received::Truncated(_) => panic!("expected a request"),
            }
        }
        for (msg, fd) in script {
            let bytes = message(&msg);
            match fd {
                Some(fd) => theirs.send_with_fd(&bytes[..], fd).map(drop).expect("send"),
                None => theirs.send(&bytes).map(drop).expect("send"),
            }
        }
        std::thread::sleep(hold);
        got
    })
}

#[test]
fn a_clone_that_reports_before_its_pid_arrives_is_listed_with_its_pid() {
    let (zygote, zygote_fd) = process();
    let (clone, clone_fd) = process();
    let (ours, theirs) = seqpacket::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let script = vec![
        (Message::Ready { index: 0, pid: 0 }, None),
        (
            Message::Forked {
                index: 0,
                pid: clone.id(),
            },
            Some(clone_fd.as_raw_fd()),
        ),
    ];
    let fake = fake_zygote(theirs, 1, script, Duration::from_secs(1));
    let started = run(&ours, &zygote_fd, clones(1)).expect("the fork succeeds");
    let requests = fake.join().unwrap();
    assert!(
        matches!(&requests[0], Message::Start { parent, clone } if parent == "p" && clone.index == 0)
    );
    assert_eq!(started.len(), 1);
    assert_eq!(started[0].0.pid, clone.id());
    // SAFETY: F_GETFD on a descriptor this test owns.
    let flags = unsafe { libc::fcntl(started[0].1.as_raw_fd(), libc::F_GETFD) };
    assert!(flags & libc::FD_CLOEXEC != 0, "pidfds arrive close-on-exec");
    assert!(
        !was_killed(clone),
        "a clone of a fork that succeeded is left running"
    );
    stop(zygote);
}

#[test]
fn a_clone_reported_ready_that_the_zygote_never_handed_over_fails_the_fork() {
    // Before: this was a success with pid 0 (and `kill 0` is the caller's own group).
    let (zygote, zygote_fd) = process();
    let (ours, theirs) = seqpacket::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let fake = fake_zygote(
        theirs,
        1,
        vec![(Message::Ready { index: 0, pid: 0 }, None)],
        Duration::ZERO,
    );
    let err = run(&ours, &zygote_fd, clones(1)).expect_err("no pid, no success");
    fake.join().unwrap();
    assert!(
        matches!(&err, ZygoteError::CloneFailed { name, reason, .. } if name == "c-0" && reason.contains("never said which process")),
        "{err}"
    );
    stop(zygote);
}

#[test]
fn a_clone_known_only_by_its_own_report_is_killed_when_the_fork_fails() {
    // The zygote forked it but never said so (it stalled or died); the clone ran and
    // reported with its own pidfd, then another clone failed.
    let (zygote, zygote_fd) = process();
    let (a, a_fd) = process();
    let (ours, theirs) = seqpacket::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let script = vec![
        (
            Message::Ready {
                index: 0,
                pid: a.id(),
            },
            Some(a_fd.as_raw_fd()),
        ),
        (
            Message::NotForked {
                index: 1,
                reason: "fork(2) failed".into(),
            },
            None,
        ),
    ];
    let fake = fake_zygote(theirs, 2, script, Duration::from_secs(1));
    let err = run(&ours, &zygote_fd, clones(2)).expect_err("a clone failed");
    fake.join().unwrap();
    assert!(
        matches!(&err, ZygoteError::CloneFailed { name, .. } if name == "c-1"),
        "{err}"
    );
    assert!(was_killed(a), "the clone that reported by itself is killed");
    stop(zygote);
}

#[test]
fn one_clone_failing_kills_every_clone_the_fork_was_handed() {
    let (zygote, zygote_fd) = process();
    let (a, a_fd) = process();
    let (b, b_fd) = process();
    let (ours, theirs) = seqpacket::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let script = vec![
        (
            Message::Forked {
                index: 0,
                pid: a.id(),
            },
            Some(a_fd.as_raw_fd()),
        ),
        (Message::Ready { index: 0, pid: 0 }, None),
        (
            Message::Forked {
                index: 1,
                pid: b.id(),
            },
            Some(b_fd.as_raw_fd()),
        ),
        (
            Message::Failed {
                index: 1,
                reason: "no KVM for you".into(),
            },
            None,
        ),
    ];
    let fake = fake_zygote(theirs, 2, script, Duration::from_secs(1));
    let err = run(&ours, &zygote_fd, clones(2)).expect_err("a clone failed");
    fake.join().unwrap();
    assert!(
        matches!(&err, ZygoteError::CloneFailed { name, reason, killed: 2, .. } if name == "c-1" && reason == "no KVM for you"),
        "{err}"
    );
    assert!(was_killed(a), "the clone that ran is killed");
    assert!(was_killed(b), "the clone that failed is killed");
    stop(zygote);
}

#[test]
fn a_message_the_buffer_cannot_hold_ends_the_fork_and_kills_its_clones() {
    // Before: a read error returned at once and left the clones handed over so far running.
    let (zygote, zygote_fd) = process();
    let (a, a_fd) = process();
    let (b, b_fd) = process();
    let (ours, theirs) = seqpacket::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let (a_pid, a_raw, b_raw) = (a.id(), a_fd.as_raw_fd(), b_fd.as_raw_fd());
    let fake = std::thread::spawn(move || {
        let mut buf = vec![0u8; MAX_MESSAGE];
        seqpacket::receive(&theirs, &mut buf).expect("a request");
        let forked = message(&Message::Forked {
            index: 0,
            pid: a_pid,
        });
        theirs.send_with_fd(&forked[..], a_raw).expect("send");
        let huge = vec![b' '; MAX_MESSAGE + 1];
        theirs.send_with_fd(&huge[..], b_raw).expect("send");
        std::thread::sleep(Duration::from_secs(1));
    });
    let err = run(&ours, &zygote_fd, clones(1)).expect_err("the zygote broke the protocol");
    fake.join().unwrap();
    assert!(matches!(err, ZygoteError::Protocol(_)), "{err}");
    assert!(was_killed(a), "the clone handed over is killed");
    assert!(
        was_killed(b),
        "the process whose pidfd came with the bad message is killed"
    );
    stop(zygote);
}

#[test]
fn the_zygote_ending_fails_the_clones_it_never_answered_for_at_once() {
    // Before: the fork waited for its whole timeout (120 s) when the zygote died.
    let (mut zygote, zygote_fd) = process();
    let (ours, theirs) = seqpacket::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    // The socket stays open (a clone may still hold it) while the zygote dies.
    let fake = fake_zygote(theirs, 2, vec![], Duration::from_secs(2));
    zygote.kill().unwrap();
    let err = run(&ours, &zygote_fd, clones(2)).expect_err("no zygote, no clones");
    assert!(
        matches!(&err, ZygoteError::CloneFailed { reason, .. } if reason.contains("zygote ended before it made its process")),
        "{err}"
    );
    assert!(!still_running(&mut zygote));
    drop(ours);
    fake.join().unwrap();
}

#[test]
fn a_clone_whose_paths_cannot_be_sent_fails_without_reaching_the_zygote() {
    use std::os::unix::ffi::OsStrExt;
    let (zygote, zygote_fd) = process();
    let (ours, theirs) = seqpacket::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let mut clone = info(0);
    clone.console_log = std::ffi::OsStr::from_bytes(b"/tmp/\xff.log").into();
    let err = run(&ours, &zygote_fd, vec![clone]).expect_err("a path that is not UTF-8");
    assert!(
        matches!(&err, ZygoteError::CloneFailed { reason, .. } if reason.contains("not UTF-8")),
        "{err}"
    );
    theirs.set_nonblocking(true).unwrap();
    let mut buf = vec![0u8; MAX_MESSAGE];
    assert!(
        seqpacket::receive(&theirs, &mut buf).is_err(),
        "nothing was sent (not even an empty message, which reads as the end)"
    );
    stop(zygote);
}

/// The forking VMM's end closed with a message still unread on it: the clones' end says
/// ECONNRESET once before its queue, and a clone still finds the word after it.
#[test]
fn a_clone_finds_the_go_even_when_its_forks_end_closed_with_messages_unread() {
    let (vmm, clones) = seqpacket::pair().unwrap();
    // A zygote's late word, never read by the forking VMM.
    clones
        .send(&message(&Message::Exited {
            index: 0,
            status: "x".into(),
        }))
        .unwrap();
    vmm.send(&message(&Message::Go)).unwrap();
    drop(vmm);
    let look = clones.try_clone().unwrap();
    assert!(ForkEnd(clones).wait(), "the clone found its fork's word");
    // Looked at, not taken: the next clone finds it too.
    assert!(ForkEnd(look).wait(), "the next clone found it too");
}

/// A release lets the clones run only if the fork's answer reached its client.
#[test]
fn clones_run_only_if_their_forks_answer_was_delivered() {
    for delivered in [true, false] {
        let (vmm, clones) = seqpacket::pair().unwrap();
        vmm.set_nonblocking(true).unwrap();
        clones
            .send(&message(&Message::Exited {
                index: 0,
                status: "x".into(),
            }))
            .unwrap();
        let release = Release::new(vmm);
        if delivered {
            release.delivered();
        }
        drop(release);
        assert_eq!(ForkEnd(clones).wait(), delivered);
    }
    // The forking VMM gone without a word (it died mid-fork): no clone runs.
    let (vmm, clones) = seqpacket::pair().unwrap();
    drop(vmm);
    assert!(!ForkEnd(clones).wait());
}

#[test]
fn a_clone_failure_of_any_length_and_content_reaches_the_fork() {
    // Before: 4 KiB of control characters grew past the 16 KiB message limit in JSON.
    let (ours, theirs) = seqpacket::pair().unwrap();
    Reporter {
        socket: theirs,
        index: 7,
    }
    .failed(&"\u{1}é".repeat(20_000));
    let mut buf = vec![0u8; MAX_MESSAGE];
    let Received::Message(len, None) = seqpacket::receive(&ours, &mut buf).expect("a message")
    else {
        panic!("expected one whole message");
    };
    match serde_json::from_slice(&buf[..len]).expect("it parses") {
        Message::Failed { index: 7, reason } => {
            assert!(
                !reason.is_empty() && reason.len() <= MAX_REASON,
                "{}",
                reason.len()
            );
        }
        other => panic!("unexpected {other:?}"),
    }
}
