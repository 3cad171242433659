//! The embedding example (`crates/vmm/examples/embed.rs`, docs/embedding.md) run on the probe
//! guest on this machine's KVM: mayfly as a library, in process, boots a VM, snapshots it,
//! forks it into two live clones (the example itself answers as their zygote), shuts it down
//! and restores the snapshot into a new VM. What it prints is checked step by step.

use std::process::Command;

use mayfly_tests::guest::mayfly_bin;

#[test]
fn the_embedding_example_boots_snapshots_forks_and_restores_in_process() {
    let example = mayfly_bin().with_file_name("examples").join("embed");
    assert!(
        example.exists(),
        "no example at {}: build it (cargo build --release --workspace --all-targets)",
        example.display()
    );
    let out = Command::new(&example)
        .args(["--kernel", mayfly_tests::probe::ELF, "--probe"])
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 7, "{stdout}");
    assert_eq!(lines[0], "booted: \"running\"");
    assert!(lines[1].starts_with("snapshot: "), "{stdout}");
    assert_eq!(
        lines[2],
        "clone: \"embedded-0\" (index 0, parent \"embedded\")"
    );
    assert_eq!(
        lines[3],
        "clone: \"embedded-1\" (index 1, parent \"embedded\")"
    );
    assert_eq!(lines[4], "shut down: Shutdown");
    assert!(
        lines[5].starts_with("restored: \"restored\" (generation 1, from \"restore of "),
        "{stdout}"
    );
    assert_eq!(lines[6], "shut down: Shutdown");
}
