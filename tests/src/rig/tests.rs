//! Tests of the rig: KVM detection, option and environment checks, quoting for sh and QEMU,
//! the directories L1 shares and keeps, reading QEMU's log; and one run of L1 for real
//! (ignored unless asked for).

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::l1::{command_env, kept_dirs, run_script, rw_dirs, sh_quote};
use super::qemu::qemu_escape;
use super::run::count_bad_vmexits;
use super::*;

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "mayfly-rig-test-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn detection_needs_real_kvm_without_pvm_and_a_device() {
    let t = TempDir::new("detect");
    let module = t.0.join("module");
    let dev = t.0.join("kvm");
    fs::create_dir_all(&module).unwrap();
    assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
    fs::write(&dev, b"").unwrap();
    assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
    fs::create_dir_all(module.join("kvm_amd")).unwrap();
    assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Host);
    fs::create_dir_all(module.join("kvm_pvm")).unwrap();
    assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
    fs::remove_dir(module.join("kvm_pvm")).unwrap();
    fs::remove_file(&dev).unwrap();
    assert_eq!(detect_kvm_location(&module, &dev), KvmLocation::Rig);
}

#[test]
fn location_parses() {
    assert_eq!("host".parse::<KvmLocation>().unwrap(), KvmLocation::Host);
    assert_eq!(" rig\n".parse::<KvmLocation>().unwrap(), KvmLocation::Rig);
    assert!("kvm".parse::<KvmLocation>().is_err());
    assert_eq!(KvmLocation::Rig.to_string(), "rig");
}

#[test]
fn quoting_round_trips_through_sh() {
    let nasty = [
        "plain",
        "with space",
        "it's",
        "'",
        "",
        "$HOME `x` \"q\" \\ *",
        "a\nb",
    ];
    let mut script = b"for a in".to_vec();
    for s in nasty {
        script.push(b' ');
        script.extend_from_slice(&sh_quote(s.as_bytes()));
    }
    script.extend_from_slice(b"; do printf '%s\\0' \"$a\"; done");
    let out = Command::new("sh")
        .arg("-c")
        .arg(OsStr::from_bytes(&script))
        .output()
        .unwrap();
    let got: Vec<&[u8]> = out.stdout.split(|&b| b == 0).collect();
    let want: Vec<&[u8]> = nasty
        .iter()
        .map(|s| s.as_bytes())
        .chain([&b""[..]])
        .collect();
    assert_eq!(got, want);
}

#[test]
fn env_settings() {
    let (k, v) = parse_env_setting(OsStr::new("A_1=x=y")).unwrap();
    assert_eq!(
        (k.as_os_str(), v.as_os_str()),
        (OsStr::new("A_1"), OsStr::new("x=y"))
    );
    assert!(parse_env_setting(OsStr::new("novalue")).is_err());
    assert!(parse_env_setting(OsStr::new("1A=x")).is_err());
    assert!(parse_env_setting(OsStr::new("A-B=x")).is_err());
    assert!(parse_env_setting(OsStr::new("=x")).is_err());
}

#[test]
fn run_script_forces_host_inside_and_quotes() {
    let opts = RigOptions {
        env: vec![("MAYFLY_TEST_KVM".into(), "rig".into())],
        ..RigOptions::default()
    };
    let env = command_env(&opts).unwrap();
    let script = run_script(
        Path::new("/work/it's"),
        &env,
        &[OsStr::new("echo"), OsStr::new("a b")],
    );
    let text = String::from_utf8(script).unwrap();
    let last_force = text
        .lines()
        .rfind(|l| l.starts_with("export MAYFLY_TEST_KVM="))
        .unwrap();
    assert_eq!(last_force, "export MAYFLY_TEST_KVM='host'");
    assert!(text.contains("cd '/work/it'\\''s' ||"));
    assert!(text.ends_with("exec 'echo' 'a b'\n"));
}

#[test]
fn rw_dirs_are_checked_and_ordered() {
    let t = TempDir::new("rw");
    let inner = t.0.join("a/b");
    fs::create_dir_all(&inner).unwrap();
    let dirs = rw_dirs(&[inner.clone(), t.0.clone(), t.0.join("a/../a/b")]).unwrap();
    let real = fs::canonicalize(&t.0).unwrap();
    assert_eq!(dirs, vec![real.clone(), real.join("a/b")]);
    assert!(rw_dirs(&[t.0.join("missing")]).is_err());
    assert!(rw_dirs(&[PathBuf::from("/")]).is_err());
    assert!(rw_dirs(&[PathBuf::from("/proc")]).is_err());
    fs::write(t.0.join("file"), b"").unwrap();
    assert!(rw_dirs(&[t.0.join("file")]).is_err());
}

#[test]
fn bad_options_are_errors() {
    let base = RigOptions {
        kernel: Some("/nonexistent".into()),
        initrd: Some("/nonexistent".into()),
        ..RigOptions::default()
    };
    let empty: [&str; 0] = [];
    assert!(matches!(run(&base, &empty), Err(RigError::EmptyCommand)));
    let cases = [
        RigOptions {
            cpus: 0,
            ..base.clone()
        },
        RigOptions {
            mem_mib: 1,
            ..base.clone()
        },
        RigOptions {
            cpu_model: "EPYC -monitor stdio".into(),
            ..base.clone()
        },
        RigOptions {
            timeout: Some(Duration::ZERO),
            ..base.clone()
        },
    ];
    for opts in cases {
        assert!(matches!(
            run(&opts, &["true"]),
            Err(RigError::BadOption { .. })
        ));
    }
    let missing = run(
        &RigOptions {
            qemu: Some("/bin/true".into()),
            ..base
        },
        &["true"],
    );
    assert!(matches!(missing, Err(RigError::ArtifactMissing { .. })));
}

#[test]
fn qemu_option_commas_are_doubled() {
    assert_eq!(qemu_escape(Path::new("/a,b")), OsString::from("/a,,b"));
}

#[test]
fn bad_vmexits_are_counted_from_the_qemu_log() {
    let log = "qemu-system-x86_64: warning: something else\n\
        rig-qemu: cpu 1: a #VMEXIT (exit code 0x400) outside guest mode (rip ffffffff8155f70c, vmcb 0x101b04000, npt 1): the guest's VMCB gets the host's registers\n\
        rig-qemu: cpu 0: a #VMEXIT (exit code 0x7b) outside guest mode (rip 1, vmcb 0x2000, npt 0): the guest's VMCB gets the host's registers\n";
    assert_eq!(count_bad_vmexits(log), 2);
    assert_eq!(count_bad_vmexits(""), 0);
}

#[test]
fn keeps_only_dirs_under_tmp_and_run_that_l1_would_hide() {
    let t = TempDir::new("keep");
    let inner = t.0.join("inner");
    fs::create_dir_all(&inner).unwrap();
    let kept = kept_dirs(&[inner.clone(), t.0.clone(), PathBuf::from("/usr")]);
    // The temp dir is under /tmp (unless TMPDIR says otherwise); its inner dir comes along.
    if t.0.canonicalize().unwrap().starts_with("/tmp") {
        assert_eq!(kept, vec![t.0.canonicalize().unwrap()]);
    }
    assert!(kept_dirs(&[PathBuf::from("/tmp"), PathBuf::from("/usr")]).is_empty());
}

/// Boots L1 for real (about 2 s): `cargo test -p mayfly-tests -- --ignored`.
#[test]
#[ignore = "boots the rig's L1 under QEMU (needs qemu-system-x86 and the L1 kernel)"]
fn rig_end_to_end() {
    let t = TempDir::new("e2e");
    let opts = RigOptions {
        rw: vec![t.0.clone()],
        env: vec![("MAYFLY_E2E".into(), "it's here".into())],
        timeout: Some(Duration::from_secs(120)),
        ..RigOptions::default()
    };
    let out_file = t.0.join("out");
    let script = format!(
        "cat /sys/module/kvm_amd/parameters/nested; echo \"$MAYFLY_E2E\"; \
         echo done > {}; exit 3",
        String::from_utf8_lossy(&sh_quote(out_file.as_os_str().as_bytes()))
    );
    let out = run(&opts, &["sh", "-c", &script]).expect("the rig runs");
    assert_eq!(out.status, 3, "{}", out.output_lossy());
    assert_eq!(out.output_lossy(), "1\nit's here\n");
    assert_eq!(fs::read_to_string(&out_file).unwrap(), "done\n");

    let short = RigOptions {
        timeout: Some(Duration::from_secs(3)),
        ..RigOptions::default()
    };
    match run(&short, &["sleep", "60"]) {
        Err(RigError::Timeout { console_log, .. }) => {
            // The control directory is kept for debugging; this one is not needed.
            if let Some(dir) = console_log.parent() {
                let _ = fs::remove_dir_all(dir);
            }
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}
