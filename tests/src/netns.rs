//! Network namespaces a test makes for itself: VMs' networks go out to one of these
//! (`--net-uplink`) instead of the host's, so a test touches nothing of the machine's own
//! network.

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// A new, empty network namespace, and the path that names it while the test runs (what
/// `--net-uplink` is given).
pub fn uplink() -> (File, String) {
    let ns = std::thread::spawn(|| {
        // SAFETY: unshare affects only this short-lived thread.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        File::open("/proc/thread-self/ns/net").expect("the new namespace")
    })
    .join()
    .expect("the namespace thread");
    let path = path_of(&ns);
    (ns, path)
}

/// The names of the links in the namespace `ns` (`ip -o link`).
pub fn links_in(ns: &File) -> Vec<String> {
    sh_in(ns, "ip", &["-o", "link"])
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .filter_map(|name| name.split('@').next())
        .map(str::to_string)
        .collect()
}

/// `program`, to be run inside the network namespace `ns`.
pub fn command_in(ns: &File, program: &str) -> Command {
    let fd = ns.as_raw_fd();
    let mut cmd = Command::new(program);
    // SAFETY: setns only, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Run `tool args...` inside the namespace `ns`; its output, or the test fails.
pub fn sh_in(ns: &File, tool: &str, args: &[&str]) -> String {
    let out = command_in(ns, tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{tool} (scripts/setup.sh installs it): {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The link between an [`Internet`]'s uplink and its internet (a /30).
pub const LINK_UPLINK: Ipv4Addr = Ipv4Addr::new(100, 100, 0, 1);
pub const LINK_INTERNET: Ipv4Addr = Ipv4Addr::new(100, 100, 0, 2);
/// The VMs' outside addresses (mayfly's default slot pool), routed back to the uplink.
const POOL: &str = "10.200.0.0/16";

/// An uplink namespace (what VMs' traffic goes out to: the host, as far as they know) and an
/// "internet" namespace behind it, holding addresses of the test's own for its servers (a VM
/// never reaches the host's own addresses, so servers cannot live in the uplink itself).
pub struct Internet {
    pub uplink: File,
    pub internet: File,
}

impl Internet {
    /// The two namespaces, linked and routed, with `addrs` on the internet's loopback.
    pub fn new(addrs: &[Ipv4Addr]) -> Internet {
        assert!(
            std::path::Path::new("/dev/net/tun").exists(),
            "/dev/net/tun is missing: the kernel needs CONFIG_TUN"
        );
        let net = Internet {
            uplink: uplink().0,
            internet: uplink().0,
        };
        sh_in(&net.uplink, "ip", &["link", "set", "lo", "up"]);
        sh_in(&net.internet, "ip", &["link", "set", "lo", "up"]);
        for addr in addrs {
            sh_in(
                &net.internet,
                "ip",
                &["addr", "add", &format!("{addr}/32"), "dev", "lo"],
            );
        }
        let internet_path = path_of(&net.internet);
        sh_in(
            &net.uplink,
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
                &internet_path,
            ],
        );
        for args in [
            format!("addr add {LINK_UPLINK}/30 dev up0"),
            "link set up0 up".to_string(),
            format!("route add default via {LINK_INTERNET}"),
        ] {
            sh_in(&net.uplink, "ip", &args.split(' ').collect::<Vec<_>>());
        }
        for args in [
            format!("addr add {LINK_INTERNET}/30 dev inet0"),
            "link set inet0 up".to_string(),
            format!("route add {POOL} via {LINK_UPLINK}"),
        ] {
            sh_in(&net.internet, "ip", &args.split(' ').collect::<Vec<_>>());
        }
        mayfly_network::run_in(&net.uplink, || {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        })
        .expect("the uplink namespace")
        .expect("forwarding on in the uplink namespace");
        net
    }

    /// The path mayfly is given as `--net-uplink` (valid while this test runs).
    pub fn uplink_path(&self) -> String {
        path_of(&self.uplink)
    }
}

/// A path that names the namespace `ns` while this process holds it open (what
/// `--net-uplink` is given).
pub fn path_of(ns: &File) -> String {
    format!("/proc/{}/fd/{}", std::process::id(), ns.as_raw_fd())
}

/// Where a test's VMs make their networks: a namespace of its own for them to go out to, and
/// a directory under the test's for their slot locks.
pub struct TestNet {
    /// The uplink namespace (held open while the test runs).
    pub ns: File,
    /// The internet behind it, for [`TestNet::with_internet`].
    pub internet: Option<Internet>,
    /// `--net-uplink PATH --net-dir DIR [--net-dns IP]`, for `mayfly run|restore|serve`.
    args: Vec<String>,
}

impl TestNet {
    /// An empty uplink: VMs reach nothing beyond it.
    pub fn new(dir: &crate::guest::TestDir) -> TestNet {
        let (ns, path) = uplink();
        TestNet {
            ns,
            internet: None,
            args: vec![
                "--net-uplink".into(),
                path,
                "--net-dir".into(),
                dir.arg("net"),
            ],
        }
    }

    /// An uplink with an [`Internet`] behind it holding `addrs`; `dns` (one of them, if
    /// given) is the resolver VMs are told to use (`--net-dns`).
    pub fn with_internet(
        dir: &crate::guest::TestDir,
        addrs: &[Ipv4Addr],
        dns: Option<Ipv4Addr>,
    ) -> TestNet {
        let internet = Internet::new(addrs);
        let mut args = vec![
            "--net-uplink".into(),
            internet.uplink_path(),
            "--net-dir".into(),
            dir.arg("net"),
        ];
        if let Some(dns) = dns {
            args.extend(["--net-dns".into(), dns.to_string()]);
        }
        TestNet {
            ns: internet.uplink.try_clone().expect("the uplink namespace"),
            internet: Some(internet),
            args,
        }
    }

    pub fn args(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }
}
