//! Host-side networking for mayfly VMs: Firecracker's "network for clones" pattern.
//!
//! Every VM gets a network namespace of its own holding its tap (`tap0`, the guest's
//! gateway `172.16.0.1/30`). The guest always has the same address inside
//! ([`GUEST_IP`]/30, gateway [`GATEWAY_IP`], gateway MAC [`GATEWAY_MAC`]), so every clone of a
//! snapshot wakes up with a configuration that still works. Outside, the namespace reaches the
//! host (or a test's "uplink" namespace) over a veth pair with addresses of its own slot: slot
//! `n` of the pool (default 10.200.0.0/16, in /30s) has `.1` on the host side (link
//! `mfv<n>`) and `.2` inside (`veth0`). The guest's traffic is SNATed to the `.2` address, so
//! each VM or clone is told apart outside.
//!
//! Egress policy ([`Policy`]) is enforced with nftables inside the VM's namespace, never in the
//! guest: anti-spoofing at the tap (the guest's MAC and IP only), then the policy sets on
//! every forwarded packet (see `nft.rs` for the rules), denied attempts rejected
//! (TCP reset, ICMP admin-prohibited) and counted. Whatever the policy, a VM never reaches
//! the host's own addresses (those of the uplink namespace), link-local 169.254.0.0/16 (cloud
//! metadata), the slot pool, loopback, multicast, reserved addresses, and the private ranges
//! (10/8, 172.16/12, 192.168/16, 100.64/10) but for what the operator opens
//! ([`NetworkConfig::reach`]); DNS to the configured resolver is the one exception. See
//! `never.rs`.
//!
//! Nothing leaks when a VMM dies (even by kill -9): a VM's namespace is not bind-mounted
//! anywhere, so it lives exactly as long as the descriptors the VMM holds (the namespace, the
//! tap), and the tap and veth inside die with it (a veth pair dies with either end, so the
//! host side goes too, with its address). There are no per-VM rules or addresses on the host
//! side. Slots are taken with an flock on `<state_dir>/slot-<n>.lock`, which the kernel
//! releases when the VMM dies; [`Network::sweep`] (run by a create that builds its slot, and
//! on every slot a create takes) removes whatever a dead process left: a host-side veth the
//! kernel has not reaped yet, a half-built pool namespace.
//!
//! Setup shells out to `ip` (iproute2) and `nft` (nftables), once per slot; the per-VM hot
//! path (claiming a pre-built slot from the pool, changing policy) is Rust only: a netlink
//! batch to nftables, the tap opened with an ioctl. The pool ([`Network::prewarm`]) holds
//! slots built in advance, bind-mounted under `<state_dir>/ns/` until claimed; claiming one
//! unmounts it, so from then on it lives and dies with the VMM that claimed it. A long-lived
//! keeper (the sandbox manager) holds its pool instead ([`Network::prewarm_held`]): each
//! slot's namespace and attached tap stay open in the keeper, which a VM takes with
//! pidfd_getfd, so the pool adds nothing to the mount table and dies with its keeper.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

mod addr;
mod dns;
mod error;
mod expose;
pub mod keeper;
mod local;
mod netns;
mod network;
mod never;
mod nft;
pub mod policy;

pub use addr::{MacAddr, GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_PREFIX};
pub use error::{Fault, NetworkError};
pub use expose::{ExposeOn, HostEndpoint};
pub use ipnet::Ipv4Net;
pub use netns::{check_tools, inode as namespace_inode, run_in};
pub use network::*;
pub use never::{parse_net, LINK_LOCAL, PRIVATE};
pub use policy::{Dest, Policy, PolicyError, Rule};
