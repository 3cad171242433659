//! The addresses a namespace takes as its own: the routes of its `local` routing table (every
//! interface address, the subnet broadcasts, any local route such as an AnyIP range), read
//! over rtnetlink. A VM never reaches them: they are the host (see `never.rs`).

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd};

use ipnet::Ipv4Net;

const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const RTA_DST: u16 = 1;
const RTA_TABLE: u16 = 15;
const RT_TABLE_LOCAL: u32 = 255;
const RTN_LOCAL: u8 = 2;
const RTN_BROADCAST: u8 = 3;
const RTN_ANYCAST: u8 = 4;
/// struct nlmsghdr, then struct rtmsg.
const NLMSG_HDR: usize = 16;
const RTMSG: usize = 12;

/// The IPv4 addresses (and local ranges) of the calling thread's network namespace.
pub(crate) fn addresses() -> io::Result<Vec<Ipv4Net>> {
    // SAFETY: a plain socket call.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nobody else owns.
    let sock = unsafe { File::from_raw_fd(fd) };
    // A dump always ends; the timeout is only against a kernel that never answers.
    let timeout = libc::timeval {
        tv_sec: 5,
        tv_usec: 0,
    };
    // SAFETY: SO_RCVTIMEO reads a struct timeval of the given size.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::timeval>()).unwrap_or(16),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let seq: u32 = 1;
    let mut req = Vec::with_capacity(NLMSG_HDR + RTMSG);
    let len = u32::try_from(NLMSG_HDR + RTMSG).unwrap_or(28);
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&RTM_GETROUTE.to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
    req.push(u8::try_from(libc::AF_INET).unwrap_or(2));
    req.extend_from_slice(&[0; 7]);
    req.extend_from_slice(&0u32.to_ne_bytes());
    // SAFETY: an all-zero sockaddr_nl addresses the kernel.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::sa_family_t::try_from(libc::AF_NETLINK).unwrap_or(16);
    // SAFETY: sendto reads `req` and the address of the given size.
    let n = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&addr as *const libc::sockaddr_nl).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_nl>()).unwrap_or(12),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 64 << 10];
    let mut out = Vec::new();
    loop {
        // SAFETY: recv writes at most buf.len() bytes.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        let n = usize::try_from(n).unwrap_or(0);
        if n == 0 {
            return Err(io::Error::other("the routing dump ended early"));
        }
        if parse(&buf[..n], seq, &mut out)? {
            break;
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Read one datagram of a route dump into `out`; whether the dump is done.
fn parse(mut rest: &[u8], seq: u32, out: &mut Vec<Ipv4Net>) -> io::Result<bool> {
    let u16_at = |b: &[u8], at: usize| u16::from_ne_bytes([b[at], b[at + 1]]);
    let u32_at = |b: &[u8], at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    while rest.len() >= NLMSG_HDR {
        let len = usize::try_from(u32_at(rest, 0)).unwrap_or(usize::MAX);
        if len < NLMSG_HDR || len > rest.len() {
            return Err(io::Error::other("a malformed routing message"));
        }
        let msg = &rest[..len];
        rest = &rest[len.div_ceil(4).saturating_mul(4).min(rest.len())..];
        if u32_at(msg, 8) != seq {
            continue;
        }
        match u16_at(msg, 4) {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let code = if msg.len() >= NLMSG_HDR + 4 {
                    i32::from_ne_bytes([msg[16], msg[17], msg[18], msg[19]])
                } else {
                    -libc::EIO
                };
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
            }
            RTM_NEWROUTE if msg.len() >= NLMSG_HDR + RTMSG => {
                let rtm = &msg[NLMSG_HDR..];
                let (family, dst_len, table, kind) = (rtm[0], rtm[1], rtm[4], rtm[7]);
                if i32::from(family) != libc::AF_INET {
                    continue;
                }
                let mut table = u32::from(table);
                let mut dst = Ipv4Addr::UNSPECIFIED;
                let mut attrs = &msg[NLMSG_HDR + RTMSG..];
                while attrs.len() >= 4 {
                    let alen = usize::from(u16_at(attrs, 0));
                    if alen < 4 || alen > attrs.len() {
                        break;
                    }
                    let data = &attrs[4..alen];
                    match u16_at(attrs, 2) {
                        RTA_DST if data.len() == 4 => {
                            dst = Ipv4Addr::new(data[0], data[1], data[2], data[3]);
                        }
                        RTA_TABLE if data.len() == 4 => table = u32_at(data, 0),
                        _ => {}
                    }
                    attrs = &attrs[alen.div_ceil(4).saturating_mul(4).min(attrs.len())..];
                }
                if table == RT_TABLE_LOCAL
                    && matches!(kind, RTN_LOCAL | RTN_BROADCAST | RTN_ANYCAST)
                {
                    if let Ok(net) = Ipv4Net::new(dst, dst_len) {
                        out.push(net.trunc());
                    }
                }
            }
            _ => {}
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(seq: u32, dst: [u8; 4], dst_len: u8, table: u8, kind: u8) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&36u32.to_ne_bytes());
        m.extend_from_slice(&RTM_NEWROUTE.to_ne_bytes());
        m.extend_from_slice(&2u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[2, dst_len, 0, 0, table, 2, 0xfe, kind]);
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&8u16.to_ne_bytes());
        m.extend_from_slice(&RTA_DST.to_ne_bytes());
        m.extend_from_slice(&dst);
        m
    }

    #[test]
    fn local_and_broadcast_routes_of_the_local_table_are_the_hosts() {
        let mut dump = Vec::new();
        dump.extend(route(1, [203, 0, 113, 200], 32, 255, RTN_LOCAL));
        dump.extend(route(1, [203, 0, 113, 255], 32, 255, RTN_BROADCAST));
        dump.extend(route(1, [198, 51, 100, 0], 24, 255, RTN_LOCAL));
        // The main table's routes, and another dump's, are not the host's.
        dump.extend(route(1, [192, 0, 2, 0], 24, 254, 1));
        dump.extend(route(7, [192, 0, 2, 9], 32, 255, RTN_LOCAL));
        let mut out = Vec::new();
        assert!(!parse(&dump, 1, &mut out).unwrap());
        assert_eq!(
            out,
            vec![
                "203.0.113.200/32".parse::<Ipv4Net>().unwrap(),
                "203.0.113.255/32".parse().unwrap(),
                "198.51.100.0/24".parse().unwrap(),
            ]
        );
        let mut done = Vec::new();
        done.extend_from_slice(&20u32.to_ne_bytes());
        done.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        done.extend_from_slice(&2u16.to_ne_bytes());
        done.extend_from_slice(&1u32.to_ne_bytes());
        done.extend_from_slice(&0u32.to_ne_bytes());
        done.extend_from_slice(&0u32.to_ne_bytes());
        assert!(parse(&done, 1, &mut out).unwrap());
        assert!(parse(&dump[..20], 1, &mut out).is_err(), "a cut message");
    }

    /// A namespace of its own: loopback's routes, and an address added to it.
    #[test]
    fn a_namespaces_own_addresses_are_read() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let ns = crate::netns::create().unwrap();
        crate::netns::run("ip", &["link", "set", "lo", "up"], None, Some(&ns)).unwrap();
        crate::netns::run(
            "ip",
            &["addr", "add", "198.51.100.9/24", "dev", "lo"],
            None,
            Some(&ns),
        )
        .unwrap();
        let got = crate::netns::run_in(&ns, addresses).unwrap().unwrap();
        for want in ["127.0.0.0/8", "198.51.100.9/32", "198.51.100.255/32"] {
            assert!(
                got.contains(&want.parse().unwrap()),
                "{want} not in {got:?}"
            );
        }
    }
}
