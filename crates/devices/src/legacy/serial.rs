//! The guest's console: a 16550A UART (vm-superio) at 0x3f8, interrupting on IRQ 4.

use std::io::{self, Write};

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::persist::Persist;

/// The COM1 port base and its interrupt line.
pub const COM1_PORT: u64 = 0x3f8;
pub const COM1_PORT_COUNT: u64 = 8;
pub const COM1_IRQ: u32 = 4;

/// Raises the UART's interrupt through an eventfd that KVM turns into IRQ 4 (an irqfd).
pub struct IrqEventFd(pub EventFd);

impl Trigger for IrqEventFd {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// Where the guest's console output goes (stdout, a file, a pipe).
pub type ConsoleOut = Box<dyn Write + Send>;

/// The serial console: guest output to a writer, host input queued into the receive FIFO.
pub struct SerialConsole {
    uart: Serial<IrqEventFd, NoEvents, ConsoleOut>,
    /// Output errors are reported once, not on every byte.
    output_failed: bool,
}

/// The UART's registers and unread input, as a snapshot keeps them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialConsoleState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    /// Bytes typed on the host that the guest has not read yet.
    pub in_buffer: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
#[error("the saved serial console state is invalid: {0}")]
pub struct SerialStateError(String);

impl Persist for SerialConsole {
    type State = SerialConsoleState;
    /// Its interrupt line and where its output goes now.
    type ConstructorArgs = (EventFd, ConsoleOut);
    type Error = SerialStateError;

    /// A console in a saved state, writing to a new output.
    fn restore(
        (irq, out): (EventFd, ConsoleOut),
        state: &SerialConsoleState,
    ) -> Result<Self, SerialStateError> {
        let uart_state = SerialState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        let uart = Serial::from_state(&uart_state, IrqEventFd(irq), NoEvents, out)
            .map_err(|e| SerialStateError(format!("{e:?}")))?;
        Ok(Self {
            uart,
            output_failed: false,
        })
    }

    fn save(&self) -> SerialConsoleState {
        let s = self.uart.state();
        SerialConsoleState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl SerialConsole {
    pub fn new(irq: EventFd, out: ConsoleOut) -> Self {
        Self {
            uart: Serial::new(IrqEventFd(irq), out),
            output_failed: false,
        }
    }

    /// Queue bytes typed on the host for the guest to read. Returns how many fit in the FIFO;
    /// the caller retries the rest once the guest has read some.
    pub fn queue_input(&mut self, bytes: &[u8]) -> usize {
        if bytes.is_empty() || self.uart.fifo_capacity() == 0 {
            return 0;
        }
        // Only a failing irqfd can make this fail; the bytes are queued either way.
        self.uart.enqueue_raw_bytes(bytes).unwrap_or(0)
    }

    /// Raise the interrupt again if the UART says one is pending, as a restored VM's first
    /// act. A real UART holds its line up while an interrupt is pending; this one signals an
    /// edge through an irqfd, and KVM injects an IOAPIC-routed irqfd from a worker, after the
    /// write returns. A snapshot can thus catch an interrupt the UART raised but KVM had not
    /// yet delivered: the restored guest would wait for it forever, its console stuck. (Not a
    /// workaround for a lost edge while the VM runs: the rig's stalls of that kind were its
    /// emulator's, fixed there; see the README's rig section.)
    pub fn raise_pending_interrupt(&self) -> io::Result<()> {
        if self.interrupt_pending() {
            self.uart.interrupt_evt().trigger()?;
        }
        Ok(())
    }

    /// Whether the UART has an interrupt pending (its IIR says one is), which the guest has
    /// not taken yet.
    pub fn interrupt_pending(&self) -> bool {
        const IIR_NO_INTERRUPT: u8 = 0x01;
        self.uart.state().interrupt_identification & IIR_NO_INTERRUPT == 0
    }

    /// Room left in the receive FIFO.
    pub fn input_capacity(&self) -> usize {
        self.uart.fifo_capacity()
    }
}

impl BusDevice for SerialConsole {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(first), Ok(offset)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.uart.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (Some(&value), Ok(offset)) = (data.first(), u8::try_from(offset)) else {
            return;
        };
        if let Err(err) = self.uart.write(offset, value) {
            if !self.output_failed {
                self.output_failed = true;
                eprintln!(
                    "mayfly: the guest console's output failed, dropping its output: {err:?}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn output_reaches_the_writer_and_input_the_guest() {
        let out = Shared::default();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut console = SerialConsole::new(irq.try_clone().unwrap(), Box::new(out.clone()));
        for byte in b"hi\n" {
            console.write(0, &[*byte]);
        }
        assert_eq!(out.0.lock().unwrap().as_slice(), b"hi\n");

        // Enable the "received data" interrupt, then type.
        console.write(1, &[0x01]);
        assert_eq!(console.queue_input(b"ls\n"), 3);
        assert!(irq.read().unwrap() >= 1);
        let mut byte = [0u8];
        // Line status says data is ready; the data register gives it in order.
        console.read(5, &mut byte);
        assert_eq!(byte[0] & 1, 1);
        console.read(0, &mut byte);
        assert_eq!(byte[0], b'l');
    }

    #[test]
    fn state_round_trips_with_pending_input() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut console = SerialConsole::new(irq, Box::new(io::sink()));
        console.write(3, &[0x03]); // 8N1
        console.write(1, &[0x01]);
        console.queue_input(b"abc");
        let state = console.save();
        assert_eq!(state.in_buffer, b"abc");
        assert_eq!(state.line_control, 0x03);

        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut restored = SerialConsole::restore((irq, Box::new(io::sink())), &state).unwrap();
        assert_eq!(restored.save(), state);
        let mut byte = [0u8];
        restored.read(0, &mut byte);
        assert_eq!(byte[0], b'a');
    }

    #[test]
    fn a_pending_interrupt_is_raised_again() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut console = SerialConsole::new(irq.try_clone().unwrap(), Box::new(io::sink()));
        console.raise_pending_interrupt().unwrap();
        assert!(irq.read().is_err(), "nothing pending, nothing raised");
        console.write(1, &[0x02]); // enable "transmitter empty": it is pending at once
        while irq.read().is_ok() {}
        console.raise_pending_interrupt().unwrap();
        assert_eq!(irq.read().unwrap(), 1);
        let mut iir = [0u8];
        console.read(2, &mut iir); // the guest reads IIR: no longer pending
        console.raise_pending_interrupt().unwrap();
        assert!(irq.read().is_err());
    }

    #[test]
    fn input_beyond_the_fifo_is_left_to_the_caller() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut console = SerialConsole::new(irq, Box::new(io::sink()));
        let capacity = console.input_capacity();
        let input = vec![b'x'; capacity + 10];
        assert_eq!(console.queue_input(&input), capacity);
        assert_eq!(console.queue_input(&input), 0);
    }
}
