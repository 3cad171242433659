//! mayfly from Rust, in process: boot a VM, snapshot it, fork it into live clones, shut it
//! down, restore the snapshot into a new VM, and (with a guest that runs `mayfly-agent`) run a
//! command in it. See docs/embedding.md.
//!
//! ```sh
//! cargo run --release -p mayfly-vmm --example embed -- --kernel KERNEL [--probe] [--exec CMD]
//! ```
//!
//! `tests/run` runs it on the probe guest (`--probe`, the kernel built by the tests crate:
//! `tests/tests/host_embed.rs`), which has no agent; `--exec` needs a Linux guest with one.
//! Each step prints one line; the exit status is 0 when every step worked.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use mayfly_api::{Action, ForkRequest};
use mayfly_vmm::boot::{boot, cpu_template};
use mayfly_vmm::config::RunConfig;
use mayfly_vmm::controller::Controller;
use mayfly_vmm::devices::config::{DevicesConfig, RestoreTargets, VsockConfig, DEFAULT_GUEST_CID};
use mayfly_vmm::devices::console::Console;
use mayfly_vmm::event::VmExit;
use mayfly_vmm::guest::agent::Agent;
use mayfly_vmm::kernel::Image;
use mayfly_vmm::persist::restore::{restore, Instance, MemoryMode, RestoreConfig, SnapshotSource};

type Error = Box<dyn std::error::Error>;

struct Options {
    kernel: PathBuf,
    probe: bool,
    exec: Option<String>,
}

fn options() -> Result<Options, Error> {
    let mut args = std::env::args().skip(1);
    let (mut kernel, mut probe, mut exec) = (None, false, None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--kernel" => kernel = args.next().map(PathBuf::from),
            "--probe" => probe = true,
            "--exec" => exec = args.next(),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let kernel = kernel.ok_or("give --kernel KERNEL (a vmlinux, or the probe guest's ELF)")?;
    Ok(Options {
        kernel,
        probe,
        exec,
    })
}

fn main() -> ExitCode {
    // A fork starts its clones' zygote as this very program (`embed zygote ...`): answer it.
    if let Some(status) = mayfly_vmm::launch::zygote_if_asked() {
        return status;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("embed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Wait until `sock` answers `GET /vm` with a VM in `state`.
fn wait_state(sock: &Path, state: &str) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, vm)) = mayfly_api::request(sock, "GET", "/vm", None) {
            if vm["state"] == state {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("{} never reported {state}", sock.display()).into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run() -> Result<(), Error> {
    let options = options()?;
    let dir = std::env::temp_dir().join(format!("mayfly-embed-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("vm.sock");
    let vsock = dir.join("vm.vsock");

    // 1. Boot: a configuration checked up front, then a `Vmm` (the machine and what runs
    //    around it), driven by a `Controller` on a thread of ours.
    let config = RunConfig {
        kernel: Image::File(options.kernel.clone()),
        initrd: None,
        cmdline: if options.probe {
            "touch=1".into()
        } else {
            mayfly_vmm::config::DEFAULT_CMDLINE.into()
        },
        mem_mib: if options.probe { 64 } else { 256 },
        vcpus: 1,
        console: Console::File(dir.join("console.log")),
        cpu_template: cpu_template(None)?,
        boot_trace: false,
        probe: options.probe,
        api_sock: Some(sock.clone()),
        name: "embedded".into(),
        devices: DevicesConfig {
            rng: true,
            vsock: Some(VsockConfig {
                guest_cid: DEFAULT_GUEST_CID,
                path: Some(vsock.clone()),
            }),
            ..DevicesConfig::default()
        },
    };
    let controller = Controller::new(boot(&config)?);
    let vm = controller.handle();
    let running = std::thread::spawn(move || controller.run());
    println!(
        "booted: {}",
        vm.request(Action::Describe).body.unwrap_or_default()["state"]
    );

    // 2. Snapshot: pause, write it, resume.
    let snap = dir.join("snap");
    for action in [
        Action::Pause,
        Action::Snapshot {
            path: snap.clone(),
            diff: false,
        },
        Action::Resume,
    ] {
        let reply = vm.request(action.clone());
        if reply.status >= 300 {
            return Err(format!("{action:?}: {} {:?}", reply.status, reply.body).into());
        }
    }
    println!("snapshot: {}", snap.display());

    // 3. Fork into two live clones, each a process of its own with its own control socket
    //    beside ours; they run once the fork's reply is dropped.
    let reply = vm.request(Action::Fork(ForkRequest {
        count: 2,
        name_prefix: None,
        parent_paused: false,
        overcommit: true,
    }));
    if reply.status != 200 {
        return Err(format!("fork: {} {:?}", reply.status, reply.body).into());
    }
    let clones: Vec<PathBuf> = reply.body.as_ref().map_or(Vec::new(), |body| {
        body["clones"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["api_sock"].as_str().map(PathBuf::from))
            .collect()
    });
    drop(reply);
    for clone in &clones {
        wait_state(clone, "running")?;
        let (_, described) = mayfly_api::request(clone, "GET", "/vm", None)?;
        println!(
            "clone: {} (index {}, parent {})",
            described["name"], described["clone_index"], described["parent"]
        );
        mayfly_api::request(clone, "PUT", "/vm/shutdown", None)?;
    }

    // 4. Shut the VM down: its controller's run ends with how it ended.
    vm.request(Action::Shutdown);
    let exit = running.join().map_err(|_| "the controller panicked")?;
    println!("shut down: {exit:?}");
    if exit != VmExit::Shutdown {
        return Err(format!("the VM ended as {exit:?}").into());
    }

    // 5. Restore the snapshot into a new VM, in this same process.
    let restored = restore(RestoreConfig {
        source: SnapshotSource::Dir(snap.clone()),
        memory: MemoryMode::Cow,
        instance: Instance {
            origin: format!("restore of {}", snap.display()),
            console: Console::File(dir.join("console-restored.log")),
            console_input: None,
            api_sock: Some(sock.clone()),
            paused: false,
            name: Some("restored".into()),
            clone_of: None,
            devices: RestoreTargets {
                vsock_path: Some(vsock.clone()),
                snapshot_dir: Some(snap.clone()),
                ..RestoreTargets::default()
            },
        },
    })?;
    let controller = Controller::new(restored);
    let vm = controller.handle();
    let running = std::thread::spawn(move || controller.run());
    let described = vm.request(Action::Describe).body.unwrap_or_default();
    println!(
        "restored: {} (generation {}, from {})",
        described["name"], described["generation"], described["origin"]
    );

    // 6. A command in the guest, through its agent (a Linux guest with mayfly-agent).
    if let Some(command) = &options.exec {
        let agent = Agent::for_vm(&sock)?;
        let output = agent.exec_output(&command_request(command), None)?;
        println!(
            "exec: {command:?} -> {:?}: {}",
            output.exit.exit_code,
            String::from_utf8_lossy(&output.stdout)
        );
    }

    vm.request(Action::Shutdown);
    let exit = running.join().map_err(|_| "the controller panicked")?;
    println!("shut down: {exit:?}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// `sh -c COMMAND` as the agent's exec request.
fn command_request(command: &str) -> mayfly_agent_protocol::ExecRequest {
    mayfly_agent_protocol::ExecRequest::shell(command)
}
