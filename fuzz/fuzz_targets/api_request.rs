//! One request on the control socket, as the server reads it: the request line, headers,
//! body framing (Content-Length, chunked), then the route and its JSON arguments; and the same
//! request as a VMM standing by for a snapshot reads it. Anyone who
//! can reach the socket writes these bytes; a bad request gets an error status, never a
//! panic, and never an allocation it asked for.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;

/// More than the reader ever takes in before it refuses (and less than a socket buffer holds,
/// so writing it all first cannot block).
const MAX_INPUT: usize = 64 << 10;

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_INPUT {
        return;
    }
    // The same bytes to a VM's control socket and to a VMM standing by (`restore --standby`).
    for standby in [false, true] {
        let (mut client, server) = UnixStream::pair().expect("a socket pair");
        // The whole request, then end of stream: the reader never waits for more.
        if client.write_all(data).is_err() {
            return;
        }
        let _ = client.shutdown(std::net::Shutdown::Write);
        if standby {
            let _ = mayfly_vmm::persist::standby::route(&server);
        } else {
            let _ = mayfly_api::read_and_route(
                &server,
                Duration::from_millis(100),
                Duration::from_millis(500),
            );
        }
    }
});
