//! The I/O buses: route a vCPU's port I/O (`in`/`out`) or MMIO access to the device that owns
//! the address. One type serves both; ports are addresses below 0x10000.

use std::sync::{Arc, Mutex};

/// A device on a bus. `offset` is relative to the start of the device's range.
pub trait BusDevice: Send {
    /// Fill `data` with what the guest reads at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Take what the guest writes at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Error adding a device to the bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// Two devices would own the same address.
    #[error("addresses {base:#x}..{end:#x} overlap a device already on the bus")]
    Overlap { base: u64, end: u64 },
    /// A range of zero addresses.
    #[error("a device cannot own an empty range at {0:#x}")]
    Empty(u64),
}

struct Entry {
    base: u64,
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// A bus. Addresses nobody owns read as all ones and ignore writes, as on a PC.
#[derive(Default)]
pub struct Bus {
    // Few devices: a sorted vector beats a map here.
    entries: Vec<Entry>,
}

/// The port I/O bus.
pub type PioBus = Bus;
/// The MMIO bus.
pub type MmioBus = Bus;

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Give `device` the addresses `base..base + len`.
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        device: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = base.checked_add(len).ok_or(BusError::Overlap {
            base,
            end: u64::MAX,
        })?;
        let overlaps = self
            .entries
            .iter()
            .any(|e| base < e.base + e.len && e.base < end);
        if overlaps {
            return Err(BusError::Overlap { base, end });
        }
        let at = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(at, Entry { base, len, device });
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<&Entry> {
        let at = self.entries.partition_point(|e| e.base <= addr);
        let entry = self.entries.get(at.checked_sub(1)?)?;
        (addr < entry.base + entry.len).then_some(entry)
    }

    /// A guest read: returns false when no device owns the address (data is then all ones).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some(entry) => {
                lock(&entry.device).read(addr - entry.base, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// A guest write: returns false when no device owns the address (the write is dropped).
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some(entry) => {
                lock(&entry.device).write(addr - entry.base, data);
                true
            }
            None => false,
        }
    }
}

/// Lock a device. A device whose lock was poisoned by a panicking vCPU thread is still usable:
/// its state is plain data, and the VMM is shutting down anyway.
pub fn lock<T: ?Sized>(device: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    device
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        writes: Vec<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.writes.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn routes_by_port_and_offset() {
        let mut bus = PioBus::new();
        let a = Arc::new(Mutex::new(Recorder::default()));
        let b = Arc::new(Mutex::new(Recorder::default()));
        bus.insert(0x3f8, 8, a.clone()).unwrap();
        bus.insert(0x60, 1, b.clone()).unwrap();

        let mut data = [0u8; 1];
        assert!(bus.read(0x3fa, &mut data));
        assert_eq!(data, [2]);
        assert!(bus.write(0x60, &[0xfe]));
        assert!(!bus.write(0x61, &[1]));
        assert!(!bus.read(0x400, &mut data));
        assert_eq!(data, [0xff]);
        assert_eq!(b.lock().unwrap().writes, vec![(0, vec![0xfe])]);
        assert!(a.lock().unwrap().writes.is_empty());
    }

    #[test]
    fn rejects_overlaps_and_empty_ranges() {
        let mut bus = PioBus::new();
        bus.insert(0x60, 5, Arc::new(Mutex::new(Recorder::default())))
            .unwrap();
        assert!(matches!(
            bus.insert(0x64, 1, Arc::new(Mutex::new(Recorder::default()))),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(0x5c, 4, Arc::new(Mutex::new(Recorder::default()))),
            Ok(())
        ));
        assert!(matches!(
            bus.insert(0x10, 0, Arc::new(Mutex::new(Recorder::default()))),
            Err(BusError::Empty(0x10))
        ));
        // The last port of the address space is addressable.
        bus.insert(0xffff, 1, Arc::new(Mutex::new(Recorder::default())))
            .unwrap();
        assert!(bus.write(0xffff, &[0]));
    }
}
