//! Why a net device could not be created.

use crate::virtio::net::spec::MacAddr;

/// Why a net device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("the descriptor given as the VM's tap is not a tap (TUNGETIFF failed: {0}); open /dev/net/tun and attach it with TUNSETIFF first")]
    NotATap(std::io::Error),
    #[error(
        "the tap was opened with flags {0:#x}; open it with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR"
    )]
    TapFlags(u32),
    #[error("cannot set the tap up (virtio-net header size, non-blocking mode): {0}")]
    TapSetup(std::io::Error),
    #[error("the backend socket must be SOCK_SEQPACKET or SOCK_DGRAM: one frame per message")]
    NotADatagramSocket,
    #[error("{0:02x?} is not a usable MAC: it must be unicast (lowest bit of the first byte clear) and not all zeros")]
    BadMac(MacAddr),
    #[error("cannot create the net device's event descriptors: {0}")]
    EventFd(std::io::Error),
}
