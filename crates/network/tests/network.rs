//! mayfly-network against the real kernel, as root, with no VM: a namespace of the test's own
//! plays the host ("uplink", which routes on to a third namespace, the "internet", holding
//! servers on addresses of its own), and a second namespace per VM plays the guest: its
//! kernel's network stack sits behind a tap whose frames a relay thread copies to and from the
//! VM's tap descriptor, as the virtio-net device would. All traffic stays inside namespaces
//! these tests create.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mayfly_network::*;

/// The "internet", a namespace behind the uplink: public-range servers...
const SERVER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const OTHER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// ...a metadata service (link-local)...
const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// ...a private server in a network the tests' configuration opens ([`REACHED`]), and one in a
/// network it does not.
const PRIVATE_REACHED: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 1);
const REACHED: &str = "10.9.0.0/16";
const PRIVATE_UNLISTED: Ipv4Addr = Ipv4Addr::new(192, 168, 7, 1);
/// The uplink namespace's own addresses (the host): the resolver (on its loopback), a
/// public-range address on its interface to the internet, and that link's address.
const DNS: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 200);
const LINK_UPLINK: Ipv4Addr = Ipv4Addr::new(100, 100, 0, 1);
const LINK_INTERNET: Ipv4Addr = Ipv4Addr::new(100, 100, 0, 2);

fn require_root_and_tools() {
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "these tests need root (network namespaces, taps, nftables)"
    );
    if let Err(e) = check_tools() {
        panic!("{e}");
    }
    assert!(
        std::path::Path::new("/dev/net/tun").exists(),
        "/dev/net/tun is missing: the kernel needs CONFIG_TUN"
    );
}

fn new_netns() -> File {
    std::thread::spawn(|| {
        // SAFETY: unshare affects only this short-lived thread.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        File::open("/proc/thread-self/ns/net").unwrap()
    })
    .join()
    .unwrap()
}

/// Run a tool inside `ns`; panics with its stderr on failure.
fn sh_in(ns: &File, tool: &str, args: &[&str]) -> String {
    let fd = ns.as_raw_fd();
    let mut cmd = Command::new(tool);
    cmd.args(args).stdin(Stdio::null());
    // SAFETY: setns only, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Rig {
    uplink: File,
    internet: File,
    state_dir: PathBuf,
    network: Network,
}

fn ns_path(ns: &File) -> String {
    format!("/proc/{}/fd/{}", std::process::id(), ns.as_raw_fd())
}

impl Rig {
    fn new(name: &str) -> Self {
        require_root_and_tools();
        let uplink = new_netns();
        let internet = new_netns();
        sh_in(&uplink, "ip", &["link", "set", "lo", "up"]);
        sh_in(
            &uplink,
            "ip",
            &["addr", "add", &format!("{DNS}/32"), "dev", "lo"],
        );
        sh_in(&internet, "ip", &["link", "set", "lo", "up"]);
        for addr in [SERVER, OTHER, METADATA, PRIVATE_REACHED, PRIVATE_UNLISTED] {
            sh_in(
                &internet,
                "ip",
                &["addr", "add", &format!("{addr}/32"), "dev", "lo"],
            );
        }
        // The uplink routes on to the internet, which routes the VMs' addresses back.
        sh_in(
            &uplink,
            "ip",
            &[
                "link",
                "add",
                "up0",
                "type",
                "veth",
                "peer",
                "name",
                "inet0",
                "netns",
                &ns_path(&internet),
            ],
        );
        for args in [
            format!("addr add {LINK_UPLINK}/30 dev up0"),
            format!("addr add {HOST_ADDR}/32 dev up0"),
            "link set up0 up".to_string(),
            format!("route add default via {LINK_INTERNET}"),
        ] {
            sh_in(&uplink, "ip", &args.split(' ').collect::<Vec<_>>());
        }
        let pool = NetworkConfig::default().pool;
        for args in [
            format!("addr add {LINK_INTERNET}/30 dev inet0"),
            "link set inet0 up".to_string(),
            format!("route add {pool} via {LINK_UPLINK}"),
        ] {
            sh_in(&internet, "ip", &args.split(' ').collect::<Vec<_>>());
        }
        run_in(&uplink, || {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").unwrap()
        })
        .unwrap();
        let state_dir =
            std::env::temp_dir().join(format!("mayfly-net-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state_dir);
        let network = Network::new(config(&state_dir, &uplink)).unwrap();
        Self {
            uplink,
            internet,
            state_dir,
            network,
        }
    }

    /// The namespace holding `ip`.
    fn ns_of(&self, ip: Ipv4Addr) -> &File {
        if [DNS, HOST_ADDR, LINK_UPLINK].contains(&ip) {
            &self.uplink
        } else {
            &self.internet
        }
    }

    /// A TCP server (in the namespace holding its address) that answers each connection with
    /// the client's address, then echoes.
    fn tcp_server(&self, at: SocketAddr) -> Server {
        let ns = match at.ip() {
            std::net::IpAddr::V4(ip) => self.ns_of(ip),
            other => panic!("{other}"),
        };
        let listener = run_in(ns, || TcpListener::bind(at)).unwrap().unwrap();
        Server::start(listener)
    }

    /// The resolver guests are told to use ([`DNS`], on the uplink): `pypi.test` is
    /// [`SERVER`], `loopback.test` is 127.0.0.1, any other name does not exist.
    fn resolver(&self) -> JoinHandle<()> {
        use simple_dns::rdata::{RData, A};
        use simple_dns::{Packet, ResourceRecord, CLASS, RCODE};
        let sock = run_in(&self.uplink, || UdpSocket::bind(addr(DNS, 53)))
            .unwrap()
            .unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = sock.recv_from(&mut buf) {
                let Ok(query) = Packet::parse(&buf[..n]) else {
                    continue;
                };
                let mut reply = Packet::new_reply(query.id());
                let question = query.questions[0].clone();
                let ip = match question.qname.to_string().as_str() {
                    "pypi.test" => Some(SERVER),
                    "loopback.test" => Some(Ipv4Addr::LOCALHOST),
                    _ => None,
                };
                match ip {
                    Some(ip) => reply.answers.push(ResourceRecord::new(
                        question.qname.clone(),
                        CLASS::IN,
                        60,
                        RData::A(A {
                            address: u32::from(ip),
                        }),
                    )),
                    None => *reply.rcode_mut() = RCODE::NameError,
                }
                reply.questions.push(question);
                let _ = sock.send_to(&reply.build_bytes_vec().unwrap(), from);
            }
        })
    }

    fn udp_echo(&self, at: SocketAddr) -> JoinHandle<()> {
        let ns = match at.ip() {
            std::net::IpAddr::V4(ip) => self.ns_of(ip),
            other => panic!("{other}"),
        };
        let sock = run_in(ns, || UdpSocket::bind(at)).unwrap().unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = sock.recv_from(&mut buf) {
                let _ = sock.send_to(&buf[..n], from);
            }
        })
    }
}

/// The tests' configuration: the resolver on the uplink, [`REACHED`] opened.
fn config(state_dir: &std::path::Path, uplink: &File) -> NetworkConfig {
    config_with(state_dir, uplink, &[REACHED], &[])
}

fn config_with(
    state_dir: &std::path::Path,
    uplink: &File,
    reach: &[&str],
    never: &[&str],
) -> NetworkConfig {
    let nets = |list: &[&str]| list.iter().map(|n| n.parse().unwrap()).collect::<Vec<_>>();
    NetworkConfig {
        state_dir: state_dir.to_path_buf(),
        uplink: Uplink::Path(PathBuf::from(ns_path(uplink))),
        dns: Some(DNS),
        reach: nets(reach),
        never: nets(never),
        ..NetworkConfig::default()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = self.network.drain_pool();
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

/// Peers seen by a test server.
struct Server {
    seen: Arc<Mutex<Vec<SocketAddr>>>,
}

impl Server {
    fn start(listener: TcpListener) -> Self {
        let seen: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
        let s = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let peer = conn.peer_addr().unwrap();
                s.lock().unwrap().push(peer);
                std::thread::spawn(move || {
                    let _ = writeln!(conn, "{}", peer.ip());
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 || conn.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Self { seen }
    }

    fn peers(&self) -> Vec<SocketAddr> {
        self.seen.lock().unwrap().clone()
    }
}

/// The guest stand-in: a namespace whose `eth0` (a tap) carries the frames of the VM's tap.
struct Guest {
    ns: File,
    stop: Arc<AtomicBool>,
    relays: Vec<JoinHandle<()>>,
}

fn poll_in(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one pollfd.
    unsafe { libc::poll(&mut p, 1, ms) > 0 && p.revents & libc::POLLIN != 0 }
}

fn relay(from: Arc<OwnedFd>, to: Arc<OwnedFd>, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 70_000];
        while !stop.load(Ordering::SeqCst) {
            if !poll_in(from.as_raw_fd(), 50) {
                continue;
            }
            // SAFETY: read/write with our buffer's bounds.
            let n = unsafe { libc::read(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                // SAFETY: as above.
                unsafe { libc::write(to.as_raw_fd(), buf.as_ptr().cast(), n as usize) };
            }
        }
    })
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

impl Guest {
    fn attach(vm: &mut VmNetwork) -> Self {
        let vm_tap = Arc::new(vm.take_tap().expect("the tap"));
        let ns = new_netns();
        let guest_tap = run_in(&ns, || {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/net/tun")
                .unwrap();
            let mut req = [0u8; 40];
            req[..4].copy_from_slice(b"eth0");
            let flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
            req[16..18].copy_from_slice(&flags.to_ne_bytes());
            // SAFETY: TUNSETIFF reads and writes a 40-byte ifreq.
            let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::TUNSETIFF, req.as_mut_ptr()) };
            assert_eq!(r, 0);
            OwnedFd::from(f)
        })
        .unwrap();
        let g = vm.guest();
        sh_in(&ns, "ip", &["link", "set", "lo", "up"]);
        sh_in(
            &ns,
            "ip",
            &["link", "set", "eth0", "address", &mac_text(g.mac)],
        );
        sh_in(
            &ns,
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/{}", g.ip, g.prefix),
                "dev",
                "eth0",
            ],
        );
        sh_in(&ns, "ip", &["link", "set", "eth0", "up"]);
        sh_in(
            &ns,
            "ip",
            &["route", "add", "default", "via", &g.gateway.to_string()],
        );
        let guest_tap = Arc::new(guest_tap);
        let stop = Arc::new(AtomicBool::new(false));
        let relays = vec![
            relay(vm_tap.clone(), guest_tap.clone(), stop.clone()),
            relay(guest_tap, vm_tap, stop.clone()),
        ];
        Self { ns, stop, relays }
    }

    fn connect(&self, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
        run_in(&self.ns, || TcpStream::connect_timeout(&to, timeout)).unwrap()
    }

    /// Connect and read the server's first line (the address it sees us at).
    fn seen_as(&self, to: SocketAddr) -> String {
        let conn = self
            .connect(to, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connect to {to}: {e}"));
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut line = String::new();
        BufReader::new(conn).read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    fn udp(&self) -> UdpSocket {
        let s = run_in(&self.ns, || UdpSocket::bind("0.0.0.0:0"))
            .unwrap()
            .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s
    }

    fn ip(&self, args: &[&str]) {
        sh_in(&self.ns, "ip", args);
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for r in self.relays.drain(..) {
            let _ = r.join();
        }
    }
}

fn addr(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

/// A connect the policy refuses fails at once (a reset), not after a timeout.
fn assert_refused_fast(guest: &Guest, to: SocketAddr) {
    let start = Instant::now();
    let err = guest
        .connect(to, Duration::from_secs(5))
        .err()
        .unwrap_or_else(|| panic!("{to} should be refused"));
    let took = start.elapsed();
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::ConnectionRefused,
        "{to}: {err}"
    );
    assert!(took < Duration::from_secs(1), "{to} took {took:?} to fail");
}

#[test]
fn open_policy_reaches_the_outside_as_the_vms_own_address() {
    let rig = Rig::new("open");
    let server = rig.tcp_server(addr(SERVER, 8080));
    let _udp = rig.udp_echo(addr(SERVER, 5353));
    let mut vm = rig.network.create(&Policy::Open, None).unwrap();
    assert_eq!(vm.guest().ip, GUEST_IP);
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    assert_eq!(server.peers()[0].ip(), vm.outside_ip());
    let udp = guest.udp();
    udp.send_to(b"ping", addr(SERVER, 5353)).unwrap();
    let mut buf = [0u8; 16];
    let (n, from) = udp.recv_from(&mut buf).unwrap();
    assert_eq!((&buf[..n], from), (&b"ping"[..], addr(SERVER, 5353)));
    // The host side's own link addresses are never reachable, even when open.
    let (_, host_ip) = vm.host_link();
    assert_refused_fast(&guest, addr(host_ip, 22));
    let c = vm.counters().unwrap();
    assert!(c.allowed > 0 && c.denied > 0, "{c:?}");
    vm.destroy().unwrap();
}

/// A UDP socket connected to `to` hears of a refusal (an ICMP error) at once.
fn assert_udp_refused_fast(guest: &Guest, to: SocketAddr) {
    let udp = guest.udp();
    udp.connect(to).unwrap();
    udp.send(b"x").unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 16];
    let err = udp.recv(&mut buf).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(1) && err.kind() != std::io::ErrorKind::WouldBlock,
        "UDP to {to} should fail fast: {err} after {:?}",
        start.elapsed()
    );
}

#[test]
fn open_never_reaches_the_host_link_local_or_private_networks_the_operator_did_not_open() {
    let rig = Rig::new("never-open");
    let servers: Vec<(Ipv4Addr, Server)> = [
        SERVER,
        PRIVATE_REACHED,
        HOST_ADDR,
        LINK_UPLINK,
        METADATA,
        PRIVATE_UNLISTED,
    ]
    .into_iter()
    .map(|ip| (ip, rig.tcp_server(addr(ip, 8080))))
    .collect();
    let _dns_udp = rig.udp_echo(addr(DNS, 53));
    let dns_tcp = rig.tcp_server(addr(DNS, 53));
    let _dns_other = rig.udp_echo(addr(DNS, 5353));
    let mut vm = rig.network.create(&Policy::Open, None).unwrap();
    let guest = Guest::attach(&mut vm);
    let outside = vm.outside_ip().to_string();
    let never = sh_in(
        vm.namespace(),
        "nft",
        &["list", "set", "inet", "mayfly", "never"],
    );
    for net in [
        "0.0.0.0/8",
        "10.0.0.0-10.8.255.255",
        "10.10.0.0-10.255.255.255",
        "169.254.0.0/16",
        "192.168.0.0/16",
        "198.51.100.53",
        "203.0.113.200",
        "224.0.0.0/3",
    ] {
        assert!(never.contains(net), "{net} is not in {never}");
    }

    // (e) The internet, and (d) a private network the operator opened.
    assert_eq!(guest.seen_as(addr(SERVER, 8080)), outside);
    assert_eq!(guest.seen_as(addr(PRIVATE_REACHED, 8080)), outside);

    let before = vm.counters().unwrap().denied;
    // (a) The host: an address of the uplink's own interface (public range, too), the
    // address of its link to the internet, the host side of the VM's own link.
    let (_, host_ip) = vm.host_link();
    for ip in [HOST_ADDR, LINK_UPLINK, host_ip] {
        assert_refused_fast(&guest, addr(ip, 8080));
    }
    // (b) Link-local: the metadata service. (c) A private network nobody opened.
    assert_refused_fast(&guest, addr(METADATA, 8080));
    assert_refused_fast(&guest, addr(PRIVATE_UNLISTED, 8080));
    for (ip, server) in &servers {
        if ![SERVER, PRIVATE_REACHED].contains(ip) {
            assert!(server.peers().is_empty(), "{ip} was reached");
        }
    }

    // The resolver is a host address too: DNS reaches it (UDP and TCP port 53), nothing else.
    let udp = guest.udp();
    udp.send_to(b"query", addr(DNS, 53)).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(udp.recv_from(&mut buf).unwrap().0, 5);
    assert_eq!(guest.seen_as(addr(DNS, 53)), outside);
    assert_eq!(dns_tcp.peers().len(), 1);
    assert_udp_refused_fast(&guest, addr(DNS, 5353));
    assert_refused_fast(&guest, addr(HOST_ADDR, 53));

    let denied = vm.counters().unwrap().denied - before;
    assert!(denied >= 7, "denied attempts are counted: {denied}");
}

#[test]
fn an_allowlist_cannot_name_what_a_vm_never_reaches() {
    let rig = Rig::new("never-allow");
    let _dns = rig.resolver();
    let _servers: Vec<Server> = [SERVER, PRIVATE_REACHED, METADATA, PRIVATE_UNLISTED]
        .into_iter()
        .map(|ip| rig.tcp_server(addr(ip, 8080)))
        .collect();
    for (policy, says) in [
        (format!("allow={PRIVATE_UNLISTED}:8080"), "--net-reach"),
        (format!("allow={METADATA}"), "link-local"),
        (format!("allow={HOST_ADDR}:8080"), "this host's own"),
        ("allow=10.200.0.0/16".to_string(), "pool"),
        (
            "allow=10.0.0.0/8:443,loopback.test:80".to_string(),
            "loopback",
        ),
    ] {
        let err = match rig.network.create(&policy.parse().unwrap(), None) {
            Ok(vm) => panic!("{policy} was applied (slot {})", vm.slot()),
            Err(e) => e,
        };
        assert!(
            matches!(err, NetworkError::Policy(PolicyError::NeverReached { .. })),
            "{policy}: {err:?}"
        );
        assert!(err.to_string().contains(says), "{policy}: {err}");
    }

    // What the operator opened can be named; a wider entry reaches only what is not never
    // reached.
    let policy: Policy = format!("allow={PRIVATE_REACHED}:8080,0.0.0.0/0:8080")
        .parse()
        .unwrap();
    let mut vm = rig.network.create(&policy, None).unwrap();
    let guest = Guest::attach(&mut vm);
    let outside = vm.outside_ip().to_string();
    assert_eq!(guest.seen_as(addr(PRIVATE_REACHED, 8080)), outside);
    assert_eq!(guest.seen_as(addr(SERVER, 8080)), outside);
    assert_refused_fast(&guest, addr(METADATA, 8080));
    assert_refused_fast(&guest, addr(PRIVATE_UNLISTED, 8080));

    // At run time too, and the policy in force stays.
    let err = vm
        .set_policy(format!("allow={METADATA}").parse().unwrap())
        .unwrap_err();
    assert!(
        matches!(err, NetworkError::Policy(PolicyError::NeverReached { .. })),
        "{err:?}"
    );
    assert_eq!(vm.policy(), &policy);
    assert_eq!(guest.seen_as(addr(SERVER, 8080)), outside);
}

/// A VM network from the one pooled slot. A create passes over a pooled slot whose lock is
/// held for a moment (a process another test forks holds a copy until it execs) and builds a
/// slot instead: those are kept (returned) until the pooled one is claimed.
fn claim_the_pooled_slot(network: &Network) -> (VmNetwork, Vec<VmNetwork>) {
    assert_eq!(network.pooled(), 1);
    let mut others = Vec::new();
    for _ in 0..20 {
        let vm = network.create(&Policy::Open, None).unwrap();
        if network.pooled() == 0 {
            return (vm, others);
        }
        others.push(vm);
    }
    panic!("the pooled slot was never claimed");
}

#[test]
fn a_pooled_namespace_gets_the_never_set_of_the_vmm_that_claims_it() {
    let rig = Rig::new("never-pool");
    let _servers: Vec<Server> = [SERVER, OTHER, PRIVATE_REACHED]
        .into_iter()
        .map(|ip| rig.tcp_server(addr(ip, 8080)))
        .collect();
    // Two VMMs over one pool: one keeps VMs from OTHER and opens nothing private, the other
    // opens REACHED and keeps nothing more.
    let strict = Network::new(config_with(
        &rig.state_dir,
        &rig.uplink,
        &[],
        &[&format!("{OTHER}/32")],
    ))
    .unwrap();
    let open = Network::new(config_with(&rig.state_dir, &rig.uplink, &[REACHED], &[])).unwrap();

    assert_eq!(strict.prewarm(1).unwrap(), 1);
    let (mut vm, _others) = claim_the_pooled_slot(&open);
    let guest = Guest::attach(&mut vm);
    let outside = vm.outside_ip().to_string();
    assert_eq!(guest.seen_as(addr(OTHER, 8080)), outside);
    assert_eq!(guest.seen_as(addr(PRIVATE_REACHED, 8080)), outside);
    drop(guest);
    vm.destroy().unwrap();

    assert_eq!(open.prewarm(1).unwrap(), 1);
    let (mut vm, _others) = claim_the_pooled_slot(&strict);
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    assert_refused_fast(&guest, addr(OTHER, 8080));
    assert_refused_fast(&guest, addr(PRIVATE_REACHED, 8080));
}

#[test]
fn an_allowlist_lets_out_only_what_it_lists_and_denials_fail_fast_and_are_counted() {
    let rig = Rig::new("allow");
    let _a = rig.tcp_server(addr(SERVER, 8080));
    let _b = rig.tcp_server(addr(SERVER, 9090));
    let _c = rig.tcp_server(addr(OTHER, 8080));
    let _dns = rig.udp_echo(addr(DNS, 53));
    let _udp = rig.udp_echo(addr(OTHER, 5353));
    let policy: Policy = format!("allow={SERVER}/32:8080").parse().unwrap();
    let mut vm = rig.network.create(&policy, None).unwrap();
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    let before = vm.counters().unwrap().denied;
    assert_refused_fast(&guest, addr(SERVER, 9090));
    assert_refused_fast(&guest, addr(OTHER, 8080));
    // DNS goes to the named resolver only.
    let udp = guest.udp();
    udp.send_to(b"query", addr(DNS, 53)).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(udp.recv_from(&mut buf).unwrap().0, 5);
    // UDP elsewhere is refused with an ICMP error: a connected socket hears of it.
    assert_udp_refused_fast(&guest, addr(OTHER, 5353));
    let denied = vm.counters().unwrap().denied - before;
    assert!(denied >= 3, "denied attempts are counted: {denied}");
}

/// A name in an allowlist is what the resolver guests are told to use says it is, asked from
/// the uplink (where that resolver may be the only one): not this host's resolver.
#[test]
fn names_in_an_allowlist_are_asked_of_the_guests_resolver() {
    let rig = Rig::new("names");
    let _dns = rig.resolver();
    let _a = rig.tcp_server(addr(SERVER, 8080));
    let _c = rig.tcp_server(addr(OTHER, 8080));
    let mut vm = rig
        .network
        .create(&"allow=pypi.test:8080".parse().unwrap(), None)
        .unwrap();
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    assert_refused_fast(&guest, addr(OTHER, 8080));
    let described = vm.describe();
    assert_eq!(described["policy"], "allow=pypi.test:8080");
    assert_eq!(
        described["resolved"],
        serde_json::json!([format!("{SERVER}/32:8080")])
    );
    // A name the resolver does not know is refused with its reason, and the policy stays.
    let err = vm
        .set_policy("allow=nothing.test:8080".parse().unwrap())
        .unwrap_err();
    assert!(
        matches!(err, NetworkError::Policy(PolicyError::Unresolvable { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains("no such name"), "{err}");
    assert_eq!(vm.policy().to_string(), "allow=pypi.test:8080");
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
}

#[test]
fn policy_none_is_no_network_and_denies_everything_at_runtime() {
    let rig = Rig::new("none");
    let _a = rig.tcp_server(addr(SERVER, 8080));
    assert!(matches!(
        rig.network.create(&Policy::None, None),
        Err(NetworkError::NoNetwork)
    ));
    let mut vm = rig.network.create(&Policy::Open, None).unwrap();
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    vm.set_policy(Policy::None).unwrap();
    assert_refused_fast(&guest, addr(SERVER, 8080));
    assert_refused_fast(&guest, addr(DNS, 53));
}

#[test]
fn tightening_the_policy_cuts_an_open_connection() {
    let rig = Rig::new("tighten");
    let _a = rig.tcp_server(addr(SERVER, 8080));
    let mut vm = rig.network.create(&Policy::Open, None).unwrap();
    let guest = Guest::attach(&mut vm);
    let mut conn = guest
        .connect(addr(SERVER, 8080), Duration::from_secs(5))
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    conn.write_all(b"hello\n").unwrap();
    line.clear();
    reader.read_line(&mut line).unwrap();
    assert_eq!(line, "hello\n", "the connection works while open");

    vm.set_policy(format!("allow={OTHER}/32").parse().unwrap())
        .unwrap();
    let start = Instant::now();
    let _ = conn.write_all(b"after\n");
    line.clear();
    let result = reader.read_line(&mut line);
    assert!(
        matches!(&result, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the connection should be reset, got {result:?} {line:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    assert_refused_fast(&guest, addr(SERVER, 8080));
    assert_eq!(vm.policy().to_string(), format!("allow={OTHER}/32"));
}

#[test]
fn ten_networks_at_once_are_each_seen_outside_with_their_own_address() {
    let rig = Rig::new("ten");
    let server = rig.tcp_server(addr(SERVER, 8080));
    let mut vms: Vec<VmNetwork> = (0..10)
        .map(|_| rig.network.create(&Policy::Open, None).unwrap())
        .collect();
    let guests: Vec<Guest> = vms.iter_mut().map(Guest::attach).collect();
    for (vm, guest) in vms.iter().zip(&guests) {
        assert_eq!(
            vm.guest().ip,
            GUEST_IP,
            "every guest has the same address inside"
        );
        assert_eq!(
            guest.seen_as(addr(SERVER, 8080)),
            vm.outside_ip().to_string()
        );
    }
    let mut seen: Vec<Ipv4Addr> = server
        .peers()
        .iter()
        .map(|p| match p.ip() {
            std::net::IpAddr::V4(v4) => v4,
            other => panic!("{other}"),
        })
        .collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 10, "ten distinct outside addresses: {seen:?}");
    let mut slots: Vec<u32> = vms.iter().map(VmNetwork::slot).collect();
    slots.dedup();
    assert_eq!(slots.len(), 10);
}

#[test]
fn concurrent_vmms_never_share_a_slot() {
    let rig = Rig::new("concurrent");
    // Five "VMMs", each with a Network of its own over the same state directory.
    let networks: Vec<Network> = (0..5)
        .map(|_| Network::new(config(&rig.state_dir, &rig.uplink)).unwrap())
        .collect();
    let vms: Vec<VmNetwork> = std::thread::scope(|s| {
        let handles: Vec<_> = networks
            .iter()
            .map(|n| {
                s.spawn(move || {
                    (0..3)
                        .map(|_| n.create(&Policy::Open, None).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let mut slots: Vec<u32> = vms.iter().map(VmNetwork::slot).collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), 15, "two VMMs took the same slot: {slots:?}");
    let links = sh_in(&rig.uplink, "ip", &["-br", "link"]);
    for vm in &vms {
        assert!(links.contains(vm.host_link().0));
    }
}

#[test]
fn a_spoofed_source_address_or_mac_gets_nothing_out() {
    let rig = Rig::new("spoof");
    let server = rig.tcp_server(addr(SERVER, 8080));
    let mut vm = rig.network.create(&Policy::Open, None).unwrap();
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    let before = vm.counters().unwrap().spoofed;

    // Another source address.
    guest.ip(&["addr", "flush", "dev", "eth0"]);
    guest.ip(&["addr", "add", "172.16.0.3/30", "dev", "eth0"]);
    guest.ip(&["route", "replace", "default", "via", "172.16.0.1"]);
    guest.ip(&[
        "neigh",
        "replace",
        "172.16.0.1",
        "lladdr",
        &mac_text(GATEWAY_MAC),
        "dev",
        "eth0",
    ]);
    let r = guest.connect(addr(SERVER, 8080), Duration::from_millis(700));
    assert!(r.is_err(), "a spoofed source got a connection");

    // Its own address back, another MAC.
    guest.ip(&["addr", "flush", "dev", "eth0"]);
    guest.ip(&["link", "set", "eth0", "address", "02:00:00:00:00:99"]);
    guest.ip(&["addr", "add", "172.16.0.2/30", "dev", "eth0"]);
    guest.ip(&["route", "replace", "default", "via", "172.16.0.1"]);
    guest.ip(&[
        "neigh",
        "replace",
        "172.16.0.1",
        "lladdr",
        &mac_text(GATEWAY_MAC),
        "dev",
        "eth0",
    ]);
    let r = guest.connect(addr(SERVER, 8080), Duration::from_millis(700));
    assert!(r.is_err(), "a spoofed MAC got a connection");

    assert_eq!(
        server.peers().len(),
        1,
        "only the honest connection arrived"
    );
    let spoofed = vm.counters().unwrap().spoofed - before;
    assert!(spoofed >= 2, "spoofed frames are counted: {spoofed}");

    // The real MAC again: traffic flows again.
    guest.ip(&["link", "set", "eth0", "address", &mac_text(vm.guest().mac)]);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
}

#[test]
fn an_exposed_guest_port_is_reachable_on_the_host() {
    let rig = Rig::new("expose");
    let mut vm = rig.network.create(&Policy::Open, None).unwrap();
    let guest = Guest::attach(&mut vm);
    let listener = run_in(&guest.ns, || TcpListener::bind("0.0.0.0:7000"))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    // Expose works whatever the egress policy: it is traffic into the guest.
    vm.set_policy(Policy::None).unwrap();
    let tcp = vm
        .expose(7000, ExposeOn::Tcp("127.0.0.1:0".parse().unwrap()))
        .unwrap();
    let HostEndpoint::Tcp(at) = tcp else {
        panic!("{tcp:?}")
    };
    let mut c = TcpStream::connect(at).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(b"through the forwarder").unwrap();
    let mut buf = [0u8; 21];
    c.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"through the forwarder");

    let path = rig.state_dir.join("guest-7000.sock");
    let unix = vm.expose(7000, ExposeOn::Unix(path.clone())).unwrap();
    assert_eq!(unix, HostEndpoint::Unix(path.clone()));
    let mut u = std::os::unix::net::UnixStream::connect(&path).unwrap();
    u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    u.write_all(b"unix").unwrap();
    let mut buf = [0u8; 4];
    u.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"unix");
    vm.destroy().unwrap();
    assert!(!path.exists(), "the socket is removed with the network");
    assert!(TcpStream::connect(at).is_err());
}

#[test]
fn pooled_slots_are_claimed_and_work() {
    let rig = Rig::new("pool");
    let _a = rig.tcp_server(addr(SERVER, 8080));
    assert_eq!(rig.network.prewarm(2).unwrap(), 2);
    assert_eq!(rig.network.pooled(), 2);
    // A sweep keeps pool slots. (Not `report.pooled == 2`: a sweep skips a slot whose lock it
    // cannot take, and a process another test forks holds a copy of that lock until it execs;
    // counting it so failed one fresh-clone CI run in four.)
    let report = rig.network.sweep().unwrap();
    assert!(report.cleaned.is_empty(), "{report:?}");
    assert!(report.pooled <= 2, "{report:?}");
    assert_eq!(rig.network.pooled(), 2, "the sweep removed a pool slot");
    let mac = fresh_mac();
    let mut vm = rig.network.create(&Policy::Open, Some(mac)).unwrap();
    assert_eq!(vm.guest().mac, mac, "a restored VM keeps its saved MAC");
    assert_eq!(rig.network.pooled(), 1);
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    // A claimed slot's namespace is no longer mounted: it lives with its holder only.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&format!("ns/slot-{} ", vm.slot())));
    drop(guest);
    vm.destroy().unwrap();
    assert_eq!(rig.network.drain_pool().unwrap(), 1);
    assert_eq!(rig.network.pooled(), 0);
}

#[test]
fn held_pool_slots_are_taken_through_their_keepers_descriptor_and_go_with_it() {
    let rig = Rig::new("held");
    let _a = rig.tcp_server(addr(SERVER, 8080));
    let first_slot = rig.network.prewarm_held().unwrap();
    let second_slot = rig.network.prewarm_held().unwrap();
    let (first, second) = (first_slot.index, second_slot.index);
    assert_eq!(rig.network.pooled(), 2);
    // Nothing mounted: the keeper's descriptors hold the namespaces.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let ours = rig.state_dir.join("ns");
    assert!(!mounts.contains(&ours.display().to_string()), "{mounts}");
    let report = rig.network.sweep().unwrap();
    assert!(report.cleaned.is_empty(), "{report:?}");
    assert_eq!(rig.network.pooled(), 2, "the sweep removed a held slot");

    // A create takes one of them, and works through it.
    let mut vm = rig.network.create(&Policy::Open, None).unwrap();
    let (taken, left_slot) = if vm.slot() == first {
        (first_slot, second_slot)
    } else {
        assert_eq!(vm.slot(), second, "not a pooled slot");
        (second_slot, first_slot)
    };
    assert!(rig.network.is_claimed(&taken));
    assert!(!rig.network.is_claimed(&left_slot));
    assert_eq!(rig.network.pooled(), 1);
    let guest = Guest::attach(&mut vm);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    // The keeper may let go of its descriptors: the VM holds its namespace now.
    drop(taken);
    assert_eq!(
        guest.seen_as(addr(SERVER, 8080)),
        vm.outside_ip().to_string()
    );
    drop(guest);
    vm.destroy().unwrap();

    // A keeper that let go of a slot without giving it up (its descriptors closed, its ready
    // file left; the numbers may name other files of its now): a create finds the slot gone,
    // removes it, and builds its own.
    drop(left_slot);
    assert_eq!(rig.network.pooled(), 1);
    let vm = rig.network.create(&Policy::Open, None).unwrap();
    assert_eq!(rig.network.pooled(), 0);
    drop(vm);

    // A keeper that gives a slot up removes it from the pool.
    let slot = rig.network.prewarm_held().unwrap();
    assert!(rig.network.release_held(&slot));
    assert!(rig.network.is_claimed(&slot));
    assert_eq!(rig.network.pooled(), 0);
    drop(slot);

    // A pool in a directory anyone may write is not taken from (its ready files could name
    // anyone's descriptors): a create builds its own.
    use std::os::unix::fs::PermissionsExt;
    let slot = rig.network.prewarm_held().unwrap();
    let mode = std::fs::metadata(&rig.state_dir).unwrap().permissions();
    std::fs::set_permissions(&rig.state_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let vm = rig.network.create(&Policy::Open, None);
    std::fs::set_permissions(&rig.state_dir, mode).unwrap();
    let vm = vm.unwrap();
    assert_ne!(vm.slot(), slot.index);
    assert!(!rig.network.is_claimed(&slot));
    drop(vm);
    rig.network.release_held(&slot);
}

/// Every netns inode some process holds (a task's namespace or an open descriptor).
fn held_netns_inodes() -> Vec<u64> {
    let mut out: Vec<PathBuf> = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for p in procs.flatten() {
        let base = p.path();
        if let Ok(l) = std::fs::read_link(base.join("ns/net")) {
            out.push(l);
        }
        if let Ok(fds) = std::fs::read_dir(base.join("fd")) {
            out.extend(
                fds.flatten()
                    .filter_map(|f| std::fs::read_link(f.path()).ok()),
            );
        }
    }
    out.iter()
        .filter_map(|l| {
            l.to_str()?
                .strip_prefix("net:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// Not a test on its own: the process the kill -9 test starts and kills.
#[test]
#[ignore]
fn child_process_holding_a_network() {
    let Ok(state) = std::env::var("MAYFLY_NET_CHILD_STATE") else {
        return;
    };
    let uplink = std::env::var("MAYFLY_NET_CHILD_UPLINK").unwrap();
    let network = Network::new(NetworkConfig {
        state_dir: state.into(),
        uplink: Uplink::Path(uplink.into()),
        dns: Some(DNS),
        ..NetworkConfig::default()
    })
    .unwrap();
    let vm = network.create(&Policy::Open, None).unwrap();
    let (link, host_ip) = vm.host_link();
    println!(
        "READY {} {} {} {}",
        vm.slot(),
        namespace_inode(vm.namespace()).unwrap(),
        link,
        host_ip
    );
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn kill_9_leaves_nothing_behind() {
    let rig = Rig::new("kill9");
    let uplink_path = format!("/proc/{}/fd/{}", std::process::id(), rig.uplink.as_raw_fd());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_process_holding_a_network",
            "--ignored",
            "--nocapture",
        ])
        .env("MAYFLY_NET_CHILD_STATE", &rig.state_dir)
        .env("MAYFLY_NET_CHILD_UPLINK", &uplink_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = loop {
        let line = lines.next().expect("the child ended early").unwrap();
        if let Some(rest) = line.strip_prefix("READY ") {
            break rest.to_string();
        }
    };
    let parts: Vec<&str> = ready.split_whitespace().collect();
    let (inode, link, host_ip): (u64, &str, &str) = (parts[1].parse().unwrap(), parts[2], parts[3]);
    assert!(held_netns_inodes().contains(&inode));
    assert!(sh_in(&rig.uplink, "ip", &["-br", "link"]).contains(link));
    assert!(sh_in(&rig.uplink, "ip", &["-4", "addr"]).contains(host_ip));

    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();

    // The next user of the state directory sweeps (a create that builds a slot does).
    let next = Network::new(config(&rig.state_dir, &rig.uplink)).unwrap();
    next.sweep().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while held_netns_inodes().contains(&inode) {
        assert!(
            Instant::now() < deadline,
            "the VM's namespace outlived its VMM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !sh_in(&rig.uplink, "ip", &["-br", "link"]).contains(link),
        "a veth is left"
    );
    assert!(
        !sh_in(&rig.uplink, "ip", &["-4", "addr"]).contains(host_ip),
        "an address is left"
    );
    assert_eq!(
        sh_in(&rig.uplink, "nft", &["list", "ruleset"]).trim(),
        "",
        "host-side rules are left"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(rig.state_dir.to_str().unwrap()),
        "a namespace mount is left"
    );
    // And the slot is free again.
    let vm = next.create(&Policy::Open, None).unwrap();
    assert_eq!(vm.host_link().0, link);
}

/// Creating one network and a hundred, cold and from the pool. Prints JSON.
#[test]
#[ignore]
fn bench_create_networks() {
    let rig = Rig::new("bench");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        format!(
            "{{\"mean_ms\": {mean:.3}, \"p50_ms\": {:.3}, \"p99_ms\": {:.3}, \"max_ms\": {:.3}}}",
            v[v.len() / 2],
            v[(v.len() * 99 / 100).min(v.len() - 1)],
            v[v.len() - 1]
        )
    };
    let t = Instant::now();
    let one = rig.network.create(&Policy::Open, None).unwrap();
    let cold_one = ms(t.elapsed());
    drop(one);

    let mut cold = Vec::new();
    let t = Instant::now();
    let mut vms = Vec::new();
    for _ in 0..100 {
        let s = Instant::now();
        vms.push(rig.network.create(&Policy::Open, None).unwrap());
        cold.push(ms(s.elapsed()));
    }
    let cold_total = ms(t.elapsed());
    let t = Instant::now();
    drop(vms);
    let destroy_total = ms(t.elapsed());

    let t = Instant::now();
    rig.network.prewarm(100).unwrap();
    let prewarm_total = ms(t.elapsed());
    let mut warm = Vec::new();
    let t = Instant::now();
    let mut vms = Vec::new();
    let policy: Policy = "allow=198.51.100.0/24:443,203.0.113.0/24".parse().unwrap();
    for _ in 0..100 {
        let s = Instant::now();
        vms.push(rig.network.create(&policy, None).unwrap());
        warm.push(ms(s.elapsed()));
    }
    let warm_total = ms(t.elapsed());
    let mut set_policy = Vec::new();
    for vm in vms.iter_mut() {
        let s = Instant::now();
        vm.set_policy(Policy::Open).unwrap();
        set_policy.push(ms(s.elapsed()));
    }
    println!(
        "{{\"cold_create_one_ms\": {cold_one:.3}, \"cold_create_100\": {{\"total_ms\": {cold_total:.1}, \"each\": {}}}, \
         \"destroy_100_total_ms\": {destroy_total:.1}, \"prewarm_100_total_ms\": {prewarm_total:.1}, \
         \"pooled_create_100\": {{\"total_ms\": {warm_total:.1}, \"each\": {}}}, \"set_policy\": {}}}",
        stats(&mut cold),
        stats(&mut warm),
        stats(&mut set_policy)
    );
}

#[test]
fn bad_configuration_is_refused_with_reasons() {
    require_root_and_tools();
    let dir = std::env::temp_dir().join(format!("mayfly-net-{}-badcfg", std::process::id()));
    let small = NetworkConfig {
        state_dir: dir.clone(),
        pool: "10.0.0.0/31".parse().unwrap(),
        ..NetworkConfig::default()
    };
    assert!(matches!(Network::new(small), Err(NetworkError::BadPool(_))));
    let long = NetworkConfig {
        state_dir: dir.clone(),
        link_prefix: "averyveryverylongprefix".into(),
        ..NetworkConfig::default()
    };
    assert!(matches!(
        Network::new(long),
        Err(NetworkError::BadPrefix(_))
    ));
    for reach in ["169.254.0.0/16", "198.51.100.0/24", "10.0.0.0/7"] {
        let bad = NetworkConfig {
            state_dir: dir.clone(),
            reach: vec![reach.parse().unwrap()],
            ..NetworkConfig::default()
        };
        match Network::new(bad) {
            Err(e @ NetworkError::BadReach(_)) => {
                assert!(e.to_string().contains("only private networks"), "{e}")
            }
            Err(e) => panic!("reach {reach}: {e}"),
            Ok(_) => panic!("reach {reach} was taken"),
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
