//! ACPI power registers of a hardware-reduced platform (ACPI 6, section 4.8.3.7): the sleep
//! control register (the guest powers off by entering S5), the sleep status register, and the
//! reset register. The FADT mayfly writes points the guest at these ports.

use crate::bus::BusDevice;
use crate::{PowerHandler, PowerRequest};

/// Ports: 0x600 sleep control, 0x601 sleep status, 0x602 reset.
pub const ACPI_POWER_PORT: u64 = 0x600;
pub const ACPI_POWER_PORT_COUNT: u64 = 3;
pub const SLEEP_CONTROL_OFFSET: u64 = 0;
pub const SLEEP_STATUS_OFFSET: u64 = 1;
pub const RESET_OFFSET: u64 = 2;
/// The value the FADT tells the guest to write to the reset register.
pub const RESET_VALUE: u8 = 0x1;
/// The sleep type the DSDT's `\_S5` package gives: soft off.
pub const S5_SLEEP_TYPE: u8 = 5;

const SLEEP_ENABLE: u8 = 1 << 5;
const SLEEP_TYPE_SHIFT: u8 = 2;
const SLEEP_TYPE_MASK: u8 = 0x7;

pub struct AcpiPower {
    on_request: PowerHandler,
}

impl AcpiPower {
    pub fn new(on_request: PowerHandler) -> Self {
        Self { on_request }
    }
}

impl BusDevice for AcpiPower {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Sleep status: never "woken", nothing pending. The other registers are write-only.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        match offset {
            SLEEP_CONTROL_OFFSET
                if value & SLEEP_ENABLE != 0
                    && (value >> SLEEP_TYPE_SHIFT) & SLEEP_TYPE_MASK == S5_SLEEP_TYPE =>
            {
                (self.on_request)(PowerRequest::PowerOff)
            }
            RESET_OFFSET if value == RESET_VALUE => (self.on_request)(PowerRequest::Reset),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn s5_powers_off_and_reset_value_resets() {
        let (tx, rx) = mpsc::channel();
        let mut dev = AcpiPower::new(Box::new(move |req| tx.send(req).unwrap()));
        // What Linux writes for S5: (SLP_TYP << 2) | SLP_EN.
        dev.write(SLEEP_CONTROL_OFFSET, &[(5 << 2) | SLEEP_ENABLE]);
        assert_eq!(rx.try_recv().unwrap(), PowerRequest::PowerOff);
        // Sleep type without the enable bit, or another sleep state: nothing happens.
        dev.write(SLEEP_CONTROL_OFFSET, &[5 << 2]);
        dev.write(SLEEP_CONTROL_OFFSET, &[(3 << 2) | SLEEP_ENABLE]);
        dev.write(RESET_OFFSET, &[0x6]);
        assert!(rx.try_recv().is_err());
        dev.write(RESET_OFFSET, &[RESET_VALUE]);
        assert_eq!(rx.try_recv().unwrap(), PowerRequest::Reset);
    }
}
