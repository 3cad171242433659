//! The addresses and names every VM network uses: the same inside every VM's namespace, so
//! that every clone of a snapshot wakes up with a configuration that still works.

use std::net::Ipv4Addr;

/// The guest's address inside every VM's namespace.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The guest's gateway: the tap, inside the namespace.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
pub const GUEST_PREFIX: u8 = 30;
/// The tap's MAC, the same in every namespace so a clone's ARP cache stays right.
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x6d, 0x66, 0x00, 0x00, 0x01];
/// Names inside a VM's namespace.
pub(crate) const NS_TAP: &str = "tap0";
pub(crate) const NS_UPLINK: &str = "veth0";

/// A MAC address.
pub type MacAddr = [u8; 6];
