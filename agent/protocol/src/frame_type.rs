//! A frame's type byte, and the names the documentation gives each.

use std::fmt;

/// A frame's type byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    Hello = 0x01,
    Request = 0x02,
    Stdin = 0x03,
    Stdout = 0x04,
    Stderr = 0x05,
    Exit = 0x06,
    Signal = 0x07,
    Ok = 0x08,
    Error = 0x09,
    Data = 0x0A,
    Started = 0x0B,
    Entries = 0x0C,
}

impl FrameType {
    /// The type for a byte, or `None` for a byte this protocol version does not define.
    pub fn from_byte(byte: u8) -> Option<FrameType> {
        use FrameType::*;
        Some(match byte {
            0x01 => Hello,
            0x02 => Request,
            0x03 => Stdin,
            0x04 => Stdout,
            0x05 => Stderr,
            0x06 => Exit,
            0x07 => Signal,
            0x08 => Ok,
            0x09 => Error,
            0x0A => Data,
            0x0B => Started,
            0x0C => Entries,
            _ => return None,
        })
    }

    pub fn as_byte(self) -> u8 {
        self as u8
    }

    /// The name the documentation uses, e.g. `"STDOUT"`.
    pub fn name(self) -> &'static str {
        use FrameType::*;
        match self {
            Hello => "HELLO",
            Request => "REQUEST",
            Stdin => "STDIN",
            Stdout => "STDOUT",
            Stderr => "STDERR",
            Exit => "EXIT",
            Signal => "SIGNAL",
            Ok => "OK",
            Error => "ERROR",
            Data => "DATA",
            Started => "STARTED",
            Entries => "ENTRIES",
        }
    }
}

impl fmt::Display for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
