//! The terminal a VMM runs on: raw mode while a guest's console is on it, and the saved
//! settings put back from any thread before the process exits without unwinding (a fatal
//! signal's report, a seccomp violation, a stop signal before the VM runs).

use std::io;
use std::os::fd::AsRawFd;

/// Puts a terminal in raw mode and restores it when dropped.
pub struct RawTerminal {
    fd: i32,
    saved: libc::termios,
}

/// The settings of the terminal in raw mode, for [`restore_terminal`].
static SAVED_TERMINAL: std::sync::Mutex<Option<(i32, libc::termios)>> = std::sync::Mutex::new(None);

/// Put back the terminal settings a [`RawTerminal`] changed, from any thread (the process is
/// about to exit without unwinding).
pub fn restore_terminal() {
    let saved = SAVED_TERMINAL
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some((fd, termios)) = saved {
        // SAFETY: restores settings read from the same terminal.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &termios) };
    }
}

impl RawTerminal {
    /// Raw mode for stdin if it is a terminal; None otherwise.
    pub fn stdin() -> Option<Self> {
        let fd = io::stdin().as_raw_fd();
        // SAFETY: termios is plain data; tcgetattr fills it and we check the result.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd is stdin and `saved` is a valid termios to fill.
        if unsafe { libc::isatty(fd) } != 1 || unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw only edits the struct we pass.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: fd is a terminal and `raw` a valid termios.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        *SAVED_TERMINAL.lock().unwrap_or_else(|p| p.into_inner()) = Some((fd, saved));
        Some(Self { fd, saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        SAVED_TERMINAL
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        // SAFETY: restores the settings read from the same terminal.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}
