//! Boot tracing for benchmarks (`--boot-trace`), the guest's side: the host's side is
//! `mayfly_sys::trace` (timestamps of boot phases on stderr, as `mayfly-trace: <event>
//! <CLOCK_MONOTONIC ns>`, so a benchmark can line them up with its own clock).
//!
//! Inside the guest: the boot vCPU starts in a three-instruction trampoline that writes to
//! [`TRACE_PORT`] and jumps to the kernel's entry, so the VMM sees the guest's first
//! instruction on any KVM; `start_kernel` is caught with a hardware breakpoint where KVM
//! delivers guest debug exits (not inside the emulated test rig).

/// Port the boot trampoline writes to: "the guest runs its first instruction".
pub const TRACE_PORT: u16 = 0x440;
/// Where the trampoline sits: a free spot of the boot area, below the boot stack.
pub const TRAMPOLINE_ADDR: u64 = 0x8000;

/// `mov $TRACE_PORT, %dx; out %al, %dx; mov $entry, %(e|r)ax; jmp *%(e|r)ax`: valid in 32-bit
/// protected mode (PVH, `long_mode` false) and in long mode. It clobbers only rax and rdx, which
/// neither boot protocol passes anything in.
pub fn trampoline(entry: u64, long_mode: bool) -> Vec<u8> {
    let mut code = vec![0x66, 0xba];
    code.extend_from_slice(&TRACE_PORT.to_le_bytes());
    code.push(0xee);
    if long_mode {
        code.extend_from_slice(&[0x48, 0xb8]);
        code.extend_from_slice(&entry.to_le_bytes());
    } else {
        code.push(0xb8);
        // A 32-bit entry point: the PVH entry is a physical address below 4 GiB.
        code.extend_from_slice(&crate::arch::layout::below_4g(entry).to_le_bytes());
    }
    code.extend_from_slice(&[0xff, 0xe0]);
    code
}

/// Up to four execution breakpoints (the debug registers), each reported once.
#[derive(Clone, Debug)]
pub struct Breakpoints {
    points: Vec<(&'static str, u64, bool)>,
}

impl Breakpoints {
    pub fn new(points: &[(&'static str, u64)]) -> Self {
        Self {
            points: points.iter().take(4).map(|&(n, a)| (n, a, false)).collect(),
        }
    }

    /// Debug register slots and addresses not hit yet.
    pub fn armed(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.points
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.2)
            .map(|(i, p)| (i, p.1))
    }

    pub fn remaining(&self) -> bool {
        self.points.iter().any(|p| !p.2)
    }

    /// A debug exit with status `dr6`: report and retire the breakpoints it names.
    pub fn hit(&mut self, dr6: u64) {
        for (i, point) in self.points.iter_mut().enumerate() {
            if dr6 & (1 << i) != 0 && !point.2 {
                point.2 = true;
                mayfly_sys::trace::event(point.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trampoline_encodings() {
        let pvh = trampoline(0x0100_0500, false);
        assert_eq!(
            pvh,
            [0x66, 0xba, 0x40, 0x04, 0xee, 0xb8, 0x00, 0x05, 0x00, 0x01, 0xff, 0xe0]
        );
        let long = trampoline(0x0100_0200, true);
        assert_eq!(&long[5..7], &[0x48, 0xb8]);
        assert_eq!(
            u64::from_le_bytes(long[7..15].try_into().unwrap()),
            0x0100_0200
        );
        assert!(
            TRAMPOLINE_ADDR + long.len() as u64 <= crate::arch::layout::BOOT_STACK_POINTER - 0x800
        );
    }

    #[test]
    fn breakpoints_retire_once_hit() {
        let mut bps = Breakpoints::new(&[("entry", 0x1000), ("start_kernel", 0xffff_0000)]);
        assert_eq!(
            bps.armed().collect::<Vec<_>>(),
            vec![(0, 0x1000), (1, 0xffff_0000)]
        );
        bps.hit(0b01);
        assert_eq!(bps.armed().collect::<Vec<_>>(), vec![(1, 0xffff_0000)]);
        assert!(bps.remaining());
        bps.hit(0b10);
        assert!(!bps.remaining());
    }
}
