//! The guest's serial console on the host side: output to stdout or a file, input from stdin
//! (in raw mode when stdin is a terminal, so keys such as Ctrl-C reach the guest).

use std::fs::File;
use std::io::{self, Read};

use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mayfly_devices::bus::lock;
use mayfly_devices::legacy::serial::ConsoleOut;
use mayfly_devices::legacy::SerialConsole;
use mayfly_devices::virtio::thread::Gate;

/// Where the console goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Console {
    /// Output to stdout, input from stdin.
    Stdio,
    /// Output to this file (created or truncated); no input.
    File(PathBuf),
    /// Output appended to this file, which exists (a clone's console log, which is also its
    /// stderr); no input.
    Log(PathBuf),
}

impl std::str::FromStr for Console {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" => Err("--console takes 'stdio' or a file path".into()),
            "stdio" => Ok(Console::Stdio),
            path => Ok(Console::File(PathBuf::from(path))),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot open the console file {path}: {source}")]
pub struct ConsoleError {
    path: PathBuf,
    source: io::Error,
}

/// A writer that passes every write straight through, so nothing waits in a buffer if the
/// VMM is killed.
struct Stdout;

impl io::Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut out = io::stdout().lock();
        let n = out.write(buf)?;
        out.flush()?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stdout().flush()
    }
}

/// A console file that takes at most a set number of bytes: a guest that writes without end
/// must not fill the host's disk. What comes past the limit is dropped (and reported written,
/// so the guest's UART goes on), after one line that says so.
struct Capped<W> {
    inner: W,
    /// Bytes the file may still take.
    left: u64,
    limit: u64,
    said: bool,
}

impl<W: io::Write> Capped<W> {
    fn new(inner: W, limit: u64, already: u64) -> Self {
        Self {
            inner,
            left: limit.saturating_sub(already),
            limit,
            said: false,
        }
    }
}

impl<W: io::Write> io::Write for Capped<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.left == 0 {
            if !self.said {
                self.said = true;
                let line = format!(
                    "\n[mayfly: the console reached its limit of {} bytes (MAYFLY_CONSOLE_LIMIT); \
                     the rest of the guest's output is dropped]\n",
                    self.limit
                );
                // Best effort: the limit holds whether or not the line gets out.
                let _ = self.inner.write_all(line.as_bytes());
            }
            return Ok(buf.len());
        }
        let take = usize::try_from(self.left).map_or(buf.len(), |left| buf.len().min(left));
        let n = self.inner.write(&buf[..take])?;
        self.left -= n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// `file` as a console output, capped at `limit` bytes (counting what it holds already).
fn capped(file: File, limit: Option<u64>) -> ConsoleOut {
    match limit {
        None => Box::new(file),
        Some(limit) => {
            let already = file.metadata().map_or(0, |m| m.len());
            Box::new(Capped::new(file, limit, already))
        }
    }
}

impl Console {
    /// The console's output, capped at the process's `console_limit` (see
    /// [`crate::settings::Settings`]) unless it is stdout.
    pub fn output(&self) -> Result<ConsoleOut, ConsoleError> {
        let limit = crate::settings::get().console_limit;
        match self {
            Console::Stdio => Ok(Box::new(Stdout)),
            // Not following a symlink: a console log is the VMM's own file.
            Console::File(path) => File::options()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
                .map(|f| capped(f, limit))
                .map_err(|source| ConsoleError {
                    path: path.clone(),
                    source,
                }),
            // Appended to: the clone's stderr is the same file, and neither may write over
            // the other. A fork creates a clone's log with O_EXCL, and the clone reopens it
            // here, not following a symlink.
            Console::Log(path) => File::options()
                .append(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
                .map(|f| capped(f, limit))
                .map_err(|source| ConsoleError {
                    path: path.clone(),
                    source,
                }),
        }
    }
}

/// Type what arrives on stdin (with `Console::Stdio`) and in `input` (a file or FIFO, opened
/// read-write so writers may come and go) into the guest's serial port.
pub fn connect_input(
    serial: &Arc<Mutex<SerialConsole>>,
    gate: &Arc<Gate>,
    console: &Console,
    input: Option<&std::path::Path>,
) -> io::Result<()> {
    if *console == Console::Stdio {
        spawn_forwarder(serial.clone(), gate.clone(), Box::new(io::stdin()))?;
    }
    if let Some(path) = input {
        let file = File::options().read(true).write(true).open(path)?;
        spawn_forwarder(serial.clone(), gate.clone(), Box::new(file))?;
    }
    Ok(())
}

/// The UART, locked, once the VM is not paused (see `DeviceManager::pause`). None when the VM
/// is going away.
fn lock_unpaused<'a>(
    serial: &'a Mutex<SerialConsole>,
    gate: &Gate,
) -> Option<std::sync::MutexGuard<'a, SerialConsole>> {
    loop {
        let guard = lock(serial);
        if !gate.is_paused() {
            return Some(guard);
        }
        drop(guard);
        if !gate.pass() {
            return None;
        }
    }
}

/// Forward `input` to the guest's serial port until it ends. Input waits while the guest has
/// not read what is already queued (the UART's FIFO is small).
fn spawn_forwarder(
    serial: Arc<Mutex<SerialConsole>>,
    gate: Arc<Gate>,
    mut input: Box<dyn Read + Send>,
) -> io::Result<()> {
    // It reads what the host's user types and queues it in the UART the guest drives.
    let builder = std::thread::Builder::new()
        .name("console-in".into())
        .stack_size(mayfly_sys::HELPER_THREAD_STACK);
    mayfly_jail::seccomp::spawn(
        builder,
        mayfly_jail::seccomp::ThreadKind::Console,
        move || {
            let stdin = &mut input;
            let mut buf = [0u8; 256];
            loop {
                let n = match stdin.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => return,
                };
                let mut pending = &buf[..n];
                while !pending.is_empty() {
                    let Some(mut uart) = lock_unpaused(&serial, &gate) else {
                        return;
                    };
                    let queued = uart.queue_input(pending);
                    drop(uart);
                    pending = &pending[queued..];
                    if !pending.is_empty() {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capped_console_takes_its_limit_and_says_so_once() {
        use std::io::Write;
        let mut out = Capped::new(Vec::new(), 10, 4);
        assert_eq!(out.write(b"abcd").unwrap(), 4);
        assert_eq!(out.write(b"efgh").unwrap(), 2);
        // Past the limit: taken (the UART goes on) and dropped, with one line.
        assert_eq!(out.write(b"ijkl").unwrap(), 4);
        assert_eq!(out.write(b"mnop").unwrap(), 4);
        let text = String::from_utf8(out.inner).unwrap();
        assert!(text.starts_with("abcdef\n[mayfly: the console reached its limit of 10 bytes"));
        assert_eq!(text.matches("limit").count(), 1, "{text}");
        assert!(!text.contains("ij") && !text.contains("mn"), "{text}");
    }

    #[test]
    fn console_argument() {
        assert_eq!("stdio".parse::<Console>().unwrap(), Console::Stdio);
        assert_eq!(
            "/tmp/x.log".parse::<Console>().unwrap(),
            Console::File("/tmp/x.log".into())
        );
        assert!("".parse::<Console>().is_err());
    }
}
