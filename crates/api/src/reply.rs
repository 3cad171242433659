//! The VM's answer to a request: an HTTP status, an optional JSON body, and what the reply
//! keeps until it is written.

/// The VM's answer: an HTTP status and an optional JSON body.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Option<serde_json::Value>,
    /// Kept until the answer is written (or cannot be), then dropped.
    pub until_written: UntilWritten,
}

/// What a reply keeps until it is written: told that the answer reached the client's socket
/// (or never told, if it did not), then dropped. A fork's held clones run when it is dropped
/// after the answer went out (so that the answer goes out before they all take the CPU), and
/// stop if it never did. Compares equal to any other.
#[derive(Clone, Default)]
pub struct UntilWritten(Option<std::sync::Arc<dyn Delivery>>);

/// Kept by a reply until it is written (see [`Reply::keeping`]).
pub trait Delivery: Send + Sync {
    /// The answer was written whole to the client's socket.
    fn delivered(&self) {}
}

impl UntilWritten {
    /// The answer was written whole: say so to what the reply keeps.
    pub fn delivered(&self) {
        if let Some(kept) = &self.0 {
            kept.delivered();
        }
    }
}

impl std::fmt::Debug for UntilWritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "held" } else { "none" })
    }
}

impl PartialEq for UntilWritten {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Reply {
    /// 200 with a body.
    pub fn ok(body: serde_json::Value) -> Self {
        Self {
            status: 200,
            body: Some(body),
            until_written: UntilWritten::default(),
        }
    }

    /// 204: done, nothing to say.
    pub fn no_content() -> Self {
        Self {
            status: 204,
            body: None,
            until_written: UntilWritten::default(),
        }
    }

    /// An error status with the body `{"error": message}`. Say what went wrong and what to do.
    pub fn error(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            body: Some(serde_json::json!({ "error": message.into() })),
            until_written: UntilWritten::default(),
        }
    }

    /// Keep `value` until this reply has been written (or could not be), then drop it; it is
    /// told first if the answer was written ([`Delivery::delivered`]).
    pub fn keeping(mut self, value: impl Delivery + 'static) -> Self {
        self.until_written = UntilWritten(Some(std::sync::Arc::new(value)));
        self
    }
}
