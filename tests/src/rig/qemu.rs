//! QEMU's command line for the rig: the emulated machine with its SVM CPU, L1's kernel and
//! initramfs, its two serial ports (the command's console, L1's kernel log) and the 9p shares
//! (the host's root read-only, the control directory and each writable directory).

use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use super::options::{RigArtifacts, RigOptions};

/// A QEMU option value: commas are doubled.
pub(super) fn qemu_escape(path: &Path) -> OsString {
    let mut out = Vec::new();
    for &b in path.as_os_str().as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}

fn opt(prefix: &str, path: &Path, suffix: &str) -> OsString {
    let mut s = OsString::from(prefix);
    s.push(qemu_escape(path));
    s.push(suffix);
    s
}

pub(super) fn qemu_args(
    opts: &RigOptions,
    artifacts: &RigArtifacts,
    ctl: &Path,
    rw: &[PathBuf],
) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |items: &[&str]| args.extend(items.iter().map(OsString::from));
    // One host thread runs every emulated CPU. Multi-threaded TCG (thread=multi) breaks L2
    // guests: now and then a #VMEXIT comes while the CPU is in host mode with nested paging
    // on, and the guest's VMCB gets the L1 host's registers (the guest then runs at L1's RIP
    // with L1's CR3 and stalls or triple-faults). tests/tests/guest_stress.rs showed it in 3
    // runs of 3 with thread=multi and in none of 3 with thread=single; patches/0003 reports
    // each occurrence. MAYFLY_RIG_TCG_THREAD=multi brings it back, to study it.
    let thread = match std::env::var("MAYFLY_RIG_TCG_THREAD").as_deref() {
        Ok("multi") => "tcg,thread=multi",
        _ => "tcg,thread=single",
    };
    push(&["-accel", thread, "-M", "pc"]);
    push(&["-cpu", &opts.cpu_model]);
    push(&[
        "-smp",
        &opts.cpus.to_string(),
        "-m",
        &opts.mem_mib.to_string(),
    ]);
    push(&[
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]);
    // The state of every CPU at every reset, the one that ends L1 (a triple fault) included:
    // the evidence when L1 dies without a word on its console. A few KiB per reset.
    args.push("-d".into());
    args.push("cpu_reset".into());
    args.push("-D".into());
    args.push(ctl.join("qemu-cpu-reset.log").into());
    // kvm.tdp_mmu=0: L1's KVM with the TDP MMU, whose vCPUs update page tables concurrently
    // with atomic operations, corrupts its SPTEs under QEMU's software emulation when several
    // guests run at once ("Invalid SPTE change", then a BUG); the older MMU serialises updates.
    let append = format!(
        "console=ttyS1 loglevel={} panic=-1 mitigations=off random.trust_cpu=on kvm.tdp_mmu=0",
        opts.kernel_loglevel.min(8)
    );
    args.push("-kernel".into());
    args.push(artifacts.kernel.clone().into());
    args.push("-initrd".into());
    args.push(artifacts.initrd.clone().into());
    args.push("-append".into());
    args.push(append.into());
    // ttyS0: the command's console; QEMU also logs it to console.log.
    let mux = if opts.interactive { ",mux=on" } else { "" };
    args.push("-chardev".into());
    args.push(opt(
        &format!("stdio,id=con0,signal=off{mux},logfile="),
        &ctl.join("console.log"),
        "",
    ));
    args.push("-serial".into());
    args.push("chardev:con0".into());
    if opts.interactive {
        // Ctrl-A c switches to QEMU's monitor, Ctrl-A x quits.
        args.push("-mon".into());
        args.push("chardev=con0,mode=readline".into());
    }
    // ttyS1: L1's kernel console.
    args.push("-chardev".into());
    args.push(opt("file,id=klog,path=", &ctl.join("l1-kernel.log"), ""));
    args.push("-serial".into());
    args.push("chardev:klog".into());
    args.push("-virtfs".into());
    args.push(
        "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap"
            .into(),
    );
    for (i, dir) in std::iter::once(ctl)
        .chain(rw.iter().map(PathBuf::as_path))
        .enumerate()
    {
        args.push("-virtfs".into());
        args.push(opt(
            "local,path=",
            dir,
            &format!(",mount_tag=rw{i},security_model=passthrough,multidevs=remap"),
        ));
    }
    args
}
