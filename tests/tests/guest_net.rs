//! The guest's network, seen from inside real guests: `--net none` has no NIC, an allowlist
//! lets out what it lists and nothing else (denials fail fast and are counted), tightening
//! the policy at runtime cuts an open connection, a guest that changes its address or MAC gets
//! nothing out, snapshots and restores keep the policy, clones reach the allowed server at once
//! each with its own outside address and MAC, an exposed guest port answers on the host, and a
//! VMM killed with -9 leaves nothing behind. Run through tests/run (the host's KVM or the rig's).
//!
//! All traffic stays inside network namespaces this test creates: an "uplink" namespace per
//! test stands in for the host, and routes on to an "internet" namespace behind it with
//! servers on documentation addresses of its own (a VM never reaches the host's own
//! addresses, so the servers cannot live in the uplink itself).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mayfly_agent_protocol::ExecRequest;
use mayfly_tests::agent::{exec_request, sh, wait_agent};
use mayfly_tests::guest::{mayfly_ok, request, Guest, TestDir, BOOT_TIMEOUT};
use mayfly_tests::netns::{sh_in, Internet};

/// The "internet", a namespace behind the uplink.
const SERVER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const OTHER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const PORT: u16 = 8080;
/// Network namespaces of this test's own: the uplink VMs' traffic goes out to (the host),
/// and the internet behind it, holding the servers VMs may or may not reach.
struct Uplink {
    ns: File,
    internet: File,
}

impl Uplink {
    fn new() -> Self {
        for tool in ["ip", "nft"] {
            let found = Command::new(tool)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok();
            assert!(
                found,
                "{tool} is not installed (scripts/setup.sh installs it)"
            );
        }
        let Internet { uplink, internet } = Internet::new(&[SERVER, OTHER]);
        Self {
            ns: uplink,
            internet,
        }
    }

    /// The path mayfly is given as `--net-uplink` (valid while this test runs).
    fn path(&self) -> String {
        mayfly_tests::netns::path_of(&self.ns)
    }

    /// Run `tool args...` in the uplink namespace.
    fn sh(&self, tool: &str, args: &[&str]) -> String {
        sh_in(&self.ns, tool, args)
    }

    /// A TCP server at `ip:PORT` in the internet namespace: it answers each connection with
    /// the client's address (as it sees it) and records what the client sent.
    fn server(&self, ip: Ipv4Addr) -> Server {
        // The listener keeps the namespace it was made in.
        let listener = mayfly_network::run_in(&self.internet, || TcpListener::bind((ip, PORT)))
            .unwrap()
            .unwrap();
        let conns: Conns = Arc::default();
        let seen = conns.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let peer = conn.peer_addr().unwrap();
                let received: Arc<Mutex<Vec<u8>>> = Arc::default();
                seen.lock().unwrap().push((peer, received.clone()));
                std::thread::spawn(move || {
                    let _ = writeln!(conn, "{}", peer.ip());
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        received.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                });
            }
        });
        Server { conns }
    }
}

/// A server's connections: the peer, and what it sent.
type Conns = Arc<Mutex<Vec<(SocketAddr, Arc<Mutex<Vec<u8>>>)>>>;

struct Server {
    conns: Conns,
}

impl Server {
    fn peers(&self) -> Vec<Ipv4Addr> {
        self.conns
            .lock()
            .unwrap()
            .iter()
            .map(|(peer, _)| match peer.ip() {
                std::net::IpAddr::V4(ip) => ip,
                other => panic!("an IPv6 peer {other}"),
            })
            .collect()
    }

    /// What the `n`th connection sent so far.
    fn received(&self, n: usize) -> String {
        let conns = self.conns.lock().unwrap();
        let bytes = conns[n].1.lock().unwrap().clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Boot the default guest with `--net net` in `dir`, its network made under `dir` and going
/// out to `uplink`; returns once its agent answers.
fn boot(dir: &TestDir, name: &str, net: &str, uplink: &Uplink) -> (Guest, PathBuf) {
    boot_with(dir, name, net, uplink, &[])
}

/// [`boot`] with more `mayfly run` arguments.
fn boot_with(
    dir: &TestDir,
    name: &str,
    net: &str,
    uplink: &Uplink,
    extra: &[&str],
) -> (Guest, PathBuf) {
    let sock = dir.join(&format!("{name}.sock"));
    let uplink_path = uplink.path();
    let net_dir = dir.arg("net");
    let console = dir.arg(&format!("{name}.log"));
    let sock_arg = sock.to_string_lossy().into_owned();
    let mut args = vec![
        "run",
        "--name",
        name,
        "--api-sock",
        &sock_arg,
        "--console",
        &console,
        "--net",
        net,
        "--net-dir",
        &net_dir,
        "--net-uplink",
        &uplink_path,
    ];
    args.extend_from_slice(extra);
    let guest = Guest::start(&args);
    wait_for(&guest, &sock);
    (guest, sock)
}

/// Wait for the agent of the VM `guest` serves on `sock`; a VMM that failed to start fails
/// the test with what it said.
fn wait_for(guest: &Guest, sock: &Path) {
    let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_agent(sock, BOOT_TIMEOUT);
    }));
    if answered.is_err() {
        panic!(
            "the VM on {} never answered; its VMM said:\n{}",
            sock.display(),
            guest.stderr(),
        );
    }
}

fn net_info(sock: &Path) -> serde_json::Value {
    let (status, body) = request(sock, "GET", "/vm/net", None);
    assert_eq!(status, 200, "GET /vm/net: {body}");
    body
}

/// Connect from the guest to `ip:PORT`, send `line`, return (exit code, what came back).
fn guest_connect(sock: &Path, ip: Ipv4Addr, line: &str) -> (Option<i32>, String, String) {
    let out = exec_request(
        sock,
        ExecRequest::shell(format!("echo {line} | nc -w 5 {ip} {PORT}")),
        None,
    );
    (
        out.exit.exit_code,
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

#[test]
fn net_none_gives_the_guest_no_nic() {
    let dir = TestDir::new("net-none");
    let sock = dir.join("none.sock");
    let guest = Guest::start(&[
        "run",
        "--name",
        "none",
        "--api-sock",
        &sock.to_string_lossy(),
        "--console",
        &dir.arg("none.log"),
    ]);
    wait_for(&guest, &sock);
    assert_eq!(sh(&sock, "ls /sys/class/net"), "lo");
    assert_eq!(sh(&sock, "ip route | wc -l"), "0", "a route out");
    let (status, body) = request(&sock, "GET", "/vm/net", None);
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("--net none"),
        "{body}"
    );
}

#[test]
fn an_allowlist_is_enforced_outside_the_guest_and_kept_by_restore() {
    let uplink = Uplink::new();
    let allowed = uplink.server(SERVER);
    let denied = uplink.server(OTHER);
    let dir = TestDir::new("net-allow");
    let policy = format!("allow={SERVER}/32:{PORT}");
    let (mut guest, sock) = boot(&dir, "allow", &policy, &uplink);
    let info = net_info(&sock);
    assert_eq!(info["policy"], policy.as_str());
    let outside: Ipv4Addr = info["outside_ip"].as_str().unwrap().parse().unwrap();

    // The allowed server answers, and sees the VM's own outside address.
    let (code, answer, err) = guest_connect(&sock, SERVER, "hello");
    assert_eq!(code, Some(0), "stderr: {err}");
    assert_eq!(answer, outside.to_string());
    assert_eq!(allowed.peers(), vec![outside]);

    // The denied one is refused at once (a reset from the host side, not a timeout), never
    // reached, and counted.
    let started = Instant::now();
    let (code, _, err) = guest_connect(&sock, OTHER, "nope");
    assert_ne!(code, Some(0), "a denied server was reached");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the denied connection was not refused but timed out: {err}"
    );
    assert!(denied.peers().is_empty());
    let counters = &net_info(&sock)["counters"];
    assert!(counters["denied"].as_u64().unwrap() >= 1, "{counters}");
    assert!(counters["allowed"].as_u64().unwrap() >= 1, "{counters}");

    // Tightening the policy cuts an open connection: the guest sends "before", the policy
    // stops allowing the server, the guest sends "after", which never arrives.
    sh(
        &sock,
        &format!(
            "(echo before; sleep 3; echo after) | nc -w 10 {SERVER} {PORT} >/tmp/cut.out 2>&1 & \
             echo started"
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while allowed.peers().len() < 2 || !allowed.received(1).contains("before") {
        assert!(
            Instant::now() < deadline,
            "the second connection never arrived"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = mayfly_ok(&[
        "net",
        "--sock",
        &sock.to_string_lossy(),
        "--policy",
        "allow=192.0.2.1",
    ]);
    assert!(out.contains("allow=192.0.2.1"), "{out}");
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        allowed.received(1),
        "before\n",
        "data got through after the policy changed"
    );

    // A guest that takes another address, or another MAC, still gets nothing out (the
    // anti-spoofing at the tap), even to what the policy allows again.
    mayfly_ok(&[
        "net",
        "--sock",
        &sock.to_string_lossy(),
        "--policy",
        &policy,
    ]);
    let spoofed_before = net_info(&sock)["counters"]["spoofed"].as_u64().unwrap();
    let spoof = exec_request(
        &sock,
        ExecRequest::shell(format!(
            "ip addr flush dev eth0; ip addr add 172.16.0.3/30 dev eth0; \
             ip route add default via 172.16.0.1; \
             echo x | nc -w 3 {SERVER} {PORT}; r1=$?; \
             ip addr flush dev eth0; ip link set eth0 address 02:00:00:00:00:66; \
             ip addr add 172.16.0.2/30 dev eth0; ip route add default via 172.16.0.1; \
             echo y | nc -w 3 {SERVER} {PORT}; r2=$?; echo $r1 $r2"
        )),
        None,
    );
    let results = String::from_utf8_lossy(&spoof.stdout).to_string();
    let codes: Vec<&str> = results.split_whitespace().collect();
    assert!(
        codes.len() == 2 && codes.iter().all(|c| *c != "0"),
        "a guest with another address or MAC got out: {results}"
    );
    assert_eq!(
        allowed.peers().len(),
        2,
        "a spoofed connection reached the server"
    );
    assert!(denied.peers().is_empty());
    let spoofed = net_info(&sock)["counters"]["spoofed"].as_u64().unwrap();
    assert!(spoofed > spoofed_before, "no spoofed frame counted");
    // Back to its own MAC: it reaches the allowed server again.
    let mac = net_info(&sock)["guest"]["mac"]
        .as_str()
        .unwrap()
        .to_string();
    sh(&sock, &format!("ip link set eth0 address {mac}"));
    assert_eq!(guest_connect(&sock, SERVER, "again").0, Some(0));

    // A snapshot keeps the policy; the restored VM (same MAC) reaches the server from a new
    // namespace of its own.
    let snap = dir.join("snap");
    mayfly_ok(&[
        "snapshot",
        "--sock",
        &sock.to_string_lossy(),
        &snap.to_string_lossy(),
    ]);
    mayfly_ok(&["shutdown", "--sock", &sock.to_string_lossy()]);
    guest.wait_exit(Duration::from_secs(60));
    let rsock = dir.join("restored.sock");
    let restored = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--api-sock",
        &rsock.to_string_lossy(),
        "--console",
        &dir.arg("restored.log"),
        "--net-dir",
        &dir.arg("net"),
        "--net-uplink",
        &uplink.path(),
    ]);
    wait_for(&restored, &rsock);
    let rinfo = net_info(&rsock);
    assert_eq!(rinfo["policy"], policy.as_str());
    assert_eq!(rinfo["guest"]["mac"], mac.as_str());
    let (code, answer, err) = guest_connect(&rsock, SERVER, "restored");
    assert_eq!(code, Some(0), "stderr: {err}");
    assert_eq!(answer, rinfo["outside_ip"].as_str().unwrap());
    assert_ne!(guest_connect(&rsock, OTHER, "nope").0, Some(0));
    assert!(denied.peers().is_empty());
}

#[test]
fn a_jailed_vm_reaches_what_its_policy_allows_and_only_root_changes_it() {
    let uplink = Uplink::new();
    let allowed = uplink.server(SERVER);
    let denied = uplink.server(OTHER);
    let dir = TestDir::new("net-jail");
    let policy = format!("allow={SERVER}/32:{PORT}");
    let jails = dir.arg("jails");
    let (mut guest, sock) = boot_with(
        &dir,
        "jailed",
        &policy,
        &uplink,
        &["--jail", "--jail-dir", &jails],
    );
    let (status, vm) = request(&sock, "GET", "/vm", None);
    assert_eq!(status, 200, "{vm}");
    assert_eq!(vm["jail"]["uid"], 65534, "{vm}");
    let info = net_info(&sock);
    assert_eq!(info["policy"], policy.as_str());
    let outside: Ipv4Addr = info["outside_ip"].as_str().unwrap().parse().unwrap();

    // Egress as unjailed: the allowed server answers and sees the VM's outside address; the
    // other is refused at once and counted.
    let (code, answer, err) = guest_connect(&sock, SERVER, "hello");
    assert_eq!(code, Some(0), "stderr: {err}");
    assert_eq!(answer, outside.to_string());
    let (code, _, _) = guest_connect(&sock, OTHER, "nope");
    assert_ne!(code, Some(0), "a denied server was reached");
    assert!(denied.peers().is_empty());
    let counters = &net_info(&sock)["counters"];
    assert!(counters["denied"].as_u64().unwrap() >= 1, "{counters}");

    // The VMM (its guest's, maybe) cannot open its egress; root can, through the waiter.
    let (status, body) = request(
        &sock,
        "PUT",
        "/vm/net/policy",
        Some(serde_json::json!({"policy": "open"})),
    );
    assert_eq!(status, 409, "{body}");
    let out = mayfly_ok(&[
        "net",
        "--sock",
        &sock.to_string_lossy(),
        "--policy",
        &format!("allow={OTHER}/32:{PORT}"),
    ]);
    assert!(out.contains(&OTHER.to_string()), "{out}");
    let (code, answer, err) = guest_connect(&sock, OTHER, "now");
    assert_eq!(code, Some(0), "stderr: {err}");
    assert_eq!(answer, outside.to_string());
    assert_ne!(guest_connect(&sock, SERVER, "no more").0, Some(0));
    assert_eq!(allowed.peers().len(), 1);
    mayfly_ok(&["shutdown", "--sock", &sock.to_string_lossy()]);
    assert!(guest.wait_exit(Duration::from_secs(60)).success());
}

#[test]
fn ten_clones_reach_the_server_at_once_each_as_itself() {
    let uplink = Uplink::new();
    let server = uplink.server(SERVER);
    let dir = TestDir::new("net-fork");
    let policy = format!("allow={SERVER}/32:{PORT}");
    let (_parent, sock) = boot(&dir, "p", &policy, &uplink);
    let parent = net_info(&sock);
    let fork: serde_json::Value = serde_json::from_str(&mayfly_ok(&[
        "fork",
        "--sock",
        &sock.to_string_lossy(),
        "--count",
        "10",
    ]))
    .unwrap();
    let clones: Vec<PathBuf> = fork["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| PathBuf::from(c["api_sock"].as_str().unwrap()))
        .collect();
    assert_eq!(clones.len(), 10);
    // Every clone's agent first (each has had its refresh, which sets its MAC), then all
    // connect at once.
    for clone in &clones {
        wait_agent(clone, BOOT_TIMEOUT);
    }
    let results: Vec<(PathBuf, String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = clones
            .iter()
            .map(|clone| {
                s.spawn(move || {
                    let mac = sh(clone, "cat /sys/class/net/eth0/address");
                    let (code, seen_as, err) = guest_connect(clone, SERVER, "clone");
                    assert_eq!(code, Some(0), "{}: {err}", clone.display());
                    (clone.clone(), mac, seen_as)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut macs = std::collections::HashSet::new();
    let mut addresses = std::collections::HashSet::new();
    for (clone, mac, seen_as) in &results {
        let info = net_info(clone);
        assert_eq!(info["policy"], policy.as_str(), "the clone kept the policy");
        assert_eq!(
            info["guest"]["mac"].as_str().unwrap(),
            mac,
            "the guest took its MAC"
        );
        assert_eq!(
            info["outside_ip"].as_str().unwrap(),
            seen_as,
            "seen as itself"
        );
        assert_ne!(mac, parent["guest"]["mac"].as_str().unwrap());
        assert_ne!(seen_as, parent["outside_ip"].as_str().unwrap());
        macs.insert(mac.clone());
        addresses.insert(seen_as.clone());
    }
    assert_eq!(macs.len(), 10, "MACs shared: {results:?}");
    assert_eq!(addresses.len(), 10, "addresses shared: {results:?}");
    assert_eq!(server.peers().len(), 10);
    for clone in &clones {
        mayfly_ok(&["shutdown", "--sock", &clone.to_string_lossy()]);
    }
}

/// `mayfly net --expose PORT` on the VM at `sock`: where the host listens.
fn expose(sock: &std::path::Path, port: u16) -> SocketAddr {
    let out: serde_json::Value = serde_json::from_str(&mayfly_ok(&[
        "net",
        "--sock",
        &sock.to_string_lossy(),
        "--expose",
        &port.to_string(),
    ]))
    .unwrap();
    let host = out["host"].as_str().unwrap();
    host.strip_prefix("tcp:")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("not a TCP address: {out}"))
}

/// The first line a server at `addr` sends, tried for up to 60 s (the guest's listener may
/// take a moment to come up); empty if none came.
fn first_line_from(addr: SocketAddr) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut line = String::new();
        if let Ok(conn) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            conn.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let _ = BufReader::new(conn).read_line(&mut line);
        }
        if !line.is_empty() || Instant::now() > deadline {
            return line;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn an_exposed_guest_port_answers_on_the_host_and_kill_9_leaves_nothing() {
    let uplink = Uplink::new();
    let dir = TestDir::new("net-expose");
    let (guest, sock) = boot(&dir, "web", "open", &uplink);
    sh(
        &sock,
        "(while true; do echo served-by-guest | nc -l -p 8000; done) >/dev/null 2>&1 & echo ok",
    );
    let addr = expose(&sock, 8000);
    assert!(addr.ip().is_loopback(), "{addr}");
    let line = first_line_from(addr);
    assert_eq!(line.trim(), "served-by-guest");

    // Unexposed, it no longer listens, and a connection open across it is cut; unexposed
    // again, it is not there to stop; exposed again, it serves again.
    let mut held = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    held.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let out = mayfly_ok(&[
        "net",
        "--sock",
        &sock.to_string_lossy(),
        "--unexpose",
        "8000",
    ]);
    let out: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(out["exposed"], false, "{out}");
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err(),
        "an unexposed port still listens"
    );
    // Whatever the guest sent on it, the connection ends (EOF or reset): it does not wait.
    let mut rest = Vec::new();
    let ended = std::io::Read::read_to_end(&mut held, &mut rest);
    assert!(
        !matches!(&ended, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "a connection open across the unexpose was not cut: {ended:?}"
    );
    let again = mayfly_tests::guest::mayfly_output(
        &[
            "net",
            "--sock",
            &sock.to_string_lossy(),
            "--unexpose",
            "8000",
        ],
        Duration::from_secs(30),
    );
    assert!(!again.status.success());
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(said.contains("not exposed"), "{said}");
    let addr = expose(&sock, 8000);
    let line = first_line_from(addr);
    assert_eq!(line.trim(), "served-by-guest", "exposed again");

    // kill -9: the namespace, its veth and address go with the process.
    let info = net_info(&sock);
    let link = info["host_link"]["name"].as_str().unwrap().to_string();
    let host_ip = info["host_link"]["ip"].as_str().unwrap().to_string();
    assert!(uplink.sh("ip", &["-br", "link"]).contains(&link));
    guest.signal(libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(30);
    while uplink.sh("ip", &["-br", "link"]).contains(&link) {
        assert!(Instant::now() < deadline, "the VM's veth outlived its VMM");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !uplink.sh("ip", &["-4", "addr"]).contains(&host_ip),
        "an address is left"
    );
    assert_eq!(
        uplink.sh("nft", &["list", "ruleset"]).trim(),
        "",
        "host-side rules are left"
    );
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err(),
        "the exposed port outlived its VM"
    );
}
