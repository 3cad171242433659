//! A VM's network, host side: what `--net` asks for, where its namespace comes from, and what
//! boot, restore and fork do with it. The namespace, tap, veth and nftables policy are
//! `mayfly_network`'s; the guest's NIC is `mayfly_devices::virtio::net`.
//!
//! - `--net none` (the default) gives the VM no NIC at all: nothing to misconfigure, nothing to
//!   reach. `--net open` and `--net allow=CIDR[:PORT],...` give it a virtio-net NIC whose tap
//!   lives in a network namespace of the VM's own, the policy enforced there by nftables,
//!   outside the guest's reach.
//! - Whatever the policy, a VM never reaches the host's own addresses, link-local (cloud
//!   metadata), the slot pool, loopback, multicast, reserved addresses, the private ranges but
//!   for what `--net-reach` opens, and what `--net-never` adds; DNS to `--net-dns` is the one
//!   exception. An allowlist entry naming only such networks is refused when the policy is
//!   applied (see `mayfly_network::Policy`).
//! - The guest's address is the same in every VM (`mayfly_network::GUEST_IP`/30 behind the
//!   gateway `GATEWAY_IP`), so a restored VM and every clone keep a configuration that works;
//!   outside, each VM's traffic leaves from its own address (SNAT to its slot's address). The
//!   guest is told its address on the kernel command line (`mayfly.net=IP/PREFIX,GATEWAY[,DNS]`,
//!   which the guest's init applies) at boot; after that it never changes.
//! - A restore gets a new namespace with the snapshot's policy and MAC (the same VM, woken).
//!   A clone gets a new namespace, the parent's policy and a MAC of its own: its config space
//!   says the new MAC, and the agent's refresh sets it in the guest (which learnt its parent's
//!   before the snapshot). Until then the clone's frames carry the parent's MAC and the
//!   namespace's anti-spoofing drops them: a clone never speaks as its parent.
//! - The namespace lives as long as the VMM holds it: a VMM killed with -9 leaves nothing behind
//!   (see `mayfly_network`).

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::str::FromStr;

use std::os::fd::OwnedFd;

use mayfly_network::keeper::KeptNetwork;
use mayfly_network::{
    GuestConfig, Ipv4Net, MacAddr, Network, NetworkConfig, Policy, Uplink, VmNetwork,
};

/// Where VM networks are made on this host: `--net-dir`, `--net-uplink`, `--net-dns`,
/// `--net-reach`, `--net-never`. A restore takes them from its command line, a clone from its
/// parent.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetSettings {
    /// Slot locks and pooled namespaces (`mayfly_network::NetworkConfig::state_dir`).
    pub state_dir: PathBuf,
    /// The namespace VMs' traffic goes out to: the VMM's own when `None`.
    pub uplink: Option<PathBuf>,
    /// The resolver guests are told to use; an allowlist lets DNS reach it and nothing else.
    pub dns: Option<Ipv4Addr>,
    /// The private networks policies may reach (`mayfly_network::NetworkConfig::reach`).
    #[serde(default)]
    pub reach: Vec<Ipv4Net>,
    /// More networks no VM reaches (`mayfly_network::NetworkConfig::never`).
    #[serde(default)]
    pub never: Vec<Ipv4Net>,
}

impl NetSettings {
    /// The network layer's configuration for these settings (a manager building a pool of
    /// networks for its VMMs uses the same one they do).
    pub fn network_config(&self) -> NetworkConfig {
        NetworkConfig {
            state_dir: self.state_dir.clone(),
            uplink: match &self.uplink {
                Some(path) => Uplink::Path(path.clone()),
                None => Uplink::Current,
            },
            dns: self.dns,
            reach: self.reach.clone(),
            never: self.never.clone(),
            ..NetworkConfig::default()
        }
    }
}

impl Default for NetSettings {
    fn default() -> Self {
        Self {
            state_dir: NetworkConfig::default().state_dir,
            uplink: None,
            dns: None,
            reach: Vec::new(),
            never: Vec::new(),
        }
    }
}

/// A VM's NIC as `mayfly run` asks for it.
#[derive(Clone, Debug)]
pub struct NetSpec {
    pub policy: Policy,
    pub settings: NetSettings,
}

/// What a restored VM's NIC (if its snapshot has one) gets on this host.
#[derive(Clone, Debug, Default)]
pub struct NetTargets {
    pub settings: NetSettings,
    /// A policy instead of the snapshot's (`mayfly restore --net`).
    pub policy: Option<Policy>,
    /// Give the NIC a fresh MAC (a clone) rather than the snapshot's.
    pub new_mac: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum NetSetupError {
    #[error("{0}")]
    Network(#[from] mayfly_network::NetworkError),
    #[error("--net {given:?}: {source}; use none, open, or allow=CIDR[:PORT],... (e.g. allow=10.0.0.0/8:443,192.0.2.7)")]
    BadPolicy {
        given: String,
        source: mayfly_network::PolicyError,
    },
    #[error("the snapshot's network policy {given:?} does not parse ({source}): the snapshot is damaged, or give the policy with --net")]
    BadSavedPolicy {
        given: String,
        source: mayfly_network::PolicyError,
    },
    #[error("the snapshot's VM has no NIC: --net {0} needs a VM booted with a network (--net open or allow=...)")]
    NoNic(String),
    #[error("this jailed VMM has no waiter keeping networks for it (mayfly was started without one): a jailed VM's network is made outside its jail")]
    NoKeeper,
}

/// A `--net` argument.
pub fn parse_policy(text: &str) -> Result<Policy, NetSetupError> {
    Policy::from_str(text).map_err(|source| NetSetupError::BadPolicy {
        given: text.to_owned(),
        source,
    })
}

/// The policy a snapshot saved (in `--net` syntax).
pub fn saved_policy(text: &str) -> Result<Policy, NetSetupError> {
    Policy::from_str(text).map_err(|source| NetSetupError::BadSavedPolicy {
        given: text.to_owned(),
        source,
    })
}

/// A VM's network as its VMM holds it.
pub enum VmNet {
    /// Made and held here: an unjailed VMM (root) changes it itself.
    Own(VmNetwork),
    /// Kept by the jail's waiter outside the jail (`mayfly_network::keeper`): the VMM holds
    /// only the tap, and the policy is changed through the waiter's socket.
    Kept(KeptNetwork),
}

/// What the VMM's own control socket says when asked to change a jailed VM's network.
pub const KEPT_OUTSIDE: &str = "this VM is jailed, and its network is kept outside its jail by \
    the jail's waiter: change its policy or expose a port there, at the VM's control socket \
    with .net added (PUT /vm/net/policy or /vm/net/expose, as root); `mayfly net` goes there \
    by itself";

impl VmNet {
    pub fn guest(&self) -> &GuestConfig {
        match self {
            VmNet::Own(n) => n.guest(),
            VmNet::Kept(n) => n.guest(),
        }
    }

    /// The policy now (a snapshot saves it).
    pub fn policy(&self) -> Result<Policy, mayfly_network::NetworkError> {
        match self {
            VmNet::Own(n) => Ok(n.policy().clone()),
            VmNet::Kept(n) => n.policy(),
        }
    }

    /// What `GET /vm/net` says.
    pub fn describe(&self) -> Result<serde_json::Value, mayfly_network::NetworkError> {
        match self {
            VmNet::Own(n) => Ok(n.describe()),
            VmNet::Kept(n) => n.describe(),
        }
    }

    /// The network itself, when this VMM holds it (not jailed).
    pub fn own_mut(&mut self) -> Option<&mut VmNetwork> {
        match self {
            VmNet::Own(n) => Some(n),
            VmNet::Kept(_) => None,
        }
    }

    /// The namespace's name in mayfly's terms.
    pub fn name(&self) -> String {
        match self {
            VmNet::Own(n) => n.name(),
            VmNet::Kept(n) => n.name().to_owned(),
        }
    }

    pub fn outside_ip(&self) -> Ipv4Addr {
        match self {
            VmNet::Own(n) => n.outside_ip(),
            VmNet::Kept(n) => n.outside_ip(),
        }
    }
}

/// Build one VM's network: a namespace with its tap, veth and `policy`, the guest's NIC
/// having `mac` (a fresh one when `None`); returns it and the tap for the NIC.
/// `Policy::None` here is a restored NIC that may reach nothing (the guest keeps its NIC, its
/// driver is bound): the network is made with the rules in place and everything denied
/// before the VM runs. A jailed VMM asks its jail's waiter to make it (see
/// `mayfly_network::keeper`): it must, before its jail is locked down.
pub fn attach(
    settings: &NetSettings,
    policy: &Policy,
    mac: Option<MacAddr>,
) -> Result<(VmNet, OwnedFd), NetSetupError> {
    let config = settings.network_config();
    if let Some(jail) = mayfly_jail::jail::current() {
        let channel = jail.outside().ok_or(NetSetupError::NoKeeper)?;
        let (kept, tap) = KeptNetwork::make(channel, config, policy, mac)?;
        return Ok((VmNet::Kept(kept), tap));
    }
    let mut network = Network::new(config)?.create_nic(policy, mac)?;
    let tap = network.take_tap().ok_or_else(|| {
        NetSetupError::Network(mayfly_network::NetworkError::Kept(
            "the network came without its tap".into(),
        ))
    })?;
    Ok((VmNet::Own(network), tap))
}

/// The kernel command line argument that tells the guest's init its address.
pub fn guest_cmdline_arg(guest: &GuestConfig) -> String {
    let mut arg = format!("mayfly.net={}/{},{}", guest.ip, guest.prefix, guest.gateway);
    if let Some(dns) = guest.dns {
        arg.push_str(&format!(",{dns}"));
    }
    arg
}

/// A MAC as `02:6d:66:00:00:01`.
pub fn mac_text(mac: MacAddr) -> String {
    mayfly_agent_protocol::format_mac(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_learns_its_address_from_one_argument() {
        let guest = GuestConfig {
            ip: mayfly_network::GUEST_IP,
            prefix: mayfly_network::GUEST_PREFIX,
            gateway: mayfly_network::GATEWAY_IP,
            dns: Some(Ipv4Addr::new(198, 51, 100, 53)),
            mac: [2, 0, 0, 0, 0, 1],
        };
        assert_eq!(
            guest_cmdline_arg(&guest),
            "mayfly.net=172.16.0.2/30,172.16.0.1,198.51.100.53"
        );
        let no_dns = GuestConfig { dns: None, ..guest };
        assert_eq!(
            guest_cmdline_arg(&no_dns),
            "mayfly.net=172.16.0.2/30,172.16.0.1"
        );
    }

    /// A clone's settings reach its zygote serialized: what the host keeps out goes with them,
    /// and settings without it read as nothing opened, nothing more kept out.
    #[test]
    fn reach_and_never_travel_with_the_settings() {
        let settings = NetSettings {
            reach: vec!["10.1.0.0/16".parse().unwrap()],
            never: vec!["198.51.100.0/24".parse().unwrap()],
            ..NetSettings::default()
        };
        let json = serde_json::to_string(&settings).unwrap();
        assert_eq!(
            serde_json::from_str::<NetSettings>(&json).unwrap(),
            settings
        );
        let old = r#"{"state_dir": "/run/mayfly/net", "uplink": null, "dns": null}"#;
        assert_eq!(
            serde_json::from_str::<NetSettings>(old).unwrap(),
            NetSettings::default()
        );
    }

    #[test]
    fn a_bad_policy_says_what_to_give() {
        let err = parse_policy("allow=10.0.0.0/33").unwrap_err().to_string();
        assert!(err.contains("--net \"allow=10.0.0.0/33\""), "{err}");
        assert!(err.contains("use none, open, or allow="), "{err}");
        assert!(matches!(parse_policy("open"), Ok(Policy::Open)));
        assert!(matches!(parse_policy("none"), Ok(Policy::None)));
    }
}
