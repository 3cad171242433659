//! The Python client (clients/python) against a real `mayfly serve` with the default Linux
//! guest (run through tests/run, on a KVM that runs Linux): its pytest suite
//! (tests/test_serve.py: the life cycle, errors, 50 execs across 10 sandboxes with asyncio)
//! passes, and the RL example forks a task into rollouts, scores them and picks the right one.
//! The suite needs Debian's python3-pytest (scripts/setup.sh installs it); without it this
//! test fails, it does not skip.

use std::path::{Path, PathBuf};
use std::process::Command;

use mayfly_tests::guest::TestDir;
use mayfly_tests::serve::Manager;

fn client_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository")
        .join("clients/python")
}

/// Run the system Python (the one python3-pytest is for) in clients/python with the manager
/// in its environment: whether it exited 0, and what it printed.
fn python(m: &Manager, args: &[&str]) -> (bool, String) {
    let dir = client_dir();
    let out = Command::new("/usr/bin/python3")
        .args(args)
        .current_dir(&dir)
        .env("MAYFLY_SOCK", &m.sock)
        .env("MAYFLY_STATE_DIR", &m.state)
        .env_remove("MAYFLY_TOKEN")
        .env("PYTHONPATH", dir.join("src"))
        // The checkout is read-only in the rig: no bytecode, no pytest cache.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("/usr/bin/python3 runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("python3 {}:\n{text}", args.join(" "));
    (out.status.success(), text)
}

#[test]
fn the_python_client_passes_its_suite_and_the_rl_example_picks_the_right_rollout() {
    let dir = TestDir::new("serve-python");
    let m = Manager::start(&dir);

    let (ok, out) = python(
        &m,
        &[
            "-m",
            "pytest",
            "-v",
            "-s",
            "-p",
            "no:cacheprovider",
            "tests/test_serve.py",
        ],
    );
    assert!(ok, "the Python client's suite failed:\n{out}");
    assert!(out.contains("3 passed"), "{out}");
    assert!(!out.contains("skipped"), "{out}");

    // The README's five-line example, as it is written there.
    let readme = std::fs::read_to_string(client_dir().join("README.md")).unwrap();
    let example = readme
        .split("```python\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a python example in clients/python/README.md");
    let (ok, out) = python(&m, &["-c", example]);
    assert!(ok, "the README's example failed:\n{out}");
    assert!(out.starts_with("Linux "), "{out}");
    assert_eq!(out.matches("hello").count(), 3, "{out}");

    let (ok, out) = python(&m, &["examples/rl_rollouts.py"]);
    assert!(ok, "the RL example failed:\n{out}");
    // Round 1: six candidates from one snapshot of the task; numeric sort (the second
    // candidate, so the second clone) is the only one that passes every case.
    assert!(
        out.contains("best: rl-task-2 (numeric sort, reward 1.00)"),
        "{out}"
    );
    assert!(out.contains("lexicographic sort"), "{out}");
    // Round 2 starts from that rollout's VM, its patch in place.
    assert!(
        out.contains("(squeeze blanks and tabs, reward 1.00)"),
        "{out}"
    );
    // Everything the example and the suite made is gone.
    let (status, body) = m.admin("GET", "/sandboxes", None);
    assert_eq!(status, 200);
    assert_eq!(body["sandboxes"], serde_json::json!([]), "{body}");
}
