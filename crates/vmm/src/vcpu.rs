//! One thread per vCPU: run the guest, route its port I/O to the devices, and stop, pause or
//! report when told to or when the guest does something fatal.
//!
//! Control: another thread sets the vCPU's target state and kicks it with a real-time signal;
//! the signal handler sets `immediate_exit` in the vCPU's `kvm_run`, so the kick cannot be lost
//! between checking the target and entering `KVM_RUN`.

use std::cell::Cell;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;

use kvm_bindings::{
    kvm_guest_debug, kvm_run, KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_USE_HW_BP, KVM_SYSTEM_EVENT_CRASH,
    KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use mayfly_devices::bus::{MmioBus, PioBus};
use mayfly_devices::PowerRequest;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::event::VmEvent;
use crate::trace;

thread_local! {
    /// This thread's `kvm_run`, for the kick signal handler.
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN.with(|r| r.get());
    if !run.is_null() {
        // SAFETY: the pointer is this thread's kvm_run mapping, set by the vCPU loop before it
        // first runs and valid for as long as the thread's VcpuFd lives (the whole loop).
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
}

fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Install the kick handler once per process.
pub fn init_kick_signal() -> Result<(), std::io::Error> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = register_signal_handler(kick_signal(), kick_handler)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()));
    });
    result
}

/// What a vCPU thread is asked to be doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Run,
    Pause,
    Exit,
}

/// Work run on a paused vCPU's own thread (vCPU ioctls such as saving its state).
pub type VcpuJob = Box<dyn FnOnce(&mut VcpuFd) + Send>;

struct ControlState {
    target: Target,
    /// The vCPU and what its loop needs, handed to a thread started ahead of them
    /// ([`VcpuHandle::prepare`]).
    start: Option<(VcpuFd, Arc<VcpuContext>)>,
    /// The vCPU ended its run (fatal exit or power request): it only waits for `Exit` now.
    finished: bool,
    paused: bool,
    exited: bool,
    jobs: VecDeque<VcpuJob>,
}

/// Where a vCPU thread is, updated around every `KVM_RUN` (a few relaxed atomic stores): when a
/// guest stops answering, this tells a vCPU that KVM never returns to mayfly (the guest or KVM
/// is stuck) from one that mayfly stopped running (mayfly is stuck).
#[derive(Default)]
pub struct VcpuActivity {
    in_kvm_run: AtomicBool,
    entries: AtomicU64,
    /// The `exit_reason` of the last exit (KVM_EXIT_*), or u32::MAX for an error return.
    last_exit: AtomicU32,
    /// CLOCK_MONOTONIC ns of the last entry or exit.
    since_ns: AtomicU64,
}

impl VcpuActivity {
    fn enter(&self) {
        self.entries.fetch_add(1, Ordering::Relaxed);
        self.since_ns
            .store(mayfly_devices::probe::monotonic_ns(), Ordering::Relaxed);
        self.in_kvm_run.store(true, Ordering::Release);
    }

    fn exit(&self, reason: u32) {
        self.in_kvm_run.store(false, Ordering::Release);
        self.last_exit.store(reason, Ordering::Relaxed);
        self.since_ns
            .store(mayfly_devices::probe::monotonic_ns(), Ordering::Relaxed);
    }

    /// How long the vCPU has been inside its current `KVM_RUN`, if it is in one.
    pub fn in_kvm_run_for_ns(&self) -> Option<u64> {
        self.in_kvm_run.load(Ordering::Acquire).then(|| {
            mayfly_devices::probe::monotonic_ns()
                .saturating_sub(self.since_ns.load(Ordering::Relaxed))
        })
    }

    /// One line: in KVM_RUN or not, since when, how many entries, the last exit.
    pub fn describe(&self) -> String {
        let age_ms = mayfly_devices::probe::monotonic_ns()
            .saturating_sub(self.since_ns.load(Ordering::Relaxed)) as f64
            / 1e6;
        let last = match self.last_exit.load(Ordering::Relaxed) {
            u32::MAX => "an error or EINTR".to_string(),
            reason => format!("exit reason {reason}"),
        };
        if self.in_kvm_run.load(Ordering::Acquire) {
            format!(
                "in KVM_RUN for {age_ms:.1} ms ({} entries; before that: {last})",
                self.entries.load(Ordering::Relaxed)
            )
        } else {
            format!(
                "in mayfly (not in KVM_RUN) for {age_ms:.1} ms after {last} ({} entries)",
                self.entries.load(Ordering::Relaxed)
            )
        }
    }
}

/// Shared between a vCPU thread and whoever controls it.
pub struct VcpuControl {
    state: Mutex<ControlState>,
    changed: Condvar,
    activity: VcpuActivity,
}

impl VcpuControl {
    fn new(target: Target) -> Self {
        Self {
            state: Mutex::new(ControlState {
                target,
                start: None,
                finished: false,
                paused: false,
                exited: false,
                jobs: VecDeque::new(),
            }),
            changed: Condvar::new(),
            activity: VcpuActivity::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the vCPU thread needs besides its fd.
pub struct VcpuContext {
    pub pio: Arc<PioBus>,
    pub mmio: Arc<MmioBus>,
    pub events: Sender<VmEvent>,
    pub trace: Option<trace::Breakpoints>,
}

/// The controlling side of a running vCPU thread.
pub struct VcpuHandle {
    pub index: u8,
    control: Arc<VcpuControl>,
    thread: Option<JoinHandle<()>>,
}

impl VcpuHandle {
    /// Start the vCPU's thread before its vCPU exists: it installs its seccomp filter at once
    /// and waits for [`VcpuHandle::start`] (or the end, if the VM never comes). A restore
    /// starts its vCPU threads first, so that making a thread and installing its filter
    /// (~0.1 ms here) happen while the VM is being made, not after it.
    pub fn prepare(index: u8, start: Target) -> std::io::Result<Self> {
        init_kick_signal()?;
        let control = Arc::new(VcpuControl::new(start));
        let thread_control = control.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .stack_size(mayfly_sys::HELPER_THREAD_STACK)
            .spawn(move || {
                // The filter first: from here on this thread handles what the guest writes.
                let filtered =
                    mayfly_jail::seccomp::install(mayfly_jail::seccomp::ThreadKind::Vcpu);
                let started = {
                    let mut state = thread_control.lock();
                    loop {
                        if let Some(start) = state.start.take() {
                            break Some(start);
                        }
                        if state.target == Target::Exit {
                            break None;
                        }
                        state = thread_control
                            .changed
                            .wait(state)
                            .unwrap_or_else(|p| p.into_inner());
                    }
                };
                match started {
                    Some((vcpu, context)) => {
                        vcpu_loop(index, vcpu, &context, &thread_control, filtered);
                    }
                    None => {
                        thread_control.lock().exited = true;
                        thread_control.changed.notify_all();
                    }
                }
            })?;
        Ok(Self {
            index,
            control,
            thread: Some(thread),
        })
    }

    /// Give a thread started by [`VcpuHandle::prepare`] its vCPU: it runs the guest at once
    /// when its target is `Target::Run`.
    pub fn start(&self, vcpu: VcpuFd, context: Arc<VcpuContext>) {
        self.control.lock().start = Some((vcpu, context));
        self.control.changed.notify_all();
    }

    /// Where the vCPU thread is right now (see [`VcpuActivity`]).
    pub fn activity(&self) -> &VcpuActivity {
        &self.control.activity
    }

    /// Kick the vCPU out of `KVM_RUN` without asking anything of it: it enters again at once.
    /// (See [`crate::machine::Machine::nudge_stalled_console`].)
    pub fn nudge(&self) {
        self.kick();
    }

    fn kick(&self) {
        if let Some(thread) = &self.thread {
            // A thread that already ended cannot be signalled; nothing to do then.
            let _ = thread.kill(kick_signal());
        }
    }

    fn set_target(&self, target: Target) {
        let mut state = self.control.lock();
        if state.target != Target::Exit && (!state.finished || target == Target::Exit) {
            state.target = target;
        }
        drop(state);
        self.control.changed.notify_all();
        self.kick();
    }

    /// Ask the vCPU to pause (it finishes the exit it is handling first).
    pub fn request_pause(&self) {
        self.set_target(Target::Pause);
    }

    /// Wait until the vCPU is paused or gone. Returns false if it is gone.
    pub fn wait_paused(&self) -> bool {
        let mut state = self.control.lock();
        while !state.paused && !state.exited {
            state = self
                .control
                .changed
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
        !state.exited
    }

    pub fn resume(&self) {
        self.set_target(Target::Run);
    }

    /// Run `job` on the (paused) vCPU's thread and wait for it. Returns None if the vCPU is gone.
    pub fn run_job<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut VcpuFd) -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut state = self.control.lock();
            if state.exited {
                return None;
            }
            state.jobs.push_back(Box::new(move |vcpu| {
                let _ = tx.send(job(vcpu));
            }));
        }
        self.control.changed.notify_all();
        rx.recv().ok()
    }

    /// Ask the thread to end; `join` waits for it.
    pub fn request_exit(&self) {
        self.set_target(Target::Exit);
    }

    pub fn join(&mut self) {
        self.join_until(std::time::Instant::now() + std::time::Duration::from_secs(3600));
    }

    /// Wait for the thread to end, kicking it out of KVM_RUN, but not past `deadline`: a vCPU
    /// stuck in the kernel (e.g. on guest memory nobody can serve) is left behind.
    pub fn join_until(&mut self, deadline: std::time::Instant) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        loop {
            let state = self.control.lock();
            if state.exited {
                break;
            }
            if std::time::Instant::now() >= deadline {
                return;
            }
            let _ = thread.kill(kick_signal());
            let _ = self
                .control
                .changed
                .wait_timeout(state, std::time::Duration::from_millis(5));
        }
        let _ = thread.join();
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.request_exit();
        self.join();
    }
}

/// Wait while paused (running queued jobs). Returns false when the thread should exit.
/// `entered`: the vCPU has been in KVM_RUN on this thread, so an exit may be pending.
fn obey_control(vcpu: &mut VcpuFd, control: &VcpuControl, entered: bool) -> bool {
    let mut state = control.lock();
    loop {
        match state.target {
            Target::Run => {
                if state.paused {
                    state.paused = false;
                    control.changed.notify_all();
                }
                return true;
            }
            Target::Exit => return false,
            Target::Pause => {
                if !state.paused {
                    drop(state);
                    // A vCPU that never ran here has nothing pending (a restored one starts
                    // paused: a fork's held clone). Entering KVM_RUN only to leave costs a
                    // vCPU load on this nested host (its MSRs read through the host).
                    if entered {
                        complete_pending_io(vcpu);
                    }
                    state = control.lock();
                    state.paused = true;
                    control.changed.notify_all();
                    continue;
                }
                if let Some(job) = state.jobs.pop_front() {
                    drop(state);
                    job(vcpu);
                    state = control.lock();
                    continue;
                }
                state = control
                    .changed
                    .wait(state)
                    .unwrap_or_else(|p| p.into_inner());
            }
        }
    }
}

/// KVM finishes an I/O exit (an `in` gets its data, a string `out` moves on) only when
/// KVM_RUN is entered again, and that progress is not in any state a snapshot can read. Enter
/// it with `immediate_exit` set: KVM completes the exit and returns at once, running no guest
/// instruction. Done before every pause, so a paused vCPU's state is complete.
fn complete_pending_io(vcpu: &mut VcpuFd) {
    vcpu.set_kvm_immediate_exit(1);
    // EINTR is the expected answer; a real exit here would need nothing completed either.
    let _ = vcpu.run();
    vcpu.set_kvm_immediate_exit(0);
}

fn vcpu_loop(
    index: u8,
    mut vcpu: VcpuFd,
    context: &VcpuContext,
    control: &VcpuControl,
    filtered: Result<(), mayfly_jail::seccomp::SeccompError>,
) {
    let run_ptr: *mut kvm_run = vcpu.get_kvm_run();
    KVM_RUN.with(|r| r.set(run_ptr));
    let mut breakpoints = if index == 0 {
        context.trace.clone()
    } else {
        None
    };
    match &breakpoints {
        Some(bps) if bps.remaining() => arm_breakpoints(&vcpu, bps),
        _ => breakpoints = None,
    }
    let mut first_run = true;
    let mut entered = false;

    let outcome = match filtered {
        Err(e) => Some(fatal(&vcpu, index, e.to_string())),
        Ok(()) => loop {
            if !obey_control(&mut vcpu, control, entered) {
                break None;
            }
            if first_run && index == 0 {
                mayfly_sys::trace::event("first_kvm_run");
                first_run = false;
            }
            control.activity.enter();
            entered = true;
            let result = vcpu.run();
            control.activity.exit(match &result {
                // SAFETY: reading a plain integer field of this thread's kvm_run mapping.
                Ok(_) => unsafe { (*run_ptr).exit_reason },
                Err(_) => u32::MAX,
            });
            match result {
                Ok(VcpuExit::IoOut(trace::TRACE_PORT, _)) if context.trace.is_some() => {
                    mayfly_sys::trace::event("first_instruction");
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    context.pio.write(u64::from(port), data);
                }
                Ok(VcpuExit::IoIn(port, data)) => {
                    context.pio.read(u64::from(port), data);
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    context.mmio.read(addr, data);
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    context.mmio.write(addr, data);
                }
                Ok(VcpuExit::Shutdown) => {
                    // A triple fault: how a PC resets when nothing else did (Linux's last resort
                    // with reboot=t), or a guest crashing hard. Say which state led there.
                    eprintln!(
                        "mayfly: vCPU {index}: triple fault, the guest resets\n{}",
                        dump_registers(&vcpu)
                    );
                    break Some(VmEvent::Power(PowerRequest::Reset));
                }
                Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
                    KVM_SYSTEM_EVENT_SHUTDOWN => {
                        break Some(VmEvent::Power(PowerRequest::PowerOff))
                    }
                    KVM_SYSTEM_EVENT_RESET => break Some(VmEvent::Power(PowerRequest::Reset)),
                    KVM_SYSTEM_EVENT_CRASH => {
                        break Some(fatal(&vcpu, index, "the guest reported a crash".into()))
                    }
                    other => {
                        break Some(fatal(&vcpu, index, format!("unknown system event {other}")))
                    }
                },
                Ok(VcpuExit::Debug(debug)) => {
                    if let Some(bps) = &mut breakpoints {
                        bps.hit(debug.dr6);
                        if bps.remaining() {
                            arm_breakpoints(&vcpu, bps);
                        } else {
                            disarm_breakpoints(&vcpu);
                            breakpoints = None;
                        }
                    }
                }
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    break Some(fatal(
                        &vcpu,
                        index,
                        format!(
                    "KVM could not enter the guest (hardware reason {reason:#x}, host cpu {cpu})"
                ),
                    ))
                }
                Ok(VcpuExit::InternalError) => {
                    let suberror = vcpu.get_kvm_run();
                    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so the union holds
                    // `internal`.
                    let code = unsafe { suberror.__bindgen_anon_1.internal.suberror };
                    break Some(fatal(
                        &vcpu,
                        index,
                        format!("KVM internal error, suberror {code}"),
                    ));
                }
                Ok(other) => {
                    let what = format!("unexpected exit {other:?}");
                    break Some(fatal(&vcpu, index, what));
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    vcpu.set_kvm_immediate_exit(0);
                }
                Err(e) => break Some(fatal(&vcpu, index, format!("KVM_RUN failed: {e}"))),
            }
        },
    };

    KVM_RUN.with(|r| r.set(std::ptr::null_mut()));
    if let Some(event) = outcome {
        // The receiver is gone only when the VM is being torn down already.
        let _ = context.events.send(event);
        // Stay until told to exit, so the controller can still read state from this vCPU.
        {
            let mut state = control.lock();
            state.finished = true;
            if state.target == Target::Run {
                state.target = Target::Pause;
            }
        }
        while obey_control(&mut vcpu, control, true) {}
    }
    let mut state = control.lock();
    state.exited = true;
    state.paused = false;
    // Jobs queued after the end get their channels dropped: callers see None.
    state.jobs.clear();
    drop(state);
    control.changed.notify_all();
}

fn fatal(vcpu: &VcpuFd, index: u8, what: String) -> VmEvent {
    VmEvent::VcpuFailed {
        index,
        reason: what,
        registers: dump_registers(vcpu),
    }
}

/// The vCPU's registers as text, for a fatal error report.
pub fn dump_registers(vcpu: &VcpuFd) -> String {
    let mut out = String::new();
    match vcpu.get_regs() {
        Ok(r) => {
            let _ = writeln!(
                out,
                "  rip {:016x}  rsp {:016x}  rflags {:08x}",
                r.rip, r.rsp, r.rflags
            );
            let _ = writeln!(
                out,
                "  rax {:016x}  rbx {:016x}  rcx {:016x}  rdx {:016x}",
                r.rax, r.rbx, r.rcx, r.rdx
            );
            let _ = writeln!(
                out,
                "  rsi {:016x}  rdi {:016x}  rbp {:016x}",
                r.rsi, r.rdi, r.rbp
            );
            let _ = writeln!(
                out,
                "  r8  {:016x}  r9  {:016x}  r10 {:016x}  r11 {:016x}",
                r.r8, r.r9, r.r10, r.r11
            );
            let _ = writeln!(
                out,
                "  r12 {:016x}  r13 {:016x}  r14 {:016x}  r15 {:016x}",
                r.r12, r.r13, r.r14, r.r15
            );
        }
        Err(e) => {
            let _ = writeln!(out, "  (general registers unavailable: {e})");
        }
    }
    match vcpu.get_sregs() {
        Ok(s) => {
            let _ = writeln!(
                out,
                "  cr0 {:016x}  cr2 {:016x}  cr3 {:016x}  cr4 {:016x}  efer {:x}",
                s.cr0, s.cr2, s.cr3, s.cr4, s.efer
            );
            let _ = writeln!(
                out,
                "  cs {:04x} base {:x} l={} db={}  ss {:04x}  gdt {:x}/{:x}  idt {:x}/{:x}",
                s.cs.selector,
                s.cs.base,
                s.cs.l,
                s.cs.db,
                s.ss.selector,
                s.gdt.base,
                s.gdt.limit,
                s.idt.base,
                s.idt.limit
            );
        }
        Err(e) => {
            let _ = writeln!(out, "  (segment registers unavailable: {e})");
        }
    }
    out
}

fn arm_breakpoints(vcpu: &VcpuFd, bps: &trace::Breakpoints) {
    let mut debug = kvm_guest_debug {
        control: KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_HW_BP,
        ..Default::default()
    };
    let mut dr7 = 0u64;
    for (i, addr) in bps.armed() {
        debug.arch.debugreg[i] = addr;
        dr7 |= 1 << (2 * i); // local enable, execute, 1 byte
    }
    debug.arch.debugreg[7] = dr7;
    if let Err(e) = vcpu.set_guest_debug(&debug) {
        eprintln!("mayfly: boot trace: cannot set breakpoints ({e}); phases will be missing");
    }
}

fn disarm_breakpoints(vcpu: &VcpuFd) {
    let _ = vcpu.set_guest_debug(&kvm_guest_debug::default());
}
