//! The host side of VM networking ([`Network`]: slots, the pool, the uplink) and one VM's
//! network ([`VmNetwork`]: its namespace, tap, veth and egress policy).

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::addr::{MacAddr, GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_PREFIX, NS_TAP, NS_UPLINK};
use crate::error::{sys, NetworkError, Result};
use crate::expose::{self, ExposeOn, HostEndpoint};
use crate::netns::{self, check_tools};
use crate::never::Never;
use crate::nft;
use crate::policy::{self, Policy};

/// Which namespace the VMs' veths connect to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Uplink {
    /// The caller's namespace (the host).
    #[default]
    Current,
    /// The namespace at this path (`/run/netns/NAME`, `/proc/PID/ns/net`, `/proc/PID/fd/N`).
    Path(PathBuf),
}

/// How VM networks are laid out on this host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// Slot locks, pool namespaces. Default `/run/mayfly/net`.
    pub state_dir: PathBuf,
    /// Per-VM outside addresses, in /30s. Default 10.200.0.0/16.
    pub pool: Ipv4Net,
    /// The namespace VM traffic goes out to. Its own addresses (read when the [`Network`] is
    /// made) are the host's: no VM reaches them.
    pub uplink: Uplink,
    /// The resolver the guest is told to use; an allowlist lets DNS (TCP/UDP 53) go to it
    /// and nowhere else. DNS reaches it even if it is a host or private address (that alone:
    /// nothing else to that address). `None`: no DNS.
    pub dns: Option<Ipv4Addr>,
    /// Host-side link names are this prefix and the slot number (at most 15 characters).
    pub link_prefix: String,
    /// Private networks policies may reach: each inside 10.0.0.0/8, 172.16.0.0/12,
    /// 192.168.0.0/16 or 100.64.0.0/10 (anything else is refused with
    /// [`NetworkError::BadReach`]). The rest of the private ranges is never reached, by
    /// `open` or by an allowlist naming it. Default: none. What `never`, the pool or the
    /// host's addresses hold stays unreached even inside these.
    #[serde(default)]
    pub reach: Vec<Ipv4Net>,
    /// More networks no policy reaches, besides those always kept out: the host's own
    /// addresses, link-local 169.254.0.0/16 (cloud metadata), the pool, 0.0.0.0/8, loopback,
    /// multicast, 240.0.0.0/4 and the private ranges not in `reach`. Default: none.
    pub never: Vec<Ipv4Net>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from("/run/mayfly/net"),
            pool: Ipv4Net::new(Ipv4Addr::new(10, 200, 0, 0), 16).expect("a valid prefix"),
            uplink: Uplink::Current,
            dns: None,
            link_prefix: "mfv".to_string(),
            reach: Vec::new(),
            never: Vec::new(),
        }
    }
}

/// What the guest must be configured with (kernel `ip=` argument, or the agent).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestConfig {
    pub ip: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Ipv4Addr,
    pub dns: Option<Ipv4Addr>,
    /// The MAC the guest's NIC has (the virtio-net config space MAC).
    pub mac: MacAddr,
}

impl GuestConfig {
    /// The kernel command line's `ip=` argument for this configuration (the guest's first
    /// NIC, no autoconfiguration), e.g. `ip=172.16.0.2::172.16.0.1:255.255.255.252::eth0:off`
    /// followed by the resolver, if any.
    pub fn kernel_ip_arg(&self, device: &str) -> String {
        let mask = Ipv4Net::new(self.ip, self.prefix)
            .map(|n| n.netmask())
            .unwrap_or(Ipv4Addr::BROADCAST);
        let mut arg = format!("ip={}::{}:{mask}::{device}:off", self.ip, self.gateway);
        if let Some(dns) = self.dns {
            arg.push_str(&format!(":{dns}"));
        }
        arg
    }
}

/// Denied and allowed packets, from the VM's nftables counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Packets the policy let out.
    pub allowed: u64,
    /// Packets the policy refused (each rejected with a TCP reset or ICMP).
    pub denied: u64,
    /// Frames from the guest with a MAC or source address not its own (dropped).
    pub spoofed: u64,
}

/// What [`Network::sweep`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Slots whose leftovers were removed.
    pub cleaned: Vec<u32>,
    /// Pool slots kept (built, waiting to be claimed).
    pub pooled: usize,
}

/// A slot's addresses and names.
#[derive(Clone, Debug)]
struct Slot {
    index: u32,
    /// The host side of the veth.
    host_ip: Ipv4Addr,
    /// The namespace side: the VM's address outside.
    outside_ip: Ipv4Addr,
    link: String,
}

/// The host side of VM networking: allocates slots and builds VM networks.
pub struct Network {
    config: NetworkConfig,
    uplink: File,
    /// For interface look-ups in the uplink namespace.
    uplink_sock: File,
    /// What no VM reaches, written into each VM's namespace when it takes its slot.
    never: Arc<Never>,
    slots: u32,
    hint: Mutex<u32>,
}

/// A slot built into the pool by [`Network::prewarm_held`]: its namespace and attached tap,
/// held open for as long as this is kept.
#[derive(Debug)]
pub struct HeldSlot {
    pub index: u32,
    /// Its ready file's content, which names it.
    mark: Vec<u8>,
    _ns: File,
    _tap: File,
}

/// What a claim finds of a ready slot.
enum Pooled {
    Taken(File, Option<File>),
    /// Its keeper or mount is gone: the slot is cleaned.
    Gone,
    /// Not for this process to take now (not allowed to, out of descriptors): left alone.
    Unavailable,
}

/// A held slot's line of its ready file: `held PID START NSFD net:[INODE] TAPFD`.
struct Held<'a> {
    pid: libc::pid_t,
    start: u64,
    ns_fd: std::os::fd::RawFd,
    inode: &'a str,
    tap_fd: std::os::fd::RawFd,
}

impl<'a> Held<'a> {
    fn parse(line: &'a str) -> Option<Held<'a>> {
        let mut words = line.split_whitespace();
        let held = Held {
            pid: words.next()?.parse().ok()?,
            start: words.next()?.parse().ok()?,
            ns_fd: words.next()?.parse().ok()?,
            inode: words.next()?,
            tap_fd: words.next()?.parse().ok()?,
        };
        (held.pid > 0 && held.inode.starts_with("net:[")).then_some(held)
    }
}

/// When process `pid` started (field 22 of /proc/PID/stat, clock ticks since boot): with
/// its pid, what names one process for good.
fn start_time(pid: u32) -> std::io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces and parentheses: fields are counted after
    // its last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19)?.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("/proc/{pid}/stat does not parse")))
}

/// The effective uid of process `pid` (its status's `Uid:` line, second field).
fn effective_uid(pid: u32) -> std::io::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1)?.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("/proc/{pid}/status has no Uid line")))
}

/// Whether `dir` is root's and no one else may write it.
fn owned_by_root_alone(dir: &Path) -> bool {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    std::fs::metadata(dir).is_ok_and(|m| m.uid() == 0 && m.permissions().mode() & 0o022 == 0)
}

impl Network {
    /// Check the tools and the configuration, and read the uplink namespace's own addresses
    /// (the never-reached host addresses: see [`NetworkConfig::never`]). What dead VMMs left
    /// is swept by a create that builds its slot ([`Network::sweep`]), not here: a create that
    /// takes a pooled slot skips it.
    pub fn new(config: NetworkConfig) -> Result<Self> {
        check_tools()?;
        if config.pool.prefix_len() > 30 {
            return Err(NetworkError::BadPool(config.pool));
        }
        let slots = 1u32 << (30 - config.pool.prefix_len()).min(24);
        if config.link_prefix.len() + (slots - 1).to_string().len() > 15
            || config.link_prefix.is_empty()
        {
            return Err(NetworkError::BadPrefix(config.link_prefix.clone()));
        }
        for dir in [config.state_dir.clone(), config.state_dir.join("ns")] {
            std::fs::create_dir_all(&dir)
                .map_err(sys(format!("cannot create {}", dir.display())))?;
        }
        let uplink = match &config.uplink {
            Uplink::Current => netns::current(),
            Uplink::Path(p) => File::open(p),
        }
        .map_err(sys("cannot open the uplink namespace"))?;
        // One trip into the uplink namespace: a socket for interface look-ups, and its own
        // addresses (the host's: never reached).
        let (uplink_sock, host) = netns::run_in(&uplink, || {
            (netns::ioctl_socket(), crate::local::addresses())
        })
        .map_err(sys("cannot enter the uplink namespace"))?;
        let uplink_sock =
            uplink_sock.map_err(sys("cannot open a socket in the uplink namespace"))?;
        let host = host.map_err(NetworkError::HostAddresses)?;
        let never = Never::new(&host, config.pool, &config.never, &config.reach)?;
        let network = Self {
            config,
            uplink,
            uplink_sock,
            never: Arc::new(never),
            slots,
            hint: Mutex::new(0),
        };
        Ok(network)
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.config
    }

    /// The uplink namespace.
    pub fn uplink(&self) -> &File {
        &self.uplink
    }

    fn slot(&self, index: u32) -> Slot {
        let base = u32::from(self.config.pool.network()) + index * 4;
        Slot {
            index,
            host_ip: Ipv4Addr::from(base + 1),
            outside_ip: Ipv4Addr::from(base + 2),
            link: format!("{}{index}", self.config.link_prefix),
        }
    }

    fn lock_path(&self, index: u32) -> PathBuf {
        self.config.state_dir.join(format!("slot-{index}.lock"))
    }

    fn ready_path(&self, index: u32) -> PathBuf {
        self.config.state_dir.join(format!("slot-{index}.ready"))
    }

    fn mount_path(&self, index: u32) -> PathBuf {
        self.config
            .state_dir
            .join("ns")
            .join(format!("slot-{index}"))
    }

    /// [`Network::create`] for a NIC whose policy may be [`Policy::None`]: a restored NIC that
    /// may reach nothing (the guest keeps its NIC, its driver is bound) gets its network with
    /// the rules in place and everything denied before the VM runs.
    pub fn create_nic(&self, policy: &Policy, mac: Option<MacAddr>) -> Result<VmNetwork> {
        if *policy == Policy::None {
            let mut network = self.create(&Policy::Open, mac)?;
            network.set_policy(Policy::None)?;
            return Ok(network);
        }
        self.create(policy, mac)
    }

    /// A network for a VM with `policy`: from the pool if a slot is ready there, built now
    /// otherwise. `mac` is the guest's MAC: the saved one for a restored VM (its guest does
    /// not read the MAC again), `None` for a fresh locally administered one.
    pub fn create(&self, policy: &Policy, mac: Option<MacAddr>) -> Result<VmNetwork> {
        if *policy == Policy::None {
            return Err(NetworkError::NoNetwork);
        }
        // Resolve first: a policy that cannot be applied costs no slot.
        let resolved = resolve(policy, self.config.dns, &self.uplink, &self.never)?;
        let mac = mac.unwrap_or_else(fresh_mac);
        if let Some((slot, lock, ns, tap)) = self.claim_pooled()? {
            mayfly_sys::trace::event("net_claimed");
            return self.finish(slot, lock, ns, tap, policy, &resolved, mac);
        }
        // Built now: what dead VMMs left is swept first (a pooled claim skips this, ~5 ms
        // with a hundred slots in the directory).
        self.sweep()?;
        let (slot, lock) = self.take_free_slot()?;
        let ns = self.build(&slot)?;
        self.finish(slot, lock, ns, None, policy, &resolved, mac)
    }

    /// Take the lock of a slot nobody uses (and that is not in the pool), its leftovers
    /// removed.
    fn take_free_slot(&self) -> Result<(Slot, netns::SlotLock)> {
        let mut hint = self.hint.lock().unwrap_or_else(|p| p.into_inner());
        for step in 0..self.slots {
            let index = (*hint + step) % self.slots;
            let Some(mut lock) = netns::SlotLock::try_take(&self.lock_path(index))
                .map_err(sys("cannot open a slot lock"))?
            else {
                continue;
            };
            if self.ready_path(index).exists() {
                continue;
            }
            self.clean(index)?;
            lock.note(&format!(
                "mayfly-{index} pid {} building\n",
                std::process::id()
            ));
            *hint = (index + 1) % self.slots;
            return Ok((self.slot(index), lock));
        }
        Err(NetworkError::PoolFull(self.slots))
    }

    /// Remove what a dead holder of slot `index` may have left (the caller holds its lock).
    fn clean(&self, index: u32) -> Result<bool> {
        let slot = self.slot(index);
        let mut cleaned = false;
        if netns::link_index(&self.uplink_sock, &slot.link).is_some() {
            // Deleting one end of a veth deletes both.
            match netns::run("ip", &["link", "del", &slot.link], None, Some(&self.uplink)) {
                Ok(_) => {}
                // Gone meanwhile (the kernel reaped the namespace).
                Err(_) if netns::link_index(&self.uplink_sock, &slot.link).is_none() => {}
                Err(e) => return Err(e),
            }
            cleaned = true;
        }
        let mount = self.mount_path(index);
        if mount.exists() {
            netns::unbind(&mount).map_err(sys(format!("cannot unmount {}", mount.display())))?;
            cleaned = true;
        }
        let _ = std::fs::remove_file(self.ready_path(index));
        Ok(cleaned)
    }

    /// Build slot `slot`: namespace, tap, veth, addresses, routes, ruleset. The namespace is
    /// held by the returned descriptor only.
    fn build(&self, slot: &Slot) -> Result<File> {
        let ns = netns::create().map_err(sys("cannot create a network namespace"))?;
        netns::run_in(&ns, || -> std::io::Result<()> {
            let tap = netns::open_tap(NS_TAP)?;
            netns::persist_tap(&tap, true)?;
            netns::sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
            for conf in ["all", "default"] {
                let path = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
                if Path::new(&path).exists() {
                    netns::sysctl(&path, "1")?;
                }
            }
            Ok(())
        })
        .and_then(|r| r)
        .map_err(sys("cannot set up the VM's namespace (tap, sysctls)"))?;
        let ns_path = format!("/proc/{}/fd/{}", std::process::id(), ns.as_raw_fd());
        let host = format!(
            "link add {link} type veth peer name {peer} netns {ns_path}\n\
             addr add {ip}/30 dev {link}\n\
             link set {link} up\n",
            link = slot.link,
            peer = NS_UPLINK,
            ip = slot.host_ip,
        );
        netns::run("ip", &["-batch", "-"], Some(&host), Some(&self.uplink))?;
        let mac = GATEWAY_MAC
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":");
        let inside = format!(
            "link set lo up\n\
             link set {tap} address {mac}\n\
             addr add {gw}/{prefix} dev {tap}\n\
             link set {tap} up\n\
             addr add {outside}/30 dev {uplink}\n\
             link set {uplink} up\n\
             route add default via {host}\n",
            tap = NS_TAP,
            gw = GATEWAY_IP,
            prefix = GUEST_PREFIX,
            outside = slot.outside_ip,
            uplink = NS_UPLINK,
            host = slot.host_ip,
        );
        netns::run("ip", &["-batch", "-"], Some(&inside), Some(&ns))?;
        netns::run(
            "nft",
            &["-f", "-"],
            Some(&nft::ruleset(slot.outside_ip)),
            Some(&ns),
        )?;
        Ok(ns)
    }

    /// Attach to the slot's tap, point the sets at the guest's MAC, this host's never-reached
    /// networks and the policy, in one batch (a pooled slot holds nothing of whoever built
    /// it).
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        slot: Slot,
        mut lock: netns::SlotLock,
        ns: File,
        tap: Option<File>,
        policy: &Policy,
        resolved: &policy::Resolved,
        mac: MacAddr,
    ) -> Result<VmNetwork> {
        let (tap, nft) = netns::run_in(&ns, || -> Result<(File, nft::NftSocket)> {
            // A held pool slot's tap comes attached already, its carrier on.
            let tap = match tap {
                Some(tap) => tap,
                None => netns::open_tap(NS_TAP).map_err(sys("cannot open the VM's tap"))?,
            };
            let mut nft = nft::NftSocket::open().map_err(NetworkError::Nft)?;
            let [nets, svcs, dns] = nft::policy_sets(resolved);
            nft.replace(&[
                nft::mac_set(mac),
                nft::never_set(self.never.spans()),
                dns,
                nets,
                svcs,
            ])
            .map_err(NetworkError::Nft)?;
            mayfly_sys::trace::event("net_policy_set");
            // Until the kernel has seen the tap's carrier come on, what the namespace sends
            // the guest is dropped (a restored guest's first ARP would wait for its retry).
            netns::wait_running(NS_TAP, std::time::Duration::from_millis(200))
                .map_err(sys("cannot read the tap's state"))?;
            Ok((tap, nft))
        })
        .map_err(sys("cannot enter the VM's namespace"))??;
        let inode = netns::inode(&ns).unwrap_or(0);
        lock.note(&format!(
            "mayfly-{} pid {} netns net:[{inode}] (nsenter --net=/proc/{}/fd/{})\n",
            slot.index,
            std::process::id(),
            std::process::id(),
            ns.as_raw_fd()
        ));
        Ok(VmNetwork {
            guest: GuestConfig {
                ip: GUEST_IP,
                prefix: GUEST_PREFIX,
                gateway: GATEWAY_IP,
                dns: self.config.dns,
                mac,
            },
            slot,
            _lock: lock,
            tap: Some(tap.into()),
            nft: Mutex::new(nft),
            uplink: self
                .uplink
                .try_clone()
                .map_err(sys("cannot keep the uplink namespace"))?,
            dns: self.config.dns,
            never: self.never.clone(),
            policy: policy.clone(),
            pinned: resolved.clone(),
            exposed: Vec::new(),
            ns,
            destroyed: false,
        })
    }

    /// Build `count` slots ahead of time, into the pool (they stay there, bind-mounted under
    /// `<state_dir>/ns/`, until a create claims them or [`Network::drain_pool`] removes them).
    pub fn prewarm(&self, count: usize) -> Result<usize> {
        for _ in 0..count {
            let (slot, mut lock) = self.take_free_slot()?;
            let ns = self.build(&slot)?;
            let mount = self.mount_path(slot.index);
            netns::bind(&ns, &mount)
                .map_err(sys(format!("cannot bind-mount {}", mount.display())))?;
            // The slot's veth is in this uplink: only a create going out the same one takes it.
            std::fs::write(self.ready_path(slot.index), self.uplink_mark())
                .map_err(sys("cannot mark a pool slot ready"))?;
            lock.note(&format!("mayfly-{} pooled\n", slot.index));
        }
        Ok(count)
    }

    /// Build one slot into the pool, its namespace and attached tap held by the returned
    /// [`HeldSlot`] instead of a bind mount: the slot's ready file names this process (pid and
    /// start time) and the two descriptors, and a create takes them with pidfd_getfd. For a
    /// long-lived keeper (the sandbox manager), whose pool then adds nothing to the host's
    /// mount table (every mount there is copied into each jail's mount namespace and
    /// detached again: 110 pooled mounts made a jail's lock-down ~15 ms slower) and leaves
    /// nothing behind if the keeper dies but its ready files, which the next claim or sweep
    /// removes. The keeper drops a slot once [`Network::is_claimed`] says so.
    pub fn prewarm_held(&self) -> Result<HeldSlot> {
        let (slot, mut lock) = self.take_free_slot()?;
        let ns = self.build(&slot)?;
        // Its tap attached now, so its carrier is on (the kernel's link watch is slow to say
        // so: ~5 ms a VM when many start at once) when a VM takes it with pidfd_getfd.
        let tap = netns::run_in(&ns, || netns::open_tap(NS_TAP))
            .and_then(|r| r)
            .map_err(sys("cannot open a pooled slot's tap"))?;
        let inode = netns::inode(&ns).map_err(sys("cannot read a namespace's inode"))?;
        let pid = std::process::id();
        let start = start_time(pid).map_err(sys("cannot read this process's start time"))?;
        let mut mark = self.uplink_mark();
        mark.extend(
            format!(
                "held {pid} {start} {} net:[{inode}] {}\n",
                ns.as_raw_fd(),
                tap.as_raw_fd()
            )
            .into_bytes(),
        );
        std::fs::write(self.ready_path(slot.index), &mark)
            .map_err(sys("cannot mark a pool slot ready"))?;
        lock.note(&format!("mayfly-{} pooled, held\n", slot.index));
        Ok(HeldSlot {
            index: slot.index,
            mark,
            _ns: ns,
            _tap: tap,
        })
    }

    /// Whether the held pool slot `slot` was taken (or given up): its ready file is gone, or
    /// is another's now (the index taken and built again meanwhile by another keeper).
    pub fn is_claimed(&self, slot: &HeldSlot) -> bool {
        std::fs::read(self.ready_path(slot.index)).map_or(true, |mark| mark != slot.mark)
    }

    /// Give up the held pool slot `slot`: its ready file removed if it is still this slot's,
    /// so the caller may drop it (the namespace then goes, and its veth with it). Whether it
    /// was still in the pool. No lock is needed: a create taking it right now either has its
    /// descriptors already (the VM keeps them) or finds them gone and builds its own.
    pub fn release_held(&self, slot: &HeldSlot) -> bool {
        if self.is_claimed(slot) {
            return false;
        }
        std::fs::remove_file(self.ready_path(slot.index)).is_ok()
    }

    /// The namespace of a ready slot (and, for a held one, its attached tap), by its mount
    /// or from its keeper (see [`Network::prewarm_held`]). Every number in the ready file is
    /// checked against the kernel before anything taken is used: the keeper is the process
    /// that wrote it (its start time), the namespace is a network namespace of that inode,
    /// the tap is a tun device attached to `tap0` in that namespace.
    fn pooled_namespace(&self, index: u32, mark: &[u8]) -> Pooled {
        let text = String::from_utf8_lossy(mark);
        let Some(held) = text.lines().find_map(|l| l.strip_prefix("held ")) else {
            return match File::open(self.mount_path(index)) {
                Ok(ns) => Pooled::Taken(ns, None),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Pooled::Gone,
                Err(_) => Pooled::Unavailable,
            };
        };
        let Some(held) = Held::parse(held) else {
            return Pooled::Gone;
        };
        let keeper = match mayfly_sys::pidfd::open(held.pid) {
            Ok(keeper) => keeper,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Pooled::Gone,
            Err(_) => return Pooled::Unavailable,
        };
        // With the pidfd held, the pid is that process's until it is let go: the same start
        // time means the same process as wrote the file.
        let Ok(pid) = u32::try_from(held.pid) else {
            return Pooled::Gone;
        };
        match start_time(pid) {
            Ok(start) if start == held.start => {}
            Ok(_) => return Pooled::Gone,
            Err(_) => return Pooled::Unavailable,
        }
        // Only root keeps a pool: a ready file naming anyone else's process (written through
        // a directory swapped under the check above, say) is not followed.
        match effective_uid(pid) {
            Ok(0) => {}
            Ok(_) => return Pooled::Gone,
            Err(_) => return Pooled::Unavailable,
        }
        // EBADF: the keeper let it go; anything else (EPERM where ptrace is restricted,
        // EMFILE): this process cannot take it, which says nothing of the slot.
        let take = |fd| match mayfly_sys::pidfd::get_fd(&keeper, fd) {
            Ok(fd) => Ok(File::from(fd)),
            Err(e) if e.raw_os_error() == Some(libc::EBADF) => Err(Pooled::Gone),
            Err(_) => Err(Pooled::Unavailable),
        };
        let ns = match take(held.ns_fd) {
            Ok(ns) => ns,
            Err(no) => return no,
        };
        // The inode first (a stat of whatever the number now names), then, on a file that
        // is that namespace's, the kernel's word that it is a network namespace.
        let inode = netns::inode(&ns).ok();
        let named = inode.map(|i| format!("net:[{i}]"));
        if named.as_deref() != Some(held.inode) || !netns::is_net_namespace(&ns) {
            return Pooled::Gone;
        }
        let tap = match take(held.tap_fd) {
            Ok(tap) => tap,
            Err(no) => return no,
        };
        if !netns::is_tap(&tap, NS_TAP) || netns::tap_namespace_inode(&tap).ok() != inode {
            return Pooled::Gone;
        }
        Pooled::Taken(ns, Some(tap))
    }

    /// Whether the keeper of a held ready slot still runs (a sweep's check: nothing is
    /// taken; a keeper that gives a slot up removes its ready file first).
    fn held_alive(mark: &[u8]) -> bool {
        let text = String::from_utf8_lossy(mark);
        let Some(held) = text
            .lines()
            .find_map(|l| l.strip_prefix("held "))
            .and_then(Held::parse)
        else {
            return false;
        };
        let Ok(pid) = u32::try_from(held.pid) else {
            return false;
        };
        match start_time(pid) {
            Ok(start) if start == held.start => {}
            Ok(_) => return false,
            Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
        }
        // Still holding that namespace at that number (a keeper that dropped the slot without
        // giving it up does not).
        match std::fs::read_link(format!("/proc/{pid}/fd/{}", held.ns_fd)) {
            Ok(target) => target.to_str() == Some(held.inode),
            Err(e) => e.kind() != std::io::ErrorKind::NotFound,
        }
    }

    /// Slots ready in the pool for this uplink.
    pub fn pooled(&self) -> usize {
        let mark = self.uplink_mark();
        self.ready_slots()
            .into_iter()
            .filter(|&index| {
                std::fs::read(self.ready_path(index)).is_ok_and(|m| m.starts_with(&mark))
            })
            .count()
    }

    /// What a pool slot's ready file holds: its uplink namespace's inode.
    fn uplink_mark(&self) -> Vec<u8> {
        format!("uplink net:[{}]\n", netns::inode(&self.uplink).unwrap_or(0)).into_bytes()
    }

    /// The slots with a ready file (for any uplink), by index: one read of the directory.
    pub fn ready_slots(&self) -> Vec<u32> {
        let Ok(dir) = std::fs::read_dir(&self.config.state_dir) else {
            return Vec::new();
        };
        let mut slots: Vec<u32> = dir
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                name.strip_prefix("slot-")?
                    .strip_suffix(".ready")?
                    .parse()
                    .ok()
            })
            .collect();
        slots.sort_unstable();
        slots
    }

    /// Take a slot from the pool: its namespace is unmounted, so from now on it lives only
    /// as long as the caller holds it.
    #[allow(clippy::type_complexity)]
    fn claim_pooled(&self) -> Result<Option<(Slot, netns::SlotLock, File, Option<File>)>> {
        // A ready file says which descriptors of which process to take: only from a
        // directory no one but root may write.
        if !owned_by_root_alone(&self.config.state_dir) {
            return Ok(None);
        }
        for index in self.ready_slots() {
            let Some(lock) = netns::SlotLock::try_take(&self.lock_path(index))
                .map_err(sys("cannot open a slot lock"))?
            else {
                continue;
            };
            // Built for another uplink (another program sharing the directory): not ours.
            let Ok(mark) = std::fs::read(self.ready_path(index)) else {
                continue;
            };
            if !mark.starts_with(&self.uplink_mark()) {
                continue;
            }
            let (ns, tap) = match self.pooled_namespace(index, &mark) {
                Pooled::Taken(ns, tap) => (ns, tap),
                Pooled::Gone => {
                    self.clean(index)?;
                    continue;
                }
                // Left as it is, for a process that can take it.
                Pooled::Unavailable => continue,
            };
            let _ = std::fs::remove_file(self.ready_path(index));
            let mount = self.mount_path(index);
            if mount.exists() {
                netns::unbind(&mount)
                    .map_err(sys(format!("cannot unmount {}", mount.display())))?;
            }
            return Ok(Some((self.slot(index), lock, ns, tap)));
        }
        Ok(None)
    }

    /// Remove the pool's slots.
    pub fn drain_pool(&self) -> Result<usize> {
        let mut drained = 0;
        for index in self.ready_slots() {
            if let Some(_lock) = netns::SlotLock::try_take(&self.lock_path(index))
                .map_err(sys("cannot open a slot lock"))?
            {
                self.clean(index)?;
                drained += 1;
            }
        }
        Ok(drained)
    }

    /// Remove whatever dead VMMs left in slots whose lock nobody holds (pool slots are kept).
    pub fn sweep(&self) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        let Ok(dir) = std::fs::read_dir(&self.config.state_dir) else {
            return Ok(report);
        };
        let mut indices: Vec<u32> = dir
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                name.strip_prefix("slot-")?
                    .strip_suffix(".lock")?
                    .parse()
                    .ok()
            })
            .filter(|&i| i < self.slots)
            .collect();
        indices.sort_unstable();
        for index in indices {
            let Some(_lock) = netns::SlotLock::try_take(&self.lock_path(index))
                .map_err(sys("cannot open a slot lock"))?
            else {
                continue;
            };
            let pooled = std::fs::read(self.ready_path(index))
                .ok()
                .is_some_and(|mark| {
                    if mark.windows(5).any(|w| w == b"held ") {
                        Self::held_alive(&mark)
                    } else {
                        self.mount_path(index).exists()
                    }
                });
            if pooled {
                report.pooled += 1;
                continue;
            }
            if self.clean(index)? {
                report.cleaned.push(index);
            }
        }
        Ok(report)
    }
}

/// `policy` resolved, an allowlist entry refused if a VM never reaches any of it. Names go
/// to `dns` (the resolver guests are told to use), asked from the `uplink` namespace, or to
/// this host's resolver when there is none (see `dns.rs`).
fn resolve(
    policy: &Policy,
    dns: Option<Ipv4Addr>,
    uplink: &File,
    never: &Never,
) -> Result<policy::Resolved> {
    Ok(policy.resolve_checked(dns, &lookup(dns, uplink), |nets| never.refuses(nets))?)
}

/// How a name in a policy is resolved: by `dns` from `uplink`, else by this host's resolver;
/// every name of one policy within [`policy::RESOLVE_BUDGET`] from now.
fn lookup(
    dns: Option<Ipv4Addr>,
    uplink: &File,
) -> impl Fn(&str) -> std::result::Result<Vec<Ipv4Addr>, policy::LookupError> + '_ {
    let deadline = std::time::Instant::now() + policy::RESOLVE_BUDGET;
    move |name: &str| match dns {
        Some(server) => crate::dns::lookup(SocketAddrV4::new(server, 53), uplink, name, deadline),
        None => policy::host_lookup(name),
    }
}

/// What resolving a VM's policy takes, apart from the VM's network (so that a caller holding
/// the network behind a lock can resolve without holding it: see [`VmNetwork::resolver`]).
pub struct PolicyResolver {
    dns: Option<Ipv4Addr>,
    uplink: File,
    never: Arc<Never>,
}

impl PolicyResolver {
    /// `policy` resolved as [`VmNetwork::set_policy`] would resolve it.
    pub fn resolve(&self, policy: &Policy) -> Result<policy::Resolved> {
        resolve(policy, self.dns, &self.uplink, &self.never)
    }
}

/// Where names in policies are resolved on this host (`--net-dns`, `--net-uplink`), for a
/// caller that refuses a policy before it starts a VMM for it (the sandbox manager): the same
/// resolver, asked from the same namespace, as when a VMM applies the policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub dns: Option<Ipv4Addr>,
    pub uplink: Uplink,
}

impl Names {
    /// Every name in `policy` resolves to an IPv4 address, or the first that does not, with
    /// the resolver's reason ([`crate::PolicyError::Unresolvable`]). A policy without names costs
    /// nothing. Whether a VM may reach those addresses is the VMM's check, when it applies
    /// the policy.
    pub fn check(&self, policy: &Policy) -> Result<()> {
        let Policy::Allow(rules) = policy else {
            return Ok(());
        };
        if !rules
            .iter()
            .any(|r| matches!(r.dest, policy::Dest::Host(_)))
        {
            return Ok(());
        }
        let uplink = match &self.uplink {
            Uplink::Current => netns::current(),
            Uplink::Path(path) => File::open(path),
        }
        .map_err(sys("cannot open the uplink namespace"))?;
        policy.resolve_checked(self.dns, &lookup(self.dns, &uplink), |_| None)?;
        Ok(())
    }
}

/// A fresh locally administered unicast MAC (02:xx:...; random).
pub fn fresh_mac() -> MacAddr {
    let mut mac = [0u8; 6];
    // SAFETY: getrandom writes at most 6 bytes into `mac`.
    let n = unsafe { libc::getrandom(mac.as_mut_ptr().cast(), mac.len(), 0) };
    if n != 6 {
        // Never in practice; fall back on time and pid, still unique enough per host.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            // The low 64 bits of the nanoseconds are the ones that change.
            .map(|d| u64::try_from(d.as_nanos() & u128::from(u64::MAX)).unwrap_or(0))
            .unwrap_or(0)
            ^ u64::from(std::process::id()) << 32;
        mac.copy_from_slice(&t.to_le_bytes()[..6]);
    }
    mac[0] = (mac[0] & 0xfc) | 0x02;
    if mac == GATEWAY_MAC {
        mac[5] ^= 0x80;
    }
    mac
}

/// One VM's network: its namespace, tap, veth, policy. Removed by [`VmNetwork::destroy`] or
/// on drop, and by the kernel if the process dies.
pub struct VmNetwork {
    slot: Slot,
    _lock: netns::SlotLock,
    ns: File,
    tap: Option<OwnedFd>,
    nft: Mutex<nft::NftSocket>,
    uplink: File,
    guest: GuestConfig,
    dns: Option<Ipv4Addr>,
    never: Arc<Never>,
    policy: Policy,
    /// What the policy allows, its names as they were resolved when it was applied.
    pinned: policy::Resolved,
    exposed: Vec<expose::Forwarder>,
    destroyed: bool,
}

impl VmNetwork {
    /// The tap, opened inside the namespace with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR: hand it
    /// to the virtio-net device (`mayfly_devices::virtio::net::Net::new`). Once taken, it is
    /// the caller's; the namespace stays as long as this `VmNetwork` does.
    pub fn take_tap(&mut self) -> Option<OwnedFd> {
        self.tap.take()
    }

    pub fn tap(&self) -> Option<BorrowedFd<'_>> {
        self.tap.as_ref().map(|t| t.as_fd())
    }

    pub fn guest(&self) -> &GuestConfig {
        &self.guest
    }

    pub fn slot(&self) -> u32 {
        self.slot.index
    }

    /// The namespace's name in mayfly's terms (it is not mounted anywhere: see the lock file
    /// `<state_dir>/slot-<n>.lock` for how to enter it).
    pub fn name(&self) -> String {
        format!("mayfly-{}", self.slot.index)
    }

    /// The VM's network namespace.
    pub fn namespace(&self) -> &File {
        &self.ns
    }

    /// The address the VM's traffic has outside (after SNAT).
    pub fn outside_ip(&self) -> Ipv4Addr {
        self.slot.outside_ip
    }

    /// The host side of the veth: its name and address.
    pub fn host_link(&self) -> (&str, Ipv4Addr) {
        (&self.slot.link, self.slot.host_ip)
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Change the policy now. Every packet is checked against it, so a connection the new
    /// policy forbids is cut at its next packet (the guest gets a TCP reset or an ICMP
    /// error). Names are resolved now. [`Policy::None`] denies everything (the NIC stays). An
    /// allowlist entry naming only never-reached networks is refused
    /// ([`crate::PolicyError::NeverReached`]) and the old policy stays.
    pub fn set_policy(&mut self, policy: Policy) -> Result<()> {
        let resolved = self.resolver()?.resolve(&policy)?;
        self.apply_policy(policy, resolved)
    }

    /// What resolves a policy for this VM's network, on its own (names take up to
    /// [`policy::RESOLVE_BUDGET`]: resolve with it, then [`VmNetwork::apply_policy`]).
    pub fn resolver(&self) -> Result<PolicyResolver> {
        Ok(PolicyResolver {
            dns: self.dns,
            uplink: self
                .uplink
                .try_clone()
                .map_err(sys("cannot keep the uplink namespace"))?,
            never: self.never.clone(),
        })
    }

    /// [`VmNetwork::set_policy`] with `resolved`, what [`VmNetwork::resolver`] made of `policy`.
    pub fn apply_policy(&mut self, policy: Policy, resolved: policy::Resolved) -> Result<()> {
        let [nets, svcs, dns] = nft::policy_sets(&resolved);
        self.nft
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(&[dns, nets, svcs])
            .map_err(NetworkError::Nft)?;
        self.policy = policy;
        self.pinned = resolved;
        Ok(())
    }

    /// What `GET /vm/net` says of the network: policy, namespace, the guest's addresses and
    /// MAC, the outside address, the host link and the counters (or why they cannot be read).
    pub fn describe(&self) -> serde_json::Value {
        let (link, host_ip) = self.host_link();
        let guest = self.guest();
        let counters = self.counters().map_err(|e| e.to_string());
        let mac: Vec<String> = guest.mac.iter().map(|b| format!("{b:02x}")).collect();
        serde_json::json!({
            "policy": self.policy().to_string(),
            "resolved": self.pinned.entries(),
            "namespace": self.name(),
            "guest": {
                "ip": guest.ip.to_string(),
                "prefix": guest.prefix,
                "gateway": guest.gateway.to_string(),
                "dns": guest.dns.map(|d| d.to_string()),
                "mac": mac.join(":"),
            },
            "outside_ip": self.outside_ip().to_string(),
            "host_link": {"name": link, "ip": host_ip.to_string()},
            "counters": match &counters {
                Ok(c) => serde_json::to_value(c).unwrap_or_default(),
                Err(_) => serde_json::Value::Null,
            },
            "counters_error": counters.err(),
        })
    }

    /// The nftables counters of the VM's namespace.
    pub fn counters(&self) -> Result<Counters> {
        let text = netns::run("nft", &["list", "counters"], None, Some(&self.ns))?;
        let mut c = Counters::default();
        for (table, name, packets) in nft::parse_counters(&text) {
            match (table.as_str(), name.as_str()) {
                ("mayfly", "allowed") => c.allowed += packets,
                ("mayfly", "denied") => c.denied += packets,
                (_, "spoofed") => c.spoofed += packets,
                _ => {}
            }
        }
        Ok(c)
    }

    /// Make guest port `guest_port` reachable on the host at `on`: a forwarding thread in
    /// the VM's namespace connects each client to the guest (see the `expose` module docs).
    pub fn expose(&mut self, guest_port: u16, on: ExposeOn) -> Result<HostEndpoint> {
        let err = |source| NetworkError::Expose {
            port: guest_port,
            source,
        };
        let ns = self.ns.try_clone().map_err(err)?;
        let forwarder = expose::Forwarder::start(ns, SocketAddrV4::new(GUEST_IP, guest_port), &on)
            .map_err(err)?;
        let endpoint = forwarder.endpoint.clone();
        self.exposed.push(forwarder);
        Ok(endpoint)
    }

    /// Stop exposing `guest_port` at `on` (where `expose` said it listens), or at every
    /// endpoint with `None`: each forwarder stops, its open connections closed, its Unix
    /// socket removed. Whether any was.
    pub fn unexpose(&mut self, guest_port: u16, on: Option<&ExposeOn>) -> bool {
        let before = self.exposed.len();
        self.exposed.retain(|f| {
            let at = match (on, &f.endpoint) {
                (None, _) => true,
                (Some(ExposeOn::Tcp(a)), HostEndpoint::Tcp(b)) => a == b,
                (Some(ExposeOn::Unix(a)), HostEndpoint::Unix(b)) => a == b,
                _ => false,
            };
            !(f.guest_port == guest_port && at)
        });
        self.exposed.len() != before
    }

    /// Remove everything: forwarders, tap, veth (with its host-side address), namespace.
    pub fn destroy(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        if self.destroyed {
            return Ok(());
        }
        self.destroyed = true;
        for mut f in self.exposed.drain(..) {
            f.stop();
        }
        self.tap = None;
        // The namespace goes when its last holder does; deleting the veth now makes the host
        // side clean at once rather than when the kernel gets round to the namespace.
        let result = netns::run(
            "ip",
            &["link", "del", &self.slot.link],
            None,
            Some(&self.uplink),
        );
        match result {
            Ok(_) => Ok(()),
            Err(_) if link_gone(&self.uplink, &self.slot.link) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn link_gone(uplink: &File, link: &str) -> bool {
    netns::run_in(uplink, || {
        netns::ioctl_socket()
            .map(|s| netns::link_index(&s, link).is_none())
            .unwrap_or(false)
    })
    .unwrap_or(false)
}

impl Drop for VmNetwork {
    fn drop(&mut self) {
        let _ = self.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_unicast_locally_administered_and_fresh() {
        let a = fresh_mac();
        let b = fresh_mac();
        assert_eq!(a[0] & 0x03, 0x02);
        assert_ne!(a, b);
        assert_ne!(a, GATEWAY_MAC);
    }

    #[test]
    fn the_guest_is_told_its_address_on_the_kernel_command_line() {
        let g = GuestConfig {
            ip: GUEST_IP,
            prefix: GUEST_PREFIX,
            gateway: GATEWAY_IP,
            dns: Some(Ipv4Addr::new(192, 0, 2, 53)),
            mac: GATEWAY_MAC,
        };
        assert_eq!(
            g.kernel_ip_arg("eth0"),
            "ip=172.16.0.2::172.16.0.1:255.255.255.252::eth0:off:192.0.2.53"
        );
    }

    #[test]
    fn slots_carve_the_pool_into_30s() {
        let dir = std::env::temp_dir().join(format!("mayfly-net-unit-{}", std::process::id()));
        let cfg = NetworkConfig {
            state_dir: dir.clone(),
            ..NetworkConfig::default()
        };
        // Only the arithmetic: no namespace is touched.
        let network = Network {
            slots: 1 << 14,
            uplink: File::open("/dev/null").unwrap(),
            uplink_sock: File::open("/dev/null").unwrap(),
            never: Arc::new(Never::new(&[], cfg.pool, &[], &[]).unwrap()),
            hint: Mutex::new(0),
            config: cfg,
        };
        let s = network.slot(0);
        assert_eq!(
            (s.host_ip, s.outside_ip, s.link.as_str()),
            (
                Ipv4Addr::new(10, 200, 0, 1),
                Ipv4Addr::new(10, 200, 0, 2),
                "mfv0"
            )
        );
        let s = network.slot(16383);
        assert_eq!(s.outside_ip, Ipv4Addr::new(10, 200, 255, 254));
        assert!(s.link.len() <= 15);
        let _ = std::fs::remove_dir_all(dir);
    }
}
