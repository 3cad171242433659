//! `mayfly serve` with hostile tenants (issue 34), on this machine's KVM with the probe guest:
//! a sandbox's token cannot take the manager's connections from the admin, a VMM that stops
//! answering costs its caller a bounded wait (504), a client that hangs up ends the call it
//! started; a sandbox token gets the same 403 for every name not its own and is accepted in
//! one spelling only, as is a credential; credentials expire, name their audience, are
//! rotated and revoked one sandbox at a time, a fork's clone gets its own; sandbox tokens may
//! expire.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use mayfly_tests::guest::TestDir;
use mayfly_tests::serve::{call, Manager};
use serde_json::{json, Value};

/// One request sent as it is (`auth` is the whole Authorization header line, if any); the
/// whole answer as bytes.
fn raw(sock: &Path, auth: Option<&str>, method: &str, path: &str, body: &str) -> Vec<u8> {
    let mut stream = send(sock, auth, method, path, body);
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    answer
}

fn send(sock: &Path, auth: Option<&str>, method: &str, path: &str, body: &str) -> UnixStream {
    let mut stream = UnixStream::connect(sock).unwrap_or_else(|e| panic!("connect {sock:?}: {e}"));
    let auth = auth.map(|a| format!("{a}\r\n")).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
}

fn status_of(answer: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(answer);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"))
}

/// The host pid of sandbox `name`'s VMM (its own answer: a jailed VMM's waiter is its parent).
fn vmm_pid(m: &Manager, name: &str) -> libc::pid_t {
    let (status, body) = m.admin("GET", &format!("/sandboxes/{name}/vm"), None);
    assert_eq!(status, 200, "{body}");
    libc::pid_t::try_from(body["pid"].as_u64().unwrap()).unwrap()
}

fn signal(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) of a VMM this test's manager started.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

/// Threads of the manager serving a connection now.
fn serving(m: &Manager) -> usize {
    let tasks = std::fs::read_dir(format!("/proc/{}/task", m.process.pid())).unwrap();
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "serve-conn")
        })
        .count()
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

// Class 1: one tenant cannot hold every connection of the manager, a stalled VMM costs a
// bounded wait, and a client's hang-up ends its call.

#[test]
fn tenants_with_stalled_vmms_cannot_take_the_managers_connections_from_the_admin() {
    let dir = TestDir::new("tenants-lanes");
    let m = Manager::start(&dir);
    // Five sandboxes of one tenant, each with its token; their VMMs stop answering (as a
    // stalled guest call would, or a long exec): each request passed to them waits.
    let hogs: Vec<(String, String, libc::pid_t)> = (1..=5)
        .map(|i| {
            let name = format!("hog-{i}");
            let token = m.create_probe(&name, None);
            let pid = vmm_pid(&m, &name);
            (name, token, pid)
        })
        .collect();
    m.create_probe("victim", None);
    for (_, _, pid) in &hogs {
        signal(*pid, libc::SIGSTOP);
    }
    let sent = Instant::now();
    let mut streams: Vec<(usize, UnixStream)> = (0..300)
        .map(|i| {
            let (name, token, _) = &hogs[i % hogs.len()];
            let auth = format!("Authorization: Bearer {token}");
            let path = format!("/sandboxes/{name}/vm");
            (i % hogs.len(), send(&m.sock, Some(&auth), "GET", &path, ""))
        })
        .collect();
    // The admin's list and delete answer at once all the same.
    let started = Instant::now();
    let (status, body) = m.admin("GET", "/sandboxes", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = m.admin("DELETE", "/sandboxes/victim", None);
    assert_eq!(status, 200, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the admin waited {:?}",
        started.elapsed()
    );
    // Each token was told to come back later past its share, with Retry-After; the requests
    // each holds are few.
    // Answered: those whose answer came whole within 3 s (the refusals are immediate; a
    // held request's answer can come only at its deadline, 15 s).
    let mut answers: Vec<Option<Vec<u8>>> = vec![None; streams.len()];
    let mut partial: Vec<Vec<u8>> = vec![Vec::new(); streams.len()];
    for (_, stream) in &streams {
        stream.set_nonblocking(true).unwrap();
    }
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(3) {
        for (i, (_, stream)) in streams.iter().enumerate() {
            if answers[i].is_some() {
                continue;
            }
            let mut buf = [0u8; 4096];
            match (&mut &*stream).read(&mut buf) {
                Ok(0) => answers[i] = Some(std::mem::take(&mut partial[i])),
                Ok(n) => partial[i].extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut held = Vec::new();
    let mut held_by = [0usize; 5];
    let mut refused = 0;
    for ((hog, stream), answer) in streams.drain(..).zip(answers) {
        match answer {
            Some(answer) => {
                let text = String::from_utf8_lossy(&answer);
                let status = status_of(&answer);
                assert!(status == 429 || status == 503, "{text}");
                assert!(text.contains("\r\nRetry-After: 1\r\n"), "{text}");
                refused += 1;
            }
            None => {
                stream.set_nonblocking(false).unwrap();
                held_by[hog] += 1;
                held.push(stream);
            }
        }
    }
    assert!(
        held_by.iter().all(|n| *n <= 16),
        "connections held by each token: {held_by:?} ({refused} refused)"
    );
    assert!(refused >= 300 - 5 * 16, "{refused} refused");
    // What they hold ends with 504 once the manager's deadline for a VMM passes (15 s for a
    // read of the VM's state), not never.
    for mut stream in held {
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        // Nothing was read of these yet.
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(status_of(&answer), 504, "{text}");
        assert!(
            text.contains("did not answer GET /vm within 15 s"),
            "{text}"
        );
    }
    let waited = sent.elapsed();
    assert!(waited < Duration::from_secs(30), "504 after {waited:?}");
    for (name, token, pid) in &hogs {
        signal(*pid, libc::SIGCONT);
        let path = format!("/sandboxes/{name}/vm");
        let (status, body) = call(&m.sock, Some(token), "GET", &path, None);
        assert_eq!(status, 200, "{body}");
    }
}

#[test]
fn a_client_that_hangs_up_ends_the_vmm_call_it_started() {
    let dir = TestDir::new("tenants-hangup");
    let m = Manager::start(&dir);
    let token = m.create_probe("stuck", None);
    let pid = vmm_pid(&m, "stuck");
    signal(pid, libc::SIGSTOP);
    wait_until(
        "the test's earlier calls ended",
        Duration::from_secs(10),
        || serving(&m) == 0,
    );
    let auth = format!("Authorization: Bearer {token}");
    let stream = send(&m.sock, Some(&auth), "GET", "/sandboxes/stuck/vm", "");
    wait_until("the call reached the VMM", Duration::from_secs(10), || {
        serving(&m) == 1
    });
    drop(stream);
    // Well before the call's own deadline (15 s): the manager saw its client go, and closed
    // its connection to the VMM.
    let took = wait_until(
        "the manager ended the call of a client that left",
        Duration::from_secs(5),
        || serving(&m) == 0,
    );
    eprintln!("the call ended {took:?} after its client left");
    signal(pid, libc::SIGCONT);
    let (status, body) = call(&m.sock, Some(&token), "GET", "/sandboxes/stuck/vm", None);
    assert_eq!(status, 200, "{body}");
}

// Class 7: one answer for every name not the token's own; one spelling of each secret.

#[test]
fn a_sandbox_token_gets_one_403_for_every_name_not_its_own_and_one_spelling_passes() {
    let dir = TestDir::new("tenants-403");
    let m = Manager::start(&dir);
    let mine = m.create_probe("mine", None);
    m.create_probe("theirs", None);
    let auth = format!("Authorization: Bearer {mine}");
    for (method, tail, body) in [
        ("GET", "", ""),
        ("DELETE", "", ""),
        ("PUT", "/pause", ""),
        ("GET", "/vm", ""),
        ("POST", "/vm/exec", r#"{"argv": ["true"]}"#),
        ("PUT", "/token", ""),
        ("POST", "/fork", r#"{"count": 1}"#),
        ("POST", "/credential", "{}"),
        ("GET", "/nothing-here", ""),
    ] {
        let foreign = raw(
            &m.sock,
            Some(&auth),
            method,
            &format!("/sandboxes/theirs{tail}"),
            body,
        );
        let unknown = raw(
            &m.sock,
            Some(&auth),
            method,
            &format!("/sandboxes/no-such-one{tail}"),
            body,
        );
        assert_eq!(status_of(&foreign), 403, "{method} {tail}");
        assert_eq!(
            String::from_utf8_lossy(&foreign),
            String::from_utf8_lossy(&unknown),
            "{method} {tail}"
        );
    }

    // The token in the spelling it was given passes; no other does.
    let hex = mine.strip_prefix("mfs_").unwrap();
    let (status, body) = call(&m.sock, Some(&mine), "GET", "/sandboxes/mine", None);
    assert_eq!(status, 200, "{body}");
    for variant in [
        format!("Authorization: Bearer  {mine}"),
        format!("Authorization: Bearer mfs_{}", hex.to_uppercase()),
        format!("Authorization: Bearer MFS_{hex}"),
        format!("Authorization: Bearer +{mine}"),
        format!("Authorization: Bearer {mine}="),
        format!("Authorization: Bearer \t{mine}"),
    ] {
        let answer = raw(&m.sock, Some(&variant), "GET", "/sandboxes/mine", "");
        assert_eq!(status_of(&answer), 403, "{variant:?} passed");
    }

    // So is a credential: its hex in lower case, with no sign, is the one spelling.
    let verify = |credential: &str| {
        let (status, body) = m.admin(
            "POST",
            "/credentials/verify",
            Some(json!({ "credential": credential })),
        );
        assert_eq!(status, 200, "{body}");
        body
    };
    let mut tries = 0;
    let (credential, signed) = loop {
        let (status, body) = m.admin("POST", "/sandboxes/mine/credential", Some(json!({})));
        assert_eq!(status, 200, "{body}");
        let credential = body["credential"].as_str().unwrap().to_string();
        assert_eq!(verify(&credential)["valid"], true);
        // A byte of the MAC under 16 is written `0x`: `+x` reads as the same byte to a
        // parser that takes signs.
        let (claims, tag) = credential.split_once('.').unwrap();
        let at = (0..tag.len())
            .step_by(2)
            .find(|i| tag.as_bytes()[*i] == b'0');
        if let Some(at) = at {
            let signed = format!("{claims}.{}+{}", &tag[..at], &tag[at + 1..]);
            break (credential, signed);
        }
        tries += 1;
        assert!(tries < 50, "no MAC with a byte under 16 in 50 credentials");
    };
    let (claims, tag) = credential.split_once('.').unwrap();
    for variant in [
        credential.to_uppercase(),
        format!("mfc_{}.{tag}", claims[4..].to_uppercase()),
        format!("{claims}.{}", tag.to_uppercase()),
        signed,
        format!(" {credential}"),
        format!("{credential}\n"),
    ] {
        let answer = verify(&variant);
        assert_eq!(answer["valid"], false, "{variant:?} verified: {answer}");
    }
    assert_eq!(verify(&credential)["valid"], true);
}

// Class 10: credentials with a subject, an audience and an expiry; rotated, revoked; a
// clone's own; tokens that expire.

#[test]
fn credentials_expire_rotate_and_are_revoked_per_sandbox_and_tokens_expire() {
    let dir = TestDir::new("tenants-credentials");
    let m = Manager::start(&dir);
    let token = m.create_probe("owner", None);
    m.create_probe("other", None);
    let verify = |credential: &str, audience: Option<&str>| {
        let mut body = json!({ "credential": credential });
        if let Some(audience) = audience {
            body["audience"] = json!(audience);
        }
        let (status, body) = m.admin("POST", "/credentials/verify", Some(body));
        assert_eq!(status, 200, "{body}");
        body
    };
    let mint = |name: &str, body: Value| -> String {
        let (status, answer) =
            m.admin("POST", &format!("/sandboxes/{name}/credential"), Some(body));
        assert_eq!(status, 200, "{answer}");
        // The probe has no agent: the platform hands it over itself.
        assert_eq!(answer["delivered"], false, "{answer}");
        answer["credential"].as_str().unwrap().to_string()
    };

    // Minted for an audience, for a while: it says for which sandbox, and whom it is for.
    let first = mint("owner", json!({ "audience": "billing", "ttl_s": 3600 }));
    let said = verify(&first, None);
    assert_eq!(said["valid"], true, "{said}");
    assert_eq!(said["sandbox"], "owner");
    assert_eq!(said["audience"], "billing");
    assert!(said["expires_ms"].as_u64().is_some(), "{said}");
    assert_eq!(verify(&first, Some("billing"))["valid"], true);
    assert_eq!(verify(&first, Some("storage"))["valid"], false);

    // Rotated: the new one verifies, the one before it no longer does; the other sandbox's
    // is untouched.
    let others = mint("other", json!({}));
    let second = mint("owner", json!({}));
    assert_ne!(first, second);
    assert_eq!(verify(&second, None)["valid"], true);
    let old = verify(&first, None);
    assert_eq!(old["valid"], false, "{old}");
    assert!(old["error"].as_str().unwrap().contains("replaced"), "{old}");

    // Revoked: at once, this sandbox's only.
    let (status, body) = m.admin("DELETE", "/sandboxes/owner/credential", None);
    assert_eq!(status, 200, "{body}");
    let revoked = verify(&second, None);
    assert_eq!(revoked["valid"], false, "{revoked}");
    assert!(
        revoked["error"].as_str().unwrap().contains("revoked"),
        "{revoked}"
    );
    assert_eq!(verify(&others, None)["valid"], true);

    // A short one expires.
    let brief = mint("owner", json!({ "ttl_s": 1 }));
    assert_eq!(verify(&brief, None)["valid"], true);
    wait_until("the credential expired", Duration::from_secs(10), || {
        verify(&brief, None)["valid"] == false
    });
    let expired = verify(&brief, None);
    assert!(
        expired["error"].as_str().unwrap().contains("expired"),
        "{expired}"
    );

    // Only the admin mints or revokes, and only JSON objects are bodies.
    let (status, _) = call(
        &m.sock,
        Some(&token),
        "POST",
        "/sandboxes/owner/credential",
        Some(json!({})),
    );
    assert_eq!(status, 403);
    for bad in [
        "null",
        "[null,null]",
        "[]",
        "7",
        r#"{"ttl_s": 0}"#,
        r#"{"nope": 1}"#,
    ] {
        for (method, path) in [
            ("POST", "/sandboxes/owner/credential"),
            ("PUT", "/sandboxes/owner/token"),
            ("POST", "/sandboxes/owner/fork"),
            ("POST", "/credentials/verify"),
        ] {
            let auth = format!("Authorization: Bearer {}", m.admin);
            let answer = raw(&m.sock, Some(&auth), method, path, bad);
            assert_eq!(
                status_of(&answer),
                400,
                "{method} {path} {bad}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
    }

    // A fork's clone has a credential of its own; its source's does not verify as it.
    let source = mint("owner", json!({}));
    let (status, forked) = m.admin(
        "POST",
        "/sandboxes/owner/fork",
        Some(json!({ "names": ["clone"] })),
    );
    assert_eq!(status, 201, "{forked}");
    let clones = mint("clone", json!({ "audience": "billing" }));
    assert_ne!(clones, source);
    let as_clone = verify(&clones, None);
    assert_eq!(as_clone["sandbox"], "clone", "{as_clone}");
    let as_source = verify(&source, None);
    assert_eq!(as_source["valid"], true, "{as_source}");
    assert_eq!(as_source["sandbox"], "owner", "{as_source}");
    // The clone's rotation left its source's alone, and the other way round.
    let source_again = mint("owner", json!({}));
    assert_eq!(verify(&clones, None)["valid"], true);
    assert_eq!(verify(&source, None)["valid"], false);
    assert_eq!(verify(&source_again, None)["sandbox"], "owner");

    // Tokens: without a lifetime as before; with one, they expire.
    let (status, body) = call(&m.sock, Some(&token), "GET", "/sandboxes/owner", None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = m.admin("PUT", "/sandboxes/owner/token", Some(json!({ "ttl_s": 1 })));
    assert_eq!(status, 200, "{body}");
    let short = body["token"].as_str().unwrap().to_string();
    let (status, body) = call(&m.sock, Some(&token), "GET", "/sandboxes/owner", None);
    assert_eq!(status, 403, "the old token still works: {body}");
    wait_until("the token expired", Duration::from_secs(10), || {
        call(&m.sock, Some(&short), "GET", "/sandboxes/owner", None).0 == 403
    });
    let (status, body) = m.admin(
        "POST",
        "/sandboxes",
        Some(json!({
            "name": "lasting",
            "kernel": mayfly_tests::probe::ELF,
            "mem_mib": 64,
            "cmdline": "touch=1",
            "probe": true,
            "token_ttl_s": 3600,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let lasting = body["token"].as_str().unwrap();
    let (status, described) = call(&m.sock, Some(lasting), "GET", "/sandboxes/lasting", None);
    assert_eq!(status, 200, "{described}");
    assert!(
        described["token_expires_ms"].as_u64().is_some(),
        "{described}"
    );
}

#[test]
fn a_name_is_measured_by_the_socket_path_its_vmm_binds() {
    let dir = TestDir::new("tenants-path");
    let m = Manager::start(&dir);
    // The longest path a sandbox's VMM binds: its vsock socket for the highest port, beside
    // its control socket in its directory's `sock/`. A Unix socket path holds 107 bytes.
    let base = format!("{}/sandboxes/", m.state.display()).len();
    let tail = "/sock/vm.sock.vsock_4294967295".len();
    let fits = 107 - base - tail;
    assert!(
        (2..=63).contains(&fits),
        "the test directory's path ({base} bytes) leaves no room to test this"
    );
    let spec = |name: &str| {
        json!({
            "name": name,
            "kernel": mayfly_tests::probe::ELF,
            "mem_mib": 64,
            "cmdline": "touch=1",
            "probe": true,
        })
    };
    let over = "o".repeat(fits + 1);
    let (status, body) = m.admin("POST", "/sandboxes", Some(spec(&over)));
    assert_eq!(
        status,
        409,
        "a {}-byte socket path was let through: {body}",
        base + tail + fits + 1
    );
    assert!(
        body["error"].as_str().unwrap().contains("108 bytes long"),
        "{body}"
    );
    let (status, body) = m.admin("POST", "/sandboxes", Some(spec(&"f".repeat(fits))));
    assert_eq!(status, 201, "{body}");
}

#[test]
fn connections_that_never_send_their_request_cannot_take_the_managers_connections_from_the_admin() {
    let dir = TestDir::new("tenants-unread");
    let m = Manager::start(&dir);
    // Every connection the manager serves at once, each trickling a request head it never
    // finishes (as a slow client would, or one meaning harm).
    let trickling: Vec<UnixStream> = (0..256)
        .map(|_| {
            let mut stream = UnixStream::connect(&m.sock).unwrap();
            stream.write_all(b"GET /sandboxes HTTP/1.1\r\n").unwrap();
            stream
        })
        .collect();
    wait_until("the manager serves them", Duration::from_secs(30), || {
        serving(&m) >= 200
    });
    // The admin's list answers at once all the same (these hold their connections up to 30 s).
    let started = Instant::now();
    let (status, body) = m.admin("GET", "/sandboxes", None);
    assert_eq!(status, 200, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the admin waited {:?}",
        started.elapsed()
    );
    drop(trickling);
}
