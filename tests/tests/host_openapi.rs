//! The manager's OpenAPI document (`GET /openapi.json`, crates/serve/src/openapi.json) checked
//! by a tool nobody here wrote: schemathesis, run with every check against a running manager
//! (jailed sandboxes, a memory budget) that serves a probe sandbox, on this machine's KVM. It
//! sends what the document says is valid and what it says is not, every method a path does
//! not serve, requests without a token, and chains of requests through the links it infers
//! (a create, then everything on the sandbox it made); every answer must be one the document
//! gives, shaped as it says.
//!
//! schemathesis comes from `MAYFLY_SCHEMATHESIS` (the path of its program) or `schemathesis`
//! on PATH; tests/run installs it (`pip install schemathesis==4.32.5` into a venv under
//! target/). Without it this test fails, saying how to install it.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use mayfly_tests::guest::TestDir;
use mayfly_tests::probe;
use mayfly_tests::serve::{call, tcp_forwarder, Manager};

/// The sandbox every operation's `name` example names (crates/serve/src/openapi.json): the
/// probe sandbox this test makes, so that the examples reach a live sandbox.
const EXAMPLE_SANDBOX: &str = "my-sandbox";
/// The schemathesis release the document is checked with (tests/run installs this one).
const SCHEMATHESIS: &str = "4.32.5";
/// Fixed, so that a failure can be run again as it was.
const SEED: &str = "20260101";
/// Cases per operation in each phase: enough to reach every documented status, few enough
/// for about a minute on a 2-core machine.
const MAX_EXAMPLES: &str = "100";

/// schemathesis' program: `MAYFLY_SCHEMATHESIS`, or `schemathesis` on PATH.
fn schemathesis() -> PathBuf {
    if let Some(path) = std::env::var_os("MAYFLY_SCHEMATHESIS") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "MAYFLY_SCHEMATHESIS={} is not a file: point it at schemathesis' program \
             (tests/run installs it into target/schemathesis/bin/)",
            path.display()
        );
        return path;
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("schemathesis"))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "schemathesis is not installed: this test checks the manager's OpenAPI document \
                 with it. Install it (tests/run does) with\n    python3 -m venv \
                 target/schemathesis && target/schemathesis/bin/pip install \
                 schemathesis=={SCHEMATHESIS}\nand run the test with \
                 MAYFLY_SCHEMATHESIS=target/schemathesis/bin/schemathesis (or put schemathesis \
                 on PATH)"
            )
        })
}

/// What schemathesis loads beside its checks (its `hooks` file). This host's KVM runs the
/// probe guest only (a Linux guest never reaches user space here): a sandbox that boots the
/// built-in guest, or a kernel the generator names, would never answer its guest routes, and
/// the files a generated body names (kernel, initrd, rootfs, snapshot) are not on the host.
/// So a create the generator means to be valid is given the probe's machine (its name, idle
/// timeout, `acts_for` and `no_agent` kept); a create meant to be invalid goes as generated,
/// and must be refused.
fn hooks(probe_elf: &str) -> String {
    format!(
        r#"import schemathesis

PROBE = {{"kernel": {probe_elf:?}, "probe": True, "cmdline": "touch=1", "mem_mib": 64}}
KEPT = {{"name", "idle_timeout_s", "acts_for", "no_agent"}}


# Strings with a grammar of their own (a policy, a listening address) that the schema gives
# as plain strings: a positive case gets a valid one, the rest of its body as generated.
GRAMMAR = {{
    ("PUT", "/sandboxes/{{name}}/vm/net/policy"): {{"policy": "allow=192.0.2.1"}},
    ("PUT", "/sandboxes/{{name}}/vm/net/expose"): {{"on": "tcp:127.0.0.1:0"}},
    ("PUT", "/sandboxes/{{name}}/vm/net/unexpose"): {{"on": "tcp:127.0.0.1:1"}},
    ("POST", "/sandboxes/{{name}}/ports"): {{"host": "tcp:127.0.0.1:0"}},
}}


@schemathesis.hook
def before_call(context, case, kwargs):
    meta = case.meta
    if meta is not None and not meta.generation.mode.is_positive:
        return
    op = (case.operation.method.upper(), case.operation.path)
    if op in GRAMMAR and isinstance(case.body, dict):
        for key, value in GRAMMAR[op].items():
            if key in case.body:
                case.body[key] = value
        return
    if op != ("POST", "/sandboxes"):
        return
    if isinstance(case.body, dict):
        body = {{k: v for k, v in case.body.items() if k in KEPT}}
        body.update(PROBE)
        case.body = body
"#
    )
}

#[test]
fn schemathesis_finds_the_manager_true_to_its_openapi_document() {
    let program = schemathesis();
    let version = Command::new(&program)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("{} --version: {e}", program.display()));
    let version = String::from_utf8_lossy(&version.stdout).into_owned();
    assert!(
        version.contains(SCHEMATHESIS),
        "{} is not schemathesis {SCHEMATHESIS}: {version}",
        program.display()
    );

    let dir = TestDir::new("serve-schemathesis");
    // Jailed sandboxes (the default), and a memory budget: generated creates and forks meet
    // it (429) before they can take the host's memory. A generated create with a network
    // gets it in a namespace of this test's own, never on the host's.
    let net = mayfly_tests::netns::TestNet::new(&dir);
    let mut args = vec!["--mem-budget-mib", "1024"];
    args.extend(net.args());
    let m = Manager::start_with(&dir, &args);
    m.create_probe(EXAMPLE_SANDBOX, None);
    let addr = tcp_forwarder(&m.sock);

    let hooks_path = dir.join("hooks.py");
    std::fs::write(&hooks_path, hooks(probe::ELF)).unwrap();
    let config = dir.join("schemathesis.toml");
    std::fs::write(
        &config,
        format!(
            "hooks = {:?}\n\n[generation]\n# Every run from its seed alone, not from \
             examples kept by an earlier run.\ndatabase = \"none\"\n",
            hooks_path.display().to_string()
        ),
    )
    .unwrap();

    let started = Instant::now();
    let output = Command::new(&program)
        .arg("--no-color")
        .arg("--config-file")
        .arg(&config)
        .arg("run")
        .arg(format!("http://{addr}/openapi.json"))
        .args(["-H", &format!("Authorization: Bearer {}", m.admin)])
        // Every check schemathesis has: none is left out (each applies to this API; the
        // ones it cannot use here, object-level authorization across users, it skips itself).
        .args(["--checks", "all"])
        .args(["--max-examples", MAX_EXAMPLES])
        .args(["--seed", SEED])
        .args(["--workers", "1"])
        // Its .hypothesis and .schemathesis directories go into the test's own.
        .current_dir(&dir.0)
        .env("NO_COLOR", "1")
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    let took = started.elapsed();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = report
        .lines()
        .rev()
        .find(|l| l.starts_with('=') && l.contains(" in "))
        .unwrap_or_default()
        .to_owned();
    assert!(
        output.status.success()
            && !summary.contains("failure")
            && !summary.contains("error")
            && report.contains("Test cases:"),
        "schemathesis found the manager untrue to its OpenAPI document ({:?}, {summary}):\n{report}",
        output.status
    );
    let summary_block = report
        .find("SUMMARY")
        .and_then(|at| report[..at].rfind('\n').map(|line| &report[line + 1..]))
        .unwrap_or(&summary);
    println!("schemathesis ({took:.0?}):\n{summary_block}");
    // And the manager is still there, its probe sandbox still answering (unless the run
    // deleted it, which it may).
    let (status, body) = call(&m.sock, None, "GET", "/metrics", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = m.admin("GET", "/sandboxes", None);
    assert_eq!(status, 200, "{body}");
}

/// A request for a sandbox whose VMM has just died, before the manager noticed, is told what
/// the life cycle says (409: it is dead, and what to do), never a 5xx: the VMM's death is not
/// the manager's fault, nor a gateway's.
#[test]
fn a_request_racing_a_vmms_death_is_told_the_sandbox_is_dead() {
    let dir = TestDir::new("serve-racing-death");
    let m = Manager::start(&dir);
    let token = m.create_probe("short-lived", None);
    let pid = m.describe("short-lived")["pid"].as_u64().unwrap();
    // SAFETY: kill(2) of a VMM this test's manager started.
    unsafe { libc::kill(libc::pid_t::try_from(pid).unwrap(), libc::SIGKILL) };
    let deadline = Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (status, body) = call(
            &m.sock,
            Some(&token),
            "GET",
            "/sandboxes/short-lived/vm",
            None,
        );
        assert!(
            status == 200 || status == 409,
            "a request for a dying sandbox got {status}: {body}"
        );
        if status == 409 {
            let error = body["error"].as_str().unwrap_or_default();
            assert!(error.contains("is dead"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "the VMM never died: {body}");
    }
    assert_eq!(m.describe("short-lived")["state"], "dead");
}
