//! Disks in real guests: the Debian root file system (`--rootfs debian`, built by
//! `rootfs/build.sh debian`) over virtio-blk, with each VM's writes in its own copy-on-write
//! layer: files survive snapshot and restore in every memory mode, stay apart across clones,
//! survive a kill -9 after `sync`, and the base image is never written. Run through tests/run
//! (the host's KVM or the rig's).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mayfly_tests::agent::{sh, wait_agent};
use mayfly_tests::guest::{cache_dir, mayfly_ok, Guest, TestDir, BOOT_TIMEOUT};

const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

/// The Debian image: the test fails (it does not skip) when it is not built.
fn debian_image() -> PathBuf {
    let image = cache_dir().join("rootfs/debian.current/root.ext4");
    assert!(
        image.is_file(),
        "{} is missing: run rootfs/build.sh debian (scripts/setup.sh does)",
        image.display()
    );
    image
}

/// What would change if anything wrote the base: its size, mtime and ctime.
fn base_stamp() -> (u64, i64, i64, i64, i64) {
    let meta = std::fs::metadata(debian_image()).unwrap();
    (
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
    )
}

/// Boot the Debian disk as `name`, with `extra` arguments; returns once its agent answers.
fn boot(dir: &TestDir, name: &str, extra: &[&str]) -> (Guest, PathBuf) {
    let sock = dir.join(&format!("{name}.sock"));
    let mut args = vec![
        "run".to_string(),
        "--rootfs".into(),
        "debian".into(),
        "--name".into(),
        name.into(),
        "--api-sock".into(),
        sock.to_string_lossy().into_owned(),
        "--console".into(),
        dir.arg(&format!("{name}.log")),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let guest = Guest::start(&args);
    wait_agent(&sock, BOOT_TIMEOUT);
    (guest, sock)
}

fn restore(dir: &TestDir, snap: &Path, name: &str, mode: &str) -> (Guest, PathBuf) {
    let sock = dir.join(&format!("{name}.sock"));
    let guest = Guest::start(&[
        "restore",
        &snap.to_string_lossy(),
        "--memory",
        mode,
        "--name",
        name,
        "--api-sock",
        &sock.to_string_lossy(),
        "--console",
        &dir.arg(&format!("{name}.log")),
    ]);
    wait_agent(&sock, BOOT_TIMEOUT);
    (guest, sock)
}

fn kill9(mut guest: Guest) {
    guest.signal(libc::SIGKILL);
    guest.wait_exit(EXIT_TIMEOUT);
}

#[test]
fn the_debian_disk_runs_python_and_its_files_survive_snapshot_and_restore() {
    let dir = TestDir::new("disk-debian");
    let stamp = base_stamp();
    let (vm, sock) = boot(&dir, "deb", &[]);
    // The root is the virtio disk, writable, and Debian's userland is on it.
    assert_eq!(
        sh(
            &sock,
            "test \"$(mountpoint -d /)\" = \"$(cat /sys/block/vda/dev)\" && \
             awk '$2 == \"/\" { print substr($4, 1, 2) }' /proc/mounts"
        ),
        "rw",
        "the root is vda, mounted read-write"
    );
    assert_eq!(sh(&sock, "python3 -c 'print(1+1)'"), "2");
    assert!(sh(&sock, "cat /etc/debian_version").starts_with("12."));
    sh(
        &sock,
        "mkdir -p /work && echo kept > /work/a && head -c 3000000 /dev/urandom > /work/big \
         && sha256sum /work/big > /work/big.sum && sync",
    );
    let snap = dir.join("snap");
    mayfly_ok(&[
        "snapshot",
        "--sock",
        &sock.to_string_lossy(),
        &snap.to_string_lossy(),
    ]);
    // Written after the snapshot: the parent's own, no restore of the snapshot sees it.
    sh(&sock, "echo later > /work/later && sync");
    kill9(vm);

    for mode in ["cow", "lazy", "eager"] {
        let name = format!("r-{mode}");
        let (vm, rsock) = restore(&dir, &snap, &name, mode);
        assert_eq!(sh(&rsock, "cat /work/a"), "kept", "{mode}");
        sh(&rsock, "sha256sum -c /work/big.sum >/dev/null");
        assert_eq!(
            sh(&rsock, "test -e /work/later && echo yes || echo no"),
            "no",
            "{mode}: a write made after the snapshot"
        );
        // Each restore writes on a layer of its own: the next one does not see this.
        assert_eq!(
            sh(&rsock, "ls /work | grep -c '^mine-' || true"),
            "0",
            "{mode}"
        );
        sh(&rsock, &format!("echo {mode} > /work/mine-{mode} && sync"));
        kill9(vm);
    }
    assert_eq!(base_stamp(), stamp, "the base image was written");
}

#[test]
fn clones_write_apart_and_a_clone_restores_after_its_parent_is_gone() {
    let dir = TestDir::new("disk-fork");
    let stamp = base_stamp();
    let (parent, sock) = boot(&dir, "p", &[]);
    sh(&sock, "echo from-parent > /root/shared && sync");
    let sock_arg = sock.to_string_lossy().into_owned();
    let answer: serde_json::Value =
        serde_json::from_str(&mayfly_ok(&["fork", "--sock", &sock_arg, "--count", "3"])).unwrap();
    let clones: Vec<(String, PathBuf)> = answer["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                PathBuf::from(c["api_sock"].as_str().unwrap()),
            )
        })
        .collect();
    assert_eq!(clones.len(), 3);
    for (name, csock) in &clones {
        assert_eq!(sh(csock, "cat /root/shared"), "from-parent");
        sh(csock, &format!("echo {name} > /root/clone-{name} && sync"));
    }
    for (name, csock) in &clones {
        assert_eq!(
            sh(csock, "cd /root && ls clone-*"),
            format!("clone-{name}"),
            "{name} sees only its own file"
        );
    }
    assert_eq!(
        sh(&sock, "ls /root | grep -c '^clone-' || true"),
        "0",
        "the parent sees none of its clones' files"
    );

    // A fork of a fork: the grandchild sees what its parent clone wrote.
    let (first, first_sock) = &clones[0];
    let answer: serde_json::Value = serde_json::from_str(&mayfly_ok(&[
        "fork",
        "--sock",
        &first_sock.to_string_lossy(),
        "--count",
        "1",
    ]))
    .unwrap();
    let grandchild = PathBuf::from(answer["clones"][0]["api_sock"].as_str().unwrap());
    assert_eq!(
        sh(&grandchild, "cat /root/shared /root/clone-*"),
        format!("from-parent\n{first}")
    );

    // A clone's snapshot holds its whole chain: it restores with the parent and the parent's
    // disk directory gone.
    let (second, second_sock) = &clones[1];
    let snap = dir.join("clone-snap");
    mayfly_ok(&[
        "snapshot",
        "--sock",
        &second_sock.to_string_lossy(),
        &snap.to_string_lossy(),
    ]);
    for csock in [&grandchild, &clones[0].1, &clones[1].1, &clones[2].1] {
        mayfly_ok(&["shutdown", "--sock", &csock.to_string_lossy()]);
    }
    kill9(parent);
    std::fs::remove_dir_all(dir.join("p.sock.disks")).unwrap();
    let (vm, rsock) = restore(&dir, &snap, "again", "cow");
    assert_eq!(
        sh(&rsock, "cat /root/shared /root/clone-*"),
        format!("from-parent\n{second}")
    );
    kill9(vm);
    assert_eq!(base_stamp(), stamp, "the base image was written");
}

#[test]
fn synced_writes_survive_a_kill_and_the_file_system_checks_clean() {
    let dir = TestDir::new("disk-kill");
    // A second disk, an empty ext4 made here: the guest can check it unmounted. Its 1 KiB
    // blocks are smaller than the layers' 4 KiB ones, so the guest's writes also take the
    // layer's read-modify-write path.
    let data = dir.join("data.img");
    std::fs::File::create(&data)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let mkfs = std::process::Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-b", "1024"])
        .arg(&data)
        .status()
        .expect("mke2fs (e2fsprogs) is installed");
    assert!(mkfs.success());
    let before = std::fs::read(&data).unwrap();
    let disks = dir.arg("disks");
    let data_arg = data.to_string_lossy().into_owned();
    let extra = ["--disk", &data_arg, "--disk-dir", &disks];
    let (vm, sock) = boot(&dir, "k", &extra);
    sh(
        &sock,
        "mkdir -p /mnt/data && mount /dev/vdb /mnt/data && head -c 1000000 /dev/urandom \
         > /mnt/data/f && sha256sum /mnt/data/f > /root/f.sum && sync",
    );
    kill9(vm);
    // Started again on the same disk directory: the same layers, the synced data there.
    let (vm, sock) = boot(&dir, "k", &extra);
    sh(
        &sock,
        "mkdir -p /mnt/data && mount /dev/vdb /mnt/data && sha256sum -c /root/f.sum >/dev/null \
         && umount /mnt/data",
    );
    sh(&sock, "e2fsck -fn /dev/vdb >/dev/null 2>&1");
    mayfly_ok(&["shutdown", "--sock", &sock.to_string_lossy()]);
    let mut vm = vm;
    vm.wait_exit(EXIT_TIMEOUT);
    assert_eq!(
        std::fs::read(&data).unwrap(),
        before,
        "the guest's writes went to the image, not to its layer"
    );
}
