//! The handler thread's main loop: faults first, then prefetch, then `populate_all`, one block
//! at a time; it sleeps in poll when there is nothing to do, and on the way out unregisters
//! guest memory so that no thread stays blocked on a fault.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::handler::{Fatal, Handler, Why};
use super::layout::{Block, PAGE};
use super::shared::{lock, Shared};

/// Marks the handler as gone even if it panics, so `populate_all` callers do not wait forever.
struct ExitGuard(Arc<Shared>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        lock(&self.0.state).exited = true;
        self.0.changed.notify_all();
    }
}

impl Handler {
    pub(super) fn run(mut self) {
        let _exit = ExitGuard(self.shared.clone());
        match self.serve() {
            Ok(()) => self.release(),
            Err(Fatal(message)) => {
                // Release faulting threads before telling anyone: `on_failure` may well wait
                // for the vCPU threads, which may be blocked on a fault.
                self.release();
                lock(&self.shared.state).failure = Some(message.clone());
                self.shared.changed.notify_all();
                if let Some(on_failure) = self.on_failure.take() {
                    on_failure(message);
                }
            }
        }
        // Dropping `self.uffd` closes it, which would release any waiter left.
    }

    /// Unregister every region: faults on them are served by the kernel from now on, and
    /// threads waiting on one are woken.
    fn release(&self) {
        for r in &self.layout.regions {
            let _ = self.uffd.unregister(r.host as *mut libc::c_void, r.len);
        }
    }

    /// The main loop: faults first, then prefetch, then `populate_all`, one block at a time,
    /// checking for faults in between; sleep in poll when there is nothing to do.
    fn serve(&mut self) -> Result<(), Fatal> {
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            if self.pending.is_empty() {
                self.drain_events()?;
            }
            if let Some(addr) = self.pending.pop_front() {
                self.serve_fault(addr)?;
                continue;
            }
            if let Some(block) = self.next_prefetch() {
                self.serve_block(block, Why::Prefetch)?;
                continue;
            }
            let requested = self.shared.populate_requests.load(Ordering::Acquire);
            if requested > self.populate_done {
                if self.remaining > 0 {
                    if let Some(block) = self.populated.next_clear(self.fill_cursor) {
                        self.fill_cursor = block + 1;
                        self.serve_block(block, Why::Fill)?;
                        continue;
                    }
                }
                self.populate_done = requested;
                lock(&self.shared.state).populate_done = requested;
                self.shared.changed.notify_all();
                continue;
            }
            self.wait()?;
        }
    }

    fn next_prefetch(&mut self) -> Option<usize> {
        while let Some(block) = self.prefetch.pop_front() {
            if !self.populated.get(block) {
                return Some(block);
            }
        }
        None
    }

    /// Sleep until the userfaultfd has events or someone kicks the eventfd.
    fn wait(&mut self) -> Result<(), Fatal> {
        let mut fds = [
            libc::pollfd {
                fd: self.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.shared.kick.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(Fatal(format!("cannot wait for page faults: {error}")));
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            return Err(Fatal("the userfaultfd reported an error".into()));
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut count = 0u64;
            // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd; a failure
            // (EAGAIN) only means someone else consumed it.
            unsafe {
                libc::read(
                    self.shared.kick.as_raw_fd(),
                    (&mut count as *mut u64).cast(),
                    8,
                );
            }
        }
        Ok(())
    }

    fn serve_fault(&mut self, addr: usize) -> Result<(), Fatal> {
        self.shared.stats.faults.fetch_add(1, Ordering::Relaxed);
        let page = addr & !(PAGE - 1);
        match self.layout.block_of_addr(page) {
            Some(block) if !self.populated.get(block) => self.serve_block(block, Why::Fault),
            Some(_) => self.serve_stale_fault(page),
            // Not ours (cannot happen): wake it so it does not hang.
            None => self.wake(page, PAGE),
        }
    }

    /// A fault on a block already loaded: usually a fault that raced with the load (the page
    /// is there: wake the thread), or a page discarded after a REMOVE event we already read
    /// (load just that page).
    fn serve_stale_fault(&mut self, page: usize) -> Result<(), Fatal> {
        let mut present = 0u8;
        // SAFETY: `page` is a page-aligned address in one of our regions and `present` has
        // room for the one page asked about.
        let rc = unsafe { libc::mincore(page as *mut libc::c_void, PAGE, &mut present) };
        if rc == 0 && present & 1 != 0 {
            return self.wake(page, PAGE);
        }
        let Some(region) = self.layout.region_of_addr(page).copied() else {
            return self.wake(page, PAGE);
        };
        let block = Block {
            host: page,
            len: PAGE,
            file_offset: region.file_offset + (page - region.host) as u64,
        };
        self.place_with_retry(block)
    }

    /// Load one whole block.
    fn serve_block(&mut self, index: usize, why: Why) -> Result<(), Fatal> {
        let block = self.layout.block(index);
        self.accounting = Some((index, why));
        self.place_with_retry(block)?;
        self.populated.set(index);
        self.remaining -= 1;
        Ok(())
    }
}
