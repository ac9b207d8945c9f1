//! The request-body limit (`--max-line-bytes`) and what a client over it gets.
//!
//! A body over the limit is read to its end and thrown away (at most [`DRAIN_BYTES`] past the
//! limit, for at most [`DRAIN_TIME`]) before the 413 goes out. A server that answers and closes
//! with body bytes unread makes the kernel reset the connection, and a client still sending then
//! sees a broken pipe instead of the answer: a 32 MiB body against a 1 MiB limit got "Broken
//! pipe" in 2 of 3 tries before this. A client that sent `Expect: 100-continue` with a
//! `Content-Length` over the limit is answered at once: it has not sent the body yet.
//! Bodies within the limit are handed on whole, so the handlers' own limit is off.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;

use super::{respond, Api, ApiError, St};

/// Bytes past the limit read and discarded before answering 413; a longer body may see its
/// connection reset.
pub const DRAIN_BYTES: usize = 64 << 20;
/// How long the discarding may take (a slow client is then cut off).
pub const DRAIN_TIME: Duration = Duration::from_secs(10);

/// The endpoint a path is counted under in `ornith_http_requests_total`, and its error shape.
fn endpoint(path: &str) -> (&'static str, Api) {
    let name = super::paths::ALL.iter().copied().find(|&k| k == path).unwrap_or("other");
    (name, Api::of_path(path))
}

/// Reads the request body within `--max-line-bytes` and hands it on; a larger one is answered
/// 413 in the endpoint's error shape, after the rest of it was read (see the module's note).
pub(super) async fn limit_body(State(st): St, req: Request, next: Next) -> Response {
    let limit = st.opts.max_body_bytes;
    let (name, api) = endpoint(req.uri().path());
    let too_large = || {
        let msg = format!("the request body is larger than {limit} bytes (--max-line-bytes)");
        respond(&st, name, api, Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large", msg)))
    };
    let h = req.headers();
    let declared = h.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let expects_continue =
        h.get(header::EXPECT).and_then(|v| v.to_str().ok()).is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
    if expects_continue && declared.is_some_and(|n| n > limit as u64) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    let mut data = body.into_data_stream();
    let (mut kept, mut seen, started) = (Vec::new(), 0usize, Instant::now());
    while let Some(chunk) = data.next().await {
        let Ok(chunk) = chunk else {
            let e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", "the request body could not be read");
            return respond(&st, name, api, Err(e));
        };
        seen = seen.saturating_add(chunk.len());
        if seen <= limit {
            kept.extend_from_slice(&chunk);
        } else {
            kept = Vec::new();
            if seen - limit > DRAIN_BYTES || started.elapsed() > DRAIN_TIME {
                break;
            }
        }
    }
    if seen > limit {
        return too_large();
    }
    next.run(Request::from_parts(parts, Body::from(kept))).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_count_under_their_endpoint_and_shape() {
        assert!(matches!(endpoint("/v1/chat/completions"), ("/v1/chat/completions", Api::OpenAi)));
        assert!(matches!(endpoint("/v1/messages"), ("/v1/messages", Api::Anthropic)));
        assert!(matches!(endpoint("/v1/messages/count_tokens"), ("/v1/messages/count_tokens", Api::Anthropic)));
        assert!(matches!(endpoint("/v1/nothing"), ("other", Api::OpenAi)));
        assert!(matches!(endpoint("/v1/messages/x"), ("other", Api::Anthropic)));
    }
}
