//! Bad input to `mayfly run` gives one clear line and a non-zero status, never a panic, and
//! never gets as far as running a guest. These need no working KVM.

use std::process::{Command, Output};

use mayfly_tests::guest::mayfly_bin;

fn mayfly(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(mayfly_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("mayfly starts")
}

/// Asserts a one-line error containing `expected` and exit status `code`.
fn assert_error(output: &Output, code: i32, expected: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(code), "stderr: {stderr}");
    assert!(
        stderr.contains(expected),
        "expected {expected:?} in {stderr:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(output.stdout.is_empty(), "no guest output expected");
}

fn scratch(name: &str, contents: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mayfly-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn missing_kernel_file() {
    let out = mayfly(&["run", "--kernel", "/nonexistent/vmlinux"], &[]);
    assert_error(&out, 1, "cannot open the kernel /nonexistent/vmlinux");
}

#[test]
fn kernel_that_is_not_elf_or_bzimage() {
    let path = scratch("not-a-kernel", b"#!/bin/sh\necho hello\n");
    let out = mayfly(&["run", "--kernel", path.to_str().unwrap()], &[]);
    assert_error(&out, 1, "is neither an x86-64 ELF vmlinux nor a bzImage");
}

#[test]
fn elf_for_another_architecture() {
    let mut elf = vec![0u8; 64];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2;
    elf[18] = 183; // aarch64
    let path = scratch("arm64.elf", &elf);
    let out = mayfly(&["run", "--kernel", path.to_str().unwrap()], &[]);
    assert_error(&out, 1, "not an x86-64 executable");
}

#[test]
fn missing_initrd_file() {
    let out = mayfly(&["run", "--initrd", "/nonexistent/initrd"], &[]);
    assert_error(&out, 1, "cannot open the initrd /nonexistent/initrd");
}

#[test]
fn memory_too_small() {
    let out = mayfly(&["run", "--mem-mib", "4"], &[]);
    assert_error(&out, 1, "--mem-mib 4 is too small");
}

#[test]
fn memory_beyond_the_host() {
    let out = mayfly(&["run", "--mem-mib", "100000000"], &[]);
    assert_error(&out, 1, "is more than this host's");
}

#[test]
fn zero_vcpus() {
    let out = mayfly(&["run", "--vcpus", "0"], &[]);
    assert_error(&out, 1, "at least one vCPU");
}

#[test]
fn too_many_vcpus() {
    let out = mayfly(&["run", "--vcpus", "1000"], &[]);
    assert_error(&out, 1, "--vcpus 1000 is more than mayfly supports");
}

#[test]
fn no_kvm_device() {
    let out = mayfly(&["run"], &[("MAYFLY_KVM_DEVICE", "/nonexistent/kvm")]);
    assert_error(
        &out,
        1,
        "/nonexistent/kvm does not exist: this host has no KVM",
    );
}

#[test]
fn no_permission_on_the_kvm_device() {
    // A device node root may open but nobody else: run mayfly as nobody.
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("setpriv (util-linux) is installed");
    let node = scratch("kvm-node", b"");
    std::fs::remove_file(&node).unwrap();
    let path = std::ffi::CString::new(node.to_str().unwrap()).unwrap();
    // SAFETY: mknod with a valid path and mode; the result is checked.
    let rc = unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(10, 232)) };
    assert_eq!(rc, 0, "mknod: {}", std::io::Error::last_os_error());
    let out = Command::new(setpriv)
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(mayfly_bin())
        .arg("run")
        .env("MAYFLY_KVM_DEVICE", &node)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_error(&out, 1, "permission denied opening");
}

#[test]
fn bad_cpu_template() {
    let path = scratch(
        "template.json",
        br#"{"name":"x","cpuid":[{"leaf":"0x1","register":"exx"}]}"#,
    );
    let out = mayfly(&["run", "--cpu-template", path.to_str().unwrap()], &[]);
    assert_error(&out, 1, "is not valid");
}

#[test]
fn unknown_flag_is_a_usage_error() {
    let out = mayfly(&["run", "--frobnicate"], &[]);
    assert_error(&out, 2, "unexpected argument '--frobnicate'");
}

#[test]
fn help_describes_run() {
    let out = mayfly(&["run", "--help"], &[]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    for flag in [
        "--kernel",
        "--initrd",
        "--cmdline",
        "--mem-mib",
        "--vcpus",
        "--console",
    ] {
        assert!(help.contains(flag), "{flag} missing from {help}");
    }
}

#[test]
fn a_network_policy_that_does_not_parse() {
    for (policy, expected) in [
        ("closed", "\"closed\" is not a network policy"),
        ("allow=10.0.0.0/33", "is not an allowlist entry"),
        ("allow=10.0.0.1:0", "out of range"),
        ("allow=10.0.0.1:65536", "out of range"),
        ("allow=", "lists no destination"),
        ("allow=2001:db8::1", "IPv6"),
    ] {
        let out = mayfly(&["run", "--net", policy], &[]);
        assert_error(&out, 1, expected);
        assert_error(&out, 1, "use none, open, or allow=CIDR[:PORT]");
    }
}

#[test]
fn restore_standby_needs_a_socket_and_no_snapshot() {
    let out = mayfly(&["restore", "--standby"], &[]);
    assert_error(&out, 2, "--api-sock");
    let out = mayfly(
        &["restore", "--standby", "/snap", "--api-sock", "/tmp/s.sock"],
        &[],
    );
    assert_error(&out, 2, "'--standby' cannot be used with '[DIR]'");
    let out = mayfly(
        &[
            "restore",
            "--standby",
            "--api-sock",
            "/tmp/s.sock",
            "--jail",
        ],
        &[],
    );
    assert_error(&out, 2, "'--standby' cannot be used with '--jail'");
    let out = mayfly(&["restore"], &[]);
    assert_error(&out, 2, "<DIR>");
}

#[test]
fn a_missing_snapshot_is_said_before_a_missing_kvm() {
    let out = mayfly(
        &["restore", "/nonexistent/snapshot"],
        &[("MAYFLY_KVM_DEVICE", "/nonexistent/kvm")],
    );
    assert_error(&out, 1, "cannot open /nonexistent/snapshot");
}
