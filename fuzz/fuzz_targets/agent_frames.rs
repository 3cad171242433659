//! The agent protocol from both ends. The host reads what a guest's agent sends (the guest is
//! the adversary): frames, messages and each reply, through the same client a program uses.
//! The agent reads what the host sends: requests and their fields. Bad bytes end a call with
//! an error, never a panic, a hang or an allocation the sender asked for.
//!
//! Input: the first byte picks the client call; the rest is the byte stream the other end
//! sent (also fed to the incremental decoder in pieces, and parsed as request payloads).
#![no_main]

use std::io::{self, Read, Write};

use libfuzzer_sys::fuzz_target;
use mayfly_agent_protocol::{read_message, AgentClient, FrameDecoder, FrameType, Message, Request};

/// A connection whose peer sent `data` and then closed; what we write goes nowhere.
struct Peer<'a> {
    data: &'a [u8],
}

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.data.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn client_call(op: u8, stream: &[u8]) {
    let mut client = AgentClient::new(Peer { data: stream });
    match op % 8 {
        0 => {
            let _ = client.hello();
        }
        1 => {
            let _ = client.read_file("/f", io::sink());
        }
        2 => {
            let _ = client.stat("/f", true);
        }
        3 => {
            let _ = client.list("/");
        }
        4 => {
            let _ = client.identity();
        }
        5 => {
            let _ = client.ping();
        }
        6 => {
            let _ = client.mkdir("/d", 0o755, true);
        }
        _ => {
            let _ = client.remove("/f", true);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&op, stream)) = data.split_first() else {
        return;
    };
    client_call(op, stream);

    // Message by message, as a blocking reader takes them.
    let mut reader = stream;
    for _ in 0..64 {
        match read_message(&mut reader) {
            Ok(Some(_)) => {}
            _ => break,
        }
    }

    // The incremental decoder (the agent's event loop), fed in pieces of `op`'s size, and
    // every request it yields parsed as the agent parses it.
    let piece = usize::from(op).max(1);
    let mut decoder = FrameDecoder::new();
    'feed: for chunk in stream.chunks(piece) {
        decoder.push(chunk);
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => {
                    if frame.kind == FrameType::Request {
                        if let Ok(request) = Request::parse(&frame.payload) {
                            let _ = request.validate();
                        }
                    }
                    let _ = Message::from_frame(frame);
                }
                Ok(None) => break,
                Err(_) => break 'feed,
            }
        }
    }
    if let Ok(request) = Request::parse(stream) {
        let _ = request.validate();
    }
});
