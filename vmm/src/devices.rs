//! The VM's devices and how they are wired: to the port I/O bus, to KVM interrupt lines
//! (irqfd) and to the host (console, power requests).

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;
use mayfly_devices::bus::{BusError, MmioBus, PioBus};
use mayfly_devices::legacy::i8042::{I8042_PORT, I8042_PORT_COUNT};
use mayfly_devices::legacy::serial::SerialStateError;
use mayfly_devices::legacy::serial::{ConsoleOut, COM1_IRQ, COM1_PORT, COM1_PORT_COUNT};
use mayfly_devices::legacy::{SerialConsole, SerialConsoleState, I8042};
use mayfly_devices::power::{AcpiPower, ACPI_POWER_PORT, ACPI_POWER_PORT_COUNT};
use mayfly_devices::probe::{Probe, ProbeWaker, PROBE_ADDR, PROBE_SIZE};
use mayfly_devices::PowerHandler;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::layout::GED_GSI;
use crate::vm::VmEvent;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("cannot create an eventfd for a device interrupt: {0}")]
    EventFd(std::io::Error),
    #[error("KVM refused to connect a device interrupt (irqfd): {0}")]
    Irqfd(kvm_ioctls::Error),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    SerialState(#[from] SerialStateError),
}

pub struct Devices {
    pub serial: Arc<Mutex<SerialConsole>>,
    pub pio: Arc<PioBus>,
    pub mmio: Arc<MmioBus>,
    /// Wakes the probe guest's waits, so a pause need not wait for them.
    pub probe_waker: Arc<ProbeWaker>,
    /// Raises the ACPI Generic Event Device's interrupt: "the VM generation ID changed".
    pub ged: EventFd,
}

fn power_handler(events: &Sender<VmEvent>) -> PowerHandler {
    let events = events.clone();
    Box::new(move |request| {
        // The receiver only goes away when the VM is already ending.
        let _ = events.send(VmEvent::Power(request));
    })
}

/// The legacy PC devices: COM1 on IRQ 4, the i8042 reset line, the ACPI power registers.
/// With `serial_state`, the console carries on from a snapshot.
pub fn create_devices(
    vm: &VmFd,
    console_out: ConsoleOut,
    serial_state: Option<&SerialConsoleState>,
    events: &Sender<VmEvent>,
) -> Result<Devices, DeviceError> {
    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)?;
    vm.register_irqfd(&irq, COM1_IRQ)
        .map_err(DeviceError::Irqfd)?;
    let serial = match serial_state {
        Some(state) => SerialConsole::from_state(state, irq, console_out)?,
        None => SerialConsole::new(irq, console_out),
    };
    let serial = Arc::new(Mutex::new(serial));
    let ged = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)?;
    vm.register_irqfd(&ged, GED_GSI)
        .map_err(DeviceError::Irqfd)?;

    let mut pio = PioBus::new();
    pio.insert(COM1_PORT, COM1_PORT_COUNT, serial.clone())?;
    pio.insert(
        I8042_PORT,
        I8042_PORT_COUNT,
        Arc::new(Mutex::new(I8042::new(power_handler(events)))),
    )?;
    pio.insert(
        ACPI_POWER_PORT,
        ACPI_POWER_PORT_COUNT,
        Arc::new(Mutex::new(AcpiPower::new(power_handler(events)))),
    )?;
    // The probe guest's report device (guest-kernel/probe); other guests never touch it.
    let mut mmio = MmioBus::new();
    let probe_waker = Arc::new(ProbeWaker::default());
    mmio.insert(
        PROBE_ADDR,
        PROBE_SIZE,
        Arc::new(Mutex::new(Probe::new(probe_waker.clone()))),
    )?;
    Ok(Devices {
        serial,
        pio: Arc::new(pio),
        mmio: Arc::new(mmio),
        probe_waker,
        ged,
    })
}
