//! What makes one VM different from another copy of it, as its guest sees it.
//!
//! - The VM generation ID (ACPI VMGenID, 16 bytes at `VMGENID_ADDR`): every restore and every
//!   clone gets fresh random bytes from the host, and the Generic Event Device's interrupt
//!   tells the guest to look. Linux's vmgenid driver then mixes the new ID into its RNG and
//!   reseeds it (`add_vmfork_randomness`), so two clones of one snapshot stop producing the
//!   same random numbers. The reseed runs in the guest's ACPI notify work, microseconds after
//!   the clone resumes; user space that copied random bytes before the snapshot (a PRNG seeded
//!   at start-up, a cached key) keeps them and must reseed itself.
//! - The identity page (`IDENTITY_PAGE_ADDR`, described in the DSDT as device MIDT): text the
//!   guest can read through /dev/mem (`mayfly-identity` in the default rootfs), with the VM's
//!   name, its clone index, its parent's name, and how many restores it descends from.
//!
//! The identity page is written by the VMM only, and never read back: guest memory belongs to
//! the guest, which can write anything there. The identity itself lives in the VMM's own state
//! (the snapshot's state file, checksummed and checked), and every host path a VM derives from
//! a name uses a name [`check_name`] accepted.

use vm_memory::{Bytes, GuestAddress};

use crate::arch::layout::{IDENTITY_PAGE_ADDR, IDENTITY_PAGE_SIZE, VMGENID_ADDR};
use crate::memory::ram::GuestMemory;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot write the VM's identity into guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("cannot get random bytes from the host for the VM generation ID: {0}")]
    Random(std::io::Error),
    #[error("the VM name {0:?} is not usable: use letters, digits, '.', '_' and '-', at most 64")]
    BadName(String),
}

/// Who a VM is: name, clone index, parent, generation (the snapshot format's type).
pub use mayfly_snapshot::IdentityState as Identity;

/// Names go into paths (sockets, logs) and the guest's identity page.
pub fn check_name(name: &str) -> Result<(), IdentityError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(IdentityError::BadName(name.to_string()))
    }
}

/// Check an identity that came from a file (a snapshot's state): its names must be names.
pub fn check(identity: &Identity) -> Result<(), IdentityError> {
    check_name(&identity.name)?;
    if let Some(parent) = &identity.parent {
        check_name(parent)?;
    }
    Ok(())
}

fn render(identity: &Identity) -> String {
    format!(
        "name={}\nindex={}\nparent={}\ngeneration={}\n",
        identity.name,
        identity.index.map(|i| i.to_string()).unwrap_or_default(),
        identity.parent.as_deref().unwrap_or(""),
        identity.generation
    )
}

/// Write the identity page (NUL-padded text) for the guest to read.
pub fn write_page(identity: &Identity, mem: &GuestMemory) -> Result<(), IdentityError> {
    let mut page = vec![0u8; usize::try_from(IDENTITY_PAGE_SIZE).expect("one page")];
    let text = render(identity);
    let len = text.len().min(page.len() - 1);
    page[..len].copy_from_slice(&text.as_bytes()[..len]);
    mem.write_slice(&page, GuestAddress(IDENTITY_PAGE_ADDR))?;
    Ok(())
}

/// Fill `buf` from the host's RNG (getrandom): one implementation, the rng device's.
pub use mayfly_devices::virtio::rng::host_random;

/// Give the VM a new generation ID from the host's RNG. The caller then raises the Generic
/// Event Device's interrupt so the guest notices.
pub fn new_generation_id(mem: &GuestMemory) -> Result<(), IdentityError> {
    let mut id = [0u8; 16];
    host_random(&mut id).map_err(IdentityError::Random)?;
    mem.write_slice(&id, GuestAddress(VMGENID_ADDR))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ram::GuestRam;

    #[test]
    fn the_identity_page_is_text_the_guest_reads() {
        let ram = GuestRam::new_memfd(2 << 20).unwrap();
        let id = Identity {
            name: "web-3".into(),
            index: Some(3),
            parent: Some("web".into()),
            generation: 7,
        };
        write_page(&id, &ram.memory).unwrap();
        let mut page = vec![0u8; usize::try_from(IDENTITY_PAGE_SIZE).expect("one page")];
        ram.memory
            .read_slice(&mut page, GuestAddress(IDENTITY_PAGE_ADDR))
            .unwrap();
        let text = String::from_utf8_lossy(&page);
        assert!(text.starts_with("name=web-3\nindex=3\nparent=web\ngeneration=7\n\0"));
    }

    #[test]
    fn identities_from_files_are_checked() {
        let mut id = Identity {
            name: "ok".into(),
            ..Identity::default()
        };
        assert!(check(&id).is_ok());
        id.parent = Some("../../etc".into());
        assert!(check(&id).is_err());
        id.parent = None;
        id.name = "a/b".into();
        assert!(check(&id).is_err());
    }

    #[test]
    fn generation_ids_are_fresh() {
        let ram = GuestRam::new_memfd(2 << 20).unwrap();
        new_generation_id(&ram.memory).unwrap();
        let mut a = [0u8; 16];
        ram.memory
            .read_slice(&mut a, GuestAddress(VMGENID_ADDR))
            .unwrap();
        new_generation_id(&ram.memory).unwrap();
        let mut b = [0u8; 16];
        ram.memory
            .read_slice(&mut b, GuestAddress(VMGENID_ADDR))
            .unwrap();
        assert_ne!(a, b);
        assert_ne!(a, [0u8; 16]);
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("clone-1.a_b").is_ok());
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
