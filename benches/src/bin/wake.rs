//! Wake on connect: a connection to a sleeping sandbox's exposed port, to the first byte its
//! guest's server sends, against a wake on exec (an exec of `true` sent to the sleeping
//! sandbox, to its answer) of the same sandbox, interleaved in the same run. With the default
//! Linux guest (run through `benches/run wake`: the host's KVM or the rig's), through a default
//! (jailed) `mayfly serve`; the guest's server is busybox `nc` answering each connection with
//! a line. Also, as the floor of each: the same connection and the same exec to the sandbox
//! awake.
//!
//! Target (issue "the pieces compose"): wake on connect ≤ 1.5× wake on exec.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use mayfly_benches::{emit_report, Machine, Stats};
use mayfly_tests::agent::wait_agent;
use mayfly_tests::guest::{TestDir, BOOT_TIMEOUT};
use mayfly_tests::serve::{call, Manager};
use serde::Serialize;
use serde_json::json;

#[derive(Parser)]
#[command(about = "Benchmark a wake on connect to an exposed port against a wake on exec")]
struct Args {
    /// Rounds; each measures one wake of each kind (and each floor).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    machine: Machine,
    runs: usize,
    /// Sleeping sandbox: connect to its port → the first byte its server sends.
    wake_on_connect_ms: Stats,
    /// Sleeping sandbox: `POST .../vm/exec {"argv": ["true"]}` → the answer.
    wake_on_exec_ms: Stats,
    /// Median wake on connect / median wake on exec (target ≤ 1.5).
    connect_over_exec: f64,
    /// Floors, the sandbox awake: the same connection, the same exec.
    awake_connect_ms: Stats,
    awake_exec_ms: Stats,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Connect to `addr` and wait for the first byte; the time it took, or why not.
fn first_byte(addr: SocketAddr) -> Result<f64, String> {
    let start = Instant::now();
    let mut conn = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    let mut byte = [0u8; 1];
    match conn.read(&mut byte) {
        Ok(1) => Ok(ms(start)),
        Ok(_) => Err("closed with nothing".into()),
        Err(e) => Err(format!("read: {e}")),
    }
}

/// The guest's server answers (it is a loop of one-shot `nc`: between two connections it may
/// not listen for a moment, and a connection it does not take is closed with nothing).
fn answered(addr: SocketAddr) -> f64 {
    let deadline = Instant::now() + BOOT_TIMEOUT;
    loop {
        match first_byte(addr) {
            Ok(t) => return t,
            Err(e) => assert!(Instant::now() < deadline, "{addr} never answered: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn main() {
    let args = Args::parse();
    let dir = TestDir::new("wake-bench");
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let m = Manager::start_with(&dir, &net.args());
    let token = m.create(json!({ "name": "web", "net": "allow=192.0.2.1" }));
    let sock = PathBuf::from(m.describe("web")["socket"].as_str().unwrap());
    wait_agent(&sock, BOOT_TIMEOUT);
    let exec = |argv: serde_json::Value| {
        let (status, body) = call(
            &m.sock,
            Some(&token),
            "POST",
            "/sandboxes/web/vm/exec",
            Some(json!({ "argv": argv })),
        );
        assert_eq!(status, 200, "exec: {body}");
        assert_eq!(body["exit"]["exit_code"], 0, "exec: {body}");
    };
    exec(json!([
        "sh",
        "-c",
        "(while true; do echo awake | nc -l -p 8080; done) </dev/null >/dev/null 2>&1 &"
    ]));
    let (status, opened) = m.admin(
        "POST",
        "/sandboxes/web/ports",
        Some(json!({"guest_port": 8080})),
    );
    assert_eq!(status, 201, "{opened}");
    let addr: SocketAddr = opened["host"]
        .as_str()
        .and_then(|h| h.strip_prefix("tcp:"))
        .and_then(|a| a.parse().ok())
        .expect("a loopback TCP port");
    answered(addr);
    let sleep = || {
        // The server is a loop of one-shot nc's: let the next one listen before the snapshot,
        // or the woken guest has nobody to take the connection.
        std::thread::sleep(Duration::from_millis(300));
        let (status, body) = m.admin("PUT", "/sandboxes/web/pause", None);
        assert_eq!(
            (status, body["state"].as_str()),
            (200, Some("suspended")),
            "{body}"
        );
    };

    let (mut on_connect, mut on_exec, mut awake_connect, mut awake_exec) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.runs {
        eprintln!("wake bench: round {}/{}", i + 1, args.runs);
        // Which kind goes first alternates, so neither always follows the other's wake.
        for kind in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            sleep();
            if kind == 0 {
                on_connect.push(first_byte(addr).expect("a wake on connect answers"));
                // Awake: the server may be between two nc's; the first answer is the floor.
                awake_connect.push(answered(addr));
            } else {
                let start = Instant::now();
                exec(json!(["true"]));
                on_exec.push(ms(start));
                let start = Instant::now();
                exec(json!(["true"]));
                awake_exec.push(ms(start));
            }
        }
    }
    let median = |v: &[f64]| Stats::of(v).map_or(f64::NAN, |s| s.median);
    let report = Report {
        bench: "wake",
        machine: Machine::describe(),
        runs: args.runs,
        connect_over_exec: median(&on_connect) / median(&on_exec),
        wake_on_connect_ms: Stats::of(&on_connect).unwrap_or_default(),
        wake_on_exec_ms: Stats::of(&on_exec).unwrap_or_default(),
        awake_connect_ms: Stats::of(&awake_connect).unwrap_or_default(),
        awake_exec_ms: Stats::of(&awake_exec).unwrap_or_default(),
    };
    eprintln!(
        "wake bench: wake on connect {:.1} ms vs wake on exec {:.1} ms ({:.2}x, target ≤ 1.5); \
         awake: connect {:.1} ms, exec {:.1} ms",
        median(&on_connect),
        median(&on_exec),
        report.connect_over_exec,
        median(&awake_connect),
        median(&awake_exec)
    );
    assert_eq!(m.admin("DELETE", "/sandboxes/web", None).0, 200);
    emit_report("wake", &report, args.out.as_deref());
}
