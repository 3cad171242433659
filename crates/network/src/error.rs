//! What can go wrong making or changing a VM's network.

use ipnet::Ipv4Net;

use crate::policy::PolicyError;

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("'{tool}' is not installed: apt-get install {package}")]
    ToolMissing {
        tool: &'static str,
        package: &'static str,
    },
    #[error("`{command}` failed: {why}")]
    Command { command: String, why: String },
    #[error(
        "{what}: {source} (mayfly's networking needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    )]
    System {
        what: String,
        source: std::io::Error,
    },
    #[error("no free network slot: all {0} slots of the pool are in use; use a larger pool")]
    PoolFull(u32),
    #[error("the pool {0} is not usable: give an IPv4 network of /30 or larger")]
    BadPool(Ipv4Net),
    #[error("link prefix {0:?} is too long: it and a slot number must fit 15 characters")]
    BadPrefix(String),
    #[error(
        "--net-reach {0}: only private networks can be opened (inside 10.0.0.0/8, \
         172.16.0.0/12, 192.168.0.0/16 or 100.64.0.0/10); the host's own addresses, link-local \
         169.254.0.0/16, loopback, multicast and the slot pool are never reached"
    )]
    BadReach(Ipv4Net),
    #[error("{given:?} is not an IPv4 network: {why}")]
    BadNet { given: String, why: String },
    #[error("cannot read the uplink namespace's own addresses: {0}")]
    HostAddresses(std::io::Error),
    #[error("policy none means no NIC: do not create a network for this VM")]
    NoNetwork,
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("cannot update the VM's nftables sets: {0}")]
    Nft(std::io::Error),
    #[error("a jailed VM's network, kept by its jail's waiter: {0}")]
    Kept(String),
    #[error("cannot expose guest port {port}: {source}")]
    Expose { port: u16, source: std::io::Error },
}

/// Whose fault an error is, for a caller that answers a request with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// What was asked cannot be (a policy naming nothing resolvable, or only what no VM
    /// reaches; a bad network): the asker's to change.
    Request,
    /// The resolver did not answer in time, or failed: worth another try.
    Resolver,
    /// This host's: tools, system calls, slots.
    Host,
}

impl NetworkError {
    pub fn fault(&self) -> Fault {
        match self {
            NetworkError::Policy(PolicyError::ResolverFailed { .. }) => Fault::Resolver,
            NetworkError::Policy(_) | NetworkError::BadNet { .. } | NetworkError::BadReach(_) => {
                Fault::Request
            }
            _ => Fault::Host,
        }
    }
}

pub(crate) type Result<T> = std::result::Result<T, NetworkError>;

pub(crate) fn sys(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetworkError {
    let what = what.into();
    move |source| NetworkError::System { what, source }
}
