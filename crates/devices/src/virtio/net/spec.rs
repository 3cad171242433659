//! The virtio-net wire: the header before every frame, and a MAC address.

/// `virtio_net_hdr_v1`: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers.
pub const VNET_HDR_LEN: usize = 12;
/// A MAC address.
pub type MacAddr = [u8; 6];
