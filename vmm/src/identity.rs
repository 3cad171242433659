//! What makes one VM different from another copy of it, as its guest sees it.
//!
//! - The VM generation ID (ACPI VMGenID, 16 bytes at [`VMGENID_ADDR`]): every restore and every
//!   clone gets fresh random bytes from the host, and the Generic Event Device's interrupt
//!   tells the guest to look. Linux's vmgenid driver then mixes the new ID into its RNG and
//!   reseeds it (`add_vmfork_randomness`), so two clones of one snapshot stop producing the
//!   same random numbers. The reseed runs in the guest's ACPI notify work, microseconds after
//!   the clone resumes; user space that copied random bytes before the snapshot (a PRNG seeded
//!   at start-up, a cached key) keeps them and must reseed itself.
//! - The identity page ([`IDENTITY_PAGE_ADDR`], described in the DSDT as device MIDT): text the
//!   guest can read through /dev/mem (`mayfly-identity` in the default rootfs), with the VM's
//!   name, its clone index, its parent's name, and how many restores it descends from.

use std::collections::BTreeMap;

use vm_memory::{Bytes, GuestAddress};

use crate::arch::layout::{IDENTITY_PAGE_ADDR, IDENTITY_PAGE_SIZE, VMGENID_ADDR};
use crate::memory::GuestMemory;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot write the VM's identity into guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("cannot get random bytes from the host for the VM generation ID: {0}")]
    Random(std::io::Error),
    #[error("the VM name {0:?} is not usable: use letters, digits, '.', '_' and '-', at most 64")]
    BadName(String),
}

/// Who a VM is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    /// Which clone of its parent's fork this VM is.
    pub index: Option<u32>,
    pub parent: Option<String>,
    /// Restores (of snapshots or clones) since this VM's lineage booted.
    pub generation: u64,
}

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

impl Identity {
    fn render(&self) -> String {
        format!(
            "name={}\nindex={}\nparent={}\ngeneration={}\n",
            self.name,
            self.index.map(|i| i.to_string()).unwrap_or_default(),
            self.parent.as_deref().unwrap_or(""),
            self.generation
        )
    }

    fn parse(text: &str) -> Self {
        let fields: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        Identity {
            name: fields.get("name").copied().unwrap_or("").to_string(),
            index: fields.get("index").and_then(|i| i.parse().ok()),
            parent: fields
                .get("parent")
                .filter(|p| !p.is_empty())
                .map(|p| p.to_string()),
            generation: fields
                .get("generation")
                .and_then(|g| g.parse().ok())
                .unwrap_or(0),
        }
    }

    /// The identity a snapshot's guest memory holds (empty if it has none).
    pub fn read(mem: &GuestMemory) -> Self {
        let mut page = vec![0u8; IDENTITY_PAGE_SIZE as usize];
        if mem
            .read_slice(&mut page, GuestAddress(IDENTITY_PAGE_ADDR))
            .is_err()
        {
            return Identity::default();
        }
        let end = page.iter().position(|&b| b == 0).unwrap_or(page.len());
        Identity::parse(&String::from_utf8_lossy(&page[..end]))
    }

    /// Write the identity page (NUL-padded text).
    pub fn write(&self, mem: &GuestMemory) -> Result<(), IdentityError> {
        let mut page = vec![0u8; IDENTITY_PAGE_SIZE as usize];
        let text = self.render();
        let len = text.len().min(page.len() - 1);
        page[..len].copy_from_slice(&text.as_bytes()[..len]);
        mem.write_slice(&page, GuestAddress(IDENTITY_PAGE_ADDR))?;
        Ok(())
    }
}

/// Give the VM a new generation ID from the host's RNG. The caller then raises the Generic
/// Event Device's interrupt so the guest notices.
pub fn new_generation_id(mem: &GuestMemory) -> Result<(), IdentityError> {
    let mut id = [0u8; 16];
    let mut filled = 0;
    while filled < id.len() {
        // SAFETY: getrandom writes at most the given length into our buffer.
        let n = unsafe { libc::getrandom(id[filled..].as_mut_ptr().cast(), id.len() - filled, 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(IdentityError::Random(err));
        }
        filled += n as usize;
    }
    mem.write_slice(&id, GuestAddress(VMGENID_ADDR))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GuestRam;

    #[test]
    fn identity_round_trips_through_guest_memory() {
        let ram = GuestRam::new_memfd(2 << 20).unwrap();
        assert_eq!(Identity::read(&ram.memory), Identity::default());
        let id = Identity {
            name: "web-3".into(),
            index: Some(3),
            parent: Some("web".into()),
            generation: 7,
        };
        id.write(&ram.memory).unwrap();
        assert_eq!(Identity::read(&ram.memory), id);
        let root = Identity {
            name: "root".into(),
            ..Identity::default()
        };
        root.write(&ram.memory).unwrap();
        assert_eq!(Identity::read(&ram.memory), root);
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
