//! The fuzzer's bytes read front to back as the fields a target needs; past the end, zeros.
//! Shared by the structured targets (`#[path]` module: cargo-fuzz builds each target alone).

pub struct Input<'a>(pub &'a [u8]);

impl<'a> Input<'a> {
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
    pub fn byte(&mut self) -> u8 {
        self.take(1).first().copied().unwrap_or(0)
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }
    pub fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
