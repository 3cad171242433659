//! The command line: every subcommand and its options (clap), checked into the VMM's typed
//! configurations before any VM exists.
// The doc comments below are clap's help texts, printed as they are (`<name>.sock`,
// `[:PORT]`): rustdoc would read them as HTML and links.
#![allow(rustdoc::invalid_html_tags, rustdoc::broken_intra_doc_links)]

use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};
use mayfly_vmm::config::{self, RunConfig, DEFAULT_CMDLINE, DEFAULT_MEM_MIB};
use mayfly_vmm::devices::config::{DevicesConfig, VsockConfig, DEFAULT_GUEST_CID};
use mayfly_vmm::devices::console::Console;
use mayfly_vmm::devices::disks::DiskSpec;
use mayfly_vmm::kernel::Image;
use mayfly_vmm::persist::restore::MemoryMode;
use mayfly_vmm::{boot, default_guest, identity};

use crate::error::Error;
use crate::guest_commands;

pub(crate) const ABOUT: &str =
    "A KVM virtual machine monitor for microVMs that boot, snapshot, restore and fork fast.";
pub(crate) const AFTER_HELP: &str =
    "Exit status of `mayfly run` and `mayfly restore`: 0 the guest powered \
                          off (or the VM was shut down through its socket); 133 the guest \
                          rebooted (mayfly does not restart it); 128+N stopped by signal N; 1 an \
                          error (the message says what to do); 2 bad command-line usage.";
pub(crate) const RESTORE_ABOUT: &str = "Restore a snapshot into a new VM, in this process";
pub(crate) const RESTORE_LONG_ABOUT: &str =
    "Restore a snapshot into a new VM, in this process.\n\n\
    The guest carries on where it was when the snapshot was taken: its processes, its files in \
    RAM, its console. The wall clock moves on by the time the snapshot spent on disk.";

#[derive(Parser)]
#[command(
    name = "mayfly",
    version,
    about = ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// `mayfly restore`, parsed alone (see [`parse`]).
#[derive(Parser)]
#[command(
    name = "mayfly",
    version,
    about = ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct RestoreCli {
    #[command(subcommand)]
    pub(crate) command: RestoreCommand,
}

#[derive(Subcommand)]
pub(crate) enum RestoreCommand {
    #[command(about = RESTORE_ABOUT, long_about = RESTORE_LONG_ABOUT)]
    Restore(RestoreArgs),
}

/// The command line. clap builds the parser of every subcommand for any parse: 0.2-0.3 ms of
/// a restore's start on this host, where a restore's launch is the latency its user waits
/// for; so `mayfly restore` is parsed by a parser of that subcommand alone, which answers
/// exactly as the whole one does (its help, its errors: see the tests).
pub(crate) fn parse() -> Cli {
    if std::env::args_os().nth(1).as_deref() == Some(std::ffi::OsStr::new("restore")) {
        let RestoreCommand::Restore(args) = RestoreCli::parse().command;
        return Cli {
            command: Command::Restore(args),
        };
    }
    Cli::parse()
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
    /// expose a guest port on the host (or stop).
    ///
    /// Examples: mayfly net --sock /tmp/vm.sock --policy allow=192.0.2.0/24:443
    ///           mayfly net --sock /tmp/vm.sock --expose 8080      (prints the host address)
    ///           mayfly net --sock /tmp/vm.sock --unexpose 8080
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
pub(crate) struct ZygoteArgs {
    /// The fork's state.
    #[arg(long, value_name = "FD")]
    pub(crate) state_fd: i32,
    /// The fork's memory: its files, bottom first.
    #[arg(
        long,
        value_name = "FD[,FD...]",
        value_delimiter = ',',
        required = true
    )]
    pub(crate) memory_fd: Vec<i32>,
    /// The fork's socket.
    #[arg(long, value_name = "FD")]
    pub(crate) socket_fd: i32,
}

#[derive(Args)]
pub(crate) struct ForkArgs {
    #[command(flatten)]
    pub(crate) sock: SockArgs,
    /// How many clones.
    #[arg(long, value_name = "N")]
    pub(crate) count: u32,
    /// Name clones <PREFIX><n> (default: <parent's name>-).
    #[arg(long, value_name = "PREFIX")]
    pub(crate) name_prefix: Option<String>,
    /// Leave the parent paused after the fork.
    #[arg(long)]
    pub(crate) keep_paused: bool,
    /// Check host memory only for what starting the clones costs (their VMMs), not for the
    /// guest memory they will write: for many clones that stay idle.
    #[arg(long)]
    pub(crate) overcommit: bool,
    /// Make the clones here, as this JSON file places them (`{"clones": [{"name",
    /// "api_sock", "console_log", "stderr", "vsock", "disk_dir", "uid", "share", "memory_mib",
    /// "layers_moved"}], "policy"}`), their networks made where --net-* say: what the sandbox
    /// manager does, each clone a sandbox of its own. Needs root.
    #[arg(long, value_name = "FILE")]
    pub(crate) place: Option<PathBuf>,
    /// Print the clones, then let them run only once a line `go` comes on stdin (anything
    /// else, or its end, stops them): for a program that records them before they run.
    #[arg(long, requires = "place")]
    pub(crate) hold: bool,
    #[command(flatten)]
    pub(crate) net_place: NetPlaceArgs,
}

#[derive(Args)]
pub(crate) struct SockArgs {
    /// The VM's control socket (its --api-sock).
    #[arg(long, value_name = "PATH")]
    pub(crate) sock: PathBuf,
}

#[derive(Args)]
pub(crate) struct SnapshotArgs {
    #[command(flatten)]
    pub(crate) sock: SockArgs,
    /// Directory to write the snapshot to (created, or replaced if it holds an older snapshot).
    #[arg(value_name = "DIR")]
    pub(crate) dir: PathBuf,
    /// Leave the VM paused afterwards.
    #[arg(long)]
    pub(crate) keep_paused: bool,
    /// Write only the pages written since the VM was restored, over the snapshot it was
    /// restored from (hard-linked into the new one's memory-layers/): for a VM restored
    /// copy-on-write from a snapshot directory.
    #[arg(long)]
    pub(crate) diff: bool,
}

#[derive(Args)]
pub(crate) struct RestoreArgs {
    /// The snapshot directory.
    #[arg(value_name = "DIR", required_unless_present = "standby")]
    pub(crate) dir: Option<PathBuf>,
    /// Start now and stand by, without a snapshot: KVM opened and probed and a VM made ahead,
    /// the control socket (--api-sock, required) answering. `PUT /vm/restore {"snapshot":
    /// "/path/to/snapshot"}` on it restores that snapshot with this command's other options
    /// and answers once the VM runs; the socket is then the VM's. For programs that keep a
    /// VMM ready for the next VM to wake: what a restore spends before its snapshot matters
    /// (starting the process, asking KVM) is done by then. Not with --jail yet.
    #[arg(long, requires = "api_sock", conflicts_with_all = ["dir", "jail"])]
    pub(crate) standby: bool,
    /// The VM's name (default: the snapshot's). Its guest reads it with `mayfly-identity`.
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Option<String>,
    /// A file or FIFO whose bytes are typed into the guest's console.
    #[arg(long, value_name = "PATH")]
    pub(crate) console_input: Option<PathBuf>,
    /// How guest memory comes back: `cow` maps the memory file copy-on-write (instant; restores
    /// of one snapshot share memory); `lazy` loads pages as the guest touches them
    /// (userfaultfd), prefetching the pages the snapshot recorded as used first; `eager` reads
    /// everything before the guest runs.
    #[arg(long, value_name = "cow|lazy|eager", default_value = "cow")]
    pub(crate) memory: MemoryMode,
    /// With --memory lazy: do not prefetch the recorded working set.
    #[arg(long)]
    pub(crate) no_prefetch: bool,
    /// Serve the control socket (HTTP/1.1 + JSON) at this path.
    #[arg(long, value_name = "PATH")]
    pub(crate) api_sock: Option<PathBuf>,
    /// Serial console: `stdio` or a file to write it to.
    #[arg(long, value_name = "stdio|FILE", default_value = "stdio")]
    pub(crate) console: Console,
    /// Restore with the vCPUs paused (resume with `mayfly resume`).
    #[arg(long)]
    pub(crate) paused: bool,
    /// Print restore phase timestamps on stderr (for benchmarks).
    #[arg(long, hide = true)]
    pub(crate) trace: bool,
    /// The host side of the VM's vsock device (see `mayfly run --vsock`). Default:
    /// `<api-sock>.vsock` when there is a control socket.
    #[arg(long, value_name = "PATH")]
    pub(crate) vsock: Option<PathBuf>,
    /// Where the restored VM's writable disks put their own layers (see `mayfly run
    /// --disk-dir`). Default: `<api-sock>.disks` when there is a control socket.
    #[arg(long, value_name = "DIR")]
    pub(crate) disk_dir: Option<PathBuf>,
    /// Refuse a snapshot that names disk layers by full path outside DIR (for a manager that
    /// restores, as root, snapshots its jailed VMMs wrote; `mayfly serve` passes the
    /// sandbox's own directory).
    #[arg(long, value_name = "DIR")]
    pub(crate) disk_layers_within: Option<PathBuf>,
    /// The restored NIC's egress policy instead of the snapshot's (see `mayfly run --net`;
    /// `none` keeps the NIC but lets nothing out). Only for a snapshot of a VM with a NIC.
    #[arg(long, value_name = "none|open|allow=...")]
    pub(crate) net: Option<String>,
    /// Give the restored NIC a fresh MAC rather than the snapshot's, as a clone's (its
    /// guest's agent takes it on; until then its frames are dropped as spoofed): for another
    /// VM made from the same snapshot, which must not speak as the first.
    #[arg(long)]
    pub(crate) new_mac: bool,
    #[command(flatten)]
    pub(crate) net_place: NetPlaceArgs,
    #[command(flatten)]
    pub(crate) jail: JailArgs,
}

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Where the manager keeps its sandboxes, their snapshots, its admin token and its event
    /// log (made if missing). A manager started again on it finds everything.
    #[arg(long, value_name = "DIR")]
    pub(crate) state_dir: PathBuf,
    /// The manager's control socket (HTTP/1.1 + JSON).
    #[arg(long, value_name = "PATH")]
    pub(crate) sock: PathBuf,
    /// Run new sandboxes' VMMs as root, unjailed. By default each runs jailed (see `mayfly
    /// run --jail`), sharing only its own directory; a jailed sandbox's network is kept by
    /// its jail's waiter, outside the jail.
    #[arg(long)]
    pub(crate) no_jail: bool,
    /// Where sandboxes' networks are made (for creates with "net"): every VMM gets these.
    #[command(flatten)]
    pub(crate) net: NetPlaceArgs,
    /// Jailed sandboxes run as uids and gids from this one on, one each (pick a range no
    /// user or service of the host has).
    #[arg(
        long,
        value_name = "UID",
        default_value_t = 1_000_000,
        conflicts_with = "no_jail"
    )]
    pub(crate) jail_uid_base: u32,
    /// At most this much guest memory (MiB) in sandboxes whose VMMs run: a create, wake or
    /// fork past it is refused (429) until a sandbox sleeps or goes. Default: no budget.
    #[arg(long, value_name = "MIB")]
    pub(crate) mem_budget_mib: Option<u64>,
    /// What to do with a create, wake or fork past the memory budget: refuse it (429), or
    /// put the longest-idle running sandboxes to sleep on disk until it fits.
    #[arg(
        long,
        value_enum,
        value_name = "POLICY",
        default_value = "refuse",
        requires = "mem_budget_mib"
    )]
    pub(crate) when_over_budget: OverBudgetPolicy,
    /// At most this much disk (MiB) for what sandboxes keep (their snapshots, disk layers
    /// and bases, each file counted once): a suspend that could take more is refused (429),
    /// and an idle sandbox then stays awake. Default: no budget.
    #[arg(long, value_name = "MIB")]
    pub(crate) disk_budget_mib: Option<u64>,
    /// Delete a sandbox that has been asleep this long (since its suspend or its last
    /// request, whichever is later), snapshot and all: e.g. 30d, 12h, 90s. Default: never.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_s)]
    pub(crate) expire_after: Option<u64>,
    /// Collect a template that no create has used for this long (sandboxes made from it keep
    /// working: each has its own links to the files). `never` keeps them.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_ttl_s)]
    pub(crate) template_ttl: Ttl,
    /// For tests only: abort right after this step (after-spawn, after-mkdir, after-clone:K,
    /// mid-delete), as a `kill -9` there would, so a test can check what the next start makes
    /// of it.
    #[arg(long, value_name = "POINT", hide = true)]
    pub(crate) crash_at: Option<mayfly_serve::CrashPoint>,
    /// A directory the files a create names (kernel, initrd, rootfs, snapshot, a template's)
    /// may be in, each by its own absolute path with no symbolic link: anything else is
    /// refused (400) unread. Repeat it for more than one. Default: <state-dir>/images.
    #[arg(long, value_name = "DIR")]
    pub(crate) images_dir: Vec<PathBuf>,
    /// What each VMM may hold beside its guest's memory (MiB): every VMM runs in a memory
    /// cgroup limited to its guest memory and this, and the memory budget counts both.
    #[arg(long, value_name = "MIB", default_value_t = mayfly_serve::DEFAULT_VMM_ALLOWANCE_MIB,
          value_parser = clap::value_parser!(u64).range(16..=1 << 20))]
    pub(crate) vmm_allowance_mib: u64,
    /// The most each sandbox's console file takes (bytes, or with K, M, G): the rest of its
    /// guest's output is dropped.
    #[arg(long, value_name = "SIZE", default_value = "64M", value_parser = parse_console_limit)]
    pub(crate) console_limit: u64,
    /// Networks (namespace, tap, veth, nftables) kept built ahead of need, so that a create,
    /// wake or fork with "net" takes one instead of building its own (~0.6 ms against ~9
    /// ms). Kept topped up from the first sandbox with a network on; 0 builds none. Each is
    /// an idle namespace with a veth in the uplink; they are removed when the manager stops.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(0..=1024))]
    pub(crate) net_pool: u64,
}

/// `--console-limit`: a size, at least 1 KiB.
pub(crate) fn parse_console_limit(text: &str) -> Result<u64, String> {
    match crate::error::parse_size(text) {
        Some(n) if n >= 1024 => Ok(n),
        Some(_) => Err(format!("{text}: give at least 1K")),
        None => Err(format!(
            "{text}: give bytes, or a number with K, M or G (e.g. 64M)"
        )),
    }
}

/// `--template-ttl`: seconds, or none for `never`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ttl(pub(crate) Option<u64>);

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum OverBudgetPolicy {
    Refuse,
    SuspendIdle,
}

/// A duration (humantime's: 90s, 15m, 12h, 30d...) in whole seconds, at least one.
pub(crate) fn parse_duration_s(text: &str) -> Result<u64, String> {
    let d = humantime::parse_duration(text)
        .map_err(|e| format!("{text}: {e} (e.g. 90s, 15m, 12h, 30d)"))?;
    match d.as_secs() {
        0 => Err(format!("{text}: give at least 1s")),
        s => Ok(s),
    }
}

/// A duration as [`parse_duration_s`], or `never`.
pub(crate) fn parse_ttl_s(text: &str) -> Result<Ttl, String> {
    if text == "never" {
        return Ok(Ttl(None));
    }
    parse_duration_s(text).map(|s| Ttl(Some(s)))
}

#[derive(Args)]
pub(crate) struct NetArgs {
    #[command(flatten)]
    pub(crate) sock: SockArgs,
    /// The egress policy from now on: none, open or allow=CIDR[:PORT],... Tightening it cuts
    /// open connections the new policy forbids (at their next packet).
    #[arg(long, value_name = "none|open|allow=...", conflicts_with_all = ["expose", "unexpose"])]
    pub(crate) policy: Option<String>,
    /// Make this guest port reachable on the host (for as long as the VM runs).
    #[arg(long, value_name = "PORT", conflicts_with = "unexpose")]
    pub(crate) expose: Option<u16>,
    /// Stop making this guest port reachable on the host (its open connections are cut).
    #[arg(long, value_name = "PORT")]
    pub(crate) unexpose: Option<u16>,
    /// With --expose: where to listen: tcp:ADDR:PORT (port 0: a free one) or unix:PATH.
    #[arg(
        long,
        value_name = "tcp:ADDR:PORT|unix:PATH",
        requires = "expose",
        default_value = "tcp:127.0.0.1:0"
    )]
    pub(crate) on: String,
}

/// Where a VM's network is made (with `--net` other than none).
#[derive(Args)]
pub(crate) struct NetPlaceArgs {
    /// Where mayfly keeps its network slot locks and pooled namespaces.
    #[arg(long, value_name = "DIR", default_value = "/run/mayfly/net")]
    pub(crate) net_dir: PathBuf,
    /// The network namespace VMs' traffic goes out to (a path like /run/netns/NAME or
    /// /proc/PID/ns/net). Default: mayfly's own.
    #[arg(long, value_name = "PATH")]
    pub(crate) net_uplink: Option<PathBuf>,
    /// The DNS resolver the guest is told to use; an allowlist lets DNS reach it, and only it.
    /// DNS reaches it even at a host or private address. Names in policies are resolved by
    /// it too (asked from the uplink namespace), so host and guest agree on them; without it,
    /// by this host's resolver.
    #[arg(long, value_name = "IPV4")]
    pub(crate) net_dns: Option<std::net::Ipv4Addr>,
    /// Private networks a policy may reach (inside 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16
    /// or 100.64.0.0/10). The rest of those ranges no VM reaches, with --net open or an
    /// allowlist naming them. Default: none.
    #[arg(long, value_name = "CIDR,...", value_delimiter = ',', value_parser = mayfly_network::parse_net)]
    pub(crate) net_reach: Vec<mayfly_network::Ipv4Net>,
    /// More networks no VM reaches, whatever its policy. Always kept out besides: this host's
    /// own addresses, 169.254.0.0/16 (cloud metadata), the slot pool, 0.0.0.0/8, loopback,
    /// multicast, 240.0.0.0/4 and the private ranges not in --net-reach.
    #[arg(long, value_name = "CIDR,...", value_delimiter = ',', value_parser = mayfly_network::parse_net)]
    pub(crate) net_never: Vec<mayfly_network::Ipv4Net>,
}

impl NetPlaceArgs {
    pub(crate) fn settings(&self) -> mayfly_vmm::devices::net::NetSettings {
        mayfly_vmm::devices::net::NetSettings {
            state_dir: self.net_dir.clone(),
            uplink: self.net_uplink.clone(),
            dns: self.net_dns,
            reach: self.net_reach.clone(),
            never: self.net_never.clone(),
        }
    }

    /// Where names in policies resolve: the manager's check before it starts a VMM.
    pub(crate) fn names(&self) -> mayfly_network::Names {
        mayfly_network::Names {
            dns: self.net_dns,
            uplink: match &self.net_uplink {
                Some(path) => mayfly_network::Uplink::Path(path.clone()),
                None => mayfly_network::Uplink::Current,
            },
        }
    }

    /// The same options, as the arguments of a VMM the manager starts.
    pub(crate) fn vmm_args(&self) -> Vec<String> {
        // Absolute: the VMMs do not start where the manager did.
        let absolute = |p: &PathBuf| {
            std::path::absolute(p)
                .unwrap_or_else(|_| p.clone())
                .display()
                .to_string()
        };
        let mut args = vec!["--net-dir".to_string(), absolute(&self.net_dir)];
        if let Some(uplink) = &self.net_uplink {
            args.extend(["--net-uplink".to_string(), absolute(uplink)]);
        }
        if let Some(dns) = self.net_dns {
            args.extend(["--net-dns".to_string(), dns.to_string()]);
        }
        let list = |nets: &[mayfly_network::Ipv4Net]| {
            nets.iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        if !self.net_reach.is_empty() {
            args.extend(["--net-reach".to_string(), list(&self.net_reach)]);
        }
        if !self.net_never.is_empty() {
            args.extend(["--net-never".to_string(), list(&self.net_never)]);
        }
        args
    }
}

/// Whether and how to jail the VMM (see vmm/src/jail.rs).
#[derive(Args)]
pub(crate) struct JailArgs {
    /// Run the VMM jailed: in mount, PID, network, IPC and UTS namespaces and a cgroup v2 of
    /// its own, and, before the guest runs, shut into an empty root holding only what the VM
    /// still opens (its disk directory, its vsock socket's directory, --jail-share
    /// directories), as --jail-uid with no capabilities. Needs root. `mayfly fork` (as root)
    /// forks a jailed VM into clones each in a jail of its own.
    #[arg(long)]
    pub(crate) jail: bool,
    /// Where the jail's directory is made (removed when the VMM ends).
    #[arg(long, value_name = "DIR", default_value = mayfly_jail::jail::DEFAULT_DIR, requires = "jail")]
    pub(crate) jail_dir: PathBuf,
    /// The uid the jailed VMM runs as.
    #[arg(long, value_name = "UID", default_value_t = mayfly_jail::jail::DEFAULT_ID, requires = "jail")]
    pub(crate) jail_uid: u32,
    /// The gid the jailed VMM runs as.
    #[arg(long, value_name = "GID", default_value_t = mayfly_jail::jail::DEFAULT_ID, requires = "jail")]
    pub(crate) jail_gid: u32,
    /// A directory the jailed VMM sees at the same path and may write (where its snapshots
    /// go; --jail-uid must be able to write it). Repeat for more.
    #[arg(long = "jail-share", value_name = "DIR", requires = "jail")]
    pub(crate) jail_share: Vec<PathBuf>,
    /// The jail cgroup's memory.max, in MiB (guest RAM the VMM touched counts).
    #[arg(long, value_name = "MIB", requires = "jail")]
    pub(crate) jail_memory_mib: Option<u64>,
    /// The jail cgroup's cpu.max, in CPUs (0.5: half a CPU's time).
    #[arg(long, value_name = "CPUS", requires = "jail")]
    pub(crate) jail_cpus: Option<f64>,
    /// The jail cgroup's pids.max (default 256 where the pids controller is available).
    #[arg(long, value_name = "N", requires = "jail")]
    pub(crate) jail_pids: Option<u64>,
}

impl JailArgs {
    pub(crate) fn config(&self) -> Option<mayfly_jail::jail::JailConfig> {
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

/// A VM's file as given, or beside its control socket: `<api-sock><suffix>` (the vsock
/// socket, `.vsock`; the disk directory, `.disks`).
pub(crate) fn beside_socket(
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
pub(crate) struct RunArgs {
    /// Guest kernel: an x86-64 vmlinux (booted through its PVH entry if it has one) or a bzImage.
    #[arg(long, value_name = "PATH")]
    pub(crate) kernel: Option<PathBuf>,
    /// Initial ramdisk (cpio, optionally compressed as the kernel supports). Without --kernel
    /// or --initrd, the built-in initramfs.
    #[arg(long, value_name = "PATH")]
    pub(crate) initrd: Option<PathBuf>,
    /// Kernel command line (replaces the default).
    #[arg(long, value_name = "STR", default_value = DEFAULT_CMDLINE)]
    pub(crate) cmdline: String,
    /// Guest memory in MiB.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MEM_MIB)]
    pub(crate) mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub(crate) vcpus: u32,
    /// Serial console: `stdio` (output to stdout, input from stdin) or a file to write it to.
    #[arg(long, value_name = "stdio|FILE", default_value = "stdio")]
    pub(crate) console: Console,
    /// CPU template (JSON list of CPUID masks) instead of the built-in default.
    #[arg(long, value_name = "FILE")]
    pub(crate) cpu_template: Option<PathBuf>,
    /// Serve the control socket (HTTP/1.1 + JSON) at this path: pause, resume, snapshot, fork.
    #[arg(long, value_name = "PATH")]
    pub(crate) api_sock: Option<PathBuf>,
    /// The VM's name (default vm-<pid>). Its guest reads it with `mayfly-identity`.
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Option<String>,
    /// Print boot phase timestamps on stderr (for benchmarks).
    #[arg(long, hide = true)]
    pub(crate) boot_trace: bool,
    /// Give the VM the probe device (the probe benchmark's guest reports through it).
    #[arg(long, hide = true)]
    pub(crate) probe: bool,
    /// The host side of the VM's vsock device: a Unix socket (host-to-guest connections
    /// send `CONNECT <port>`; guest-to-host ones reach `<PATH>_<port>`). Default:
    /// `<api-sock>.vsock` when there is a control socket.
    #[arg(long, value_name = "PATH")]
    pub(crate) vsock: Option<PathBuf>,
    /// The guest's vsock CID.
    #[arg(long, value_name = "CID", default_value_t = DEFAULT_GUEST_CID)]
    pub(crate) vsock_cid: u64,
    /// Boot from a disk: `debian` (the image `rootfs/build.sh debian` builds) or the path of an
    /// ext4 image. It becomes /dev/vda, the root file system, writable through the VM's own
    /// copy-on-write layer (the image itself is never written); the initramfs is not used.
    #[arg(long, value_name = "debian|PATH")]
    pub(crate) rootfs: Option<String>,
    /// Attach a disk: PATH of a raw image, writable through the VM's own layer, or PATH,ro.
    /// Repeat for more (vdb, vdc, ... after the root file system's vda).
    #[arg(long = "disk", value_name = "PATH[,ro]")]
    pub(crate) disks: Vec<String>,
    /// Where the VM's writable disks keep their own layers and manifests. Default:
    /// `<api-sock>.disks` when there is a control socket. Started again with the same
    /// directory (after a crash, say), the disks carry on on the same layers.
    #[arg(long, value_name = "DIR")]
    pub(crate) disk_dir: Option<PathBuf>,
    /// The VM's network: `none` (no NIC at all), `open` (anything but the host's own VM
    /// links), or `allow=CIDR[:PORT],...` (only these destinations; names are resolved and
    /// pinned now). Enforced outside the guest, in the VM's own network namespace; changeable
    /// at runtime (`mayfly net --policy`), kept by snapshots, restores and forks.
    #[arg(long, value_name = "none|open|allow=...", default_value = "none")]
    pub(crate) net: String,
    #[command(flatten)]
    pub(crate) net_place: NetPlaceArgs,
    #[command(flatten)]
    pub(crate) jail: JailArgs,
}

impl RunArgs {
    /// Check every argument before any VM exists, so bad input costs nothing.
    pub(crate) fn into_config(self) -> Result<RunConfig, Error> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_boots_with_the_memory_mayfly_run_boots_with() {
        // The manager counts a sandbox that names no memory as this much against its budget.
        assert_eq!(mayfly_serve::DEFAULT_MEM_MIB, DEFAULT_MEM_MIB);
    }

    #[test]
    fn the_console_limit_default_is_the_managers() {
        assert_eq!(
            parse_console_limit("64M"),
            Ok(mayfly_serve::DEFAULT_CONSOLE_LIMIT)
        );
        assert!(parse_console_limit("1").is_err());
        assert!(parse_console_limit("lots").is_err());
    }

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
