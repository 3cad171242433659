//! Just enough of the i8042 keyboard controller for `reboot=k`: the guest resets the machine by
//! writing the "pulse reset line" command (0xfe) to the command port.

use crate::bus::BusDevice;
use crate::{PowerHandler, PowerRequest};

/// Data port 0x60 and command/status port 0x64; the device owns 0x60..=0x64.
pub const I8042_PORT: u64 = 0x60;
pub const I8042_PORT_COUNT: u64 = 5;

const COMMAND_OFFSET: u64 = 4;
const CMD_PULSE_RESET: u8 = 0xfe;

pub struct I8042 {
    on_reset: PowerHandler,
}

impl I8042 {
    pub fn new(on_reset: PowerHandler) -> Self {
        Self { on_reset }
    }
}

impl BusDevice for I8042 {
    /// No keyboard: status reads "input buffer empty, no output", data reads 0. Port 0x61
    /// (system control port B, between ours) also reads 0.
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == COMMAND_OFFSET && data.first() == Some(&CMD_PULSE_RESET) {
            (self.on_reset)(PowerRequest::Reset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn pulse_reset_command_requests_a_reset() {
        let (tx, rx) = mpsc::channel();
        let mut dev = I8042::new(Box::new(move |req| tx.send(req).unwrap()));
        let mut status = [0xffu8];
        dev.read(COMMAND_OFFSET, &mut status);
        assert_eq!(
            status,
            [0],
            "input buffer must read empty or the guest waits forever"
        );
        dev.write(0, &[CMD_PULSE_RESET]);
        dev.write(COMMAND_OFFSET, &[0xd1]);
        assert!(rx.try_recv().is_err());
        dev.write(COMMAND_OFFSET, &[CMD_PULSE_RESET]);
        assert_eq!(rx.try_recv().unwrap(), PowerRequest::Reset);
    }
}
