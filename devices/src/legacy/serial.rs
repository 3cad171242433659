//! The guest's console: a 16550A UART (vm-superio) at 0x3f8, interrupting on IRQ 4.

use std::io::{self, Write};

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::PioDevice;

/// The COM1 port base and its interrupt line.
pub const COM1_PORT: u16 = 0x3f8;
pub const COM1_PORT_COUNT: u16 = 8;
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

    /// Room left in the receive FIFO.
    pub fn input_capacity(&self) -> usize {
        self.uart.fifo_capacity()
    }
}

impl PioDevice for SerialConsole {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        data.fill(0);
        if let (Some(first), Ok(offset)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.uart.read(offset);
        }
    }

    fn write(&mut self, offset: u16, data: &[u8]) {
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
    fn input_beyond_the_fifo_is_left_to_the_caller() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut console = SerialConsole::new(irq, Box::new(io::sink()));
        let capacity = console.input_capacity();
        let input = vec![b'x'; capacity + 10];
        assert_eq!(console.queue_input(&input), capacity);
        assert_eq!(console.queue_input(&input), 0);
    }
}
