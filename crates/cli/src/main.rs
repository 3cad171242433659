//! The `mayfly` command line.
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

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::mpsc::Sender;

use clap::{Args, Parser, Subcommand};
use mayfly_jail::seccomp::ThreadKind;
use mayfly_sys::terminal::RawTerminal;
use mayfly_sys::trace;
use mayfly_vmm::config::{self, RunConfig, DEFAULT_CMDLINE, DEFAULT_MEM_MIB};
use mayfly_vmm::controller::Controller;
use mayfly_vmm::devices::console::Console;
use mayfly_vmm::devices::disks::DiskSpec;
use mayfly_vmm::devices::manager::{
    self as device_manager, DevicesConfig, RestoreTargets, VsockConfig,
};
use mayfly_vmm::event::{VmEvent, VmExit};
use mayfly_vmm::kernel::Image;
use mayfly_vmm::persist::restore::{self, Instance, MemoryMode, RestoreConfig, SnapshotSource};
use mayfly_vmm::persist::zygote::{self, Reporter};
use mayfly_vmm::{boot, default_guest, identity};

use crate::error::Error;

mod error;
mod guest_commands;

const ABOUT: &str =
    "A KVM virtual machine monitor for microVMs that boot, snapshot, restore and fork fast.";
const AFTER_HELP: &str = "Exit status of `mayfly run` and `mayfly restore`: 0 the guest powered \
                          off (or the VM was shut down through its socket); 133 the guest \
                          rebooted (mayfly does not restart it); 128+N stopped by signal N; 1 an \
                          error (the message says what to do); 2 bad command-line usage.";
const RESTORE_ABOUT: &str = "Restore a snapshot into a new VM, in this process";
const RESTORE_LONG_ABOUT: &str = "Restore a snapshot into a new VM, in this process.\n\n\
    The guest carries on where it was when the snapshot was taken: its processes, its files in \
    RAM, its console. The wall clock moves on by the time the snapshot spent on disk.";

#[derive(Parser)]
#[command(
    name = "mayfly",
    version,
    about = ABOUT,
    after_help = AFTER_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// `mayfly restore`, parsed alone (see [`parse`]).
#[derive(Parser)]
#[command(
    name = "mayfly",
    version,
    about = ABOUT,
    after_help = AFTER_HELP
)]
struct RestoreCli {
    #[command(subcommand)]
    command: RestoreCommand,
}

#[derive(Subcommand)]
enum RestoreCommand {
    #[command(about = RESTORE_ABOUT, long_about = RESTORE_LONG_ABOUT)]
    Restore(RestoreArgs),
}

/// The command line. clap builds the parser of every subcommand for any parse: 0.2-0.3 ms of
/// a restore's start on this host, where a restore's launch is the latency its user waits
/// for; so `mayfly restore` is parsed by a parser of that subcommand alone, which answers
/// exactly as the whole one does (its help, its errors: see the tests).
fn parse() -> Cli {
    if std::env::args_os().nth(1).as_deref() == Some(std::ffi::OsStr::new("restore")) {
        let RestoreCommand::Restore(args) = RestoreCli::parse().command;
        return Cli {
            command: Command::Restore(args),
        };
    }
    Cli::parse()
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest and attach its serial console to this terminal (or a file).
    ///
    /// With no --kernel/--initrd it boots the guest built into mayfly: a Linux 6.1 microVM
    /// kernel and a busybox initramfs that prints "mayfly-guest: ready" and opens a shell.
    /// Type `poweroff` in the guest to end it.
    Run(RunArgs),
    #[command(about = RESTORE_ABOUT, long_about = RESTORE_LONG_ABOUT)]
    Restore(RestoreArgs),
    /// Pause a running VM (its vCPUs stop; memory and devices stay).
    Pause(SockArgs),
    /// Resume a paused VM.
    Resume(SockArgs),
    /// Show a VM's state and configuration (JSON).
    Status(SockArgs),
    /// Snapshot a VM into a directory (pausing it for the time it takes, unless it was paused).
    Snapshot(SnapshotArgs),
    /// Stop a VM (the VMM exits with status 0).
    Shutdown(SockArgs),
    /// Fork a running VM into N live clones that share its memory until they write.
    ///
    /// Each clone is its own mayfly process with its own control socket, console log and
    /// console input FIFO, next to the parent's socket: <name>.sock, <name>.log, <name>.in.
    /// The parent keeps running (or stays paused with --keep-paused).
    Fork(ForkArgs),
    /// Run a command in the VM through its guest agent; exits with the command's status.
    ///
    /// Output streams as it is written (stdout to stdout, stderr to stderr); stdin is sent
    /// to the command unless it is a terminal. Exit status: the command's; 128+N if a signal N
    /// killed it; 124 if --timeout killed it; 127 if it does not exist; 255 if mayfly could
    /// not run it (the message says why).
    ///
    /// Example: mayfly exec --sock /tmp/vm.sock -- uname -a
    Exec(guest_commands::ExecArgs),
    /// Copy a file into or out of the VM: one side is vm:/path, the other a local path or -.
    ///
    /// Example: mayfly cp --sock /tmp/vm.sock ./data.csv vm:/root/data.csv
    Cp(guest_commands::CpArgs),
    /// Show a VM's network (policy, addresses, counters), change its egress policy, or
    /// expose a guest port on the host.
    ///
    /// Examples: mayfly net --sock /tmp/vm.sock --policy allow=192.0.2.0/24:443
    ///           mayfly net --sock /tmp/vm.sock --expose 8080      (prints the host address)
    Net(NetArgs),
    /// Run the sandbox manager: one control socket for many named VMs ("sandboxes"), each a
    /// VMM process of its own, that sleep to disk when idle and wake on the next request.
    ///
    /// Example: mayfly serve --state-dir /var/lib/mayfly --sock /run/mayfly.sock, then
    /// curl --unix-socket /run/mayfly.sock -H "Authorization: Bearer $(cat
    /// /var/lib/mayfly/admin.token)" -d '{"name": "a"}' http://x/sandboxes
    Serve(ServeArgs),
    /// Started by a fork: makes its clones (see the fork's code).
    #[command(hide = true)]
    Zygote(ZygoteArgs),
}

#[derive(Args)]
struct ZygoteArgs {
    /// The fork's state.
    #[arg(long, value_name = "FD")]
    state_fd: i32,
    /// The fork's memory base.
    #[arg(long, value_name = "FD")]
    memory_fd: i32,
    /// The fork's socket.
    #[arg(long, value_name = "FD")]
    socket_fd: i32,
}

#[derive(Args)]
struct ForkArgs {
    #[command(flatten)]
    sock: SockArgs,
    /// How many clones.
    #[arg(long, value_name = "N")]
    count: u32,
    /// Name clones <PREFIX><n> (default: <parent's name>-).
    #[arg(long, value_name = "PREFIX")]
    name_prefix: Option<String>,
    /// Leave the parent paused after the fork.
    #[arg(long)]
    keep_paused: bool,
    /// Check host memory only for what starting the clones costs (their VMMs), not for the
    /// guest memory they will write: for many clones that stay idle.
    #[arg(long)]
    overcommit: bool,
}

#[derive(Args)]
struct SockArgs {
    /// The VM's control socket (its --api-sock).
    #[arg(long, value_name = "PATH")]
    sock: PathBuf,
}

#[derive(Args)]
struct SnapshotArgs {
    #[command(flatten)]
    sock: SockArgs,
    /// Directory to write the snapshot to (created, or replaced if it holds an older snapshot).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Leave the VM paused afterwards.
    #[arg(long)]
    keep_paused: bool,
    /// Write only the pages written since the VM was restored, over the snapshot it was
    /// restored from (hard-linked into the new one's memory-layers/): for a VM restored
    /// copy-on-write from a snapshot directory.
    #[arg(long)]
    diff: bool,
}

#[derive(Args)]
struct RestoreArgs {
    /// The snapshot directory.
    #[arg(value_name = "DIR", required_unless_present = "standby")]
    dir: Option<PathBuf>,
    /// Start now and stand by, without a snapshot: KVM opened and probed and a VM made ahead,
    /// the control socket (--api-sock, required) answering. `PUT /vm/restore {"snapshot":
    /// "/path/to/snapshot"}` on it restores that snapshot with this command's other options
    /// and answers once the VM runs; the socket is then the VM's. For programs that keep a
    /// VMM ready for the next VM to wake: what a restore spends before its snapshot matters
    /// (starting the process, asking KVM) is done by then. Not with --jail yet.
    #[arg(long, requires = "api_sock", conflicts_with_all = ["dir", "jail"])]
    standby: bool,
    /// The VM's name (default: the snapshot's). Its guest reads it with `mayfly-identity`.
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// A file or FIFO whose bytes are typed into the guest's console.
    #[arg(long, value_name = "PATH")]
    console_input: Option<PathBuf>,
    /// How guest memory comes back: `cow` maps the memory file copy-on-write (instant; restores
    /// of one snapshot share memory); `lazy` loads pages as the guest touches them
    /// (userfaultfd), prefetching the pages the snapshot recorded as used first; `eager` reads
    /// everything before the guest runs.
    #[arg(long, value_name = "cow|lazy|eager", default_value = "cow")]
    memory: MemoryMode,
    /// With --memory lazy: do not prefetch the recorded working set.
    #[arg(long)]
    no_prefetch: bool,
    /// Serve the control socket (HTTP/1.1 + JSON) at this path.
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// Serial console: `stdio` or a file to write it to.
    #[arg(long, value_name = "stdio|FILE", default_value = "stdio")]
    console: Console,
    /// Restore with the vCPUs paused (resume with `mayfly resume`).
    #[arg(long)]
    paused: bool,
    /// Print restore phase timestamps on stderr (for benchmarks).
    #[arg(long, hide = true)]
    trace: bool,
    /// The host side of the VM's vsock device (see `mayfly run --vsock`). Default:
    /// `<api-sock>.vsock` when there is a control socket.
    #[arg(long, value_name = "PATH")]
    vsock: Option<PathBuf>,
    /// Where the restored VM's writable disks put their own layers (see `mayfly run
    /// --disk-dir`). Default: `<api-sock>.disks` when there is a control socket.
    #[arg(long, value_name = "DIR")]
    disk_dir: Option<PathBuf>,
    /// Refuse a snapshot that names disk layers by full path outside DIR (for a manager that
    /// restores, as root, snapshots its jailed VMMs wrote; `mayfly serve` passes the
    /// sandbox's own directory).
    #[arg(long, value_name = "DIR")]
    disk_layers_within: Option<PathBuf>,
    /// The restored NIC's egress policy instead of the snapshot's (see `mayfly run --net`;
    /// `none` keeps the NIC but lets nothing out). Only for a snapshot of a VM with a NIC.
    #[arg(long, value_name = "none|open|allow=...")]
    net: Option<String>,
    #[command(flatten)]
    net_place: NetPlaceArgs,
    #[command(flatten)]
    jail: JailArgs,
}

#[derive(Args)]
struct ServeArgs {
    /// Where the manager keeps its sandboxes, their snapshots, its admin token and its event
    /// log (made if missing). A manager started again on it finds everything.
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// The manager's control socket (HTTP/1.1 + JSON).
    #[arg(long, value_name = "PATH")]
    sock: PathBuf,
    /// Run new sandboxes' VMMs as root, unjailed (needed for sandboxes with a network). By
    /// default each runs jailed (see `mayfly run --jail`), sharing only its own directory.
    #[arg(long)]
    no_jail: bool,
    /// Jailed sandboxes run as uids and gids from this one on, one each (pick a range no
    /// user or service of the host has).
    #[arg(
        long,
        value_name = "UID",
        default_value_t = 1_000_000,
        conflicts_with = "no_jail"
    )]
    jail_uid_base: u32,
    /// At most this much guest memory (MiB) in sandboxes whose VMMs run: a create, wake or
    /// fork past it is refused (429) until a sandbox sleeps or goes. Default: no budget.
    #[arg(long, value_name = "MIB")]
    mem_budget_mib: Option<u64>,
    /// What to do with a create, wake or fork past the memory budget: refuse it (429), or
    /// put the longest-idle running sandboxes to sleep on disk until it fits.
    #[arg(
        long,
        value_enum,
        value_name = "POLICY",
        default_value = "refuse",
        requires = "mem_budget_mib"
    )]
    when_over_budget: OverBudgetPolicy,
    /// At most this much disk (MiB) for what sandboxes keep (their snapshots, disk layers
    /// and bases, each file counted once): a suspend that could take more is refused (429),
    /// and an idle sandbox then stays awake. Default: no budget.
    #[arg(long, value_name = "MIB")]
    disk_budget_mib: Option<u64>,
    /// Delete a sandbox that has been asleep this long (since its suspend or its last
    /// request, whichever is later), snapshot and all: e.g. 30d, 12h, 90s. Default: never.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_s)]
    expire_after: Option<u64>,
    /// Collect a template that no create has used for this long (sandboxes made from it keep
    /// working: each has its own links to the files). `never` keeps them.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_ttl_s)]
    template_ttl: Ttl,
}

/// `--template-ttl`: seconds, or none for `never`.
#[derive(Clone, Copy, Debug)]
struct Ttl(Option<u64>);

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum OverBudgetPolicy {
    Refuse,
    SuspendIdle,
}

/// A duration (humantime's: 90s, 15m, 12h, 30d...) in whole seconds, at least one.
fn parse_duration_s(text: &str) -> Result<u64, String> {
    let d = humantime::parse_duration(text)
        .map_err(|e| format!("{text}: {e} (e.g. 90s, 15m, 12h, 30d)"))?;
    match d.as_secs() {
        0 => Err(format!("{text}: give at least 1s")),
        s => Ok(s),
    }
}

/// A duration as [`parse_duration_s`], or `never`.
fn parse_ttl_s(text: &str) -> Result<Ttl, String> {
    if text == "never" {
        return Ok(Ttl(None));
    }
    parse_duration_s(text).map(|s| Ttl(Some(s)))
}

#[derive(Args)]
struct NetArgs {
    #[command(flatten)]
    sock: SockArgs,
    /// The egress policy from now on: none, open or allow=CIDR[:PORT],... Tightening it cuts
    /// open connections the new policy forbids (at their next packet).
    #[arg(long, value_name = "none|open|allow=...", conflicts_with = "expose")]
    policy: Option<String>,
    /// Make this guest port reachable on the host (for as long as the VM runs).
    #[arg(long, value_name = "PORT")]
    expose: Option<u16>,
    /// With --expose: where to listen: tcp:ADDR:PORT (port 0: a free one) or unix:PATH.
    #[arg(
        long,
        value_name = "tcp:ADDR:PORT|unix:PATH",
        requires = "expose",
        default_value = "tcp:127.0.0.1:0"
    )]
    on: String,
}

/// Where a VM's network is made (with `--net` other than none).
#[derive(Args)]
struct NetPlaceArgs {
    /// Where mayfly keeps its network slot locks and pooled namespaces.
    #[arg(long, value_name = "DIR", default_value = "/run/mayfly/net")]
    net_dir: PathBuf,
    /// The network namespace VMs' traffic goes out to (a path like /run/netns/NAME or
    /// /proc/PID/ns/net). Default: mayfly's own.
    #[arg(long, value_name = "PATH")]
    net_uplink: Option<PathBuf>,
    /// The DNS resolver the guest is told to use; an allowlist lets DNS reach it, and only it.
    #[arg(long, value_name = "IPV4")]
    net_dns: Option<std::net::Ipv4Addr>,
}

impl NetPlaceArgs {
    fn settings(&self) -> mayfly_vmm::devices::net::NetSettings {
        mayfly_vmm::devices::net::NetSettings {
            state_dir: self.net_dir.clone(),
            uplink: self.net_uplink.clone(),
            dns: self.net_dns,
        }
    }
}

/// Whether and how to jail the VMM (see vmm/src/jail.rs).
#[derive(Args)]
struct JailArgs {
    /// Run the VMM jailed: in mount, PID, network, IPC and UTS namespaces and a cgroup v2 of
    /// its own, and, before the guest runs, shut into an empty root holding only what the VM
    /// still opens (its disk directory, its vsock socket's directory, --jail-share
    /// directories), as --jail-uid with no capabilities. Needs root. A jailed VM has no NIC
    /// and cannot be forked yet.
    #[arg(long)]
    jail: bool,
    /// Where the jail's directory is made (removed when the VMM ends).
    #[arg(long, value_name = "DIR", default_value = mayfly_jail::jail::DEFAULT_DIR, requires = "jail")]
    jail_dir: PathBuf,
    /// The uid the jailed VMM runs as.
    #[arg(long, value_name = "UID", default_value_t = mayfly_jail::jail::DEFAULT_ID, requires = "jail")]
    jail_uid: u32,
    /// The gid the jailed VMM runs as.
    #[arg(long, value_name = "GID", default_value_t = mayfly_jail::jail::DEFAULT_ID, requires = "jail")]
    jail_gid: u32,
    /// A directory the jailed VMM sees at the same path and may write (where its snapshots
    /// go; --jail-uid must be able to write it). Repeat for more.
    #[arg(long = "jail-share", value_name = "DIR", requires = "jail")]
    jail_share: Vec<PathBuf>,
    /// The jail cgroup's memory.max, in MiB (guest RAM the VMM touched counts).
    #[arg(long, value_name = "MIB", requires = "jail")]
    jail_memory_mib: Option<u64>,
    /// The jail cgroup's cpu.max, in CPUs (0.5: half a CPU's time).
    #[arg(long, value_name = "CPUS", requires = "jail")]
    jail_cpus: Option<f64>,
    /// The jail cgroup's pids.max (default 256 where the pids controller is available).
    #[arg(long, value_name = "N", requires = "jail")]
    jail_pids: Option<u64>,
}

impl JailArgs {
    fn config(&self) -> Option<mayfly_jail::jail::JailConfig> {
        self.jail.then(|| mayfly_jail::jail::JailConfig {
            dir: self.jail_dir.clone(),
            uid: self.jail_uid,
            gid: self.jail_gid,
            share: self.jail_share.clone(),
            memory_mib: self.jail_memory_mib,
            cpus: self.jail_cpus,
            pids: self.jail_pids,
        })
    }
}

/// Enter the jail if asked (see vmm/src/jail.rs): returns in the jailed VMM, or with the
/// error that kept it from being made; the process that called it waits outside and exits
/// with the VMM's status.
fn enter_jail(
    jail: Option<mayfly_jail::jail::JailConfig>,
    name: &str,
    sockets: &[Option<&Path>],
) -> Result<(), ExitCode> {
    let Some(config) = jail else {
        return Ok(());
    };
    let sockets = sockets.iter().flatten().map(|p| p.to_path_buf()).collect();
    mayfly_jail::jail::enter(config, name, sockets).map_err(fail)
}

/// A VM's file as given, or beside its control socket: `<api-sock><suffix>` (the vsock
/// socket, `.vsock`; the disk directory, `.disks`).
fn beside_socket(
    explicit: Option<PathBuf>,
    api_sock: Option<&Path>,
    suffix: &str,
) -> Option<PathBuf> {
    explicit.or_else(|| {
        api_sock.map(|sock| {
            let mut path = sock.as_os_str().to_owned();
            path.push(suffix);
            PathBuf::from(path)
        })
    })
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
    /// Serve the control socket (HTTP/1.1 + JSON) at this path: pause, resume, snapshot, fork.
    #[arg(long, value_name = "PATH")]
    api_sock: Option<PathBuf>,
    /// The VM's name (default vm-<pid>). Its guest reads it with `mayfly-identity`.
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// Print boot phase timestamps on stderr (for benchmarks).
    #[arg(long, hide = true)]
    boot_trace: bool,
    /// Give the VM the probe device (the probe benchmark's guest reports through it).
    #[arg(long, hide = true)]
    probe: bool,
    /// The host side of the VM's vsock device: a Unix socket (host-to-guest connections
    /// send `CONNECT <port>`; guest-to-host ones reach `<PATH>_<port>`). Default:
    /// `<api-sock>.vsock` when there is a control socket.
    #[arg(long, value_name = "PATH")]
    vsock: Option<PathBuf>,
    /// The guest's vsock CID.
    #[arg(long, value_name = "CID", default_value_t = device_manager::DEFAULT_GUEST_CID)]
    vsock_cid: u64,
    /// Boot from a disk: `debian` (the image `rootfs/build.sh debian` builds) or the path of an
    /// ext4 image. It becomes /dev/vda, the root file system, writable through the VM's own
    /// copy-on-write layer (the image itself is never written); the initramfs is not used.
    #[arg(long, value_name = "debian|PATH")]
    rootfs: Option<String>,
    /// Attach a disk: PATH of a raw image, writable through the VM's own layer, or PATH,ro.
    /// Repeat for more (vdb, vdc, ... after the root file system's vda).
    #[arg(long = "disk", value_name = "PATH[,ro]")]
    disks: Vec<String>,
    /// Where the VM's writable disks keep their own layers and manifests. Default:
    /// `<api-sock>.disks` when there is a control socket. Started again with the same
    /// directory (after a crash, say), the disks carry on on the same layers.
    #[arg(long, value_name = "DIR")]
    disk_dir: Option<PathBuf>,
    /// The VM's network: `none` (no NIC at all), `open` (anything but the host's own VM
    /// links), or `allow=CIDR[:PORT],...` (only these destinations; names are resolved and
    /// pinned now). Enforced outside the guest, in the VM's own network namespace; changeable
    /// at runtime (`mayfly net --policy`), kept by snapshots, restores and forks.
    #[arg(long, value_name = "none|open|allow=...", default_value = "none")]
    net: String,
    #[command(flatten)]
    net_place: NetPlaceArgs,
    #[command(flatten)]
    jail: JailArgs,
}

impl RunArgs {
    /// Check every argument before any VM exists, so bad input costs nothing.
    fn into_config(self) -> Result<RunConfig, Error> {
        let vcpus = config::check_vcpus(self.vcpus)?;
        let host_mib = config::host_mem_mib().unwrap_or(u64::MAX);
        let mem_mib = config::check_mem(self.mem_mib, host_mib)?;
        let mut disks = Vec::new();
        if let Some(rootfs) = &self.rootfs {
            disks.push(DiskSpec {
                path: mayfly_vmm::devices::disks::rootfs_image(rootfs).map_err(Error::Disk)?,
                read_only: false,
            });
        }
        for spec in &self.disks {
            disks.push(spec.parse::<DiskSpec>().map_err(Error::Disk)?);
        }
        if disks.len() > mayfly_vmm::devices::disks::MAX_DISKS {
            return Err(Error::Disk(
                mayfly_vmm::devices::disks::DiskSetupError::TooManyDisks,
            ));
        }
        let policy = mayfly_vmm::devices::net::parse_policy(&self.net)?;
        let net =
            (policy != mayfly_network::Policy::None).then(|| mayfly_vmm::devices::net::NetSpec {
                policy,
                settings: self.net_place.settings(),
            });
        let disk_dir = beside_socket(self.disk_dir, self.api_sock.as_deref(), ".disks");
        if disk_dir.is_none() && disks.iter().any(|d| !d.read_only) {
            return Err(Error::Disk(
                mayfly_vmm::devices::disks::DiskSetupError::NoDiskDir,
            ));
        }
        let mut cmdline = self.cmdline;
        if self.rootfs.is_some() && !cmdline.split_whitespace().any(|w| w.starts_with("root=")) {
            cmdline.push(' ');
            cmdline.push_str(mayfly_vmm::devices::disks::ROOT_CMDLINE);
        }
        // A disk root replaces the built-in initramfs (the built-in kernel stays).
        let builtin = self.kernel.is_none() && self.initrd.is_none() && self.rootfs.is_none();
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
            cmdline,
            mem_mib,
            vcpus,
            console: self.console,
            cpu_template: boot::cpu_template(self.cpu_template.as_deref())?,
            boot_trace: self.boot_trace,
            probe: self.probe,
            devices: DevicesConfig {
                rng: true,
                vsock: Some(VsockConfig {
                    guest_cid: self.vsock_cid,
                    path: beside_socket(self.vsock, self.api_sock.as_deref(), ".vsock"),
                }),
                disks,
                disk_dir,
                net,
            },
            api_sock: self.api_sock,
            name: match self.name {
                Some(name) => {
                    identity::check_name(&name)?;
                    name
                }
                None => format!("vm-{}", std::process::id()),
            },
        })
    }
}

/// Raise this process's descriptor limit to the hard limit: a fork follows each of its
/// clones through a pidfd until all run (a thousand clones, a thousand descriptors), and
/// Debian's default soft limit is 1024.
fn raise_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct; failure leaves the limit as is.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// The environment a VMM process reads, here and nowhere below `main`:
/// - `MAYFLY_SECCOMP`: `on` (the default), `log` or `off` (see `mayfly_jail::seccomp`);
/// - `MAYFLY_KVM_DEVICE`: another KVM device node than /dev/kvm;
/// - `MAYFLY_CACHE`: where the build scripts keep images (default `~/.cache/mayfly`);
/// - `MAYFLY_FORK_COPY`, `MAYFLY_FORK_IN_FLIGHT`: the fork's measuring knobs (see
///   `mayfly_vmm::settings`);
/// - `MAYFLY_TRACE` (a fork's zygote): every clone prints its phases.
///
/// A bad `MAYFLY_SECCOMP` is said now, before anything starts (a filtered thread that met it
/// later could only end the process).
fn take_environment() -> Result<(), mayfly_jail::seccomp::SeccompError> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    let seccomp = std::env::var("MAYFLY_SECCOMP")
        .unwrap_or_default()
        .parse()?;
    let _ = mayfly_jail::seccomp::set_mode(seccomp);
    let _ = mayfly_vmm::settings::set(mayfly_vmm::settings::Settings {
        kvm_device: var("MAYFLY_KVM_DEVICE")
            .map_or_else(|| PathBuf::from("/dev/kvm"), PathBuf::from),
        cache_dir: cache_dir(),
        fork_copy: std::env::var_os("MAYFLY_FORK_COPY").is_some(),
        fork_in_flight: std::env::var("MAYFLY_FORK_IN_FLIGHT")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0),
    });
    Ok(())
}

/// `$MAYFLY_CACHE`, else `~/.cache/mayfly` (where the build scripts put images).
fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("MAYFLY_CACHE") {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/mayfly"))
}

fn main() -> ExitCode {
    let cli = parse();
    if matches!(
        cli.command,
        Command::Run(_) | Command::Restore(_) | Command::Zygote(_)
    ) {
        if !matches!(cli.command, Command::Zygote(_)) {
            raise_descriptor_limit();
        }
        if let Err(err) = take_environment() {
            return fail(err);
        }
    }
    match cli.command {
        Command::Run(args) => run(args),
        Command::Restore(args) => restore(args),
        Command::Pause(args) => client(&args.sock, "PUT", "/vm/pause", None),
        Command::Resume(args) => client(&args.sock, "PUT", "/vm/resume", None),
        Command::Status(args) => client(&args.sock, "GET", "/vm", None),
        Command::Shutdown(args) => client(&args.sock, "PUT", "/vm/shutdown", None),
        Command::Snapshot(args) => snapshot(args),
        Command::Fork(args) => client(
            &args.sock.sock,
            "PUT",
            "/vm/fork",
            Some(serde_json::json!({
                "count": args.count,
                "name_prefix": args.name_prefix,
                "parent": if args.keep_paused { "paused" } else { "running" },
                "overcommit": args.overcommit,
            })),
        ),
        Command::Exec(args) => guest_commands::exec(args),
        Command::Cp(args) => guest_commands::cp(args),
        Command::Serve(args) => serve_sandboxes(args),
        Command::Net(args) => match (args.policy, args.expose) {
            (Some(policy), _) => client(
                &args.sock.sock,
                "PUT",
                "/vm/net/policy",
                Some(serde_json::json!({ "policy": policy })),
            ),
            (None, Some(port)) => client(
                &args.sock.sock,
                "PUT",
                "/vm/net/expose",
                Some(serde_json::json!({ "port": port, "on": args.on })),
            ),
            (None, None) => client(&args.sock.sock, "GET", "/vm/net", None),
        },
        Command::Zygote(args) => {
            if std::env::var_os("MAYFLY_TRACE").is_some() {
                trace::enable();
            }
            if let Err(err) = mayfly_vmm::memory::ram::install_sigbus_handler() {
                return fail(Error::Signals(err));
            }
            ExitCode::from(zygote::serve(
                args.state_fd,
                args.memory_fd,
                args.socket_fd,
                start_clone,
            ))
        }
    }
}

/// A clone, in the process the fork's zygote made for it: finish the restore and run the VM.
fn start_clone(prepared: restore::Prepared, instance: Instance, report: Reporter) -> ! {
    let started = std::time::Instant::now();
    let console = instance.console.clone();
    with_stop_signals(Some(report), |signals| {
        serve(&console, signals, Raw::BeforeStart, || {
            let claims = restore::Claims::take(&instance).map_err(Error::Restore)?;
            let vmm =
                restore::start(prepared, instance, claims, started).map_err(Error::Restore)?;
            let mut controller = Controller::new(vmm);
            // Restored paused: it runs once its fork has every clone ready (see ForkEnd).
            controller.hold_for_fork();
            Ok(controller)
        })
    });
    std::process::exit(1)
}

/// `mayfly serve`: the sandbox manager, until SIGTERM, SIGINT or SIGHUP (which leave the
/// sandboxes as they are).
fn serve_sandboxes(args: ServeArgs) -> ExitCode {
    use nix::sys::signal::{SigSet, SigmaskHow, Signal};
    let mut signals = SigSet::empty();
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(sig);
    }
    // Blocked before any thread starts, so every thread inherits it and the signal thread
    // takes them (a VMM the manager starts gets an empty mask again: std resets it).
    if let Err(e) = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&signals), None) {
        return fail(format!("cannot block the stop signals: {e}"));
    }
    let (stop_tx, stop_rx) = match std::os::unix::net::UnixStream::pair() {
        Ok(pair) => pair,
        Err(e) => return fail(format!("cannot make a socket pair: {e}")),
    };
    let waiter = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let _ = signals.wait();
            drop(stop_tx);
        });
    if let Err(e) = waiter {
        return fail(format!("cannot start the signal thread: {e}"));
    }
    let state_dir = match mayfly_serve::absolute_state_dir(&args.state_dir) {
        Ok(dir) => dir,
        Err(e) => return fail(e),
    };
    let mayfly = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            return fail(format!(
                "cannot find the mayfly binary (/proc/self/exe): {e}"
            ))
        }
    };
    let config = mayfly_serve::ServeConfig {
        state_dir,
        sock: args.sock,
        mayfly,
        policy: mayfly_serve::Policy {
            jail: !args.no_jail,
            jail_uid_base: args.jail_uid_base,
            mem_budget_mib: args.mem_budget_mib,
            make_room: matches!(args.when_over_budget, OverBudgetPolicy::SuspendIdle),
            disk_budget_mib: args.disk_budget_mib,
            expire_after_s: args.expire_after,
            template_ttl_s: args.template_ttl.0,
        },
    };
    match mayfly_serve::serve(&config, stop_rx) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn fail(err: impl std::fmt::Display) -> ExitCode {
    eprintln!("mayfly: {err}");
    ExitCode::FAILURE
}

/// Run `body` with the stop signals taken by a thread of their own from the first moment: a
/// VMM told to stop while it is still starting its VM exits then and there.
fn with_stop_signals(ready: Option<Reporter>, body: impl FnOnce(Started) -> ExitCode) -> ExitCode {
    if let Err(err) = mayfly_vmm::memory::ram::install_sigbus_handler() {
        return fail_and_report(ready, Error::Signals(err));
    }
    match StopSignals::start() {
        Ok(signals) => body(Started { signals, ready }),
        Err(err) => fail_and_report(ready, Error::Signals(err)),
    }
}

/// What `run` and `restore` start with: the signal thread, and whom to tell that the VM runs.
struct Started {
    signals: StopSignals,
    /// For a clone: the fork that waits for it to run.
    ready: Option<Reporter>,
}

fn run(args: RunArgs) -> ExitCode {
    if args.boot_trace {
        trace::enable();
        trace::event("main");
    }
    let jail = args.jail.config();
    if jail.is_some() && args.net != "none" {
        return fail(mayfly_jail::jail::JailError::Net);
    }
    let config = match args.into_config() {
        Ok(config) => config,
        Err(err) => return fail(err),
    };
    let vsock = config
        .devices
        .vsock
        .as_ref()
        .and_then(|v| v.path.as_deref());
    if let Err(code) = enter_jail(jail, &config.name, &[config.api_sock.as_deref(), vsock]) {
        return code;
    }
    with_stop_signals(None, |started| {
        let console = config.console.clone();
        serve(&console, started, Raw::BeforeStart, || {
            boot::boot(&config)
                .map(Controller::new)
                .map_err(Error::Boot)
        })
    })
}

fn restore(args: RestoreArgs) -> ExitCode {
    if args.trace {
        trace::enable();
        trace::event("main");
    }
    let vsock = beside_socket(args.vsock.clone(), args.api_sock.as_deref(), ".vsock");
    let name = args.name.clone().unwrap_or_else(|| "restore".into());
    if let Err(code) = enter_jail(
        args.jail.config(),
        &name,
        &[args.api_sock.as_deref(), vsock.as_deref()],
    ) {
        return code;
    }
    with_stop_signals(None, |started| restore_started(args, started))
}

fn restore_started(args: RestoreArgs, started: Started) -> ExitCode {
    let Started { signals, ready } = started;
    let (memory, instance, dir) = match restore_instance(args) {
        Ok(made) => made,
        Err(err) => return fail_and_report(ready, err),
    };
    let console = instance.console.clone();
    match dir {
        Some(dir) => serve(
            &console,
            Started { signals, ready },
            Raw::BeforeStart,
            || {
                let config = RestoreConfig {
                    source: SnapshotSource::Dir(dir),
                    memory,
                    instance,
                };
                restore::restore(config)
                    .map(Controller::new)
                    .map_err(Error::Restore)
            },
        ),
        None => serve(
            &console,
            Started { signals, ready },
            Raw::OnceRunning,
            || {
                mayfly_vmm::persist::standby::stand_by(instance, memory)
                    .map(Controller::new)
                    .map_err(Error::Restore)
            },
        ),
    }
}

/// What `mayfly restore` makes of its arguments: the memory mode, the instance, and the
/// snapshot directory (none with --standby: a request names it later).
fn restore_instance(args: RestoreArgs) -> Result<(MemoryMode, Instance, Option<PathBuf>), String> {
    let memory = match (args.memory, args.no_prefetch) {
        (MemoryMode::Lazy { .. }, true) => MemoryMode::Lazy { prefetch: false },
        (mode, _) => mode,
    };
    if let Some(name) = &args.name {
        identity::check_name(name).map_err(|e| e.to_string())?;
    }
    let net_policy = args
        .net
        .as_deref()
        .map(mayfly_vmm::devices::net::parse_policy)
        .transpose()
        .map_err(|e| e.to_string())?;
    let instance = Instance {
        origin: match &args.dir {
            Some(dir) => format!("restore of {}", dir.display()),
            None => "standby".into(),
        },
        console: args.console,
        console_input: args.console_input,
        api_sock: args.api_sock.clone(),
        paused: args.paused,
        name: args.name,
        clone_of: None,
        devices: RestoreTargets {
            vsock_path: beside_socket(args.vsock, args.api_sock.as_deref(), ".vsock"),
            vsock_cid: None,
            snapshot_dir: args.dir.clone(),
            disk_dir: beside_socket(args.disk_dir, args.api_sock.as_deref(), ".disks"),
            layers_within: args.disk_layers_within,
            net: mayfly_vmm::devices::net::NetTargets {
                settings: args.net_place.settings(),
                policy: net_policy,
                new_mac: false,
            },
        },
    };
    Ok((memory, instance, args.dir))
}

fn fail_and_report(ready: Option<Reporter>, err: impl std::fmt::Display) -> ExitCode {
    if let Some(ready) = ready {
        ready.failed(&err.to_string());
    }
    fail(err)
}

/// When a console on stdio puts the terminal in raw mode.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Raw {
    /// Before the VM starts: the guest's first output and input find it raw.
    BeforeStart,
    /// Once it runs: for a VMM standing by, which may wait for its snapshot for hours (a raw
    /// terminal would swallow Ctrl-C meanwhile and queue keystrokes for a guest not yet there).
    OnceRunning,
}

/// Start a VM with `start` and run it until it ends; the process exit status says how.
fn serve(
    console: &Console,
    started: Started,
    raw: Raw,
    start: impl FnOnce() -> Result<Controller, Error>,
) -> ExitCode {
    let Started { signals, ready } = started;
    let stdio = *console == Console::Stdio;
    let mut raw_terminal = (stdio && raw == Raw::BeforeStart)
        .then(RawTerminal::stdin)
        .flatten();
    let controller = match start() {
        Ok(controller) => controller,
        Err(err) => {
            drop(raw_terminal);
            return fail_and_report(ready, err);
        }
    };
    if stdio && raw == Raw::OnceRunning {
        raw_terminal = RawTerminal::stdin();
    }
    trace::event("vcpus_started");
    if let Some(ready) = ready {
        let Some(fork_end) = ready.ready() else {
            // The fork that made this clone cannot hear of it (it has failed or gone), so
            // nobody would know this VM runs.
            eprintln!("mayfly: the fork that started this clone is gone; the clone stops");
            std::process::exit(1);
        };
        // Held until the fork has every clone ready; then it goes.
        let events = controller.event_sender.clone();
        let builder = std::thread::Builder::new()
            .name("fork-end".into())
            .stack_size(mayfly_sys::HELPER_THREAD_STACK);
        let waiting = mayfly_jail::seccomp::spawn(builder, ThreadKind::ForkEnd, move || {
            if fork_end.wait() {
                let _ = events.send(VmEvent::ForkEnded);
            } else {
                // Nobody was told of this clone: it stops (cleanly, its sockets removed).
                eprintln!(
                    "mayfly: this clone's fork did not end well (the VMM that forked it \
                     ended before its fork did, or the fork's answer reached nobody); the \
                     clone stops"
                );
                let _ = events.send(VmEvent::Signal(libc::SIGTERM));
            }
        });
        if let Err(err) = waiting {
            eprintln!("mayfly: cannot wait for the fork's end ({err}); the clone runs now");
            let _ = controller.event_sender.send(VmEvent::ForkEnded);
        }
    }
    signals.forward_to(controller.event_sender.clone());
    let exit = controller.run();
    drop(raw_terminal);
    match &exit {
        VmExit::PowerOff | VmExit::Shutdown => {}
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
        VmExit::Failed(reason) => eprintln!("mayfly: the VM stopped: {reason}"),
    }
    let status = exit.status();
    // A vCPU left stuck in the kernel must not keep the process alive.
    std::process::exit(i32::from(status))
}

/// One request to a VM's control socket; prints the answer.
fn client(sock: &Path, method: &str, path: &str, body: Option<serde_json::Value>) -> ExitCode {
    match mayfly_api::request(sock, method, path, body.as_ref()) {
        Ok((status, answer)) if (200..300).contains(&status) => {
            if !answer.is_null() {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&answer).unwrap_or_default()
                );
            }
            ExitCode::SUCCESS
        }
        Ok((status, answer)) => {
            let message = answer
                .get("error")
                .and_then(|e| e.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| answer.to_string());
            fail(format!("{message} (HTTP {status})"))
        }
        Err(err) => fail(err),
    }
}

/// Pause if needed, snapshot, and resume if it was running (unless asked not to).
fn snapshot(args: SnapshotArgs) -> ExitCode {
    let sock = &args.sock.sock;
    let state = match mayfly_api::request(sock, "GET", "/vm", None) {
        Ok((200, vm)) => vm
            .get("state")
            .and_then(|s| s.as_str())
            .unwrap_or("")
            .to_string(),
        Ok((status, answer)) => return fail(format!("the VM answered HTTP {status}: {answer}")),
        Err(err) => return fail(err),
    };
    // A clone still held by its fork ("starting") runs in a moment: paused here, it stays
    // paused past its fork's end, and runs again after the snapshot (unless --keep-paused).
    let was_running = state == "running" || state == "starting";
    if was_running {
        let code = client(sock, "PUT", "/vm/pause", None);
        if code != ExitCode::SUCCESS {
            return code;
        }
    }
    let dir = std::path::absolute(&args.dir).unwrap_or(args.dir.clone());
    let code = client(
        sock,
        "PUT",
        "/vm/snapshot",
        Some(serde_json::json!({ "path": dir, "diff": args.diff })),
    );
    if was_running && !args.keep_paused {
        let resumed = client(sock, "PUT", "/vm/resume", None);
        if code == ExitCode::SUCCESS {
            return resumed;
        }
    }
    code
}

/// SIGTERM, SIGINT and SIGHUP end the VM cleanly: blocked everywhere from the start of `main`
/// and taken by one thread. Until the VM runs, a stop signal ends the process at once (status
/// 128+N), whatever phase the start is in; once it runs, the signal goes to the VM's controller,
/// which stops the VM cleanly. SIGUSR1 asks a running VM for a state dump; the lease signal
/// says another process is about to change the VM's memory file.
struct StopSignals {
    sink: std::sync::Arc<std::sync::Mutex<Option<Sender<VmEvent>>>>,
}

impl StopSignals {
    fn start() -> std::io::Result<Self> {
        let lease = mayfly_vmm::memory::ram::lease_signal();
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
                        mayfly_vmm::persist::standby::remove_socket();
                        eprintln!("mayfly: stopped by signal {sig} before the VM started");
                        std::process::exit(128 + sig);
                    }
                }
            })?;
        Ok(Self { sink })
    }

    /// From now on signals go to the VM's controller.
    fn forward_to(self, events: Sender<VmEvent>) {
        *self.sink.lock().unwrap_or_else(|p| p.into_inner()) = Some(events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the two parsers must agree on: every argument a restore reads.
    fn summary(args: &RestoreArgs) -> String {
        format!(
            "{:?} {} {:?} {:?} {:?} {} {:?} {:?} {} {} {:?} {:?} {:?} {:?} {}",
            args.dir,
            args.standby,
            args.name,
            args.console_input,
            args.memory,
            args.no_prefetch,
            args.api_sock,
            args.console,
            args.paused,
            args.trace,
            args.vsock,
            args.disk_dir,
            args.disk_layers_within,
            args.net,
            args.jail.jail,
        )
    }

    #[test]
    fn a_restore_parsed_alone_is_parsed_as_the_whole_command_line_would() {
        let cases: &[&[&str]] = &[
            &["restore", "/snap"],
            &[
                "restore",
                "/snap",
                "--memory",
                "lazy",
                "--no-prefetch",
                "--paused",
            ],
            &[
                "restore",
                "/snap",
                "--name",
                "x",
                "--console",
                "/dev/null",
                "--trace",
            ],
            &[
                "restore",
                "/snap",
                "--api-sock",
                "/s",
                "--vsock",
                "/v",
                "--disk-dir",
                "/d",
            ],
            &[
                "restore",
                "/snap",
                "--disk-layers-within",
                "/w",
                "--net",
                "none",
            ],
            &["restore", "/snap", "--jail"],
            &["restore", "--standby", "--api-sock", "/s"],
            &[
                "restore",
                "--api-sock=/s",
                "--standby",
                "--console-input",
                "/in",
            ],
            &["restore"],
            &["restore", "--standby"],
            &["restore", "--standby", "/snap", "--api-sock", "/s"],
            &["restore", "--standby", "--api-sock", "/s", "--jail"],
            &["restore", "/snap", "--frobnicate"],
            &["restore", "/snap", "--memory", "bogus"],
            &["restore", "/snap", "--jail-uid", "5"],
            &["restore", "/snap", "/other"],
            &["restore", "--help"],
            &["restore", "-h"],
            &["restore", "--version"],
            &["restore", "help"],
            &["restore", "--"],
            &["restore", "--", "--standby"],
        ];
        for case in cases {
            let argv = std::iter::once("mayfly").chain(case.iter().copied());
            let whole = Cli::try_parse_from(argv.clone());
            let alone = RestoreCli::try_parse_from(argv);
            match (whole, alone) {
                (Ok(whole), Ok(alone)) => {
                    let Command::Restore(whole) = whole.command else {
                        panic!("{case:?}: the whole parser made another command");
                    };
                    let RestoreCommand::Restore(alone) = alone.command;
                    assert_eq!(summary(&whole), summary(&alone), "{case:?}");
                }
                (Err(whole), Err(alone)) => {
                    assert_eq!(whole.kind(), alone.kind(), "{case:?}");
                    assert_eq!(
                        whole.render().to_string(),
                        alone.render().to_string(),
                        "{case:?}"
                    );
                }
                (whole, alone) => panic!(
                    "{case:?}: the whole parser {}, alone {}",
                    if whole.is_ok() { "accepts" } else { "refuses" },
                    if alone.is_ok() { "accepts" } else { "refuses" },
                ),
            }
        }
    }
}
