//! Just enough AML (the ACPI machine language of the DSDT) to name objects and describe
//! devices with fixed resources. Encodings from the ACPI 6.5 specification, chapter 20.

/// PkgLength: the length of a package including the PkgLength bytes themselves.
fn pkg_length(body_len: usize) -> Vec<u8> {
    // One byte holds lengths below 64 (6 bits); otherwise 4 bits in the lead byte plus 1 to 3
    // following bytes of 8 bits each.
    for extra in 0..=3usize {
        let total = body_len + 1 + extra;
        let fits = if extra == 0 {
            total < 1 << 6
        } else {
            total < 1 << (4 + 8 * extra)
        };
        if fits {
            if extra == 0 {
                return vec![total.to_le_bytes()[0]];
            }
            let extra_bits = u8::try_from(extra).expect("at most 3 extra bytes") << 6;
            let mut out = vec![extra_bits | (total.to_le_bytes()[0] & 0xf)];
            for i in 0..extra {
                out.push((total >> (4 + 8 * i)).to_le_bytes()[0]);
            }
            return out;
        }
    }
    panic!("AML package of {body_len} bytes is beyond the encoding's 256 MiB")
}

/// A four-character name segment, padded with `_` (e.g. "COM1", "_S5").
fn name_seg(name: &str) -> [u8; 4] {
    assert!(
        (1..=4).contains(&name.len()) && name.is_ascii(),
        "AML name segments are 1 to 4 ASCII characters: {name:?}"
    );
    let mut seg = [b'_'; 4];
    seg[..name.len()].copy_from_slice(name.as_bytes());
    seg
}

/// A name string: `\` for the root, then dot-separated segments (e.g. `\_SB.COM1`).
fn name_string(path: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let rest = match path.strip_prefix('\\') {
        Some(rest) => {
            out.push(b'\\');
            rest
        }
        None => path,
    };
    let segs: Vec<&str> = rest.split('.').filter(|s| !s.is_empty()).collect();
    match segs.len() {
        0 => out.push(0x00), // NullName
        1 => {}
        2 => out.push(0x2e), // DualNamePrefix
        n => {
            out.push(0x2f); // MultiNamePrefix
            out.push(u8::try_from(n).expect("a name of at most 255 segments"));
        }
    }
    for seg in segs {
        out.extend_from_slice(&name_seg(seg));
    }
    out
}

/// An integer constant, in the smallest encoding.
pub fn integer(value: u64) -> Vec<u8> {
    match value {
        0 => vec![0x00],
        1 => vec![0x01],
        v if v <= 0xff => vec![0x0a, v.to_le_bytes()[0]],
        v if v <= 0xffff => {
            let mut out = vec![0x0b];
            out.extend_from_slice(&v.to_le_bytes()[..2]);
            out
        }
        v if v <= 0xffff_ffff => {
            let mut out = vec![0x0c];
            out.extend_from_slice(&v.to_le_bytes()[..4]);
            out
        }
        v => {
            let mut out = vec![0x0e];
            out.extend_from_slice(&v.to_le_bytes());
            out
        }
    }
}

/// A compressed EISA ID such as "PNP0501", as `EisaId()` gives it.
pub fn eisa_id(id: &str) -> Vec<u8> {
    let b = id.as_bytes();
    assert!(
        b.len() == 7,
        "EISA IDs are three letters and four hex digits: {id:?}"
    );
    let letter = |c: u8| u32::from(c - 0x40) & 0x1f;
    let hex = u32::from_str_radix(&id[3..], 16).expect("EISA ID product number is hex");
    let raw = (letter(b[0]) << 26) | (letter(b[1]) << 21) | (letter(b[2]) << 16) | hex;
    // Stored byte-swapped (big endian in the table).
    integer(u64::from(raw.swap_bytes()))
}

/// A string constant.
pub fn string(text: &str) -> Vec<u8> {
    assert!(
        text.is_ascii() && !text.contains('\0'),
        "AML strings are ASCII without NUL"
    );
    let mut out = vec![0x0d];
    out.extend_from_slice(text.as_bytes());
    out.push(0);
    out
}

/// `Method (name, args) { body }`, not serialized.
pub fn method(name: &str, args: u8, body: &[Vec<u8>]) -> Vec<u8> {
    assert!(args < 8, "AML methods take at most 7 arguments");
    let mut inner = name_string(name);
    inner.push(args);
    for b in body {
        inner.extend_from_slice(b);
    }
    let mut out = vec![0x14];
    out.extend(pkg_length(inner.len()));
    out.extend(inner);
    out
}

/// `Notify (path, value)`.
pub fn notify(path: &str, value: u64) -> Vec<u8> {
    let mut out = vec![0x86];
    out.extend(name_string(path));
    out.extend(integer(value));
    out
}

/// `Name (name, value)`.
pub fn name(name: &str, value: &[u8]) -> Vec<u8> {
    let mut out = vec![0x08];
    out.extend(name_string(name));
    out.extend_from_slice(value);
    out
}

/// `Package () { elements }`.
pub fn package(elements: &[Vec<u8>]) -> Vec<u8> {
    let mut body = vec![u8::try_from(elements.len()).expect("a package of at most 255 elements")];
    for e in elements {
        body.extend_from_slice(e);
    }
    let mut out = vec![0x12];
    out.extend(pkg_length(body.len()));
    out.extend(body);
    out
}

/// `Buffer () { bytes }`.
pub fn buffer(bytes: &[u8]) -> Vec<u8> {
    let mut body = integer(bytes.len() as u64);
    body.extend_from_slice(bytes);
    let mut out = vec![0x11];
    out.extend(pkg_length(body.len()));
    out.extend(body);
    out
}

fn named_block(opcode: &[u8], path: &str, contents: &[Vec<u8>]) -> Vec<u8> {
    let mut body = name_string(path);
    for c in contents {
        body.extend_from_slice(c);
    }
    let mut out = opcode.to_vec();
    out.extend(pkg_length(body.len()));
    out.extend(body);
    out
}

/// `Scope (path) { contents }`.
pub fn scope(path: &str, contents: &[Vec<u8>]) -> Vec<u8> {
    named_block(&[0x10], path, contents)
}

/// `Device (name) { contents }`.
pub fn device(name: &str, contents: &[Vec<u8>]) -> Vec<u8> {
    named_block(&[0x5b, 0x82], name, contents)
}

/// Resource descriptors for `_CRS`, ended by the end tag.
pub fn resource_template(descriptors: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes: Vec<u8> = descriptors.concat();
    bytes.extend_from_slice(&[0x79, 0x00]); // end tag, checksum 0 = not computed
    buffer(&bytes)
}

/// `IO (Decode16, base, base, 1, len)`: a fixed range of I/O ports.
pub fn io_ports(base: u16, len: u8) -> Vec<u8> {
    let mut d = vec![0x47, 0x01];
    d.extend_from_slice(&base.to_le_bytes());
    d.extend_from_slice(&base.to_le_bytes());
    d.extend_from_slice(&[0x01, len]);
    d
}

/// `IRQNoFlags () { irq }`: an ISA interrupt, edge-triggered, active high.
pub fn irq(irq: u8) -> Vec<u8> {
    assert!(irq < 16, "ISA interrupts are 0 to 15");
    let mask = 1u16 << irq;
    let mut d = vec![0x22];
    d.extend_from_slice(&mask.to_le_bytes());
    d
}

/// `Memory32Fixed (ReadWrite, base, len)`.
pub fn memory32_fixed(base: u32, len: u32) -> Vec<u8> {
    let mut d = vec![0x86, 0x09, 0x00, 0x01];
    d.extend_from_slice(&base.to_le_bytes());
    d.extend_from_slice(&len.to_le_bytes());
    d
}

/// `Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive) { gsi }`.
pub fn interrupt(gsi: u32) -> Vec<u8> {
    let mut d = vec![0x89, 0x06, 0x00, 0x03, 0x01];
    d.extend_from_slice(&gsi.to_le_bytes());
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pkg_length_encodings() {
        assert_eq!(pkg_length(5), vec![6]);
        assert_eq!(pkg_length(62), vec![63]);
        // 63 + 2 = 65 = 0x41: lead byte 0x41 & 0xf with one extra byte 0x04.
        assert_eq!(pkg_length(63), vec![0x41, 0x04]);
        assert_eq!(pkg_length(0x1000), vec![0x83, 0x00, 0x01]);
    }

    #[test]
    fn s5_package_matches_the_hand_assembled_bytes() {
        let s5 = name(
            "_S5",
            &package(&[integer(5), integer(0), integer(0), integer(0)]),
        );
        assert_eq!(
            s5,
            vec![0x08, b'_', b'S', b'5', b'_', 0x12, 0x07, 0x04, 0x0a, 0x05, 0x00, 0x00, 0x00]
        );
    }

    #[test]
    fn eisa_id_of_a_16550() {
        // EisaId ("PNP0501") is 0x0105D041.
        assert_eq!(eisa_id("PNP0501"), vec![0x0c, 0x41, 0xd0, 0x05, 0x01]);
    }

    #[test]
    fn names_and_scopes() {
        assert_eq!(name_string("\\_SB"), vec![b'\\', b'_', b'S', b'B', b'_']);
        assert_eq!(
            name_string("\\_SB.COM1"),
            vec![b'\\', 0x2e, b'_', b'S', b'B', b'_', b'C', b'O', b'M', b'1']
        );
        let dev = device("COM1", &[name("_UID", &integer(1))]);
        assert_eq!(&dev[..2], &[0x5b, 0x82]);
        assert_eq!(usize::from(dev[2]), dev.len() - 2);
    }

    #[test]
    fn strings_methods_and_notify() {
        assert_eq!(string("AB"), vec![0x0d, b'A', b'B', 0]);
        let m = method("_EVT", 1, &[notify("\\_SB.VGEN", 0x80)]);
        // MethodOp, PkgLength, "_EVT", flags, NotifyOp, \, DualNamePrefix, _SB_, VGEN, 0x80.
        assert_eq!(m[0], 0x14);
        assert_eq!(usize::from(m[1]), m.len() - 1);
        assert_eq!(&m[2..7], &[b'_', b'E', b'V', b'T', 1]);
        assert_eq!(&m[7..10], &[0x86, b'\\', 0x2e]);
        assert_eq!(&m[m.len() - 2..], &[0x0a, 0x80]);
    }

    #[test]
    fn resources() {
        assert_eq!(
            memory32_fixed(0xee000, 0x1000)[..4],
            [0x86, 0x09, 0x00, 0x01]
        );
        assert_eq!(interrupt(5), vec![0x89, 0x06, 0x00, 0x03, 0x01, 5, 0, 0, 0]);
        assert_eq!(
            io_ports(0x3f8, 8),
            vec![0x47, 0x01, 0xf8, 0x03, 0xf8, 0x03, 0x01, 0x08]
        );
        assert_eq!(irq(4), vec![0x22, 0x10, 0x00]);
        let crs = resource_template(&[io_ports(0x3f8, 8), irq(4)]);
        // BufferOp, PkgLength, size (ByteConst 13), 8 + 3 + 2 bytes.
        assert_eq!(&crs[..4], &[0x11, 0x10, 0x0a, 13]);
    }
}
