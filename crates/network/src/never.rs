//! The networks a VM never reaches, whatever its policy (`open` included): the host's own
//! addresses, link-local (169.254.0.0/16, where cloud metadata services answer), the slot pool,
//! loopback, "this network" 0.0.0.0/8, multicast, the reserved 240.0.0.0/4 (with the broadcast
//! address), the networks the operator lists in [`crate::NetworkConfig::never`], and the
//! private ranges (10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, the shared 100.64.0.0/10) but
//! for what the operator opens with [`crate::NetworkConfig::reach`].
//!
//! Computed in Rust as ranges of addresses (union, difference, merged) and written to the
//! `never` set of a VM's namespace when the VM takes its slot (see `nft.rs`), so a pooled
//! namespace always holds the never list of the VMM that claimed it.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::error::NetworkError;

/// The private ranges: never reached unless the operator lists a network inside them in
/// [`crate::NetworkConfig::reach`].
pub const PRIVATE: [Ipv4Net; 4] = [
    net(10, 0, 0, 0, 8),
    net(100, 64, 0, 0, 10),
    net(172, 16, 0, 0, 12),
    net(192, 168, 0, 0, 16),
];

/// Link-local: cloud metadata services (169.254.169.254) and other link-scoped services.
pub const LINK_LOCAL: Ipv4Net = net(169, 254, 0, 0, 16);

/// What is never reached whatever the operator says, and what each is.
const SPECIAL: [(Ipv4Net, &str); 4] = [
    (net(0, 0, 0, 0, 8), "\"this network\""),
    (net(127, 0, 0, 0, 8), "loopback"),
    (net(224, 0, 0, 0, 4), "multicast"),
    (
        net(240, 0, 0, 0, 4),
        "reserved (with the broadcast address)",
    ),
];

const fn net(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Ipv4Net {
    match Ipv4Net::new(Ipv4Addr::new(a, b, c, d), prefix) {
        Ok(net) => net,
        Err(_) => panic!("a prefix of at most 32"),
    }
}

/// A `--net-reach` or `--net-never` entry: an IPv4 network `A.B.C.D/N`, or an address (a /32).
pub fn parse_net(text: &str) -> Result<Ipv4Net, NetworkError> {
    let text = text.trim();
    let bad = |why: String| NetworkError::BadNet {
        given: text.to_string(),
        why,
    };
    if let Ok(ip) = text.parse::<Ipv4Addr>() {
        return Ok(Ipv4Net::from(ip));
    }
    let net: Ipv4Net = text
        .parse()
        .map_err(|_| bad("write A.B.C.D/N with N from 0 to 32, or an address".to_string()))?;
    if net.trunc() != net {
        return Err(bad(format!(
            "host bits are set; the network is {}",
            net.trunc()
        )));
    }
    Ok(net)
}

/// An inclusive range of IPv4 addresses, as numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Span {
    pub first: u32,
    pub last: u32,
}

impl From<Ipv4Net> for Span {
    fn from(net: Ipv4Net) -> Self {
        Self {
            first: u32::from(net.network()),
            last: u32::from(net.broadcast()),
        }
    }
}

/// A set of addresses: sorted spans, neither overlapping nor adjacent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Spans(Vec<Span>);

impl Spans {
    pub(crate) fn new(spans: impl IntoIterator<Item = Span>) -> Self {
        let mut all: Vec<Span> = spans.into_iter().filter(|s| s.first <= s.last).collect();
        all.sort_unstable();
        let mut merged: Vec<Span> = Vec::with_capacity(all.len());
        for span in all {
            match merged.last_mut() {
                // Overlapping or adjacent: one span.
                Some(prev) if span.first <= prev.last.saturating_add(1) => {
                    prev.last = prev.last.max(span.last);
                }
                _ => merged.push(span),
            }
        }
        Self(merged)
    }

    pub(crate) fn of_nets<'a>(nets: impl IntoIterator<Item = &'a Ipv4Net>) -> Self {
        Self::new(nets.into_iter().map(|n| Span::from(*n)))
    }

    pub(crate) fn spans(&self) -> &[Span] {
        &self.0
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn union(&self, other: &Spans) -> Spans {
        Spans::new(self.0.iter().chain(&other.0).copied())
    }

    /// The addresses of `self` that are not in `other`.
    pub(crate) fn minus(&self, other: &Spans) -> Spans {
        let cuts = &other.0;
        let mut out = Vec::new();
        let mut j = 0;
        for span in &self.0 {
            // Cuts wholly before this span cannot touch the later ones either.
            while j < cuts.len() && cuts[j].last < span.first {
                j += 1;
            }
            let mut first = span.first;
            let mut whole_cut = false;
            for cut in cuts[j..].iter().take_while(|c| c.first <= span.last) {
                if cut.first > first {
                    out.push(Span {
                        first,
                        last: cut.first - 1,
                    });
                }
                if cut.last >= span.last {
                    whole_cut = true;
                    break;
                }
                // cut.last < span.last <= u32::MAX: no overflow.
                first = first.max(cut.last + 1);
            }
            if !whole_cut {
                out.push(Span {
                    first,
                    last: span.last,
                });
            }
        }
        Spans(out)
    }

    /// Whether any address of `other` is in `self`.
    pub(crate) fn intersects(&self, other: &Spans) -> bool {
        other.minus(self) != *other
    }

    /// Whether every address of `other` is in `self`.
    pub(crate) fn covers(&self, other: &Spans) -> bool {
        other.minus(self).is_empty()
    }
}

/// Why part of the never set is there, for messages.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Why {
    /// A private range, less what the operator opened.
    Private(Ipv4Net),
    LinkLocal,
    Special(Ipv4Net, &'static str),
    Host(Ipv4Net),
    Pool(Ipv4Net),
    Listed(Ipv4Net),
}

/// The networks a VM never reaches on this host (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct Never {
    spans: Spans,
    /// Each part of `spans` and why it is there.
    parts: Vec<(Why, Spans)>,
}

impl Never {
    /// The never set for a host whose uplink namespace has the addresses `host`, with VM
    /// links in `pool`, the operator's extra `never` networks, and `reach`: the private
    /// networks the operator lets policies name. A `reach` network outside the private ranges
    /// is refused: the host's addresses, link-local, loopback, multicast and the pool are never
    /// reached, whatever anyone lists.
    pub(crate) fn new(
        host: &[Ipv4Net],
        pool: Ipv4Net,
        never: &[Ipv4Net],
        reach: &[Ipv4Net],
    ) -> Result<Self, NetworkError> {
        for &net in reach {
            if !PRIVATE.iter().any(|p| p.contains(&net.trunc())) {
                return Err(NetworkError::BadReach(net));
            }
        }
        let opened = Spans::of_nets(reach);
        let mut parts: Vec<(Why, Spans)> = Vec::new();
        for p in PRIVATE {
            let rest = Spans::of_nets([&p]).minus(&opened);
            if !rest.is_empty() {
                parts.push((Why::Private(p), rest));
            }
        }
        parts.push((Why::LinkLocal, Spans::of_nets([&LINK_LOCAL])));
        for (n, what) in SPECIAL {
            parts.push((Why::Special(n, what), Spans::of_nets([&n])));
        }
        let pool = pool.trunc();
        parts.push((Why::Pool(pool), Spans::of_nets([&pool])));
        let mut host: Vec<Ipv4Net> = host.iter().map(Ipv4Net::trunc).collect();
        host.sort_unstable();
        host.dedup();
        for n in host {
            parts.push((Why::Host(n), Spans::of_nets([&n])));
        }
        for n in never {
            let n = n.trunc();
            parts.push((Why::Listed(n), Spans::of_nets([&n])));
        }
        let spans = parts
            .iter()
            .fold(Spans::default(), |all, (_, part)| all.union(part));
        Ok(Self { spans, parts })
    }

    /// What the `never` set holds.
    pub(crate) fn spans(&self) -> &Spans {
        &self.spans
    }

    /// If every address of `nets` is never reached, why (one phrase per reason, for
    /// [`crate::PolicyError::NeverReached`]); `None` when some address of them can be reached.
    /// `nets` is what one allowlist entry names (a name's every address).
    pub(crate) fn refuses(&self, nets: &[Ipv4Net]) -> Option<String> {
        let wanted = Spans::of_nets(nets);
        if wanted.is_empty() || !self.spans.covers(&wanted) {
            return None;
        }
        let mut why = String::new();
        let mut hosts: Vec<Ipv4Net> = Vec::new();
        for (reason, part) in &self.parts {
            if !part.intersects(&wanted) {
                continue;
            }
            let phrase = match reason {
                Why::Private(p) => format!(
                    "{p} is private, and a policy may name a private network only if the \
                     host's operator opens it (mayfly's --net-reach)"
                ),
                Why::LinkLocal => {
                    format!("{LINK_LOCAL} is link-local (cloud metadata services answer there)")
                }
                Why::Special(n, what) => format!("{n} is {what}"),
                Why::Host(n) => {
                    hosts.push(*n);
                    continue;
                }
                Why::Pool(n) => format!("{n} is the pool of the VMs' own links"),
                Why::Listed(n) => format!("{n} is listed as never reached (--net-never)"),
            };
            if !why.is_empty() {
                why.push_str("; ");
            }
            why.push_str(&phrase);
        }
        if !hosts.is_empty() {
            if !why.is_empty() {
                why.push_str("; ");
            }
            let list: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
            let _ = write!(
                why,
                "{} {} this host's own",
                list.join(", "),
                if hosts.len() == 1 { "is" } else { "are" }
            );
        }
        Some(why)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn span(a: &str, b: &str) -> Span {
        Span {
            first: u32::from(a.parse::<Ipv4Addr>().unwrap()),
            last: u32::from(b.parse::<Ipv4Addr>().unwrap()),
        }
    }

    fn spans(list: &[(&str, &str)]) -> Spans {
        Spans::new(list.iter().map(|(a, b)| span(a, b)))
    }

    #[test]
    fn operator_networks_parse_with_reasons() {
        assert_eq!(parse_net("10.1.0.0/16").unwrap(), n("10.1.0.0/16"));
        assert_eq!(parse_net(" 192.0.2.7 ").unwrap(), n("192.0.2.7/32"));
        for (bad, why) in [
            ("10.1.0.1/16", "the network is 10.1.0.0/16"),
            ("10.1.0.0/33", "A.B.C.D/N"),
            ("2001:db8::/32", "A.B.C.D/N"),
            ("", "A.B.C.D/N"),
        ] {
            let err = parse_net(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn spans_merge_overlapping_and_adjacent_ranges() {
        let s = Spans::of_nets(&[
            n("10.0.1.0/24"),
            n("10.0.0.0/24"),
            n("10.0.0.128/25"),
            n("10.0.3.0/24"),
            n("255.255.255.255/32"),
            n("240.0.0.0/4"),
        ]);
        assert_eq!(
            s,
            spans(&[
                ("10.0.0.0", "10.0.1.255"),
                ("10.0.3.0", "10.0.3.255"),
                ("240.0.0.0", "255.255.255.255")
            ])
        );
        assert_eq!(
            Spans::of_nets(&[n("0.0.0.0/0"), n("10.0.0.0/8")]),
            spans(&[("0.0.0.0", "255.255.255.255")])
        );
    }

    #[test]
    fn spans_subtract_at_every_edge() {
        let all = spans(&[("0.0.0.0", "255.255.255.255")]);
        assert_eq!(all.minus(&all), Spans::default());
        assert_eq!(
            all.minus(&spans(&[
                ("0.0.0.0", "0.0.0.0"),
                ("255.255.255.255", "255.255.255.255")
            ])),
            spans(&[("0.0.0.1", "255.255.255.254")])
        );
        let ten = Spans::of_nets(&[n("10.0.0.0/8")]);
        assert_eq!(
            ten.minus(&Spans::of_nets(&[n("8.0.0.0/6")])),
            Spans::default()
        );
        assert_eq!(
            ten.minus(&Spans::of_nets(&[n("10.1.0.0/16"), n("10.3.0.0/16")])),
            spans(&[
                ("10.0.0.0", "10.0.255.255"),
                ("10.2.0.0", "10.2.255.255"),
                ("10.4.0.0", "10.255.255.255")
            ])
        );
        // A cut over two spans, and one beyond everything.
        let two = spans(&[("1.0.0.0", "1.0.0.9"), ("1.0.0.20", "1.0.0.29")]);
        assert_eq!(
            two.minus(&spans(&[("1.0.0.5", "1.0.0.24"), ("9.0.0.0", "9.0.0.1")])),
            spans(&[("1.0.0.0", "1.0.0.4"), ("1.0.0.25", "1.0.0.29")])
        );
        assert!(two.intersects(&spans(&[("1.0.0.9", "1.0.0.10")])));
        assert!(!two.intersects(&spans(&[("1.0.0.10", "1.0.0.19")])));
        assert!(two.covers(&spans(&[("1.0.0.21", "1.0.0.22")])));
        assert!(!two.covers(&spans(&[("1.0.0.8", "1.0.0.21")])));
    }

    fn default_never(reach: &[Ipv4Net]) -> Never {
        Never::new(
            &[n("203.0.113.200/32"), n("10.1.2.3/32")],
            n("10.200.0.0/16"),
            &[n("198.51.100.0/24")],
            reach,
        )
        .unwrap()
    }

    #[test]
    fn the_default_never_set_is_the_special_ranges_host_pool_and_private() {
        let never = default_never(&[]);
        assert_eq!(
            never.spans(),
            &Spans::of_nets(&[
                n("0.0.0.0/8"),
                n("10.0.0.0/8"),
                n("100.64.0.0/10"),
                n("127.0.0.0/8"),
                n("169.254.0.0/16"),
                n("172.16.0.0/12"),
                n("192.168.0.0/16"),
                n("198.51.100.0/24"),
                n("203.0.113.200/32"),
                n("224.0.0.0/3"),
            ])
        );
    }

    #[test]
    fn reach_opens_private_networks_but_never_the_host_or_the_pool() {
        let never = default_never(&[n("10.0.0.0/8"), n("192.168.7.0/24")]);
        let s = never.spans();
        let has = |ip: &str| s.covers(&Spans::of_nets(&[n(&format!("{ip}/32"))]));
        assert!(!has("10.9.0.1"), "opened");
        assert!(!has("192.168.7.1"), "opened");
        assert!(has("192.168.8.1"), "not opened");
        assert!(has("10.1.2.3"), "a host address stays never reached");
        assert!(has("10.200.3.1"), "the pool stays never reached");
        assert!(has("169.254.169.254"));
        assert!(has("255.255.255.255"));
        assert!(!has("198.51.99.255") && has("198.51.100.7"));
    }

    #[test]
    fn reach_outside_the_private_ranges_is_refused() {
        for bad in [
            "169.254.169.254/32",
            "8.8.8.8/32",
            "10.0.0.0/7",
            "127.0.0.1/32",
        ] {
            assert!(
                matches!(
                    Never::new(&[], n("10.200.0.0/16"), &[], &[n(bad)]),
                    Err(NetworkError::BadReach(_))
                ),
                "{bad}"
            );
        }
        let err = Never::new(&[], n("10.200.0.0/16"), &[], &[n("169.254.0.0/16")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("only private networks"), "{err}");
    }

    #[test]
    fn an_entry_is_refused_only_when_all_it_names_is_never_reached() {
        let never = default_never(&[n("10.9.0.0/16")]);
        let why = never.refuses(&[n("10.0.0.5/32")]).unwrap();
        assert!(
            why.contains("10.0.0.0/8 is private") && why.contains("--net-reach"),
            "{why}"
        );
        let why = never.refuses(&[n("169.254.169.254/32")]).unwrap();
        assert!(why.contains("link-local"), "{why}");
        let why = never.refuses(&[n("203.0.113.200/32")]).unwrap();
        assert!(why.contains("203.0.113.200/32 is this host's own"), "{why}");
        let why = never.refuses(&[n("10.200.0.1/32")]).unwrap();
        assert!(why.contains("10.200.0.0/16 is the pool"), "{why}");
        let why = never.refuses(&[n("198.51.100.1/32")]).unwrap();
        assert!(why.contains("--net-never"), "{why}");
        // A name whose every address is never reached.
        let why = never
            .refuses(&[n("127.0.0.1/32"), n("10.1.2.3/32")])
            .unwrap();
        assert!(why.contains("loopback") && why.contains("10.1.2.3/32 is this host's own"));
        // Reachable, wholly or in part.
        assert_eq!(never.refuses(&[n("10.9.0.1/32")]), None);
        assert_eq!(never.refuses(&[n("0.0.0.0/0")]), None);
        assert_eq!(
            never.refuses(&[n("10.0.0.0/8")]),
            None,
            "10.9.0.0/16 is open"
        );
        assert_eq!(never.refuses(&[n("127.0.0.1/32"), n("192.0.2.1/32")]), None);
    }
}
