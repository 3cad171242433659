//! A jailed VM's network, kept outside its jail.
//!
//! A VM's network namespace, tap, veth and nftables egress policy are made and changed as the
//! host's root, and a jailed VMM drops to an unprivileged uid with no capabilities before its
//! guest runs. So the jail's waiter (root, outside the jail, one per VMM) keeps the network:
//!
//! 1. Before the jail is locked down, the VMM asks its waiter for a network
//!    ([`KeptNetwork::make`], over a SOCK_SEQPACKET pair the jail made). The [`Keeper`] in the
//!    waiter builds it as an unjailed VMM would ([`crate::Network::create_nic`]) and sends
//!    back the tap (SCM_RIGHTS) and what the VM needs to know of it. The VMM holds the tap,
//!    and nothing else of the network.
//! 2. Once the VMM runs the guest, the keeper answers it only what changes nothing: the
//!    network's description and its current policy (a snapshot saves the policy). A request
//!    to make a network is refused unless the VMM is still root (read in /proc as the
//!    request is handled): a VMM the guest took over cannot make itself another network.
//! 3. The policy is changed through the keeper alone ([`Keeper::set_policy`]), by whoever the
//!    waiter lets ask (its own control socket, which only root can reach): never by the VMM,
//!    which the guest may have taken over.
//!
//! The network lives as long as the keeper holds it: the waiter drops it when the VMM has
//! ended ([`Keeper::end`]), and if the waiter is killed the kernel removes all of it with
//! the last descriptor, as for an unjailed VMM.

use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::network::{GuestConfig, Network, NetworkConfig, VmNetwork};
use crate::policy::Policy;
use crate::{MacAddr, NetworkError};

/// The largest answer the keeper sends (a description with its counters is ~600 bytes; a
/// long allowlist makes a policy longer).
const MAX_MESSAGE: usize = 64 * 1024;
/// The largest request the keeper reads (a request for a network is ~300 bytes with its
/// configuration); a longer one is refused unread.
const MAX_REQUEST: usize = 16 * 1024;
/// The least time between two requests the keeper answers: what a VMM its guest took over
/// can make the waiter (outside the jail's cgroup) do is bounded.
const REQUEST_GAP: Duration = Duration::from_millis(5);
/// The least time between two descriptions the keeper makes for its VMM: each reads the
/// counters with `nft`, a process the waiter starts outside the jail's cgroup, and a VMM its
/// guest took over could ask without end. A control socket's `GET /vm/net` waits this long
/// at worst.
const DESCRIBE_GAP: Duration = Duration::from_millis(100);
/// How long the VMM waits for its keeper: making a network runs `ip` and `nft` a few times
/// (~100 ms here), or claims a pooled slot.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// What a jailed VMM asks its keeper.
#[derive(Debug, Serialize, Deserialize)]
enum Request {
    /// A network for the VM's NIC (before the jail is locked down only).
    Make {
        config: NetworkConfig,
        policy: Policy,
        mac: Option<MacAddr>,
    },
    /// What `GET /vm/net` says.
    Describe,
    /// The policy now (what a snapshot saves).
    Policy,
}

/// What the keeper answers.
#[derive(Debug, Serialize, Deserialize)]
enum Answer {
    /// The network is made; its tap came with this message.
    Made(Made),
    Described(serde_json::Value),
    Policy(Policy),
    Refused(String),
}

/// What the VMM learns of its network when it is made.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Made {
    guest: GuestConfig,
    name: String,
    outside_ip: Ipv4Addr,
    policy: Policy,
}

/// The waiter's side: holds the network and answers its VMM.
pub struct Keeper {
    /// The VMM's pid as the host sees it: a request to make a network is answered only while
    /// it is still root.
    vmm_pid: u32,
    network: Mutex<Option<VmNetwork>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Keeper {
    pub fn new(vmm_pid: u32) -> Self {
        Self {
            vmm_pid,
            network: Mutex::new(None),
        }
    }

    /// Answer the VMM on `channel` until it closes its end (it has ended). Malformed or
    /// oversized requests are refused, never acted on. `made` is called once the network is
    /// made, before the VMM is answered.
    pub fn serve(&self, channel: &UnixDatagram, made: &mut dyn FnMut()) {
        let mut buf = vec![0u8; MAX_REQUEST];
        let mut last_described: Option<std::time::Instant> = None;
        let mut last_answered: Option<std::time::Instant> = None;
        loop {
            if let Some(t) = last_answered {
                std::thread::sleep(REQUEST_GAP.saturating_sub(t.elapsed()));
            }
            let len = match mayfly_sys::seqpacket::receive(channel, &mut buf) {
                Ok(mayfly_sys::seqpacket::Received::Message(len, _fd)) => len,
                Ok(mayfly_sys::seqpacket::Received::Truncated(_)) => {
                    self.answer(
                        channel,
                        0,
                        Answer::Refused("a request too large".into()),
                        None,
                    );
                    continue;
                }
                Ok(mayfly_sys::seqpacket::Received::End) => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            let (seq, request) = match serde_json::from_slice::<(u64, Request)>(&buf[..len]) {
                Ok((seq, request)) => (seq, Ok(request)),
                Err(e) => (0, Err(e)),
            };
            let answer = match request {
                Err(e) => (Answer::Refused(format!("a malformed request: {e}")), None),
                Ok(Request::Make {
                    config,
                    policy,
                    mac,
                }) => self.make(config, &policy, mac),
                Ok(Request::Describe) => {
                    if let Some(t) = last_described {
                        std::thread::sleep(DESCRIBE_GAP.saturating_sub(t.elapsed()));
                    }
                    last_described = Some(std::time::Instant::now());
                    let answer = match self.describe() {
                        Some(d) => Answer::Described(d),
                        None => Answer::Refused("the VM has no network".into()),
                    };
                    (answer, None)
                }
                Ok(Request::Policy) => (
                    match lock(&self.network).as_ref() {
                        Some(n) => Answer::Policy(n.policy().clone()),
                        None => Answer::Refused("the VM has no network".into()),
                    },
                    None,
                ),
            };
            // What serves the network is there before the VMM hears it has one (so before
            // its control socket answers).
            if matches!(answer.0, Answer::Made(_)) {
                made();
            }
            self.answer(channel, seq, answer.0, answer.1);
            last_answered = Some(std::time::Instant::now());
        }
    }

    fn answer(&self, channel: &UnixDatagram, seq: u64, answer: Answer, fd: Option<OwnedFd>) {
        // (An empty message would read as the end: never sent.)
        let bytes = serde_json::to_vec(&(seq, answer)).unwrap_or_else(|_| {
            br#"[0,{"Refused":"an answer that could not be written"}]"#.to_vec()
        });
        let _ = mayfly_sys::seqpacket::send(channel, &bytes, fd.as_ref().map(|f| f.as_fd()));
    }

    fn make(
        &self,
        config: NetworkConfig,
        policy: &Policy,
        mac: Option<MacAddr>,
    ) -> (Answer, Option<OwnedFd>) {
        if !still_root(self.vmm_pid) {
            return (
                Answer::Refused(
                    "a network is made for a jailed VM before its jail is locked down, not after"
                        .into(),
                ),
                None,
            );
        }
        let mut held = lock(&self.network);
        if held.is_some() {
            return (
                Answer::Refused("the VM has its network already".into()),
                None,
            );
        }
        mayfly_sys::trace::event("net_asked");
        let made = Network::new(config).and_then(|network| {
            mayfly_sys::trace::event("net_opened");
            network.create_nic(policy, mac)
        });
        mayfly_sys::trace::event("net_made");
        let mut network = match made {
            Ok(network) => network,
            Err(e) => return (Answer::Refused(e.to_string()), None),
        };
        let Some(tap) = network.take_tap() else {
            return (
                Answer::Refused("the network came without its tap".into()),
                None,
            );
        };
        let answer = Answer::Made(Made {
            guest: *network.guest(),
            name: network.name(),
            outside_ip: network.outside_ip(),
            policy: network.policy().clone(),
        });
        *held = Some(network);
        (answer, Some(tap))
    }

    /// What `GET /vm/net` says of the network, if the VM has one.
    pub fn describe(&self) -> Option<serde_json::Value> {
        lock(&self.network).as_ref().map(VmNetwork::describe)
    }

    /// Change the VM's policy (see [`VmNetwork::set_policy`]); `None` when it has no network.
    /// Names are resolved without the network's lock held (they may take seconds), so the
    /// VMM's other requests are answered meanwhile.
    pub fn set_policy(&self, policy: Policy) -> Option<Result<serde_json::Value, NetworkError>> {
        let resolver = match lock(&self.network).as_ref()?.resolver() {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let resolved = match resolver.resolve(&policy) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let mut held = lock(&self.network);
        let network = held.as_mut()?;
        Some(
            network
                .apply_policy(policy, resolved)
                .map(|()| network.describe()),
        )
    }

    /// Make `guest_port` reachable on the host at `on` (see [`VmNetwork::expose`]); `None`
    /// when the VM has no network.
    pub fn expose(
        &self,
        guest_port: u16,
        on: crate::ExposeOn,
    ) -> Option<Result<crate::HostEndpoint, NetworkError>> {
        let mut held = lock(&self.network);
        let network = held.as_mut()?;
        Some(network.expose(guest_port, on))
    }

    /// Stop exposing `guest_port` (see [`VmNetwork::unexpose`]): whether it was; `None` when
    /// the VM has no network.
    pub fn unexpose(&self, guest_port: u16, on: Option<&crate::ExposeOn>) -> Option<bool> {
        let mut held = lock(&self.network);
        Some(held.as_mut()?.unexpose(guest_port, on))
    }

    /// The VMM has ended: remove its network now (veth, namespace).
    pub fn end(&self) {
        if let Some(network) = lock(&self.network).take() {
            let _ = network.destroy();
        }
    }
}

/// Whether the process `pid` (the host's numbering) still runs as root: its jail is not
/// locked down yet, so no guest code has run in it.
fn still_root(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|ids| ids.split_whitespace().all(|id| id == "0"))
}

/// The VMM's side: its network as its keeper holds it.
#[derive(Debug)]
pub struct KeptNetwork {
    /// The channel and the number of the last question asked on it.
    channel: Mutex<(UnixDatagram, u64)>,
    made: Made,
}

impl KeptNetwork {
    /// Ask the keeper on `channel` for a network with `policy` (see
    /// [`crate::Network::create_nic`]): returns it and the tap for the VM's NIC.
    pub fn make(
        channel: &UnixDatagram,
        config: NetworkConfig,
        policy: &Policy,
        mac: Option<MacAddr>,
    ) -> Result<(KeptNetwork, OwnedFd), NetworkError> {
        let channel = channel.try_clone().map_err(crate::error::sys(
            "cannot copy the jail's channel to its waiter",
        ))?;
        channel
            .set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(crate::error::sys(
                "cannot set a timeout on the waiter's channel",
            ))?;
        let request = Request::Make {
            config,
            policy: policy.clone(),
            mac,
        };
        match ask(&channel, 1, &request)? {
            (Answer::Made(made), Some(tap)) => Ok((
                KeptNetwork {
                    channel: Mutex::new((channel, 1)),
                    made,
                },
                tap,
            )),
            (Answer::Made(_), None) => Err(NetworkError::Kept(
                "the jail's waiter made the network but sent no tap".into(),
            )),
            (Answer::Refused(why), _) => Err(NetworkError::Kept(why)),
            (other, _) => Err(NetworkError::Kept(format!(
                "the jail's waiter answered {other:?} to a request for a network"
            ))),
        }
    }

    pub fn guest(&self) -> &GuestConfig {
        &self.made.guest
    }

    /// The namespace's name in mayfly's terms.
    pub fn name(&self) -> &str {
        &self.made.name
    }

    pub fn outside_ip(&self) -> Ipv4Addr {
        self.made.outside_ip
    }

    /// The policy now, as the keeper has it (it is changed there, not here).
    pub fn policy(&self) -> Result<Policy, NetworkError> {
        match self.ask(&Request::Policy)? {
            Answer::Policy(policy) => Ok(policy),
            Answer::Refused(why) => Err(NetworkError::Kept(why)),
            other => Err(NetworkError::Kept(format!(
                "the jail's waiter answered {other:?} when asked for the policy"
            ))),
        }
    }

    /// What `GET /vm/net` says, as the keeper has it.
    pub fn describe(&self) -> Result<serde_json::Value, NetworkError> {
        match self.ask(&Request::Describe)? {
            Answer::Described(d) => Ok(d),
            Answer::Refused(why) => Err(NetworkError::Kept(why)),
            other => Err(NetworkError::Kept(format!(
                "the jail's waiter answered {other:?} when asked to describe the network"
            ))),
        }
    }

    fn ask(&self, request: &Request) -> Result<Answer, NetworkError> {
        // One question at a time on the channel; an answer to an earlier question that timed
        // out is told apart by its number, and passed over.
        let mut held = lock(&self.channel);
        held.1 += 1;
        let seq = held.1;
        ask(&held.0, seq, request).map(|(answer, _fd)| answer)
    }
}

fn ask(
    channel: &UnixDatagram,
    seq: u64,
    request: &Request,
) -> Result<(Answer, Option<OwnedFd>), NetworkError> {
    let lost = |e: std::io::Error| {
        NetworkError::Kept(format!(
            "the jail's waiter, which keeps the network, did not answer: {e}"
        ))
    };
    let bytes =
        serde_json::to_vec(&(seq, request)).map_err(|e| NetworkError::Kept(e.to_string()))?;
    mayfly_sys::seqpacket::send(channel, &bytes, None).map_err(lost)?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        match mayfly_sys::seqpacket::receive(channel, &mut buf) {
            Ok(mayfly_sys::seqpacket::Received::Message(len, fd)) => {
                let (answered, answer): (u64, Answer) = serde_json::from_slice(&buf[..len])
                    .map_err(|e| NetworkError::Kept(format!("a malformed answer: {e}")))?;
                if answered == seq || answered == 0 {
                    return Ok((answer, fd));
                }
            }
            Ok(mayfly_sys::seqpacket::Received::Truncated(_)) => {
                return Err(NetworkError::Kept("an answer too large".into()))
            }
            Ok(mayfly_sys::seqpacket::Received::End) => {
                return Err(lost(std::io::ErrorKind::BrokenPipe.into()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(lost(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::sync::Arc;

    /// A keeper for the process `pid`, answering on a thread; the VMM's end of its channel.
    fn keeper_for(pid: u32) -> UnixDatagram {
        let (vmm, ours) = mayfly_sys::seqpacket::pair().unwrap();
        let keeper = Arc::new(Keeper::new(pid));
        std::thread::spawn(move || keeper.serve(&ours, &mut || {}));
        vmm.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        vmm
    }

    fn answer_to(vmm: &UnixDatagram, bytes: &[u8]) -> (u64, Answer) {
        mayfly_sys::seqpacket::send(vmm, bytes, None).unwrap();
        let mut buf = vec![0u8; MAX_MESSAGE];
        match mayfly_sys::seqpacket::receive(vmm, &mut buf).unwrap() {
            mayfly_sys::seqpacket::Received::Message(len, None) => {
                serde_json::from_slice(&buf[..len]).unwrap()
            }
            _ => panic!("no plain answer"),
        }
    }

    #[test]
    fn a_vmm_that_is_no_longer_root_gets_no_network_made() {
        // A process running as nobody stands for a VMM whose jail is locked down.
        let mut nobody = std::process::Command::new("sleep")
            .arg("30")
            .uid(65534)
            .gid(65534)
            .spawn()
            .unwrap();
        let vmm = keeper_for(nobody.id());
        let made = KeptNetwork::make(&vmm, NetworkConfig::default(), &Policy::Open, None);
        let _ = nobody.kill();
        let _ = nobody.wait();
        match made {
            Err(NetworkError::Kept(why)) => assert!(why.contains("locked down"), "{why}"),
            other => panic!("a network was made, or refused for another reason: {other:?}"),
        }
    }

    #[test]
    fn malformed_and_oversized_requests_are_refused_and_the_keeper_answers_on() {
        let vmm = keeper_for(std::process::id());
        let (seq, answer) = answer_to(&vmm, b"{\"not\": a request");
        assert_eq!(seq, 0);
        assert!(matches!(answer, Answer::Refused(why) if why.contains("malformed")));
        let (seq, answer) = answer_to(&vmm, &vec![b'x'; MAX_REQUEST + 1]);
        assert_eq!(seq, 0);
        assert!(matches!(answer, Answer::Refused(why) if why.contains("too large")));
        let (seq, answer) = answer_to(&vmm, &serde_json::to_vec(&(7u64, Request::Policy)).unwrap());
        assert_eq!(seq, 7);
        assert!(matches!(answer, Answer::Refused(why) if why.contains("no network")));
    }
}
