//! The `mayfly` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc::Sender;

use clap::{Args, Parser, Subcommand};
use mayfly_vmm::config::{self, RunConfig, DEFAULT_CMDLINE, DEFAULT_MEM_MIB};
use mayfly_vmm::console::{Console, RawTerminal};
use mayfly_vmm::kernel::Image;
use mayfly_vmm::vm::{VmEvent, VmExit};
use mayfly_vmm::{boot, default_guest, trace, Error};

#[derive(Parser)]
#[command(
    name = "mayfly",
    version,
    about = "A KVM virtual machine monitor for microVMs that boot, snapshot, restore and fork fast.",
    after_help = "Exit status of `mayfly run`: 0 the guest powered off; 133 the guest rebooted \
                  (mayfly does not restart it); 128+N stopped by signal N; 1 an error (the \
                  message says what to do); 2 bad command-line usage."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest and attach its serial console to this terminal (or a file).
    ///
    /// With no --kernel/--initrd it boots the guest built into mayfly: a Linux 6.1 microVM
    /// kernel and a busybox initramfs that prints "mayfly-guest: ready" and opens a shell.
    /// Type `poweroff` in the guest to end it.
    Run(RunArgs),
}

#[derive(Args)]
struct RunArgs {
    /// Guest kernel: an x86-64 vmlinux (booted through its PVH entry if it has one) or a bzImage.
    #[arg(long, value_name = "PATH")]
    kernel: Option<PathBuf>,
    /// Initial ramdisk (cpio, optionally compressed as the kernel supports). Without --kernel
    /// or --initrd, the built-in initramfs.
    #[arg(long, value_name = "PATH")]
    initrd: Option<PathBuf>,
    /// Kernel command line (replaces the default).
    #[arg(long, value_name = "STR", default_value = DEFAULT_CMDLINE)]
    cmdline: String,
    /// Guest memory in MiB.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MEM_MIB)]
    mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, value_name = "N", default_value_t = 1)]
    vcpus: u32,
    /// Serial console: `stdio` (output to stdout, input from stdin) or a file to write it to.
    #[arg(long, value_name = "stdio|FILE", default_value = "stdio")]
    console: Console,
    /// CPU template (JSON list of CPUID masks) instead of the built-in default.
    #[arg(long, value_name = "FILE")]
    cpu_template: Option<PathBuf>,
    /// Print boot phase timestamps on stderr (for benchmarks).
    #[arg(long, hide = true)]
    boot_trace: bool,
}

impl RunArgs {
    /// Check every argument before any VM exists, so bad input costs nothing.
    fn into_config(self) -> Result<RunConfig, Error> {
        let vcpus = config::check_vcpus(self.vcpus)?;
        let host_mib = config::host_mem_mib().unwrap_or(u64::MAX);
        let mem_mib = config::check_mem(self.mem_mib, host_mib)?;
        let builtin = self.kernel.is_none() && self.initrd.is_none();
        let kernel = match self.kernel {
            Some(path) => Image::File(path),
            None => Image::Embedded {
                name: "kernel",
                bytes: default_guest::DEFAULT_KERNEL.ok_or(Error::NoDefaultGuest("kernel"))?,
            },
        };
        kernel.check_kernel()?;
        let initrd = match self.initrd {
            Some(path) => Some(Image::File(path)),
            None if builtin => Some(Image::Embedded {
                name: "initramfs",
                bytes: default_guest::DEFAULT_INITRAMFS
                    .ok_or(Error::NoDefaultGuest("initramfs"))?,
            }),
            None => None,
        };
        if let Some(initrd) = &initrd {
            initrd.check_readable("the initrd")?;
        }
        Ok(RunConfig {
            kernel,
            initrd,
            cmdline: self.cmdline,
            mem_mib,
            vcpus,
            console: self.console,
            cpu_template: boot::cpu_template(self.cpu_template.as_deref())?,
            boot_trace: self.boot_trace,
        })
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run(args),
    }
}

fn fail(err: impl std::fmt::Display) -> ExitCode {
    eprintln!("mayfly: {err}");
    ExitCode::FAILURE
}

fn run(args: RunArgs) -> ExitCode {
    if args.boot_trace {
        trace::enable();
        trace::event("main");
    }
    let config = match args.into_config() {
        Ok(config) => config,
        Err(err) => return fail(err),
    };
    // Block the stop signals before any thread starts, so only the signal thread takes them.
    let signals = match StopSignals::block() {
        Ok(signals) => signals,
        Err(err) => return fail(Error::Signals(err)),
    };
    let raw_terminal = (config.console == Console::Stdio)
        .then(RawTerminal::stdin)
        .flatten();
    let vm = match boot::boot(&config) {
        Ok(vm) => vm,
        Err(err) => {
            drop(raw_terminal);
            return fail(err);
        }
    };
    trace::event("vcpus_started");
    if let Err(err) = signals.forward_to(vm.event_sender.clone()) {
        drop(raw_terminal);
        return fail(Error::Signals(err));
    }
    let exit = vm.wait_for_exit();
    drop(raw_terminal);
    match &exit {
        VmExit::PowerOff => {}
        VmExit::Reset => eprintln!(
            "mayfly: the guest rebooted; mayfly does not restart it (exit status {})",
            VmExit::RESET_STATUS
        ),
        VmExit::Signal(sig) => eprintln!("mayfly: stopped by signal {sig}"),
        VmExit::Crashed {
            index,
            reason,
            registers,
        } => eprintln!("mayfly: vCPU {index} stopped the VM: {reason}\n{registers}"),
    }
    ExitCode::from(exit.status())
}

/// SIGTERM, SIGINT and SIGHUP end the VM cleanly: blocked everywhere, taken by one thread.
struct StopSignals {
    set: libc::sigset_t,
}

impl StopSignals {
    fn block() -> std::io::Result<Self> {
        // SAFETY: sigset_t is plain data, initialised by sigemptyset before use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t; the signal numbers are valid.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGHUP);
        }
        // SAFETY: blocks the signals in `set` for this thread (and threads it starts).
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        Ok(Self { set })
    }

    fn forward_to(self, events: Sender<VmEvent>) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name("signals".into())
            .stack_size(mayfly_vmm::HELPER_THREAD_STACK)
            .spawn(move || loop {
                let mut sig = 0;
                // SAFETY: waits for a signal of the blocked set; `sig` receives its number.
                let waited = unsafe { libc::sigwait(&self.set, &mut sig) };
                if waited == 0 && events.send(VmEvent::Signal(sig)).is_err() {
                    return;
                }
            })?;
        Ok(())
    }
}
