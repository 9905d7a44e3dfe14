//! Every failure a client sees: an HTTP status and OpenAI's error object,
//! naming the request field at fault where there is one.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_engine::EngineError;

use crate::wire::{ErrorBody, ErrorDetail};

/// A failed request, as the client will read it.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for a 429.
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
            code: None,
            retry_after: None,
        }
    }

    /// With an error code.
    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The error's JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind,
                param: self.param.clone(),
                code: self.code,
            },
        }
    }

    /// An engine error: the request's own fault (a 400), overload (429),
    /// the deadline (504), the engine gone (503), or the server's (500).
    pub fn from_engine(e: &EngineError) -> ApiError {
        let (status, kind, param, code) = match e {
            EngineError::PromptTooLong { .. } => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("messages"),
                Some("context_length_exceeded"),
            ),
            EngineError::MaxTokensTooSmall { .. } => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("max_tokens"),
                Some("max_tokens_too_small"),
            ),
            EngineError::UnsupportedSchema(_) => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("response_format"),
                Some("unsupported_schema"),
            ),
            EngineError::UnknownAdapter(_) => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
            EngineError::InvalidRequest(_) => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", None, None)
            }
            EngineError::QueueFull { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                None,
                Some("queue_full"),
            ),
            EngineError::DeadlineExceeded => (
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                None,
                Some("deadline_exceeded"),
            ),
            EngineError::Closed => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                None,
                Some("shutting_down"),
            ),
            _ => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                None,
            ),
        };
        ApiError {
            status,
            message: e.to_string(),
            kind,
            param: param.map(str::to_owned),
            code,
            retry_after: matches!(e, EngineError::QueueFull { .. }).then_some(1),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
