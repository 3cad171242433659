//! A VMM process's stop signals: SIGTERM, SIGINT and SIGHUP, SIGUSR1 (a state dump) and the
//! memory file's lease signal, taken by one thread from the first moment of the process.

use std::sync::mpsc::Sender;

use crate::event::VmEvent;

/// SIGTERM, SIGINT and SIGHUP end the VM cleanly: blocked everywhere from the start of `main`
/// and taken by one thread. Until the VM runs, a stop signal ends the process at once (status
/// 128+N), whatever phase the start is in; once it runs, the signal goes to the VM's controller,
/// which stops the VM cleanly. SIGUSR1 asks a running VM for a state dump; the lease signal
/// says another process is about to change the VM's memory file.
pub struct StopSignals {
    sink: std::sync::Arc<std::sync::Mutex<Option<Sender<VmEvent>>>>,
}

impl StopSignals {
    pub fn start() -> std::io::Result<Self> {
        let lease = crate::memory::ram::lease_signal();
        // SAFETY: sigset_t is plain data, initialised by sigemptyset before use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t; the signal numbers are valid.
        unsafe {
            libc::sigemptyset(&mut set);
            for sig in [
                libc::SIGTERM,
                libc::SIGINT,
                libc::SIGHUP,
                libc::SIGUSR1,
                lease,
            ] {
                libc::sigaddset(&mut set, sig);
            }
        }
        // SAFETY: blocks the signals in `set` for this thread (and the threads it starts).
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        let sink: std::sync::Arc<std::sync::Mutex<Option<Sender<VmEvent>>>> = Default::default();
        let thread_sink = sink.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .stack_size(mayfly_sys::HELPER_THREAD_STACK)
            .spawn(move || loop {
                let mut sig = 0;
                // SAFETY: waits for a signal of the blocked set; `sig` receives its number.
                if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                    continue;
                }
                let sink = thread_sink.lock().unwrap_or_else(|p| p.into_inner());
                const CUT: &str = "another process is opening the VM's memory file for writing \
                    or truncating it; the VM stops rather than run on memory that changes under \
                    it (restore with --memory eager to copy the memory instead)";
                let event = if sig == lease {
                    VmEvent::MemoryFailed(CUT.into())
                } else {
                    VmEvent::Signal(sig)
                };
                match &*sink {
                    Some(events) => {
                        if events.send(event).is_err() {
                            return;
                        }
                    }
                    None if sig == libc::SIGUSR1 => {}
                    // The vCPUs may already run while the start finishes (the controller is
                    // not told signals yet): the memory file is as cut as it is later.
                    None if sig == lease => {
                        mayfly_sys::terminal::restore_terminal();
                        eprintln!("mayfly: {CUT}");
                        std::process::exit(1);
                    }
                    None => {
                        mayfly_sys::terminal::restore_terminal();
                        crate::persist::standby::remove_socket();
                        eprintln!("mayfly: stopped by signal {sig} before the VM started");
                        std::process::exit(128 + sig);
                    }
                }
            })?;
        Ok(Self { sink })
    }

    /// From now on signals go to the VM's controller.
    pub fn forward_to(self, events: Sender<VmEvent>) {
        *self.sink.lock().unwrap_or_else(|p| p.into_inner()) = Some(events);
    }
}
