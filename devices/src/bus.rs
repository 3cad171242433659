//! Port I/O bus: routes a vCPU's `in`/`out` to the device that owns the port.

use std::sync::{Arc, Mutex};

/// A device reachable through port I/O. `offset` is relative to the start of the device's range.
pub trait PioDevice: Send {
    /// Fill `data` with what the guest reads at `offset`.
    fn read(&mut self, offset: u16, data: &mut [u8]);
    /// Take what the guest writes at `offset`.
    fn write(&mut self, offset: u16, data: &[u8]);
}

/// Error adding a device to the bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// Two devices would own the same port.
    #[error("I/O ports {base:#x}..{end:#x} overlap a device already on the bus")]
    Overlap { base: u16, end: u32 },
    /// A range of zero ports.
    #[error("a device cannot own an empty range of I/O ports at {0:#x}")]
    Empty(u16),
}

struct Entry {
    base: u16,
    len: u16,
    device: Arc<Mutex<dyn PioDevice>>,
}

/// The port I/O bus. Ports nobody owns read as all ones and ignore writes, as on a PC.
#[derive(Default)]
pub struct PioBus {
    // Few devices: a sorted vector beats a map here.
    entries: Vec<Entry>,
}

impl PioBus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Give `device` the ports `base..base + len`.
    pub fn insert(
        &mut self,
        base: u16,
        len: u16,
        device: Arc<Mutex<dyn PioDevice>>,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = u32::from(base) + u32::from(len);
        let overlaps = self.entries.iter().any(|e| {
            u32::from(base) < u32::from(e.base) + u32::from(e.len) && u32::from(e.base) < end
        });
        if overlaps {
            return Err(BusError::Overlap { base, end });
        }
        let at = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(at, Entry { base, len, device });
        Ok(())
    }

    fn find(&self, port: u16) -> Option<&Entry> {
        let at = self.entries.partition_point(|e| e.base <= port);
        let entry = self.entries.get(at.checked_sub(1)?)?;
        (u32::from(port) < u32::from(entry.base) + u32::from(entry.len)).then_some(entry)
    }

    /// A guest `in`: returns false when no device owns the port (data is then all ones).
    pub fn read(&self, port: u16, data: &mut [u8]) -> bool {
        match self.find(port) {
            Some(entry) => {
                lock(&entry.device).read(port - entry.base, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// A guest `out`: returns false when no device owns the port (the write is dropped).
    pub fn write(&self, port: u16, data: &[u8]) -> bool {
        match self.find(port) {
            Some(entry) => {
                lock(&entry.device).write(port - entry.base, data);
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
        writes: Vec<(u16, Vec<u8>)>,
    }

    impl PioDevice for Recorder {
        fn read(&mut self, offset: u16, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u16, data: &[u8]) {
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
