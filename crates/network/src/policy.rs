//! Egress policies: what a VM may reach, parsed from `--net none|open|allow=RULE,...`.
//!
//! A rule is `CIDR` (anything to those addresses: TCP, UDP, ICMP), `CIDR:PORT` (TCP and UDP to
//! that port), or `HOST:PORT` / `HOST` with a domain name, which is resolved when the policy is
//! applied and pinned to the IPv4 addresses it had then (see [`Policy::resolve`]): the guest
//! reaches those addresses, not whatever the name points at later. Names go to the resolver
//! guests are told to use (`--net-dns`) when there is one, else to this host's (`dns.rs`). A bare address is a /32.
//! IPv6 is refused: the guest has an IPv4 address only.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::str::FromStr;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

/// What a VM's network may reach.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Policy {
    /// No network at all: the VMM creates no NIC. As a runtime change
    /// ([`crate::VmNetwork::set_policy`]) it denies everything, DNS included.
    None,
    /// Anything but the networks a VM never reaches: the host's own addresses, link-local
    /// (169.254.0.0/16: cloud metadata), the slot pool, loopback, multicast, reserved
    /// addresses, what [`crate::NetworkConfig::never`] lists, and the private ranges (10/8,
    /// 172.16/12, 192.168/16, 100.64/10) but for what [`crate::NetworkConfig::reach`] opens.
    /// Plus DNS to the resolver mayfly names, wherever it is.
    Open,
    /// These destinations, plus DNS to the resolver mayfly names. The networks a VM never
    /// reaches (see [`Policy::Open`]) stay unreached even if listed: an entry naming nothing
    /// else is refused when the policy is applied ([`PolicyError::NeverReached`]), and the
    /// never-reached part of a wider entry (`0.0.0.0/0`, `10.0.0.0/7`) is left out silently.
    Allow(Vec<Rule>),
}

/// One allowlist entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    pub dest: Dest,
    /// TCP and UDP to this port only; `None`: any protocol, any port.
    pub port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dest {
    Net(Ipv4Net),
    /// A domain name, resolved and pinned when the policy is applied.
    Host(String),
}

/// Domain names one allowlist may name: each is a query when the policy is applied, all of
/// them within [`RESOLVE_BUDGET`].
pub const MAX_NAMES: usize = 16;
/// How long resolving one policy's names may take, all of them together.
pub const RESOLVE_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a name did not resolve: the resolver's answer (the name has no IPv4 address), or no
/// answer at all (the resolver's fault, or the network's: worth another try).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupError {
    Answer(String),
    Resolver(String),
}

/// Why a policy does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{0:?} is not a network policy: use none, open or allow=CIDR[:PORT],...")]
    Unknown(String),
    #[error("allow= lists no destination: give at least one CIDR[:PORT], or use --net none")]
    EmptyAllow,
    #[error("{rule:?} is not an allowlist entry: {why}")]
    BadRule { rule: String, why: String },
    #[error("{rule:?}: port {port} is out of range: use 1 to 65535")]
    PortRange { rule: String, port: String },
    #[error("{0:?}: IPv6 destinations are not supported (the guest has an IPv4 address only)")]
    Ipv6(String),
    #[error("{name:?} does not resolve to an IPv4 address ({why}): use an address, or a name the resolver knows (--net-dns when given, else this host's)")]
    Unresolvable { name: String, why: String },
    /// The resolver did not say (no answer in time, a server failure): not the policy's fault.
    #[error("cannot resolve {name:?}: {why}: check the resolver (--net-dns when given, else this host's), then try again")]
    ResolverFailed { name: String, why: String },
    #[error("allow= names {0} domain names: at most {MAX_NAMES} (each is asked of the resolver when the policy is applied); use addresses for the rest")]
    TooManyNames(usize),
    /// An allowlist entry that names only networks a VM never reaches on this host.
    #[error("allow={rule}: a VM never reaches any of it: {why}")]
    NeverReached { rule: String, why: String },
}

impl FromStr for Policy {
    type Err = PolicyError;

    fn from_str(text: &str) -> Result<Self, PolicyError> {
        let text = text.trim();
        match text {
            "none" => return Ok(Policy::None),
            "open" => return Ok(Policy::Open),
            _ => {}
        }
        let Some(list) = text.strip_prefix("allow=") else {
            return Err(PolicyError::Unknown(text.to_string()));
        };
        let rules = list
            .split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(Rule::from_str)
            .collect::<Result<Vec<_>, _>>()?;
        if rules.is_empty() {
            return Err(PolicyError::EmptyAllow);
        }
        let names = rules
            .iter()
            .filter(|r| matches!(r.dest, Dest::Host(_)))
            .count();
        if names > MAX_NAMES {
            return Err(PolicyError::TooManyNames(names));
        }
        Ok(Policy::Allow(rules))
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::None => write!(f, "none"),
            Policy::Open => write!(f, "open"),
            Policy::Allow(rules) => {
                write!(f, "allow=")?;
                for (i, rule) in rules.iter().enumerate() {
                    if i > 0 {
                        write!(f, ",")?;
                    }
                    write!(f, "{rule}")?;
                }
                Ok(())
            }
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.dest {
            Dest::Net(net) => write!(f, "{net}")?,
            Dest::Host(name) => write!(f, "{name}")?,
        }
        if let Some(port) = self.port {
            write!(f, ":{port}")?;
        }
        Ok(())
    }
}

fn is_hostname(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 253
        && text.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
        && text.bytes().any(|b| b.is_ascii_alphabetic())
}

impl FromStr for Rule {
    type Err = PolicyError;

    fn from_str(rule: &str) -> Result<Self, PolicyError> {
        let bad = |why: &str| PolicyError::BadRule {
            rule: rule.to_string(),
            why: why.to_string(),
        };
        // IPv6 in any spelling ("::1", "[2001:db8::]/32:443", "2001:db8::/32").
        if rule.starts_with('[') || rule.matches(':').count() > 1 {
            return Err(PolicyError::Ipv6(rule.to_string()));
        }
        let (dest, port) = match rule.split_once(':') {
            Some((dest, port)) => {
                let value: u32 = port.parse().map_err(|_| {
                    if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
                        PolicyError::PortRange {
                            rule: rule.to_string(),
                            port: port.to_string(),
                        }
                    } else {
                        bad("the port after ':' must be a number from 1 to 65535")
                    }
                })?;
                let value = match u16::try_from(value) {
                    Ok(value) if value != 0 => value,
                    _ => {
                        return Err(PolicyError::PortRange {
                            rule: rule.to_string(),
                            port: port.to_string(),
                        })
                    }
                };
                (dest, Some(value))
            }
            None => (rule, None),
        };
        let dest = if dest.contains('/') {
            let net = Ipv4Net::from_str(dest).map_err(|_| {
                if dest
                    .split_once('/')
                    .is_some_and(|(a, _)| a.parse::<std::net::Ipv6Addr>().is_ok())
                {
                    PolicyError::Ipv6(rule.to_string())
                } else {
                    bad("not a CIDR: write an IPv4 network as A.B.C.D/N with N from 0 to 32")
                }
            })?;
            if net.trunc() != net {
                return Err(bad(&format!(
                    "host bits are set; the network is {}",
                    net.trunc()
                )));
            }
            Dest::Net(net)
        } else if let Ok(addr) = dest.parse::<IpAddr>() {
            match addr {
                IpAddr::V4(v4) => Dest::Net(Ipv4Net::from(v4)),
                IpAddr::V6(_) => return Err(PolicyError::Ipv6(rule.to_string())),
            }
        } else if dest.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            return Err(bad("not an IPv4 address"));
        } else if is_hostname(dest) {
            Dest::Host(dest.to_ascii_lowercase())
        } else {
            return Err(bad("not a CIDR, an address or a domain name"));
        };
        Ok(Rule { dest, port })
    }
}

/// A policy with every name resolved: what the nftables sets hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Networks reachable by any protocol.
    pub nets: Vec<Ipv4Net>,
    /// (network, IP protocol, port) reachable.
    pub services: Vec<(Ipv4Net, u8, u16)>,
    /// The resolver the guest may reach with DNS (TCP and UDP port 53), even where it is a
    /// network a VM never reaches otherwise (a host or private address).
    pub dns: Option<Ipv4Addr>,
}

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

impl Policy {
    /// The destinations this policy allows, names resolved now (and pinned), with DNS to
    /// `dns` for an allowlist or `open`. Nested entries are folded into the ones containing
    /// them.
    pub fn resolve(&self, dns: Option<Ipv4Addr>) -> Result<Resolved, PolicyError> {
        self.resolve_checked(dns, &host_lookup, |_| None)
    }

    /// [`Policy::resolve`] with names resolved by `lookup` (its error says why a name does
    /// not resolve), refusing an allowlist entry for which `refuse` (given all the networks
    /// the entry names, a name's every address) says why it cannot be reached.
    pub(crate) fn resolve_checked(
        &self,
        dns: Option<Ipv4Addr>,
        lookup: &dyn Fn(&str) -> Result<Vec<Ipv4Addr>, LookupError>,
        refuse: impl Fn(&[Ipv4Net]) -> Option<String>,
    ) -> Result<Resolved, PolicyError> {
        let mut out = Resolved::default();
        match self {
            Policy::None => {}
            Policy::Open => {
                out.nets.push(Ipv4Net::default());
                out.dns = dns;
            }
            Policy::Allow(rules) => {
                for rule in rules {
                    let nets = match &rule.dest {
                        Dest::Net(net) => vec![*net],
                        Dest::Host(name) => resolve_name(name, lookup)?,
                    };
                    if let Some(why) = refuse(&nets) {
                        return Err(PolicyError::NeverReached {
                            rule: rule.to_string(),
                            why,
                        });
                    }
                    for net in nets {
                        match rule.port {
                            None => out.nets.push(net),
                            Some(port) => {
                                out.services.push((net, TCP, port));
                                out.services.push((net, UDP, port));
                            }
                        }
                    }
                }
                out.dns = dns;
            }
        }
        out.normalize();
        Ok(out)
    }
}

fn resolve_name(
    name: &str,
    lookup: &dyn Fn(&str) -> Result<Vec<Ipv4Addr>, LookupError>,
) -> Result<Vec<Ipv4Net>, PolicyError> {
    let name_of = || name.to_string();
    let mut nets: Vec<Ipv4Net> = lookup(name)
        .map_err(|e| match e {
            LookupError::Answer(why) => PolicyError::Unresolvable {
                name: name_of(),
                why,
            },
            LookupError::Resolver(why) => PolicyError::ResolverFailed {
                name: name_of(),
                why,
            },
        })?
        .into_iter()
        .map(Ipv4Net::from)
        .collect();
    nets.sort();
    nets.dedup();
    if nets.is_empty() {
        return Err(PolicyError::Unresolvable {
            name: name.to_string(),
            why: "it has no IPv4 address".to_string(),
        });
    }
    Ok(nets)
}

/// A name's IPv4 addresses by this host's resolver (glibc: `/etc/hosts`, then DNS).
pub(crate) fn host_lookup(name: &str) -> Result<Vec<Ipv4Addr>, LookupError> {
    let addrs = (name, 0u16).to_socket_addrs().map_err(|e| {
        // std keeps only gai_strerror's text: EAI_AGAIN's is the one that is not an answer.
        let why = e.to_string();
        if why.contains("Temporary failure") {
            LookupError::Resolver(why)
        } else {
            LookupError::Answer(why)
        }
    })?;
    let v4: Vec<Ipv4Addr> = addrs
        .filter_map(|a| match a.ip() {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
        .collect();
    if v4.is_empty() {
        return Err(LookupError::Answer(
            "it has IPv6 addresses only".to_string(),
        ));
    }
    Ok(v4)
}

impl Resolved {
    /// What is allowed, as allowlist entries with every name replaced by the addresses it was
    /// pinned to (`CIDR` for any protocol, `CIDR:PORT` for TCP and UDP to that port): what
    /// `GET /vm/net` shows beside the policy as given.
    pub fn entries(&self) -> Vec<String> {
        let mut out: Vec<String> = self.nets.iter().map(Ipv4Net::to_string).collect();
        let mut ports: Vec<(Ipv4Net, u16)> =
            self.services.iter().map(|&(n, _, p)| (n, p)).collect();
        ports.sort();
        ports.dedup();
        out.extend(ports.iter().map(|(net, port)| format!("{net}:{port}")));
        out
    }

    /// Drop what another entry already covers, so no two set elements overlap (nftables
    /// refuses overlapping intervals).
    fn normalize(&mut self) {
        let nets = std::mem::take(&mut self.nets);
        let mut kept: Vec<Ipv4Net> = Vec::new();
        for net in nets {
            if kept.iter().any(|k| k.contains(&net)) {
                continue;
            }
            kept.retain(|k| !net.contains(k));
            kept.push(net);
        }
        kept.sort();
        self.nets = kept;
        let services = std::mem::take(&mut self.services);
        let mut kept: Vec<(Ipv4Net, u8, u16)> = Vec::new();
        for (net, proto, port) in services {
            // Covered by an any-protocol entry, or by a wider entry for the same service.
            if self.nets.iter().any(|k| k.contains(&net))
                || kept
                    .iter()
                    .any(|(k, p, q)| *p == proto && *q == port && k.contains(&net))
            {
                continue;
            }
            kept.retain(|(k, p, q)| !(*p == proto && *q == port && net.contains(k)));
            kept.push((net, proto, port));
        }
        kept.sort();
        self.services = kept;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    /// Names resolve in mayfly's static binaries too (glibc's resolver loads its NSS
    /// modules at run time): `localhost` comes from /etc/hosts (no query leaves the host).
    #[test]
    fn a_name_in_an_allowlist_is_resolved_and_pinned() {
        let p: Policy = "allow=localhost:8080".parse().unwrap();
        let resolved = p.resolve(None).unwrap();
        assert_eq!(
            resolved.services,
            vec![
                (net("127.0.0.1/32"), TCP, 8080),
                (net("127.0.0.1/32"), UDP, 8080)
            ]
        );
    }

    #[test]
    fn policies_parse() {
        assert_eq!("none".parse::<Policy>().unwrap(), Policy::None);
        assert_eq!("open".parse::<Policy>().unwrap(), Policy::Open);
        let p: Policy = "allow=10.0.0.0/8:443, 192.0.2.7,example.com:80"
            .parse()
            .unwrap();
        assert_eq!(
            p,
            Policy::Allow(vec![
                Rule {
                    dest: Dest::Net(net("10.0.0.0/8")),
                    port: Some(443)
                },
                Rule {
                    dest: Dest::Net(net("192.0.2.7/32")),
                    port: None
                },
                Rule {
                    dest: Dest::Host("example.com".into()),
                    port: Some(80)
                },
            ])
        );
        assert_eq!(
            p.to_string(),
            "allow=10.0.0.0/8:443,192.0.2.7/32,example.com:80"
        );
        assert_eq!(p.to_string().parse::<Policy>().unwrap(), p);
    }

    #[test]
    fn bad_policies_say_what_is_wrong() {
        let err = |s: &str| s.parse::<Policy>().unwrap_err();
        assert!(matches!(err("closed"), PolicyError::Unknown(_)));
        assert!(err("closed").to_string().contains("none, open or allow="));
        assert_eq!(err("allow="), PolicyError::EmptyAllow);
        assert!(matches!(
            err("allow=10.0.0.0/33"),
            PolicyError::BadRule { .. }
        ));
        assert!(err("allow=10.0.0.0/33").to_string().contains("not a CIDR"));
        assert!(matches!(
            err("allow=300.1.2.3"),
            PolicyError::BadRule { .. }
        ));
        assert!(matches!(
            err("allow=10.0.0.1/8"),
            PolicyError::BadRule { .. }
        ));
        assert!(err("allow=10.0.0.1/8").to_string().contains("10.0.0.0/8"));
        assert!(matches!(
            err("allow=10.0.0.0/8:70000"),
            PolicyError::PortRange { .. }
        ));
        assert!(matches!(
            err("allow=10.0.0.0/8:0"),
            PolicyError::PortRange { .. }
        ));
        assert!(err("allow=1.2.3.4:0").to_string().contains("1 to 65535"));
        assert!(matches!(
            err("allow=1.2.3.4:http"),
            PolicyError::BadRule { .. }
        ));
        assert!(matches!(err("allow=1.2.3.4:"), PolicyError::BadRule { .. }));
        assert!(matches!(err("allow=2001:db8::/32"), PolicyError::Ipv6(_)));
        assert!(matches!(err("allow=[::1]:80"), PolicyError::Ipv6(_)));
        assert!(matches!(err("allow=::1"), PolicyError::Ipv6(_)));
        assert!(matches!(
            err("allow=bad_name!:80"),
            PolicyError::BadRule { .. }
        ));
    }

    #[test]
    fn resolving_folds_nested_entries_and_adds_dns() {
        let p: Policy = "allow=10.0.0.0/8,10.1.0.0/16,10.2.0.0/16:443,192.0.2.0/24:53,192.0.2.0/25:53,192.0.2.9"
            .parse()
            .unwrap();
        let dns = Some(Ipv4Addr::new(192, 0, 2, 53));
        let r = p.resolve(dns).unwrap();
        assert_eq!(r.nets, vec![net("10.0.0.0/8"), net("192.0.2.9/32")]);
        assert_eq!(
            r.services,
            vec![
                (net("192.0.2.0/24"), TCP, 53),
                (net("192.0.2.0/24"), UDP, 53)
            ],
        );
        assert_eq!(r.dns, dns, "DNS has a set of its own");
        assert_eq!(
            r.entries(),
            vec!["10.0.0.0/8", "192.0.2.9/32", "192.0.2.0/24:53"],
            "one entry per network or port, TCP and UDP together"
        );
        let open = Policy::Open.resolve(dns).unwrap();
        assert_eq!(open.nets, vec![net("0.0.0.0/0")]);
        assert_eq!(open.dns, dns);
        assert_eq!(Policy::None.resolve(dns).unwrap(), Resolved::default());
    }

    #[test]
    fn an_entry_the_host_refuses_fails_the_policy_with_the_reason() {
        let p: Policy = "allow=192.0.2.9,10.0.0.5:443".parse().unwrap();
        let refuse = |nets: &[Ipv4Net]| {
            nets.iter()
                .all(|n| net("10.0.0.0/8").contains(n))
                .then(|| "10.0.0.0/8 is private".to_string())
        };
        let err = p.resolve_checked(None, &host_lookup, refuse).unwrap_err();
        assert_eq!(
            err,
            PolicyError::NeverReached {
                rule: "10.0.0.5/32:443".into(),
                why: "10.0.0.0/8 is private".into()
            }
        );
        assert!(err
            .to_string()
            .starts_with("allow=10.0.0.5/32:443: a VM never reaches"));
        let p: Policy = "allow=0.0.0.0/0".parse().unwrap();
        assert!(p.resolve_checked(None, &host_lookup, refuse).is_ok());
    }

    #[test]
    fn an_allowlist_names_at_most_sixteen_domains() {
        let names = |n: usize| {
            let list: Vec<String> = (0..n).map(|i| format!("host{i}.test:443")).collect();
            format!("allow=192.0.2.0/24,{}", list.join(","))
        };
        assert!(names(MAX_NAMES).parse::<Policy>().is_ok());
        assert_eq!(
            names(MAX_NAMES + 1).parse::<Policy>(),
            Err(PolicyError::TooManyNames(MAX_NAMES + 1))
        );
    }

    #[test]
    fn names_are_resolved_and_pinned() {
        let p: Policy = "allow=localhost:8080".parse().unwrap();
        let r = p.resolve(None).unwrap();
        assert_eq!(
            r.services,
            vec![
                (net("127.0.0.1/32"), TCP, 8080),
                (net("127.0.0.1/32"), UDP, 8080)
            ]
        );
        let p: Policy = "allow=no-such-host.invalid:80".parse().unwrap();
        assert!(matches!(
            p.resolve(None),
            Err(PolicyError::Unresolvable { .. })
        ));
    }
}
