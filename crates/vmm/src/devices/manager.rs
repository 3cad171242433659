//! The device manager: every device of a VM, the guest resources they occupy, and their
//! pause, save and restore.
//!
//! - Resources are allocated, not hard-coded per device: each virtio device gets the next MMIO
//!   window from [`VIRTIO_MMIO_START`] and the next free interrupt line (IOAPIC pin) from
//!   [`FIRST_VIRTIO_GSI`]. The guest learns them from the DSDT ([`DeviceManager::acpi_devices`]);
//!   a restored VM gets its devices back at the same places (they are in the snapshot).
//! - Queue notifications reach a device's thread through an ioeventfd (KVM completes the
//!   guest's write without leaving the kernel); interrupts go through an irqfd.
//! - Pause quiesces the device threads and the console's helper threads (see
//!   `mayfly_devices::virtio::thread`): a snapshot or fork that follows reads devices that
//!   nothing changes, and no device touches guest memory meanwhile.
//! - Each device saves and restores itself beside its own code (`mayfly_devices::persist::
//!   Persist`); the manager holds every virtio device through one trait
//!   (`mayfly_devices::virtio::device::Device`) and does the same for each. What differs by
//!   kind (how a device is made at boot and from a snapshot) is in [`virtio`], the one place a
//!   new device is added on this side.

use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use mayfly_devices::bus::{lock, MmioBus, PioBus};
use mayfly_devices::legacy::i8042::{I8042_PORT, I8042_PORT_COUNT};
use mayfly_devices::legacy::serial::{ConsoleOut, COM1_IRQ, COM1_PORT, COM1_PORT_COUNT};
use mayfly_devices::legacy::{SerialConsole, SerialConsoleState, I8042};
use mayfly_devices::persist::Persist;
use mayfly_devices::power::{AcpiPower, ACPI_POWER_PORT, ACPI_POWER_PORT_COUNT};
use mayfly_devices::probe::{Probe, ProbeWaker, PROBE_ADDR, PROBE_SIZE};
use mayfly_devices::state::{DeviceResources, DevicesState, VirtioDeviceState, VirtioKindState};
use mayfly_devices::virtio::device::Device;
use mayfly_devices::virtio::mmio::{MmioTransport, MmioTransportState};
use mayfly_devices::virtio::thread::{DeviceThread, Gate};
use mayfly_devices::virtio::{GuestMemory, Interrupt, MMIO_WINDOW};
use mayfly_devices::PowerHandler;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::layout::{GED_GSI, IOAPIC_PINS};
pub use crate::devices::config::{DevicesConfig, RestoreTargets};
use crate::devices::disks::{self, DiskSetupError};
pub use crate::devices::error::DeviceError;
use crate::devices::net::{self, NetSetupError};
use crate::devices::virtio::{self, Made, Role};
use crate::event::VmEvent;

/// Where virtio MMIO windows start: after the probe device's page, in the gap below 4 GiB.
pub const VIRTIO_MMIO_START: u64 = PROBE_ADDR + PROBE_SIZE;
/// The end of the range virtio windows are allocated from.
pub const VIRTIO_MMIO_END: u64 = VIRTIO_MMIO_START + 0x100_0000;
/// The first interrupt line for virtio devices: 4 is COM1, 5 the Generic Event Device.
pub const FIRST_VIRTIO_GSI: u32 = 6;

/// Hands out MMIO windows and interrupt lines, and takes back those a restored VM already has.
struct ResourceAllocator {
    next_mmio: u64,
    used_gsis: Vec<u32>,
}

impl ResourceAllocator {
    fn new() -> Self {
        Self {
            next_mmio: VIRTIO_MMIO_START,
            used_gsis: vec![COM1_IRQ, GED_GSI],
        }
    }

    fn allocate(&mut self) -> Result<DeviceResources, DeviceError> {
        if self.next_mmio + MMIO_WINDOW > VIRTIO_MMIO_END {
            return Err(DeviceError::Exhausted("MMIO windows"));
        }
        let gsi = (FIRST_VIRTIO_GSI..u32::from(IOAPIC_PINS))
            .find(|g| !self.used_gsis.contains(g))
            .ok_or(DeviceError::Exhausted("interrupt lines"))?;
        let res = DeviceResources {
            mmio_base: self.next_mmio,
            mmio_size: MMIO_WINDOW,
            gsi,
        };
        self.claim(&res)?;
        Ok(res)
    }

    /// Take resources a snapshot says a device has: they must be where mayfly puts devices,
    /// and not taken twice.
    fn claim(&mut self, res: &DeviceResources) -> Result<(), DeviceError> {
        let in_range = res.mmio_size == MMIO_WINDOW
            && res.mmio_base >= VIRTIO_MMIO_START
            && res.mmio_base.is_multiple_of(MMIO_WINDOW)
            && res.mmio_base + MMIO_WINDOW <= VIRTIO_MMIO_END
            && (FIRST_VIRTIO_GSI..u32::from(IOAPIC_PINS)).contains(&res.gsi);
        if !in_range || self.used_gsis.contains(&res.gsi) {
            return Err(DeviceError::BadState {
                device: "virtio",
                reason: format!("resources {res:?} are not ones mayfly hands out (or taken twice)"),
            });
        }
        self.used_gsis.push(res.gsi);
        self.next_mmio = self.next_mmio.max(res.mmio_base + MMIO_WINDOW);
        Ok(())
    }
}

struct VirtioSlot {
    resources: DeviceResources,
    /// What the device is to the VMM, read once at creation: asking it later means taking its
    /// lock, which its thread holds while it works (the controller must never wait on a
    /// device).
    role: Role,
    transport: Arc<Mutex<MmioTransport>>,
    device: Arc<Mutex<dyn Device>>,
    /// Dropped first: the thread stops before the device goes.
    thread: DeviceThread,
}

/// A device's lock, if its thread lets go of it within a moment: for the state dump, which must
/// say that a device is stuck rather than get stuck with it.
fn try_lock_briefly<T: ?Sized>(mutex: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
    loop {
        match mutex.try_lock() {
            Ok(guard) => return Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5))
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

pub struct DeviceManager {
    pub serial: Arc<Mutex<SerialConsole>>,
    pub pio: Arc<PioBus>,
    pub mmio: Arc<MmioBus>,
    /// Wakes the probe guest's waits, so a pause need not wait for them.
    pub probe_waker: Arc<ProbeWaker>,
    /// Raises the ACPI Generic Event Device's interrupt: "the VM generation ID changed".
    pub ged: EventFd,
    /// Where the console's input thread stops while paused.
    pub console_gate: Arc<Gate>,
    virtio: Vec<VirtioSlot>,
    /// Where the writable disks keep their layers (and new tops go at a freeze).
    disk_dir: Option<PathBuf>,
    /// The NIC's network namespace, tap and policy, held for the VM's life (dropped after the
    /// device threads: see the field order).
    network: Option<net::VmNet>,
    /// Where the NIC's network was made, for the clones a fork makes.
    net_settings: Option<net::NetSettings>,
}

fn power_handler(events: &Sender<VmEvent>) -> PowerHandler {
    let events = events.clone();
    Box::new(move |request| {
        // The receiver only goes away when the VM is already ending.
        let _ = events.send(VmEvent::Power(request));
    })
}

/// The pieces every device needs to be wired.
pub struct Wiring<'a> {
    pub vm: &'a VmFd,
    pub mem: &'a GuestMemory,
    pub events: &'a Sender<VmEvent>,
}

impl DeviceManager {
    /// The legacy PC devices (COM1 on IRQ 4, i8042 reset, ACPI power), the probe device if
    /// asked for, and the virtio devices `config` names, freshly reset.
    pub fn new(
        wiring: &Wiring<'_>,
        console_out: ConsoleOut,
        probe: bool,
        config: &DevicesConfig,
    ) -> Result<Self, DeviceError> {
        let mut manager = Self::legacy(wiring, console_out, None, probe)?;
        let mut allocator = ResourceAllocator::new();
        for made in virtio::boot(config, &mut manager.network)? {
            let res = allocator.allocate()?;
            manager.add_virtio(wiring, res, made, None)?;
        }
        manager.disk_dir = config.disk_dir.clone();
        if manager.network.is_some() {
            manager.net_settings = config.net.as_ref().map(|spec| spec.settings.clone());
        }
        Ok(manager)
    }

    /// The devices of a snapshot, at the places it says, in the states it says.
    pub fn restore(
        wiring: &Wiring<'_>,
        console_out: ConsoleOut,
        probe: bool,
        state: &DevicesState,
        targets: &RestoreTargets,
    ) -> Result<Self, DeviceError> {
        let mut manager = Self::legacy(wiring, console_out, Some(&state.serial), probe)?;
        // A restored probe has a new generation ID to see, and may be just about to wait.
        manager.probe_waker.wake_once();
        manager.disk_dir = targets.disk_dir.clone();
        let mut allocator = ResourceAllocator::new();
        for saved in &state.virtio {
            allocator.claim(&saved.resources)?;
            let made = virtio::restore(&saved.device, targets, &mut manager.network)?;
            if matches!(made.role, Role::Net) {
                manager.net_settings = Some(targets.net.settings.clone());
            }
            manager.add_virtio(wiring, saved.resources, made, Some(&saved.transport))?;
        }
        if let (Some(policy), None) = (&targets.net.policy, &manager.network) {
            return Err(NetSetupError::NoNic(policy.to_string()).into());
        }
        Ok(manager)
    }

    fn legacy(
        wiring: &Wiring<'_>,
        console_out: ConsoleOut,
        serial_state: Option<&SerialConsoleState>,
        probe: bool,
    ) -> Result<Self, DeviceError> {
        let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)?;
        wiring
            .vm
            .register_irqfd(&irq, COM1_IRQ)
            .map_err(DeviceError::Irqfd)?;
        let serial = match serial_state {
            Some(state) => SerialConsole::restore((irq, console_out), state)?,
            None => SerialConsole::new(irq, console_out),
        };
        let serial = Arc::new(Mutex::new(serial));
        let ged = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)?;
        wiring
            .vm
            .register_irqfd(&ged, GED_GSI)
            .map_err(DeviceError::Irqfd)?;

        let mut pio = PioBus::new();
        pio.insert(COM1_PORT, COM1_PORT_COUNT, serial.clone())?;
        pio.insert(
            I8042_PORT,
            I8042_PORT_COUNT,
            Arc::new(Mutex::new(I8042::new(power_handler(wiring.events)))),
        )?;
        pio.insert(
            ACPI_POWER_PORT,
            ACPI_POWER_PORT_COUNT,
            Arc::new(Mutex::new(AcpiPower::new(power_handler(wiring.events)))),
        )?;
        // The probe guest's report device (guest-kernel/probe), only when asked for: a guest
        // that has it can write lines to the VMM's stderr and park its vCPU in a wait.
        let mut mmio = MmioBus::new();
        let probe_waker = Arc::new(ProbeWaker::default());
        if probe {
            mmio.insert(
                PROBE_ADDR,
                PROBE_SIZE,
                Arc::new(Mutex::new(Probe::new(probe_waker.clone()))),
            )?;
        }
        Ok(Self {
            serial,
            pio: Arc::new(pio),
            mmio: Arc::new(mmio),
            probe_waker,
            ged,
            console_gate: Arc::new(Gate::default()),
            virtio: Vec::new(),
            disk_dir: None,
            network: None,
            net_settings: None,
        })
    }

    /// Wire one virtio device: irqfd, ioeventfds, transport on the MMIO bus, its thread.
    fn add_virtio(
        &mut self,
        wiring: &Wiring<'_>,
        resources: DeviceResources,
        made: Made,
        saved: Option<&MmioTransportState>,
    ) -> Result<(), DeviceError> {
        let Made {
            device,
            transport_side,
            thread_side,
            role,
            filter,
        } = made;
        let name = lock(&device).name();
        let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)?;
        wiring
            .vm
            .register_irqfd(&irqfd, resources.gsi)
            .map_err(DeviceError::Irqfd)?;
        let notify = IoEventAddress::Mmio(
            resources.mmio_base + u64::from(virtio_bindings::virtio_mmio::VIRTIO_MMIO_QUEUE_NOTIFY),
        );
        for (index, event) in lock(&device).queue_events().iter().enumerate() {
            wiring
                .vm
                .register_ioevent(
                    event,
                    &notify,
                    u32::try_from(index).expect("a device has a few queues"),
                )
                .map_err(DeviceError::Ioeventfd)?;
        }
        let interrupt = Arc::new(Interrupt::new(irqfd));
        let transport = match saved {
            None => MmioTransport::new(transport_side, wiring.mem.clone(), interrupt),
            Some(state) => {
                MmioTransport::restore((transport_side, wiring.mem.clone(), interrupt), state)
                    .map_err(|reason| DeviceError::BadState {
                        device: name,
                        reason,
                    })?
            }
        };
        let transport = Arc::new(Mutex::new(transport));
        // The MMIO bus is shared with the vCPU threads, which are not running yet: it is
        // still this manager's alone to extend.
        Arc::get_mut(&mut self.mmio)
            .expect("devices are added before the vCPUs start")
            .insert(resources.mmio_base, resources.mmio_size, transport.clone())?;
        // A restored device waits at its gate until the vCPUs are restored (see
        // DeviceManager::raise_pending_interrupts): what it does first may raise an interrupt.
        let stack = mayfly_sys::HELPER_THREAD_STACK;
        let filter = Box::new(move || mayfly_jail::seccomp::install_or_exit(filter));
        let thread = DeviceThread::spawn_with(name, thread_side, stack, saved.is_some(), filter)
            .map_err(DeviceError::Thread)?;
        self.virtio.push(VirtioSlot {
            resources,
            role,
            transport,
            device,
            thread,
        });
        Ok(())
    }

    /// The virtio devices as the DSDT describes them: (MMIO base, size, interrupt line).
    pub fn acpi_devices(&self) -> Vec<DeviceResources> {
        self.virtio.iter().map(|s| s.resources).collect()
    }

    /// Stop every device thread and the console's helpers (the vCPUs are paused first).
    pub fn pause(&self) -> Result<(), DeviceError> {
        for slot in &self.virtio {
            if !slot.thread.pause() {
                return Err(DeviceError::Stuck(slot.thread.name().to_string()));
            }
        }
        // The console's threads check the gate under the UART's lock: once the lock has been
        // taken here after closing the gate, none of them touches the UART until resume.
        self.console_gate.close();
        drop(lock(&self.serial));
        Ok(())
    }

    /// Keep a paused restore's devices paused, without waiting for any thread: its device
    /// threads start held at their gates (they touch nothing before it) and the console's
    /// gate closes. [`DeviceManager::pause`] instead waits for each thread to stop, which a
    /// thread just started would make a handshake of (a fork's clones are restored paused).
    pub fn keep_paused(&self) -> Result<(), DeviceError> {
        if self.virtio.iter().any(|slot| !slot.thread.is_paused()) {
            return self.pause();
        }
        self.console_gate.close();
        drop(lock(&self.serial));
        Ok(())
    }

    /// For a restored VM, once its vCPUs' interrupt controllers are restored: raise again the
    /// interrupts the snapshot saw pending. (Raised earlier, they would land in LAPIC state
    /// that the vCPU restore then overwrites: the guest would never hear of them.) The
    /// restored device threads start at [`DeviceManager::resume`].
    pub fn raise_pending_interrupts(&self) -> Result<(), DeviceError> {
        for slot in &self.virtio {
            lock(&slot.transport)
                .raise_pending_interrupt()
                .map_err(DeviceError::EventFd)?;
        }
        Ok(())
    }

    pub fn resume(&self) {
        self.console_gate.resume();
        for slot in &self.virtio {
            slot.thread.resume();
        }
    }

    /// Every device's state; the devices must be paused.
    pub fn save(&self) -> DevicesState {
        DevicesState {
            serial: lock(&self.serial).save(),
            virtio: self
                .virtio
                .iter()
                .map(|slot| {
                    let mut device = lock(&slot.device).save_kind();
                    // The NIC's egress policy is not the device's business, but part of what
                    // the NIC is: a restore and every clone keep it.
                    if let (VirtioKindState::Net(state), Some(network)) =
                        (&mut device, &self.network)
                    {
                        // A jailed VM's waiter has it; one that cannot say (gone, so the VMM
                        // goes too) leaves a NIC that reaches nothing: closed, not open.
                        state.policy = network
                            .policy()
                            .unwrap_or_else(|e| {
                                eprintln!("mayfly: the snapshot's NIC reaches nothing: {e}");
                                mayfly_network::Policy::None
                            })
                            .to_string();
                    }
                    VirtioDeviceState {
                        resources: slot.resources,
                        transport: lock(&slot.transport).save(),
                        device,
                    }
                })
                .collect(),
        }
    }

    /// Freeze every writable disk (the devices must be paused): its top layer becomes part of
    /// a frozen chain that a snapshot links and clones stack on, and the VM goes on on a new
    /// empty top in its disk directory. Metadata only.
    pub fn freeze_disks(&self) -> Result<(), DeviceError> {
        for slot in &self.virtio {
            let Role::Block {
                serial,
                read_only,
                device: d,
            } = &slot.role
            else {
                continue;
            };
            if *read_only {
                continue;
            }
            let disk_error = |source| DeviceError::Disk {
                serial: serial.clone(),
                source,
            };
            let dir = self
                .disk_dir
                .as_deref()
                .ok_or(disk_error(DiskSetupError::NoDiskDir))?;
            disks::freeze(lock(d).disk_mut(), serial, dir).map_err(disk_error)?;
        }
        Ok(())
    }

    /// Whether the VM has a writable disk (a fork then needs its clones' disk directories).
    pub fn has_writable_disks(&self) -> bool {
        self.virtio.iter().any(|s| {
            matches!(
                s.role,
                Role::Block {
                    read_only: false,
                    ..
                }
            )
        })
    }

    /// The vsock device's host socket and guest CID, if the VM has one.
    pub fn vsock(&self) -> Option<(Option<PathBuf>, u64)> {
        self.virtio.iter().find_map(|slot| match &slot.role {
            Role::Vsock { path, cid } => Some((path.clone(), *cid)),
            _ => None,
        })
    }

    /// What of the host the VM still opens by path once it runs, for its jail: its disk
    /// directory (new layers at each snapshot), the directory of its vsock socket (the guest's
    /// connections to `<socket>_<port>`), and a console-input FIFO; and its own vsock socket,
    /// which its controller connects to (to reach the guest agent) as the jail's uid.
    pub fn jail_needs(&self, console_input: Option<&Path>) -> mayfly_jail::jail::Needs {
        let mut needs = mayfly_jail::jail::Needs::default();
        if let Some(dir) = &self.disk_dir {
            needs.shares.push(mayfly_jail::jail::Share {
                path: std::path::absolute(dir).unwrap_or(dir.clone()),
                writable: true,
            });
        }
        if let Some(socket) = self.vsock().and_then(|(path, _)| path) {
            let socket = std::path::absolute(&socket).unwrap_or(socket);
            if let Some(dir) = socket.parent() {
                needs.shares.push(mayfly_jail::jail::Share {
                    path: dir.to_path_buf(),
                    writable: false,
                });
            }
            needs.own.push(socket);
        }
        if let Some(fifo) = console_input {
            needs.shares.push(mayfly_jail::jail::Share {
                path: std::path::absolute(fifo).unwrap_or(fifo.to_path_buf()),
                writable: false,
            });
        }
        needs
    }

    /// The VM's network (its NIC's namespace, policy, counters), if it has a NIC.
    pub fn network(&self) -> Option<&net::VmNet> {
        self.network.as_ref()
    }

    pub fn network_mut(&mut self) -> Option<&mut net::VmNet> {
        self.network.as_mut()
    }

    /// Where the NIC's network was made (a fork's clones make theirs there too).
    pub fn net_settings(&self) -> Option<&net::NetSettings> {
        self.net_settings.as_ref()
    }

    /// One line per virtio device, for the state dump.
    pub fn describe(&self) -> Vec<String> {
        self.virtio
            .iter()
            .map(|slot| {
                let label = slot.role.label();
                let kind = match try_lock_briefly(&slot.device) {
                    Some(d) => match d.describe() {
                        Some(detail) => format!("{label} ({detail})"),
                        None => label,
                    },
                    None => format!("{label} (BUSY: its thread holds it, stuck?)"),
                };
                let transport = match try_lock_briefly(&slot.transport) {
                    Some(t) => {
                        let state = t.save();
                        format!(
                            "status {:#x} interrupt {:#x}",
                            state.status, state.interrupt_status
                        )
                    }
                    None => "transport BUSY".to_string(),
                };
                format!(
                    "virtio {kind} at {:#x} gsi {}: {transport} paused {}",
                    slot.resources.mmio_base,
                    slot.resources.gsi,
                    slot.thread_paused()
                )
            })
            .collect()
    }
}

impl VirtioSlot {
    /// Whether a pause is in force (for the state dump).
    fn thread_paused(&self) -> bool {
        self.thread.is_paused()
    }
}
