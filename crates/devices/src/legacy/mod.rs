//! The PC devices a Linux guest expects at fixed I/O ports.

pub mod i8042;
pub mod serial;

pub use i8042::I8042;
pub use serial::{SerialConsole, SerialConsoleState};
