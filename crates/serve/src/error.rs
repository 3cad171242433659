//! The manager's one error type, and the HTTP status each kind of error answers with.
//!
//! Every layer returns [`ServeError`]; only the routes turn it into an answer (its status and
//! its text), so a refusal reads the same wherever it was found.

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    VmmFailed(String),
    #[error("{0}")]
    Busy(String),
    /// A budget of the manager's would be exceeded.
    #[error("{0}")]
    OverBudget(String),
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Api(#[from] mayfly_api::ApiError),
    #[error(transparent)]
    Claim(#[from] mayfly_sys::claim::ClaimError),
    /// The host's networking failed the manager's own check (not the request's policy: that
    /// is a [`ServeError::BadRequest`]).
    #[error("sandboxes' networks: {0}")]
    Network(mayfly_network::NetworkError),
}

impl ServeError {
    /// The HTTP status a request refused with this error gets.
    pub fn status(&self) -> u16 {
        match self {
            ServeError::BadRequest(_) => 400,
            ServeError::NotFound(_) => 404,
            ServeError::Conflict(_) => 409,
            ServeError::VmmFailed(_) => 502,
            ServeError::Busy(_) => 503,
            ServeError::OverBudget(_) => 429,
            ServeError::Io { .. }
            | ServeError::Api(_)
            | ServeError::Claim(_)
            | ServeError::Network(_) => 500,
        }
    }
}
