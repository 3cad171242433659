//! `mayfly-rig`: run a command on a real /dev/kvm inside an emulated machine (the test rig), or say
//! whether tests need the rig on this machine.
// Lossy `as` casts are refused here (tests aside): every conversion that can lose bits says
// why it cannot.
#![cfg_attr(
    not(test),
    warn(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )
)]

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use mayfly_tests::rig::{self, RigOptions};

#[derive(Parser)]
#[command(
    name = "mayfly-rig",
    version,
    about = "Run commands on a real /dev/kvm inside an emulated machine (QEMU TCG + AMD SVM)",
    long_about = "Run commands on a real /dev/kvm inside an emulated machine.\n\n\
        The rig boots an \"L1\" Linux under QEMU's software emulator with an AMD SVM CPU; its KVM \
        gives a real /dev/kvm. The host's root is shared read-only: the command runs the host's own \
        binaries in the current directory. /tmp and /run are fresh inside; share directories the \
        command must write with --rw."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a command inside L1 and exit with its exit status.
    ///
    /// Exit codes: the command's own; 124 when it timed out; 130 when QEMU was stopped with
    /// Ctrl-A x; 125 when the rig failed (the message names the L1 logs). When stdin and stdout
    /// are a terminal (or with --interactive) the terminal is passed through: type into the
    /// command; Ctrl-A x stops QEMU, Ctrl-A c toggles QEMU's monitor.
    Run(RunArgs),
    /// Print "host" if this machine's /dev/kvm runs a Linux guest to user space, "rig" otherwise
    /// (MAYFLY_TEST_KVM=host|rig forces it).
    Where,
    /// Build (or find cached) the L1 kernel and initramfs and print their paths.
    Artifacts,
    /// Print the path of the QEMU the rig runs: $MAYFLY_RIG_QEMU, else the patched build of
    /// tests/rig/qemu/build.sh (fails when it is not built).
    Qemu,
}

#[derive(Args)]
struct RunArgs {
    /// A host directory the command may write (same path inside L1); repeatable.
    #[arg(long = "rw", value_name = "DIR")]
    rw: Vec<PathBuf>,
    /// An environment variable for the command; repeatable. PATH, HOME, TERM, USER, LANG, RUST_*,
    /// CARGO_* and MAYFLY_* are passed through already.
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = parse_env)]
    env: Vec<(OsString, OsString)>,
    /// L1's memory.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    mem_mib: u32,
    /// L1's vCPUs.
    #[arg(long, value_name = "N", default_value_t = 2)]
    cpus: u32,
    /// Stop after this many seconds (boot included) and exit 124.
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// QEMU -cpu model; it must offer SVM (EPYC, max, qemu64,+svm,+npt).
    #[arg(long, value_name = "MODEL", default_value = rig::DEFAULT_CPU_MODEL)]
    cpu: String,
    /// Pass the terminal through even when stdin is not a terminal.
    #[arg(long, short = 'i', conflicts_with = "batch")]
    interactive: bool,
    /// Never pass the terminal through: QEMU reads no input, output is a plain byte stream.
    #[arg(long)]
    batch: bool,
    /// Keep the control directory (run.sh and the L1 logs) after a successful run too.
    #[arg(long)]
    keep: bool,
    /// L1 kernel to boot instead of the one guest-kernel/build.sh rig-l1 builds.
    #[arg(long, value_name = "BZIMAGE")]
    kernel: Option<PathBuf>,
    /// L1 initramfs instead of the one rootfs/build.sh rig-l1 builds.
    #[arg(long, value_name = "CPIO")]
    initrd: Option<PathBuf>,
    /// L1 kernel log level (its log goes to l1-kernel.log in the control directory, never to the
    /// output).
    #[arg(long, value_name = "N", default_value_t = RigOptions::default().kernel_loglevel)]
    loglevel: u8,
    /// Print the wall time of the whole run (boot, command, power off) on stderr.
    #[arg(long)]
    time: bool,
    /// The command and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    command: Vec<OsString>,
}

fn parse_env(s: &str) -> Result<(OsString, OsString), String> {
    rig::parse_env_setting(s.as_ref()).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Where => {
            println!("{}", rig::kvm_location());
            ExitCode::SUCCESS
        }
        Cmd::Artifacts => match rig::ensure_artifacts() {
            Ok(a) => {
                println!("kernel {}", a.kernel.display());
                println!("initrd {}", a.initrd.display());
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Cmd::Qemu => match rig::qemu_binary() {
            Ok(path) => {
                println!("{}", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Cmd::Run(args) => run(args),
    }
}

fn run(args: RunArgs) -> ExitCode {
    let timeout = match args.timeout {
        None => None,
        Some(secs) => match Duration::try_from_secs_f64(secs) {
            Ok(t) if !t.is_zero() => Some(t),
            _ => {
                eprintln!("mayfly-rig: --timeout {secs}: give a number of seconds above 0");
                return ExitCode::from(2);
            }
        },
    };
    let interactive = !args.batch
        && (args.interactive
            || (std::io::stdin().is_terminal() && std::io::stdout().is_terminal()));
    let opts = RigOptions {
        rw: args.rw,
        mem_mib: args.mem_mib,
        cpus: args.cpus,
        timeout,
        cpu_model: args.cpu,
        env: args.env,
        interactive,
        stream: true,
        keep_control_dir: args.keep,
        kernel: args.kernel,
        initrd: args.initrd,
        kernel_loglevel: args.loglevel,
        ..RigOptions::default()
    };
    match rig::run(&opts, &args.command) {
        Ok(out) => {
            if args.time {
                eprintln!(
                    "mayfly-rig: {:.2} s (boot L1, run, power off)",
                    out.elapsed.as_secs_f64()
                );
            }
            if let Some(dir) = &out.control_dir {
                eprintln!("mayfly-rig: control directory kept: {}", dir.display());
            }
            ExitCode::from(u8::try_from(out.status).unwrap_or(1))
        }
        Err(e) => fail(&e),
    }
}

fn fail(e: &rig::RigError) -> ExitCode {
    eprintln!("mayfly-rig: {e}");
    ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
}
