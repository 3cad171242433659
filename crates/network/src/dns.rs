//! Names in allowlists, resolved by the resolver VMs are told to use.
//!
//! Why: `allow=pypi.internal:443` must mean the addresses the guest will get for that name,
//! or the guest resolves one address and the policy allows another. When the operator names
//! a resolver (`--net-dns`), guests are told to use it (`/etc/resolv.conf`), so the policy
//! asks it too, from the uplink namespace (where guests' DNS goes out, and where a private
//! resolver may be the only one reachable). Without `--net-dns`, guests have no resolver of
//! mayfly's and names go to this host's own (glibc, `/etc/hosts` included).
//!
//! One A query over UDP (three tries, a second each), over TCP when the answer is truncated;
//! CNAME chains in the answer are followed (a CDN's name usually is one). The socket is
//! connected, so the kernel drops datagrams from anyone but the resolver, and an answer whose
//! id or question differs from the query is ignored. Packets are built and parsed by the
//! `simple-dns` crate. All the names of one policy share one deadline
//! ([`crate::policy::RESOLVE_BUDGET`], at most [`crate::policy::MAX_NAMES`] names): a name the
//! resolver says has no IPv4 address is the policy's fault ([`LookupError::Answer`]), no
//! answer in time is the resolver's ([`LookupError::Resolver`]).

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use simple_dns::rdata::RData;
use simple_dns::{Name, Packet, PacketFlag, Question, CLASS, QCLASS, QTYPE, RCODE, TYPE};

use crate::policy::LookupError;

/// Tries over UDP before giving up, and how long each waits for an answer (less when the
/// caller's deadline is nearer).
const TRIES: u32 = 3;
const WAIT: Duration = Duration::from_secs(1);
/// The TCP exchange after a truncated answer, as a whole (or to the caller's deadline).
const TCP_WAIT: Duration = Duration::from_secs(3);
/// CNAME links followed before the answer is called a loop.
const MAX_CHAIN: usize = 16;

/// The IPv4 addresses of `name` as the resolver at `server` says, asked from the network
/// namespace `ns`, given up at `deadline`.
pub(crate) fn lookup(
    server: SocketAddrV4,
    ns: &File,
    name: &str,
    deadline: Instant,
) -> Result<Vec<Ipv4Addr>, LookupError> {
    crate::netns::run_in(ns, || query(server, name, deadline)).map_err(|e| {
        LookupError::Resolver(format!(
            "cannot enter the uplink namespace to ask {server}: {e}"
        ))
    })?
}

/// [`lookup`] in the calling thread's namespace.
pub(crate) fn query(
    server: SocketAddrV4,
    name: &str,
    deadline: Instant,
) -> Result<Vec<Ipv4Addr>, LookupError> {
    let io = |what: &'static str| {
        move |e: std::io::Error| LookupError::Resolver(format!("{what} {server}: {e}"))
    };
    let request_for = |id| build_query(id, name).map_err(LookupError::Answer);
    let sock =
        UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(io("cannot open a socket to"))?;
    sock.connect(server)
        .map_err(io("cannot reach the resolver"))?;
    let mut buf = [0u8; 1500];
    for _ in 0..TRIES {
        let id = random_id();
        let request = request_for(id)?;
        sock.send(&request).map_err(io("cannot send a query to"))?;
        let wait_until = deadline.min(Instant::now() + WAIT);
        loop {
            let left = wait_until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            sock.set_read_timeout(Some(left))
                .map_err(io("cannot wait for"))?;
            let n = match sock.recv(&mut buf) {
                Ok(n) => n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    return Err(LookupError::Resolver(format!(
                        "nothing answers DNS at {server}"
                    )));
                }
                Err(e) => return Err(io("no answer from")(e)),
            };
            let Ok(reply) = Packet::parse(&buf[..n]) else {
                continue;
            };
            if !is_reply_to(&reply, id, name) {
                continue;
            }
            if reply.has_flags(PacketFlag::TRUNCATION) {
                return query_tcp(server, id, &request, name, deadline);
            }
            return addresses(&reply, name, server);
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    Err(LookupError::Resolver(format!(
        "{server} did not answer in time"
    )))
}

/// The same query over TCP (RFC 1035 4.2.2: each message after its 16-bit length), all of it
/// within [`TCP_WAIT`] and `deadline`.
fn query_tcp(
    server: SocketAddrV4,
    id: u16,
    request: &[u8],
    name: &str,
    deadline: Instant,
) -> Result<Vec<Ipv4Addr>, LookupError> {
    let deadline = deadline.min(Instant::now() + TCP_WAIT);
    let io = |e: std::io::Error| {
        LookupError::Resolver(format!("TCP to {server} after a truncated answer: {e}"))
    };
    let left = || {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io(ErrorKind::TimedOut.into()))
        } else {
            Ok(left)
        }
    };
    let mut conn = TcpStream::connect_timeout(&server.into(), left()?).map_err(io)?;
    conn.set_write_timeout(Some(left()?)).map_err(io)?;
    let len = u16::try_from(request.len())
        .map_err(|_| LookupError::Answer("the query is too long".to_string()))?;
    let mut out = len.to_be_bytes().to_vec();
    out.extend_from_slice(request);
    conn.write_all(&out).map_err(io)?;
    // Each read waits only for what is left: a resolver that trickles cannot hold on.
    let mut read_exact = |buf: &mut [u8]| -> Result<(), LookupError> {
        let mut got = 0;
        while got < buf.len() {
            conn.set_read_timeout(Some(left()?)).map_err(io)?;
            match conn.read(&mut buf[got..]) {
                Ok(0) => return Err(io(ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        Ok(())
    };
    let mut len = [0u8; 2];
    read_exact(&mut len)?;
    let mut body = vec![0u8; usize::from(u16::from_be_bytes(len))];
    read_exact(&mut body)?;
    let reply = Packet::parse(&body)
        .map_err(|e| LookupError::Resolver(format!("{server} sent a malformed answer: {e}")))?;
    if !is_reply_to(&reply, id, name) {
        return Err(LookupError::Resolver(format!(
            "{server} answered another question over TCP"
        )));
    }
    addresses(&reply, name, server)
}

fn build_query(id: u16, name: &str) -> Result<Vec<u8>, String> {
    let qname = Name::new(name).map_err(|e| format!("not a DNS name: {e}"))?;
    let mut packet = Packet::new_query(id);
    packet.set_flags(PacketFlag::RECURSION_DESIRED);
    packet.questions.push(Question::new(
        qname,
        QTYPE::TYPE(TYPE::A),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    packet
        .build_bytes_vec()
        .map_err(|e| format!("cannot build a query: {e}"))
}

/// A response with our id, asking exactly our question.
fn is_reply_to(reply: &Packet<'_>, id: u16, name: &str) -> bool {
    reply.id() == id
        && reply.has_flags(PacketFlag::RESPONSE)
        && reply.questions.len() == 1
        && same_name(&reply.questions[0].qname, name)
        && reply.questions[0].qtype == QTYPE::TYPE(TYPE::A)
}

fn same_name(a: &Name<'_>, b: &str) -> bool {
    a.to_string()
        .trim_end_matches('.')
        .eq_ignore_ascii_case(b.trim_end_matches('.'))
}

/// The A records of `name` in `reply`, following its CNAME chain.
fn addresses(
    reply: &Packet<'_>,
    name: &str,
    server: SocketAddrV4,
) -> Result<Vec<Ipv4Addr>, LookupError> {
    match reply.rcode() {
        RCODE::NoError => {}
        RCODE::NameError => {
            return Err(LookupError::Answer(format!(
                "{server} says there is no such name"
            )))
        }
        other => {
            return Err(LookupError::Resolver(format!(
                "{server} answered {other:?}"
            )))
        }
    }
    let mut current = name.trim_end_matches('.').to_ascii_lowercase();
    let mut seen = vec![current.clone()];
    let mut found = Vec::new();
    loop {
        let mut next = None;
        for record in reply
            .answers
            .iter()
            .filter(|r| same_name(&r.name, &current))
        {
            match &record.rdata {
                RData::A(a) => found.push(Ipv4Addr::from(a.address)),
                RData::CNAME(target) => next = Some(target.0.to_string().to_ascii_lowercase()),
                _ => {}
            }
        }
        let Some(target) = next.filter(|_| found.is_empty()) else {
            break;
        };
        let target = target.trim_end_matches('.').to_string();
        if seen.contains(&target) || seen.len() > MAX_CHAIN {
            return Err(LookupError::Resolver(format!(
                "{server} answered a CNAME loop or too long a chain ({})",
                seen.join(" -> ")
            )));
        }
        seen.push(target.clone());
        current = target;
    }
    found.sort();
    found.dedup();
    if found.is_empty() {
        return Err(LookupError::Answer(format!(
            "{server} knows the name but gives it no IPv4 address"
        )));
    }
    Ok(found)
}

fn random_id() -> u16 {
    let mut id = [0u8; 2];
    // SAFETY: getrandom writes at most 2 bytes into `id`.
    let n = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if n != 2 {
        // Never in practice: the id only guards against stray answers, the socket is connected.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        return (t & 0xffff) as u16;
    }
    u16::from_ne_bytes(id)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use simple_dns::rdata::{A, CNAME};
    use simple_dns::ResourceRecord;
    use std::net::TcpListener;

    /// A resolver on loopback: `cdn.test` is a CNAME to `edge.cdn.test` with two addresses,
    /// `one.test` has one, `big.test` answers truncated over UDP and in full over TCP, `v6.test`
    /// has no A record, anything else is NXDOMAIN. Before answering it sends a reply with a
    /// wrong id, which must be ignored.
    pub(crate) fn resolver() -> SocketAddrV4 {
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = match udp.local_addr().unwrap() {
            std::net::SocketAddr::V4(a) => a.port(),
            _ => unreachable!(),
        };
        let tcp = TcpListener::bind(("127.0.0.1", port)).unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, from)) = udp.recv_from(&mut buf) else {
                    return;
                };
                let query = Packet::parse(&buf[..n]).unwrap();
                if query.questions[0].qname.to_string() == "silent.test" {
                    continue;
                }
                let mut decoy = answer(&query, false);
                decoy.set_id(query.id().wrapping_add(1));
                udp.send_to(&decoy.build_bytes_vec().unwrap(), from)
                    .unwrap();
                let reply = answer(&query, true);
                udp.send_to(&reply.build_bytes_vec().unwrap(), from)
                    .unwrap();
            }
        });
        std::thread::spawn(move || {
            for conn in tcp.incoming() {
                let mut conn = conn.unwrap();
                let mut len = [0u8; 2];
                conn.read_exact(&mut len).unwrap();
                let mut body = vec![0u8; usize::from(u16::from_be_bytes(len))];
                conn.read_exact(&mut body).unwrap();
                let query = Packet::parse(&body).unwrap();
                let reply = answer(&query, false).build_bytes_vec().unwrap();
                let mut out = u16::try_from(reply.len()).unwrap().to_be_bytes().to_vec();
                out.extend_from_slice(&reply);
                conn.write_all(&out).unwrap();
            }
        });
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)
    }

    fn answer<'a>(query: &Packet<'a>, udp: bool) -> Packet<'a> {
        let mut reply = Packet::new_reply(query.id());
        let q = query.questions[0].clone();
        let qname = q.qname.to_string().to_ascii_lowercase();
        reply.questions.push(q);
        let a = |name: &'static str, ip: [u8; 4]| {
            ResourceRecord::new(
                Name::new_unchecked(name),
                CLASS::IN,
                60,
                RData::A(A {
                    address: u32::from(Ipv4Addr::from(ip)),
                }),
            )
        };
        match qname.as_str() {
            "cdn.test" => {
                reply.answers.push(ResourceRecord::new(
                    Name::new_unchecked("cdn.test"),
                    CLASS::IN,
                    60,
                    RData::CNAME(CNAME(Name::new_unchecked("edge.cdn.test"))),
                ));
                reply.answers.push(a("edge.cdn.test", [198, 51, 100, 7]));
                reply.answers.push(a("edge.cdn.test", [198, 51, 100, 8]));
                // Not on the chain: never taken.
                reply.answers.push(a("elsewhere.test", [203, 0, 113, 66]));
            }
            "one.test" => reply.answers.push(a("one.test", [198, 51, 100, 1])),
            "loop.test" => reply.answers.push(ResourceRecord::new(
                Name::new_unchecked("loop.test"),
                CLASS::IN,
                60,
                RData::CNAME(CNAME(Name::new_unchecked("loop.test"))),
            )),
            "big.test" if udp => reply.set_flags(PacketFlag::TRUNCATION),
            "big.test" => reply.answers.push(a("big.test", [198, 51, 100, 9])),
            "v6.test" => {}
            _ => *reply.rcode_mut() = RCODE::NameError,
        }
        reply
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    fn why(e: LookupError) -> String {
        match e {
            LookupError::Answer(w) | LookupError::Resolver(w) => w,
        }
    }

    #[test]
    fn a_name_resolves_through_the_resolver_cnames_followed_truncation_over_tcp() {
        let server = resolver();
        assert_eq!(
            query(server, "one.test", soon()).unwrap(),
            vec![Ipv4Addr::new(198, 51, 100, 1)]
        );
        assert_eq!(
            query(server, "CDN.test.", soon()).unwrap(),
            vec![
                Ipv4Addr::new(198, 51, 100, 7),
                Ipv4Addr::new(198, 51, 100, 8)
            ],
            "the chain's addresses only"
        );
        assert_eq!(
            query(server, "big.test", soon()).unwrap(),
            vec![Ipv4Addr::new(198, 51, 100, 9)]
        );
        let err = query(server, "nothing.test", soon()).unwrap_err();
        assert!(
            matches!(&err, LookupError::Answer(w) if w.contains("no such name")),
            "{err:?}"
        );
        let err = query(server, "v6.test", soon()).unwrap_err();
        assert!(
            matches!(&err, LookupError::Answer(w) if w.contains("no IPv4 address")),
            "{err:?}"
        );
        let err = query(server, "loop.test", soon()).unwrap_err();
        assert!(
            matches!(&err, LookupError::Resolver(w) if w.contains("loop")),
            "{err:?}"
        );
        // A resolver that never answers: given up at the deadline, as the resolver's fault.
        let started = Instant::now();
        let err = query(server, "silent.test", started + Duration::from_millis(300)).unwrap_err();
        assert!(
            matches!(&err, LookupError::Resolver(w) if w.contains("did not answer")),
            "{err:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the deadline holds"
        );
    }

    #[test]
    fn a_resolver_that_is_not_there_is_said_so_quickly() {
        // A port nobody listens on: loopback answers with ICMP port unreachable.
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = match sock.local_addr().unwrap() {
            std::net::SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        drop(sock);
        let started = Instant::now();
        let err = why(query(addr, "one.test", soon()).unwrap_err());
        assert!(err.contains("nothing answers DNS"), "{err}");
        assert!(
            started.elapsed() < WAIT,
            "refused at once, not after timeouts"
        );
    }
}
