//! The VM state a snapshot holds, and the fingerprint of the host it depends on.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
};
use mayfly_devices::state::DevicesState;
use serde::{Deserialize, Serialize};

/// Entries of [`VmState::working_set`] kept at most (16 GiB of 4 KiB pages): more is no longer
/// a working set, and the cap keeps every state file under [`crate::MAX_STATE_BYTES`].
pub const MAX_WORKING_SET: usize = 4 << 20;

/// Everything needed to bring a VM back, besides its memory.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(test, derive(PartialEq))]
pub struct VmState {
    /// New random bytes for every snapshot and fork; the memory file's trailer holds the same.
    pub snapshot_id: [u8; 16],
    pub vcpu_count: u8,
    pub mem_bytes: u64,
    /// The kernel command line the guest booted with (for `GET /vm` and humans).
    pub cmdline: String,
    /// Where each range of guest RAM sits in the memory file.
    pub memory: Vec<MemoryRange>,
    pub vcpus: Vec<VcpuState>,
    pub vm: KvmVmState,
    /// Every device (the console, the virtio devices), each saved beside its own code.
    pub devices: DevicesState,
    /// Who the VM is. Kept here, in the VMM's own state, because guest memory is the guest's to
    /// write: nothing read back from it decides anything on the host.
    pub identity: IdentityState,
    /// The index the VM's next clone gets (so a restored VM does not reuse its clones' names).
    pub next_clone: u32,
    /// Whether the VM has the probe device (the probe benchmark's guest).
    pub probe: bool,
    /// Guest memory offsets a restored guest touched first, in order (see lazy restore's
    /// prefetch). Empty when unknown.
    pub working_set: Vec<u64>,
    /// Empty for a full snapshot (its `memory` file holds all of guest RAM). For a diff
    /// snapshot, the memory files under its own, oldest first: the first is a full snapshot's
    /// memory, every later one (and the snapshot's own `memory`) holds only its `extents`.
    pub memory_layers: Vec<MemoryLayer>,
    /// For a diff snapshot: the ranges of guest RAM its own `memory` file holds (a hole in one
    /// is a page of zeros); every other page is the newest layer's that holds it.
    pub memory_extents: Option<Vec<Extent>>,
}

/// A range of guest RAM, by memory-file offset and length, both whole pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// One memory file of a diff snapshot's chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryLayer {
    /// `memory-layers/<file>` inside the snapshot (a hard link), or a full path where the
    /// writer could not link it (a file of another owner: the sandbox manager's template).
    pub path: std::path::PathBuf,
    /// The ID its trailer holds: the snapshot it was written for.
    pub snapshot_id: [u8; 16],
    /// `None` for the full layer at the bottom; the ranges it holds for every other.
    pub extents: Option<Vec<Extent>>,
}

/// Memory layers a diff snapshot may stack at most (writers compact long before).
pub const MAX_MEMORY_LAYERS: usize = 16;
/// Extents a diff snapshot's layers may hold together at most: each is a mapping of its own
/// in a restored VM (the kernel allows 65,530 per process by default).
pub const MAX_MEMORY_EXTENTS: usize = 16_384;
/// Where a diff snapshot keeps its layers' links.
pub const MEMORY_LAYERS_DIR: &str = "memory-layers";

impl VmState {
    /// Whether its memory layers make sense for its RAM: a full layer at the bottom and only
    /// there, at most [`MAX_MEMORY_LAYERS`], extents of whole pages, in order, apart, inside
    /// RAM, [`MAX_MEMORY_EXTENTS`] at most, and relative paths only inside
    /// [`MEMORY_LAYERS_DIR`]. The reason when not.
    pub fn check_memory_layers(&self) -> Result<(), String> {
        let Some(own) = &self.memory_extents else {
            if self.memory_layers.is_empty() {
                return Ok(());
            }
            return Err("memory layers under a full memory file".into());
        };
        let Some((bottom, above)) = self.memory_layers.split_first() else {
            return Err("a diff snapshot with no layer under it".into());
        };
        if self.memory_layers.len() > MAX_MEMORY_LAYERS {
            return Err(format!("{} memory layers", self.memory_layers.len()));
        }
        if bottom.extents.is_some() {
            return Err("a diff layer at the bottom of the memory chain".into());
        }
        let mut total = 0usize;
        let mut check = |extents: &[Extent]| -> Result<(), String> {
            total += extents.len();
            if total > MAX_MEMORY_EXTENTS {
                return Err(format!("more than {MAX_MEMORY_EXTENTS} memory extents"));
            }
            let mut end = 0u64;
            for e in extents {
                let page = 4096;
                if e.len == 0
                    || !e.offset.is_multiple_of(page)
                    || !e.len.is_multiple_of(page)
                    || e.offset < end
                    || e.end() > self.mem_bytes
                    || e.offset.checked_add(e.len).is_none()
                {
                    return Err(format!("a memory extent {e:?} out of order or place"));
                }
                end = e.end();
            }
            Ok(())
        };
        check(own)?;
        for layer in above {
            check(
                layer
                    .extents
                    .as_deref()
                    .ok_or("a second full memory layer")?,
            )?;
        }
        // Each layer a different snapshot, none of them this one: a chain that names the
        // snapshot itself (or one layer twice) would map a diff's holes as RAM.
        let mut ids = vec![self.snapshot_id];
        for layer in &self.memory_layers {
            if ids.contains(&layer.snapshot_id) {
                return Err(format!(
                    "the memory layer {:?} is {} (snapshot {})",
                    layer.path,
                    if layer.snapshot_id == self.snapshot_id {
                        "this snapshot itself"
                    } else {
                        "named twice in the chain"
                    },
                    layer_file_name(&layer.snapshot_id)
                ));
            }
            ids.push(layer.snapshot_id);
        }
        for layer in &self.memory_layers {
            if layer.path.is_relative() && layer_name(&layer.path).is_none() {
                return Err(format!(
                    "the memory layer {:?} outside {MEMORY_LAYERS_DIR}/",
                    layer.path
                ));
            }
        }
        Ok(())
    }
}

/// The name a memory layer gets in [`MEMORY_LAYERS_DIR`]: its snapshot ID, in hex.
pub fn layer_file_name(snapshot_id: &[u8; 16]) -> String {
    snapshot_id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file name of a relative layer path `memory-layers/<name>`; `None` for anything else.
pub fn layer_name(path: &std::path::Path) -> Option<&std::ffi::OsStr> {
    use std::path::Component;
    let mut parts = path.components();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(Component::Normal(dir)), Some(Component::Normal(name)), None)
            if dir == MEMORY_LAYERS_DIR =>
        {
            Some(name)
        }
        _ => None,
    }
}

/// A VM's identity as the snapshot keeps it (see mayfly's `identity` module).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityState {
    pub name: String,
    /// Which clone of its parent's fork this VM is.
    pub index: Option<u32>,
    pub parent: Option<String>,
    /// Restores (of snapshots or clones) since this VM's lineage booted.
    pub generation: u64,
}

/// A range of guest RAM and where it sits in the memory file: the one guest-range type of
/// mayfly (the VMM lays RAM out in these, maps them, and a snapshot records them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRange {
    pub guest_addr: u64,
    pub size: u64,
    pub file_offset: u64,
}

/// One vCPU, as KVM reports it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(test, derive(PartialEq))]
pub struct VcpuState {
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The XSAVE area (`kvm_xsave`'s region, longer when KVM_CAP_XSAVE2 says so), in 32-bit words.
    pub xsave: Vec<u32>,
    /// XCR0 and friends; absent where KVM has no KVM_CAP_XCRS.
    pub xcrs: Option<kvm_xcrs>,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub tsc_khz: Option<u32>,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
}

/// The VM-wide state KVM keeps: interrupt controllers, PIT and clock.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KvmVmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    /// Host CLOCK_REALTIME when the clock was read, in ns: moves the guest's clock on by the
    /// time spent suspended where KVM cannot (no KVM_CLOCK_REALTIME).
    pub realtime_ns: u64,
}

/// For tests: `kvm_irqchip` (a union inside) has no `PartialEq`, so the interrupt controllers
/// compare by what a snapshot keeps of them, their bytes.
#[cfg(test)]
impl PartialEq for KvmVmState {
    fn eq(&self, other: &Self) -> bool {
        let bytes = |chip: &kvm_irqchip| {
            bincode::serde::encode_to_vec(chip, bincode::config::standard())
                .expect("an irqchip encodes")
        };
        let KvmVmState {
            pic_master,
            pic_slave,
            ioapic,
            pit,
            clock,
            realtime_ns,
        } = self;
        bytes(pic_master) == bytes(&other.pic_master)
            && bytes(pic_slave) == bytes(&other.pic_slave)
            && bytes(ioapic) == bytes(&other.ioapic)
            && *pit == other.pit
            && *clock == other.clock
            && *realtime_ns == other.realtime_ns
    }
}

/// What the saved state depends on in the host: the CPU model (the guest's CPUID and MSRs
/// describe it) and KVM's XSAVE layout.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostFingerprint {
    pub cpu_vendor: String,
    pub cpu_family: u32,
    pub cpu_model: u32,
    pub cpu_stepping: u32,
    /// Size of KVM's XSAVE area on the host, in bytes.
    pub xsave_bytes: u32,
    pub has_xcrs: bool,
}

impl HostFingerprint {
    /// The ways `self` (the snapshot's host) differs from `host` in what restore depends on;
    /// empty when restoring here is safe as far as the fingerprint can tell.
    pub fn differences(&self, host: &HostFingerprint) -> Vec<String> {
        let mut out = Vec::new();
        let cpu = |f: &HostFingerprint| {
            format!(
                "{} family {:#x} model {:#x} stepping {}",
                f.cpu_vendor, f.cpu_family, f.cpu_model, f.cpu_stepping
            )
        };
        if (
            &self.cpu_vendor,
            self.cpu_family,
            self.cpu_model,
            self.cpu_stepping,
        ) != (
            &host.cpu_vendor,
            host.cpu_family,
            host.cpu_model,
            host.cpu_stepping,
        ) {
            out.push(format!(
                "CPU: snapshot {}, this host {}",
                cpu(self),
                cpu(host)
            ));
        }
        if self.xsave_bytes != host.xsave_bytes {
            out.push(format!(
                "XSAVE area: snapshot {} bytes, this host {}",
                self.xsave_bytes, host.xsave_bytes
            ));
        }
        if self.has_xcrs && !host.has_xcrs {
            out.push("the snapshot has XCRs, this host's KVM cannot restore them".into());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_differences() {
        let a = HostFingerprint {
            cpu_vendor: "AuthenticAMD".into(),
            cpu_family: 0x17,
            cpu_model: 1,
            cpu_stepping: 2,
            xsave_bytes: 4096,
            has_xcrs: true,
        };
        assert!(a.differences(&a).is_empty());
        let mut b = a.clone();
        b.cpu_model = 0x31;
        b.has_xcrs = false;
        let d = a.differences(&b);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(
            d[0].contains("model 0x1") && d[0].contains("model 0x31"),
            "{d:?}"
        );
        // A snapshot without XCRs restores where KVM has them.
        assert!(b
            .differences(&HostFingerprint {
                cpu_model: 0x31,
                ..a.clone()
            })
            .is_empty());
    }

    #[test]
    fn memory_layers_are_checked_before_anything_is_opened() {
        let mut state = super::golden::sample_state();
        state.mem_bytes = 1 << 20;
        assert_eq!(state.check_memory_layers(), Ok(()));
        let e = |offset, len| Extent { offset, len };
        let bad = |edit: &dyn Fn(&mut VmState)| {
            let mut s = state.clone();
            edit(&mut s);
            s.check_memory_layers().unwrap_err()
        };
        // Paths outside memory-layers/.
        for path in [
            "memory-layers/../../etc/passwd",
            "../x/memory",
            "memory-layers",
            "x/y",
        ] {
            let err = bad(&|s| s.memory_layers[1].path = path.into());
            assert!(err.contains("outside"), "{path}: {err}");
        }
        // Extents out of order, overlapping, unaligned, empty, beyond RAM, overflowing.
        for extents in [
            vec![e(0x2000, 0x1000), e(0x1000, 0x1000)],
            vec![e(0x1000, 0x2000), e(0x2000, 0x1000)],
            vec![e(0x1001, 0x1000)],
            vec![e(0x1000, 0)],
            vec![e(0xff000, 0x2000)],
            vec![e(u64::MAX - 0xfff, 0x1000)],
        ] {
            bad(&|s| s.memory_extents = Some(extents.clone()));
        }
        // A diff layer at the bottom, a full one above it, none at all, too many.
        bad(&|s| s.memory_layers[0].extents = Some(vec![]));
        bad(&|s| s.memory_layers[1].extents = None);
        bad(&|s| s.memory_layers.clear());
        bad(&|s| {
            let layer = s.memory_layers[1].clone();
            s.memory_layers.resize(MAX_MEMORY_LAYERS + 1, layer);
        });
        // The snapshot itself at the bottom of its own chain, or one layer named twice.
        let err = bad(&|s| s.memory_layers[0].snapshot_id = s.snapshot_id);
        assert!(err.contains("this snapshot itself"), "{err}");
        let err = bad(&|s| s.memory_layers[1].snapshot_id = s.memory_layers[0].snapshot_id);
        assert!(err.contains("named twice"), "{err}");
        // Layers under a full memory file.
        bad(&|s| s.memory_extents = None);
        let mut full = state.clone();
        full.memory_extents = None;
        full.memory_layers.clear();
        assert_eq!(full.check_memory_layers(), Ok(()));
    }
}

/// The golden-file test of the state file's encoding. A sample [`VmState`] and [`crate::Header`]
/// with every field set (to values distinct from each other and from the defaults), encoded by
/// the real encoder, must match `tests/golden/state-v{FORMAT_VERSION}.bin` byte for byte, and
/// that file must decode back to the sample. So a change to how anything in a state file is
/// encoded (a field added, removed, reordered or retyped, here or in a device's state) fails
/// until [`FORMAT_VERSION`](crate::FORMAT_VERSION) is bumped and the new version's golden file
/// is written with `MAYFLY_BLESS=1 cargo test -p mayfly-snapshot golden`. The golden files of
/// older versions stay, and must be refused with a version error.
///
/// The sample is made of struct literals, never `..Default::default()`: a new field does not
/// compile until it is given a value here, which changes the golden bytes.
#[cfg(test)]
mod golden {
    use std::io::Write;
    use std::os::raw::c_char;
    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;

    use kvm_bindings::{
        kvm_dtable, kvm_irqchip__bindgen_ty_1, kvm_pit_channel_state, kvm_segment,
        kvm_vcpu_events__bindgen_ty_1, kvm_vcpu_events__bindgen_ty_2,
        kvm_vcpu_events__bindgen_ty_3, kvm_vcpu_events__bindgen_ty_4,
        kvm_vcpu_events__bindgen_ty_5, kvm_xcr,
    };
    use mayfly_devices::disk::{Chain, DiskIdentity, LayerId};
    use mayfly_devices::legacy::SerialConsoleState;
    use mayfly_devices::state::{DeviceResources, VirtioDeviceState, VirtioKindState};
    use mayfly_devices::virtio::block::BlockState;
    use mayfly_devices::virtio::mmio::MmioTransportState;
    use mayfly_devices::virtio::net::NetState;
    use mayfly_devices::virtio::rng::RngState;
    use mayfly_devices::virtio::vsock::VsockState;
    use mayfly_devices::virtio::QueueSnapshot;

    use super::*;
    use crate::file::{decode, encode, Header, SnapshotError, FORMAT_VERSION};

    const BLESS: &str = "MAYFLY_BLESS=1 cargo test -p mayfly-snapshot golden";

    fn golden_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
    }

    fn golden_name(version: u32) -> String {
        format!("state-v{version}.bin")
    }

    /// The version a golden file's name says it is.
    fn golden_version(name: &str) -> Option<u32> {
        name.strip_prefix("state-v")?
            .strip_suffix(".bin")?
            .parse()
            .ok()
    }

    fn blessing() -> bool {
        std::env::var_os("MAYFLY_BLESS").is_some_and(|v| v == "1")
    }

    /// `N` bytes, each different from its neighbours, starting from `seed`.
    fn pattern<const N: usize>(seed: u8) -> [u8; N] {
        std::array::from_fn(|i| seed.wrapping_add((i as u8).wrapping_mul(37)) ^ (i >> 8) as u8)
    }

    fn chars<const N: usize>(seed: u8) -> [c_char; N] {
        pattern::<N>(seed).map(|b| b as c_char)
    }

    pub(crate) fn sample_header() -> Header {
        Header {
            arch: "x86_64".into(),
            fingerprint: HostFingerprint {
                cpu_vendor: "GenuineIntel".into(),
                cpu_family: 6,
                cpu_model: 0x8f,
                cpu_stepping: 8,
                xsave_bytes: 11008,
                has_xcrs: true,
            },
            created_unix_ms: 1_700_000_123_456,
            writer: "mayfly 9.8.7 (golden sample)".into(),
        }
    }

    fn segment(n: u8) -> kvm_segment {
        kvm_segment {
            base: 0x1000_0000 * u64::from(n) + 0x10,
            limit: 0x000f_ff00 + u32::from(n),
            selector: 0x08 * u16::from(n),
            type_: 0x0b,
            present: 1,
            dpl: 3,
            db: 1,
            s: 1,
            l: 1,
            g: 1,
            avl: 1,
            unusable: 1,
            padding: 0x50 + n,
        }
    }

    fn dtable(n: u16) -> kvm_dtable {
        kvm_dtable {
            base: 0xffff_fe00_0000_0000 + u64::from(n) * 0x1000,
            limit: 0x0fff - n,
            padding: [n + 1, n + 2, n + 3],
        }
    }

    fn pit_channel(n: u8) -> kvm_pit_channel_state {
        kvm_pit_channel_state {
            count: 0x1_0000 + u32::from(n),
            latched_count: 0x1200 + u16::from(n),
            count_latched: 1,
            status_latched: 1,
            status: 0x30 + n,
            read_state: 2,
            write_state: 3,
            write_latch: 0x40 + n,
            rw_mode: 3,
            mode: 2,
            bcd: 1,
            gate: 1,
            count_load_time: 123_456_789 * i64::from(n),
        }
    }

    fn vcpu(n: u8) -> VcpuState {
        let n64 = u64::from(n);
        let n32 = u32::from(n);
        // Distinct register values: the vCPU in the top byte, the register's number below.
        let reg = |i: u64| (n64 + 1) << 56 | i << 8 | 0x11;
        VcpuState {
            mp_state: kvm_mp_state { mp_state: 2 + n32 },
            regs: kvm_regs {
                rax: reg(1),
                rbx: reg(2),
                rcx: reg(3),
                rdx: reg(4),
                rsi: reg(5),
                rdi: reg(6),
                rsp: reg(7),
                rbp: reg(8),
                r8: reg(9),
                r9: reg(10),
                r10: reg(11),
                r11: reg(12),
                r12: reg(13),
                r13: reg(14),
                r14: reg(15),
                r15: reg(16),
                rip: reg(17),
                rflags: 0x246 + n64,
            },
            sregs: kvm_sregs {
                cs: segment(10 * n + 1),
                ds: segment(10 * n + 2),
                es: segment(10 * n + 3),
                fs: segment(10 * n + 4),
                gs: segment(10 * n + 5),
                ss: segment(10 * n + 6),
                tr: segment(10 * n + 7),
                ldt: segment(10 * n + 8),
                gdt: dtable(10 * u16::from(n) + 1),
                idt: dtable(10 * u16::from(n) + 2),
                cr0: 0x8005_0033 + n64,
                cr2: 0x7fff_0000 + n64,
                cr3: 0x0123_4000 + n64 * 0x1000,
                cr4: 0x0036_06f0 + n64,
                cr8: 1 + n64,
                efer: 0xd01 + n64,
                apic_base: 0xfee0_0900 + n64,
                interrupt_bitmap: [1 + n64, 2 << n, 3 << (8 + n), 4 << (16 + n)],
            },
            xsave: (0..96u32)
                .map(|i| 0x1000_0000 * (n32 + 1) + i * 0x0101)
                .collect(),
            xcrs: Some(kvm_xcrs {
                nr_xcrs: 1,
                flags: 0x10 + n32,
                xcrs: std::array::from_fn(|i| kvm_xcr {
                    xcr: i as u32,
                    reserved: 0x100 + i as u32,
                    value: 0x2e7 + (n64 << 32) + i as u64,
                }),
                padding: std::array::from_fn(|i| 0xaaaa_0000 + (n64 << 16) + i as u64),
            }),
            debugregs: kvm_debugregs {
                db: [0xd0 + n64, 0xd1 + n64, 0xd2 + n64, 0xd3 + n64],
                dr6: 0xffff_0ff0 + n64,
                dr7: 0x0400 + n64,
                flags: 1 + n64,
                reserved: std::array::from_fn(|i| 0xee00 + (n64 << 8) + i as u64),
            },
            lapic: kvm_lapic_state {
                regs: chars(0x60 + n),
            },
            tsc_khz: Some(2_899_999 + n32),
            cpuid: vec![
                kvm_cpuid_entry2 {
                    function: 0,
                    index: n32,
                    flags: 0,
                    eax: 0x20,
                    ebx: 0x756e_6547,
                    ecx: 0x6c65_746e,
                    edx: 0x4965_6e69,
                    padding: [1, 2, 3],
                },
                kvm_cpuid_entry2 {
                    function: 0xd,
                    index: 1 + n32,
                    flags: 1,
                    eax: 0x2e7,
                    ebx: 0x2b00,
                    ecx: 0x2b00 + n32,
                    edx: 7,
                    padding: [4, 5, 6],
                },
            ],
            msrs: vec![
                kvm_msr_entry {
                    index: 0x10,
                    reserved: 0x77,
                    data: 0x1234_5678_9abc + n64,
                },
                kvm_msr_entry {
                    index: 0xc000_0080,
                    reserved: 0x78,
                    data: 0xd01 + n64,
                },
            ],
            vcpu_events: kvm_vcpu_events {
                exception: kvm_vcpu_events__bindgen_ty_1 {
                    injected: 1,
                    nr: 14,
                    has_error_code: 1,
                    pending: 1,
                    error_code: 0x6 + n32,
                },
                interrupt: kvm_vcpu_events__bindgen_ty_2 {
                    injected: 1,
                    nr: 0x20 + n,
                    soft: 1,
                    shadow: 2,
                },
                nmi: kvm_vcpu_events__bindgen_ty_3 {
                    injected: 1,
                    pending: 1,
                    masked: 1,
                    pad: 0x33,
                },
                sipi_vector: 0x9a + n32,
                flags: 0x3f,
                smi: kvm_vcpu_events__bindgen_ty_4 {
                    smm: 1,
                    pending: 1,
                    smm_inside_nmi: 1,
                    latched_init: 1,
                },
                triple_fault: kvm_vcpu_events__bindgen_ty_5 { pending: 1 },
                reserved: pattern(0xc0 + n),
                exception_has_payload: 1,
                exception_payload: 0xdead_0000 + n64,
            },
        }
    }

    fn irqchip(chip_id: u32, seed: u8) -> kvm_irqchip {
        // The union's largest member, so every byte of it is set (it is saved as raw bytes).
        kvm_irqchip {
            chip_id,
            pad: 0x5a00 + chip_id,
            chip: kvm_irqchip__bindgen_ty_1 { dummy: chars(seed) },
        }
    }

    fn virtio_device(n: u8, device: VirtioKindState) -> VirtioDeviceState {
        let n32 = u32::from(n);
        let queues = match &device {
            VirtioKindState::Rng(_) | VirtioKindState::Block(_) => 1,
            VirtioKindState::Vsock(_) | VirtioKindState::Net(_) => 3,
        };
        VirtioDeviceState {
            resources: DeviceResources {
                mmio_base: 0xd000_0000 + u64::from(n) * 0x1000,
                mmio_size: 0x1000,
                gsi: 5 + n32,
            },
            transport: MmioTransportState {
                status: 0x0f,
                device_features_select: 1,
                driver_features_select: 1,
                driver_features: 0x1_0000_0000 | (1 << n),
                queue_select: queues - 1,
                interrupt_status: 1,
                config_generation: 1 + n32,
                queues: (0..queues as u16)
                    .map(|q| {
                        let at = 0x0100_0000 * (u64::from(n) + 1) + u64::from(q) * 0x1_0000;
                        QueueSnapshot {
                            max_size: 256,
                            size: 128 >> q,
                            ready: true,
                            desc_table: at,
                            avail_ring: at + 0x1000,
                            used_ring: at + 0x2000,
                            next_avail: 17 + u16::from(n) * 10 + q,
                            next_used: 15 + u16::from(n) * 10 + q,
                            event_idx: true,
                        }
                    })
                    .collect(),
                activated: true,
            },
            device,
        }
    }

    /// A deterministic state with every field set, every device kind among its devices.
    pub(crate) fn sample_state() -> VmState {
        VmState {
            snapshot_id: pattern(0xa0),
            vcpu_count: 2,
            mem_bytes: 256 << 20,
            cmdline: "console=ttyS0 reboot=k panic=1 mayfly.golden=1".into(),
            memory: vec![
                MemoryRange {
                    guest_addr: 0,
                    size: 128 << 20,
                    file_offset: 0,
                },
                MemoryRange {
                    guest_addr: 0x1_0000_0000,
                    size: 128 << 20,
                    file_offset: 128 << 20,
                },
            ],
            vcpus: vec![vcpu(0), vcpu(1)],
            vm: KvmVmState {
                pic_master: irqchip(0, 0x10),
                pic_slave: irqchip(1, 0x20),
                ioapic: irqchip(2, 0x30),
                pit: kvm_pit_state2 {
                    channels: [pit_channel(1), pit_channel(2), pit_channel(3)],
                    flags: 1,
                    reserved: std::array::from_fn(|i| 0x900 + i as u32),
                },
                clock: kvm_clock_data {
                    clock: 987_654_321_000,
                    flags: 0x6,
                    pad0: 0x7,
                    realtime: 1_700_000_123_456_000_000,
                    host_tsc: 0x0123_4567_89ab_cdef,
                    pad: [8, 9, 10, 11],
                },
                realtime_ns: 1_700_000_123_456_789_012,
            },
            devices: DevicesState {
                serial: SerialConsoleState {
                    baud_divisor_low: 0x0c,
                    baud_divisor_high: 0x01,
                    interrupt_enable: 0x0f,
                    interrupt_identification: 0xc2,
                    line_control: 0x03,
                    line_status: 0x61,
                    modem_control: 0x0b,
                    modem_status: 0xb0,
                    scratch: 0x5c,
                    in_buffer: b"typed on the host\n".to_vec(),
                },
                virtio: vec![
                    virtio_device(
                        0,
                        VirtioKindState::Rng(RngState {
                            acked_features: 0x1_0000_0001,
                        }),
                    ),
                    virtio_device(
                        1,
                        VirtioKindState::Vsock(VsockState {
                            guest_cid: 42,
                            acked_features: 0x1_0000_0002,
                            next_local_port: (1 << 30) + 7,
                        }),
                    ),
                    virtio_device(
                        2,
                        VirtioKindState::Net(NetState {
                            mac: [0x02, 0x4d, 0x46, 0x4c, 0x59, 0x01],
                            acked_features: 0x1_0000_4823,
                            status: 1,
                            policy: "allow=198.51.100.0/24:443".into(),
                        }),
                    ),
                    virtio_device(
                        3,
                        VirtioKindState::Block(BlockState {
                            acked_features: 0x1_0000_6244,
                            serial: "golden-disk-0".into(),
                            read_only: true,
                            disk: DiskIdentity {
                                base_identity: "sha256:0123456789abcdef".into(),
                                disk_size: 8 << 30,
                                layers: vec![LayerId(pattern(0x31)), LayerId(pattern(0x41))],
                            },
                            chain: Chain {
                                base: PathBuf::from("/images/golden-base.ext4"),
                                base_identity: "sha256:0123456789abcdef".into(),
                                layers: vec![
                                    PathBuf::from("disks/vda-0123456789abcdef.layer"),
                                    PathBuf::from("disks/vda-fedcba9876543210.layer"),
                                ],
                            },
                        }),
                    ),
                ],
            },
            identity: IdentityState {
                name: "golden-vm-1".into(),
                index: Some(1),
                parent: Some("golden-vm".into()),
                generation: 3,
            },
            next_clone: 2,
            probe: true,
            working_set: vec![0x1000, 0x7000, 0x0800_2000, 0x1_0000_3000],
            memory_layers: vec![
                MemoryLayer {
                    path: "/var/lib/mayfly/t/memory".into(),
                    snapshot_id: pattern(0x61),
                    extents: None,
                },
                MemoryLayer {
                    path: "memory-layers/0a0b".into(),
                    snapshot_id: pattern(0x62),
                    extents: Some(vec![Extent {
                        offset: 0x3000,
                        len: 0x2000,
                    }]),
                },
            ],
            memory_extents: Some(vec![Extent {
                offset: 0x1_0000,
                len: 0x1000,
            }]),
        }
    }

    /// The golden file of [`FORMAT_VERSION`], checked to be exactly what the encoder writes for
    /// the sample now. Bless mode writes it when there is none, and never overwrites one.
    fn checked_golden() -> &'static [u8] {
        static GOLDEN: OnceLock<Vec<u8>> = OnceLock::new();
        GOLDEN.get_or_init(|| {
            let name = golden_name(FORMAT_VERSION);
            let path = golden_dir().join(&name);
            let encoded =
                encode(&sample_header(), &sample_state()).expect("the sample state encodes");
            match std::fs::read(&path) {
                Ok(golden) => {
                    if golden != encoded {
                        let at = golden
                            .iter()
                            .zip(&encoded)
                            .position(|(a, b)| a != b)
                            .unwrap_or(golden.len().min(encoded.len()));
                        panic!(
                            "the snapshot state encoding changed but FORMAT_VERSION is still {v}: \
                             bump FORMAT_VERSION in snapshot/src/file.rs, then run {BLESS} to \
                             write {next}\n({} is {} bytes, the sample encodes to {} now, first \
                             difference at byte {at}{})",
                            path.display(),
                            golden.len(),
                            encoded.len(),
                            if blessing() {
                                "; MAYFLY_BLESS=1 never overwrites an existing golden file"
                            } else {
                                ""
                            },
                            v = FORMAT_VERSION,
                            next = golden_name(FORMAT_VERSION + 1),
                        );
                    }
                    golden
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && blessing() => {
                    let write = || -> std::io::Result<()> {
                        std::fs::create_dir_all(golden_dir())?;
                        // `create_new`: a golden file that appeared meanwhile is not overwritten.
                        let mut file = std::fs::OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .open(&path)?;
                        file.write_all(&encoded)?;
                        file.sync_all()
                    };
                    write().unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
                    eprintln!("wrote {}: commit it", path.display());
                    encoded
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                    "there is no golden state file for snapshot format version {FORMAT_VERSION} \
                     ({}): run {BLESS} to write it, then commit it",
                    path.display()
                ),
                Err(e) => panic!("cannot read {}: {e}", path.display()),
            }
        })
    }

    #[test]
    fn golden_file_matches_the_encoding() {
        checked_golden();
    }

    #[test]
    fn golden_file_decodes_to_the_sample() {
        let bytes = checked_golden();
        let (header, state): (Header, VmState) =
            decode(bytes, &golden_name(FORMAT_VERSION)).expect("the golden file decodes");
        assert_eq!(header, sample_header());
        assert_eq!(state, sample_state());
    }

    #[test]
    fn golden_files_of_older_versions_are_refused() {
        let current = checked_golden();
        let mut checked = 0;
        for entry in std::fs::read_dir(golden_dir()).expect("the golden directory lists") {
            let entry = entry.expect("the golden directory lists");
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(version) = golden_version(&name) else {
                continue;
            };
            assert!(
                version <= FORMAT_VERSION,
                "{name} is newer than FORMAT_VERSION {FORMAT_VERSION}: was FORMAT_VERSION lowered?"
            );
            if version == FORMAT_VERSION {
                continue;
            }
            let bytes = std::fs::read(entry.path()).expect("the golden file reads");
            let err = decode::<VmState>(&bytes, &name).expect_err("an older version decodes");
            assert!(
                matches!(
                    err,
                    SnapshotError::Version { found, supported, .. }
                        if found == version && supported == FORMAT_VERSION
                ),
                "{name}: {err}"
            );
            checked += 1;
        }
        // And the current file, relabelled as the previous version: the version is checked
        // before anything else (the checksum, which relabelling breaks).
        let mut relabelled = current.to_vec();
        relabelled[8..12].copy_from_slice(&(FORMAT_VERSION - 1).to_le_bytes());
        let err = decode::<VmState>(&relabelled, "relabelled").unwrap_err();
        assert!(
            matches!(err, SnapshotError::Version { found, .. } if found == FORMAT_VERSION - 1),
            "{err}"
        );
        eprintln!("{checked} golden files of older versions refused");
    }

    /// The fuzz target `snapshot_state` starts from the golden file of the current version,
    /// as a whole file (`seed-golden-vN`) and as the header and body its framing takes
    /// (`seed-golden-vN-framed`: the header's length, big-endian u16, then header and body), so
    /// the fuzzer starts past the version check. Seeds of older versions are gone. Bless mode
    /// writes the current seeds and removes older ones.
    #[test]
    fn the_fuzz_corpus_seeds_the_current_format() {
        let golden = checked_golden();
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/snapshot_state");
        let le32 = |at: usize| u32::from_le_bytes(golden[at..at + 4].try_into().unwrap());
        let header_len = usize::try_from(le32(12)).unwrap();
        let header = &golden[16..16 + header_len];
        let body = &golden[16 + header_len + 8..golden.len() - 4];
        let mut framed = u16::try_from(header_len).unwrap().to_be_bytes().to_vec();
        framed.extend_from_slice(header);
        framed.extend_from_slice(body);
        let seeds = [
            (format!("seed-golden-v{FORMAT_VERSION}"), golden.to_vec()),
            (format!("seed-golden-v{FORMAT_VERSION}-framed"), framed),
        ];
        for entry in std::fs::read_dir(&corpus).expect("the fuzz corpus lists") {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name.starts_with("seed-golden-v") && !seeds.iter().any(|(n, _)| *n == name) {
                if blessing() {
                    std::fs::remove_file(corpus.join(&name)).unwrap();
                    eprintln!("removed {name}: commit it");
                } else {
                    panic!("fuzz/corpus/snapshot_state/{name} is of an older format: run {BLESS}");
                }
            }
        }
        for (name, bytes) in seeds {
            let path = corpus.join(&name);
            match std::fs::read(&path) {
                Ok(found) => assert!(found == bytes, "{} is stale: run {BLESS}", path.display()),
                Err(_) if blessing() => {
                    std::fs::write(&path, &bytes).unwrap();
                    eprintln!("wrote {}: commit it", path.display());
                }
                Err(e) => panic!("{}: {e}: run {BLESS}", path.display()),
            }
        }
    }

    #[test]
    fn golden_sample_has_every_device_kind() {
        // Adding a device kind fails to compile here: give the sample a device of that kind.
        const KINDS: usize = 4;
        let kind = |d: &VirtioKindState| match d {
            VirtioKindState::Rng(_) => 0,
            VirtioKindState::Vsock(_) => 1,
            VirtioKindState::Net(_) => 2,
            VirtioKindState::Block(_) => 3,
        };
        let mut seen = [false; KINDS];
        for d in &sample_state().devices.virtio {
            seen[kind(&d.device)] = true;
        }
        assert_eq!(seen, [true; KINDS], "the sample lacks a device kind");
    }
}
