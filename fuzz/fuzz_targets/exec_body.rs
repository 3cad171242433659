//! The body of `POST /vm/exec`, as the control socket checks it before anything reaches the
//! guest's agent: JSON with `argv` or `shell`, `env`, `clear_env`, `cwd`, `user`,
//! `timeout_ms`, `stdin` or `stdin_base64`, `stream`. Anyone who can reach the socket (a
//! sandbox's own token holder, through the manager) writes these bytes: a bad body is a 400
//! that says what to send, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = mayfly_api::check_exec_body(data);
});
